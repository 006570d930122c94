"""Stage 05: how fast the served model answers, per concurrency level, with repeats.

On the local context the stage starts its own server (lib.serve.local_server: a server never
outlives its stage) on the same seeded model 04 served, then runs one AIPerf per cell
(concurrency x repeat, interleaved by repeat; lib.sweep). It measures nothing, and SKIPs every
cell with the reason, when 04_serve's gates in this run are missing or FAILED.

Artifacts in the stage folder::

    server.log                                    the server's whole output
    aiperf/repeat_<r>/aiperf-<engine>-c<C>/       AIPerf's artifacts for one cell
    summary.csv, summary.json                     lib.aiperf's schema, a row per cell
    throughput.png, latency.png                   the plots shown in the notebook
    memory.json                                   the server's VmRSS after ready and each cell
    metrics/repeat_<r>/c<C>.{before,after}.prom   vLLM's /metrics around each cell (engine vllm)

With engine 'vllm' the server is vLLM with 04's flags (lib.serve_vllm), measured only when its
log proves the backend asked for; each cell also gates vLLM's own count of generated tokens. A
vLLM that exits by itself mid-sweep FAILs `vLLM: server up through its cells` (the first fatal
line of its log quoted) and the cells left are SKIPs.
With ``ab_backends`` (e.g. allgather_reducescatter,deepep_v2) the stage is instead the backend
A/B of lib.stages.serving_ab: one server per backend side by side, arms interleaved, the decode
shape (input_tokens/output_tokens) and the prefill-heavy one (prefill_*_tokens).
"""
from __future__ import annotations

import json
from typing import Any

import pandas as pd

from lib import serve, serve_vllm, sweep
from lib.stages import serving_ab
from lib.evidence import gate, skip
from lib.hardware import cuda_device_count
from lib.stage import Stage

UPSTREAM = "04_serve"
SHOWN_COLUMNS = ["concurrency", "repeat", "requests_completed", "errors", "output_tps",
                 "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms",
                 "request_latency_p50_ms", "output_tokens_mean"]



def warmup_said(p: dict) -> str:
    """The warmup as the progress line says it (runs recorded without warmup_full_batch said
    the bare count, and a replay prints what they printed)."""
    if not p.get("warmup_full_batch"):
        return str(p["warmup_requests"])
    return f"{p['warmup_requests']}, at least one full batch"

def upstream_problem(stage: Stage) -> str | None:
    """Why 04's evidence does not allow measuring (None when it does)."""
    gates = stage.upstream_gates(UPSTREAM)
    if gates is None:
        return f"{UPSTREAM} has no gates in run {stage.run_id}: serve first, then sweep"
    failed = [g["gate"] for g in gates if g["status"] == "FAIL"]
    if failed:
        return f"{UPSTREAM} FAILED in this run ({'; '.join(failed)}): not measured"
    if not any(g["status"] == "PASS" for g in gates):
        return f"{UPSTREAM} passed no gate in this run (all SKIP): not measured"
    return None


def run(stage: Stage) -> dict[str, Any]:
    p = stage.params
    engine = p["engine"] or "transformers"
    cells = sweep.plan_cells(p["concurrency"], p["repeats"])
    if stage.context != "local":
        reason = (f"the {stage.context} context's sweep (AIPerf against the vLLM leader, both "
                  "all-to-all backends) is not built yet; another issue owns it")
        stage.add(*sweep.skip_cells(cells, engine, reason))
        return {"skipped": reason}
    problem = upstream_problem(stage)
    if problem:
        stage.add(*sweep.skip_cells(cells, engine, problem))
        return {"skipped": problem}
    engine = serve.resolve_engine(stage)
    if engine == "vllm" and p["ab_backends"]:
        return serving_ab.run_backends(stage)
    model, built = serve.build_model(stage, engine)
    stage.add(built)
    if model is None:
        reason = "the model could not be built (see the gate 'model built from its seed')"
        stage.add(*sweep.skip_cells(cells, engine, reason))
        return {"skipped": reason}
    stage.add(same_model_gate(stage, model))
    print(f"sweep: {len(cells)} cells = concurrency {p['concurrency']} x {p['repeats']} repeats, "
          f"{sweep.requests_said(p)} requests (+{warmup_said(p)} warmup) each, "
          f"~{p['input_tokens']} tokens in, {p['output_tokens']} out", flush=True)
    with server_for(stage, model, engine) as server:
        problem = server_problem(server)
        if problem:
            stage.add(*sweep.skip_cells(cells, engine, problem))
            return {"skipped": problem}
        life = sweep.ServerLife("vLLM" if engine == "vllm" else engine)
        runs, memory = measure(stage, server, cells, engine, life)
    died = life.exit_gate(stage, server)
    if died:  # vLLM exited by itself mid-sweep: why, from its log; its later cells are SKIPs
        stage.add(died)
    frame = sweep.summary_table(stage, [r.cell for r in runs], engine,
                                lambda c: sweep.cell_requests(p, c))
    summary_files = sweep.write_summary(stage, frame)
    for r in runs:
        stage.add(sweep.exit_gate(r, engine))
    stage.add(*sweep.cell_gates(frame))
    stage.add(sweep.warmup_gate(frame))
    stage.add(gate("every planned cell measured", len(frame) == len(cells),
                   len(frame), len(cells), f"{len(frame)} of {len(cells)} cells in the summary",
                   summary_files))
    if engine == "vllm":
        stage.add(*sweep.token_count_gates(runs, p["request_count"], p["output_tokens"], engine))
    memory_file = stage.write_json("memory.json", memory)
    stage.add(sweep.rss_gate(runs, memory["after_ready_bytes"], [memory_file], server.device))
    title = (f"vLLM, {p['all2all_backend']}, EP over {getattr(server, 'gpus', '?')} GPUs, "
             f"{p['repeats']} repeats" if engine == "vllm" else
             f"{engine} serve, tiny seeded MoE, {p['repeats']} repeats")
    plots = [sweep.save_png(stage, "throughput.png", sweep.plot_throughput(frame, title)),
             sweep.save_png(stage, "latency.png", sweep.plot_latency(frame, title))]
    return {"engine": engine, "summary": frame, "memory": memory, "plots": plots,
            "summary_files": summary_files, "title": title}


def server_for(stage: Stage, model: dict[str, Any], engine: str):
    """The stage's own server: transformers serve, or vLLM with 04's flags (same builder)."""
    if engine == "vllm":
        return serve_vllm.vllm_server(stage, model["model_dir"],
                                      gpus=cuda_device_count(stage.door),
                                      backend=stage["all2all_backend"],
                                      num_experts=model["num_experts"],
                                      nccl_site=stage["nccl_site"] or None,
                                      deepep_dir=stage["deepep_dir"] or None,
                                      timeout_s=stage["server_timeout_s"])
    return serve.local_server(stage, model["model_dir"], timeout_s=stage["server_timeout_s"])


def server_problem(server) -> str | None:
    """Why nothing is measured on this server (None: measure). A vLLM server whose log does
    not prove the backend asked for measures nothing under that backend's name."""
    if not server.ready:
        return "the sweep's server is not ready (see the gate 'server ready')"
    if isinstance(server, serve_vllm.VllmServer) and not server.backend_ok:
        failed = [g["gate"] for g in server.backend_gates if g["status"] != "PASS"]
        return (f"vLLM did not serve what was asked ({', '.join(failed)} FAILED): a number "
                "measured now would carry the wrong backend's name")
    return None


def measure(stage: Stage, server, cells, engine: str, life: sweep.ServerLife):
    """AIPerf cell after cell against the stage's server. With vLLM, a cell whose closing
    /metrics fails asks whether the server is gone (`life`); once it is, the cells left are
    SKIPs, not runs against a closed port."""
    mmap_dir = stage.path(sweep.MMAP_FOLDER)
    after_ready = serve.server_rss(stage.door, server)
    runs = []
    try:
        for index, cell in enumerate(cells, 1):
            if life.exit_code is not None:
                stage.add(skip(f"{cell.label(engine)}: measured", life.not_run()))
                continue
            requests = sweep.cell_requests(stage.params, cell.concurrency)
            print(f"[{index}/{len(cells)}] repeat {cell.repeat}, concurrency {cell.concurrency}: "
                  f"{requests} requests ...", flush=True)
            before = sweep.scrape_metrics(stage, server, cell, "before") if engine == "vllm" \
                else None
            r = sweep.run_cell(stage, server, cell, engine=engine, mmap_dir=mmap_dir)
            if before is not None:
                r.metrics = (before, sweep.scrape_metrics(stage, server, cell, "after"))
                life.watch(stage, server, cell.label(engine), r.metrics[1])
            runs.append(r)
            rss = f"{r.rss_bytes / 2 ** 20:.0f} MiB" if r.rss_bytes else "unknown"
            row = sweep.read_cell_row(stage, cell, engine, requests).iloc[0]
            done = _count(row, "requests_completed")
            print(f"    AIPerf exit {r.rc} in {r.duration_s:.1f} s: {done}"
                  f"/{requests} completed, {_count(row, 'errors')} errors, "
                  f"{_rate(row['output_tps'])} output tokens/s; server RSS {rss}", flush=True)
    finally:
        stage.door.run(["rm", "-rf", str(mmap_dir)], timeout=60, check=False)
    memory = {"after_ready_bytes": after_ready,
              "after_cell": [{"repeat": r.cell.repeat, "concurrency": r.cell.concurrency,
                              "rss_bytes": r.rss_bytes} for r in runs],
              "limit_bytes": sweep.RSS_LIMIT_BYTES, "pid": server.proc.pid if server.proc else None}
    return runs, memory


def _count(row, column: str) -> str:
    value = row[column]
    return "?" if value is None or pd.isna(value) else str(int(value))


def _rate(value) -> str:
    return "?" if value is None or pd.isna(value) else f"{float(value):.0f}"


def same_model_gate(stage: Stage, model: dict[str, Any]):
    name = "the same model 04_serve served"
    served = stage.door.read_text(stage.run_dir / UPSTREAM / "model.json")
    if served is None:
        return skip(name, f"{UPSTREAM} wrote no model.json in this run")
    served_hash = json.loads(served).get("config_hash")
    return gate(name, served_hash == model["config_hash"], model["config_hash"], served_hash,
                "config hash of the model built here against 04's", [f"{UPSTREAM}/model.json"])


def show(stage: Stage, data: dict[str, Any]) -> None:
    from IPython.display import Image, display
    from lib.glue import glue

    if data.get("serving_ab"):
        return serving_ab.show(stage, data)
    if data.get("skipped"):
        print(f"not measured: {data['skipped']}")
        return
    frame: pd.DataFrame = data["summary"]
    display(frame[SHOWN_COLUMNS].round(2))
    tps = sweep.by_concurrency(frame, "output_tps")
    for figure in (sweep.plot_throughput(frame, data["title"]),
                   sweep.plot_latency(frame, data["title"])):
        display(Image(data=sweep.figure_png(figure), format="png"))
    peak_rss = max([s for s in [data["memory"]["after_ready_bytes"],
                                *[c["rss_bytes"] for c in data["memory"]["after_cell"]]] if s]
                   or [0])
    if not tps.empty:
        best = tps.loc[tps["mean"].idxmax()]
        glue("sweep_peak_tps", round(float(best["mean"]), 1), display=False)
        glue("sweep_peak_tps_concurrency", int(best["concurrency"]), display=False)
        for _, row in tps.iterrows():
            glue(f"sweep_tps_c{int(row['concurrency'])}", round(float(row["mean"]), 1),
                 display=False)
    for metric in ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms"):
        for _, row in sweep.by_concurrency(frame, metric).iterrows():
            glue(f"sweep_{metric}_c{int(row['concurrency'])}", round(float(row["mean"]), 2),
                 display=False)
    glue("sweep_cells", len(frame), display=False)
    glue("sweep_errors", int(pd.to_numeric(frame["errors"], errors="coerce").fillna(0).sum()),
         display=False)
    glue("sweep_server_peak_rss_mib", round(peak_rss / 2 ** 20, 1), display=False)
