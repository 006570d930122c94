"""Stage 05: how fast the served model answers, per concurrency level, with repeats.

The stage serves its own server on its place (a server never outlives its stage), the same
model 04 served, then runs one AIPerf per cell (concurrency x repeat, interleaved by repeat):
lib.measure.serving's loop with one arm. It measures nothing, and SKIPs every cell with the
reason, when 04_serve's gates in this run are missing or FAILED, or when the place cannot serve.

Artifacts in the stage folder::

    server.log                                    the server's whole output
    aiperf/repeat_<r>/aiperf-<engine>-c<C>/       AIPerf's artifacts for one cell
    summary.csv, summary.json                     lib.measure.aiperf's schema, a row per cell
    throughput.png, latency.png                   the plots shown in the notebook
    memory.json                                   the server's VmRSS after ready and each cell
    metrics/repeat_<r>/c<C>.{before,after}.prom   vLLM's /metrics around each cell (engine vllm)

With engine 'vllm' the server is vLLM with 04's flags (lib.engines.vllm_server), measured only when its
log proves the backend asked for; each cell also gates vLLM's own count of generated tokens. A
vLLM that exits by itself mid-sweep FAILs `vLLM: server up through its cells` (the first fatal
line of its log quoted) and the cells left are SKIPs.
With ``ab_backends`` (e.g. allgather_reducescatter,deepep_v2) the stage is instead the backend
A/B: the same loop with one arm per backend, servers side by side on one machine (on a
cluster place one at a time, each recreated whole for its block: lib.stages.ab), arms
interleaved, the decode shape (input_tokens/output_tokens) and the prefill-heavy one
(prefill_*_tokens).
"""
from __future__ import annotations

import json
from typing import Any

import pandas as pd

from lib import places
from lib.core.evidence import gate, skip
from lib.core.stage import Stage
from lib.engines import catalog, server as serve
from lib.measure import serving, sweep
from lib.places import Unsupported
from lib.stages import ab
from lib.stages.refusal import refusals_fail, shows_refusal

SHOWN_COLUMNS = ["concurrency", "repeat", "requests_completed", "errors", "output_tps",
                 "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms",
                 "request_latency_p50_ms", "output_tokens_mean"]


def warmup_said(p: dict) -> str:
    """The warmup as the progress line says it (runs recorded without warmup_full_batch said
    the bare count, and a replay prints what they printed)."""
    if not p.get("warmup_full_batch"):
        return str(p["warmup_requests"])
    return f"{p['warmup_requests']}, at least one full batch"


@refusals_fail
def run(stage: Stage) -> dict[str, Any]:
    p = stage.params
    place = places.for_stage(stage)
    engine = p["engine"] or "transformers"
    plan = ab.sweep_plan(p, p["repeats"])
    cells = plan.cells()
    problem = ab.upstream_problem(stage)
    if problem:
        stage.add(*sweep.skip_cells(cells, engine, problem))
        return {"skipped": problem}
    engine = serve.resolve_engine(p["engine"])
    if engine == "vllm" and p["ab_backends"]:
        return run_backends(stage, place)
    try:
        model, built = place.model(engine)
    except Unsupported as why:
        stage.add(*sweep.skip_cells(cells, engine, str(why)))
        return {"skipped": str(why)}
    stage.add(built)
    if model is None:
        reason = "the model could not be built (see the gate 'model built from its seed')"
        stage.add(*sweep.skip_cells(cells, engine, reason))
        return {"skipped": reason}
    stage.add(same_model_gate(stage, model))

    def header(layout, order):
        print(f"sweep: {len(cells)} cells = concurrency {p['concurrency']} x {p['repeats']} "
              f"repeats, {plan.requests_said()} requests (+{warmup_said(p)} warmup) each, "
              f"~{p['input_tokens']} tokens in, {p['output_tokens']} out", flush=True)

    ep = catalog.engine(engine).expert_parallel
    arm = serving.Arm(catalog.engine(engine).title if ep else engine, engine)
    shape = plan.shapes
    try:
        m = serving.measure(stage, ab.arm_servers(stage, place, model, engine, None), (arm,),
                            plan, engine=engine, backend=p["all2all_backend"], memory=True,
                            header=header)
    except Unsupported as why:  # a plan: the serve rendered and checked, nothing measured
        stage.add(*sweep.skip_cells(cells, engine, str(why)))
        return {"skipped": str(why)}
    if m.broken:
        reason = broken_reason(m.broken[0][2])
        stage.add(*sweep.skip_cells(cells, engine, reason))
        return {"skipped": reason}
    server = m.servers(arm)[0]
    stage.add(*serving.died_gates(stage, m))  # vLLM exited by itself mid-sweep: why, from its log
    frame = serving.summary(stage, m)
    summary_files = sweep.write_summary(stage, frame)
    stage.add(*serving.exit_gates(m, arm, shape[0]))
    stage.add(*sweep.cell_gates(frame))
    stage.add(sweep.warmup_gate(frame))
    stage.add(gate("every planned cell measured", len(frame) == len(cells),
                   len(frame), len(cells), f"{len(frame)} of {len(cells)} cells in the summary",
                   summary_files))
    runs = m.runs[(arm.slug, shape[0].name)]
    if engine == "vllm":  # its own /metrics counter, read around each cell (lib.measure.serving)
        stage.add(*sweep.token_count_gates(runs, p["request_count"], p["output_tokens"], engine))
    memory = {"after_ready_bytes": m.after_ready_rss,
              "after_cell": [{"repeat": r.cell.repeat, "concurrency": r.cell.concurrency,
                              "rss_bytes": r.rss_bytes} for r in runs],
              "limit_bytes": sweep.RSS_LIMIT_BYTES, "pid": server.proc.pid if server.proc else None}
    memory_file = stage.write_json("memory.json", memory)
    stage.add(sweep.rss_gate(runs, memory["after_ready_bytes"], [memory_file], server.device))
    title = (f"{arm.name}, {p['all2all_backend']}, EP over {getattr(server, 'gpus', '?')} GPUs, "
             f"{p['repeats']} repeats" if ep else
             f"{engine} serve, tiny seeded MoE, {p['repeats']} repeats")
    plots = [sweep.save_png(stage, "throughput.png", sweep.plot_throughput(frame, title)),
             sweep.save_png(stage, "latency.png", sweep.plot_latency(frame, title))]
    return {"engine": engine, "summary": frame, "memory": memory, "plots": plots,
            "summary_files": summary_files, "title": title}


def broken_reason(problem: serving.Problem) -> str:
    """Why nothing is measured on the sweep's server. A vLLM server whose log does not prove
    the backend asked for measures nothing under that backend's name."""
    if not problem.ready:
        return "the sweep's server is not ready (see the gate 'server ready')"
    return (f"vLLM did not serve what was asked ({', '.join(problem.failed)} FAILED): a number "
            "measured now would carry the wrong backend's name")


def run_backends(stage: Stage, place) -> dict[str, Any]:
    """05 with ab_backends: the backends side by side (on a cluster one at a time), eager, EP,
    both traffic shapes, arms interleaved (the serving A/B of lib.stages.ab, its arms the
    backends)."""
    p = stage.params
    backends = p["ab_backends"]
    comparisons = tuple((b, backends[0]) for b in backends[1:])
    return ab.serving_ab(stage, place, ab.backend_arms(backends),
                         ab.sweep_plan(p, p["repeats"], prefill=True), comparisons,
                         "throughput_backends.png")


def same_model_gate(stage: Stage, model: dict[str, Any]):
    name = "the same model 04_serve served"
    served = stage.door.read_text(stage.run_dir / ab.UPSTREAM / "model.json")
    if served is None:
        return skip(name, f"{ab.UPSTREAM} wrote no model.json in this run")
    served_hash = json.loads(served).get("config_hash")
    return gate(name, served_hash == model["config_hash"], model["config_hash"], served_hash,
                "config hash of the model built here against 04's", [f"{ab.UPSTREAM}/model.json"])


@shows_refusal
def show(stage: Stage, data: dict[str, Any]) -> None:
    from IPython.display import Image, display

    if data.get("serving_ab"):
        return ab.show_serving_ab(stage, data)
    if data.get("skipped"):
        print(f"not measured: {data['skipped']}")
        return
    frame: pd.DataFrame = data["summary"]
    display(frame[SHOWN_COLUMNS].round(2))
    for figure in (sweep.plot_throughput(frame, data["title"]),
                   sweep.plot_latency(frame, data["title"])):
        display(Image(data=sweep.figure_png(figure), format="png"))
