"""Stage 06 with engine 'vllm': the serving A/B on this machine's GPUs, arms interleaved.

Three vLLM servers of the same seeded model, started one after another (each takes
lib.serve_vllm.GPU_MEMORY_UTILIZATION of every GPU, so all three fit) and then measured
alternately, so drift of the machine falls on every arm alike; a server idles while another
is measured:

- ``eager+EP``: 04's serve (expert parallelism over the GPUs, the backend asked, --enforce-eager);
- ``graphs+EP``: the same without --enforce-eager (torch.compile and CUDA graphs: the seed
  sample's open question, where its non-eager path measured 239.7 against eager 301.8 tok/s at
  concurrency 64);
- ``eager, no EP``: the same model, DP over the GPUs with every expert on every rank and no
  all-to-all.

Per repeat and concurrency one AIPerf cell per arm, the arms' order reversed on every other
repeat. Each ratio (graphs+EP / eager+EP, no EP / eager+EP) of output tokens/s at each concurrency
comes with a paired bootstrap interval (lib.stats). Every number is gated by its server's log (the
backend, the EP split or its absence, eager or graphs) and by vLLM's own token count. The
cluster's arms (deepep_v2 against allgather_reducescatter over EFA, EP_NUM_COMMS 1 against 8)
are SKIPs here with their reason.

Artifacts: vllm-<arm>.log per server; aiperf/repeat_<r>/aiperf-<arm>-c<C>/; metrics/...;
summary.csv / summary.json (lib.aiperf's schema, a row per arm x concurrency x repeat);
ratios.json; throughput_ab.png.
"""
from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import pandas as pd

from lib import serve, serve_vllm, stats, sweep
from lib.evidence import gate, skip
from lib.hardware import cuda_device_count
from lib.stage import Stage


@dataclass(frozen=True)
class Arm:
    name: str  # as the gates and the book say it
    slug: str  # as AIPerf's folders and the summary's `arm` column say it
    enforce_eager: bool
    expert_parallel: bool


BASELINE = Arm("eager+EP", "vllm-eager-ep", True, True)
ARMS = (BASELINE, Arm("graphs+EP", "vllm-graphs-ep", False, True),
        Arm("eager, no EP", "vllm-eager-noep", True, False))
# (arm b, over arm a): each ratio is b / a of output tokens per second
COMPARISONS = (("graphs+EP", "eager+EP"), ("eager, no EP", "eager+EP"))
CLUSTER_ARMS = ("deepep_v2 against allgather_reducescatter over EFA, and EP_NUM_COMMS 1 against 8 "
                "(the multicomm overlay): both need DeepEP's ElasticBuffer with GIN over an RDMA "
                "NIC; this machine has NVLink and no RDMA NIC (GIN off: EP_DISABLE_GIN=1)")


def cell_order(repeats: int, concurrency: list[int]) -> list[tuple[int, int, Arm]]:
    """(repeat, concurrency, arm): every arm at every level per repeat, the arms' order reversed
    on even repeats (A B C, C B A, ...)."""
    order = []
    for r in range(1, repeats + 1):
        arms = ARMS if r % 2 else tuple(reversed(ARMS))
        order += [(r, c, arm) for c in concurrency for arm in arms]
    return order


def run(stage: Stage) -> dict[str, Any]:
    from lib.stages.sweep import upstream_problem

    p = stage.params
    stage.add(skip("EP_NUM_COMMS A/B (the kernel benchmark's K communicators)",
                   "engine 'vllm' measures the serving A/B; EP_NUM_COMMS is DeepEP's GIN lever, "
                   "off on one machine (EP_DISABLE_GIN=1); the torch analog is 06 with engine "
                   "'transformers'"))
    stage.add(skip("cluster arms", CLUSTER_ARMS))
    problem = upstream_problem(stage)
    if problem:
        stage.add(skip("serving A/B", problem))
        return {"serving_ab": True, "skipped": problem}
    model, built = serve.build_model(stage, "vllm")
    stage.add(built)
    if model is None:
        stage.add(skip("serving A/B", "the model could not be built"))
        return {"serving_ab": True, "skipped": "the model could not be built"}
    gpus = cuda_device_count(stage.door)
    order = cell_order(p["ab_repeats"], p["concurrency"])
    print(f"serving A/B: {len(ARMS)} vLLM servers side by side on {gpus} GPUs, "
          f"{len(order)} cells ({p['ab_repeats']} repeats x concurrency {p['concurrency']} x "
          f"{len(ARMS)} arms), {p['request_count']} requests each", flush=True)
    runs: dict[str, list] = {arm.slug: [] for arm in ARMS}
    servers: dict[str, Any] = {}
    with ExitStack() as stack:
        for arm in ARMS:  # one at a time: each profiles its memory while the others are idle
            server = stack.enter_context(serve_vllm.vllm_server(
                stage, model["model_dir"], gpus=gpus, backend=p["all2all_backend"],
                num_experts=model["num_experts"], enforce_eager=arm.enforce_eager,
                nccl_site=p["nccl_site"] or None,
                expert_parallel=arm.expert_parallel, timeout_s=p["server_timeout_s"],
                gate_prefix=arm.name, log_name=f"{arm.slug}.log"))
            servers[arm.slug] = server
            if not server.ready:
                break  # the arms after it would wait for nothing: stop here, gates say why
        broken = {slug: reason for slug, s in servers.items()
                  if (reason := _server_problem(s))}
        broken.update({arm.slug: "not started: an earlier arm's server failed"
                       for arm in ARMS if arm.slug not in servers})
        if broken:
            reason = "; ".join(f"{slug}: {why}" for slug, why in broken.items())
            stage.add(skip("serving A/B", f"not measured: {reason}"))
            return {"serving_ab": True, "skipped": reason}
        mmap_dir = stage.path(sweep.MMAP_FOLDER)
        try:
            for index, (repeat, concurrency, arm) in enumerate(order, 1):
                cell = sweep.Cell(repeat, concurrency)
                server = servers[arm.slug]
                before = sweep.scrape_metrics(stage, server, cell, f"{arm.slug}.before")
                r = sweep.run_cell(stage, server, cell, engine="vllm", mmap_dir=mmap_dir,
                                   arm=arm.slug)
                r.metrics = (before, sweep.scrape_metrics(stage, server, cell,
                                                          f"{arm.slug}.after"))
                runs[arm.slug].append(r)
                row = sweep.read_cell_row(stage, cell, arm.slug, p["request_count"]).iloc[0]
                print(f"[{index}/{len(order)}] repeat {repeat} c{concurrency} {arm.name}: AIPerf "
                      f"exit {r.rc}, {_fmt(row['output_tps'])} output tok/s", flush=True)
        finally:
            stage.door.run(["rm", "-rf", str(mmap_dir)], timeout=60, check=False)
    cells = sweep.plan_cells(p["concurrency"], p["ab_repeats"])
    frame = pd.concat([sweep.summary_table(stage, cells, arm.slug, p["request_count"])
                       for arm in ARMS], ignore_index=True)
    summary_files = sweep.write_summary(stage, frame)
    for arm in ARMS:
        for r in runs[arm.slug]:
            stage.add(sweep.exit_gate(r, arm.slug))
        stage.add(*sweep.token_count_gates(runs[arm.slug], p["request_count"],
                                           p["output_tokens"], arm.slug))
    stage.add(*sweep.cell_gates(frame))
    stage.add(sweep.warmup_gate(frame))
    ratios = compare(frame, p["concurrency"], p["seed"])
    ratio_file = stage.write_json("ratios.json", ratios)
    for row in ratios:
        name = f"output tok/s {row['b']} / {row['a']} at c{row['concurrency']} with its interval"
        ok = row["n"] >= 2 and row["low"] is not None and row["low"] <= row["ratio"] <= row["high"]
        stage.add(gate(name, ok, [_r(row["ratio"]), _r(row["low"]), _r(row["high"])],
                       f"ratio, low, high over >= 2 paired repeats (scipy bootstrap)",
                       _verdict(row) if ok else f"only {row['n']} paired repeat(s) measured",
                       summary_files + [ratio_file]))
    title = f"vLLM on {gpus} GPUs, {p['all2all_backend']}, {p['ab_repeats']} repeats per arm"
    plot = sweep.save_png(stage, "throughput_ab.png", plot_arms(frame, title))
    return {"serving_ab": True, "summary": frame, "ratios": ratios, "title": title,
            "plots": [plot], "startup_s": {arm.name: servers[arm.slug].startup_s
                                           for arm in ARMS},
            "ready_s": {arm.name: servers[arm.slug].ready_s for arm in ARMS}}


def _server_problem(server) -> str | None:
    if not server.ready:
        return "not ready (see its gate 'server ready')"
    if not server.backend_ok:
        failed = [g["gate"] for g in server.backend_gates if g["status"] != "PASS"]
        return f"its log does not prove the serve asked for ({', '.join(failed)})"
    return None


def compare(frame: pd.DataFrame, concurrency: list[int], seed: int) -> list[dict]:
    """Per comparison and concurrency: the paired ratio of output tok/s, repeat by repeat."""
    slug = {arm.name: arm.slug for arm in ARMS}
    rows = []
    for b, a in COMPARISONS:
        for c in concurrency:
            pick = lambda arm: (frame[(frame.arm == slug[arm]) & (frame.concurrency == c)]
                                .sort_values("repeat")[["repeat", "output_tps"]].dropna())
            va, vb = pick(a), pick(b)
            both = va.merge(vb, on="repeat", suffixes=("_a", "_b"))
            row = {"b": b, "a": a, "concurrency": c, "n": len(both),
                   "a_tps": both["output_tps_a"].tolist(), "b_tps": both["output_tps_b"].tolist(),
                   "ratio": None, "low": None, "high": None}
            if len(both) >= 2:
                result = stats.paired_ratio(both["output_tps_a"].tolist(),
                                            both["output_tps_b"].tolist(), seed=seed)
                row.update(ratio=result["ratio"], low=result["low"], high=result["high"],
                           method=result.get("method"))
            rows.append(row)
    return rows


def _r(value):
    return None if value is None else round(float(value), 3)


def _fmt(value) -> str:
    return "?" if value is None or pd.isna(value) else f"{float(value):.0f}"


def _verdict(row: dict) -> str:
    if row["high"] < 1:
        return f"{row['b']} is slower than {row['a']} here (interval below 1)"
    if row["low"] > 1:
        return f"{row['b']} is faster than {row['a']} here (interval above 1)"
    return f"no difference between {row['b']} and {row['a']} resolved here (interval spans 1)"


def plot_arms(frame: pd.DataFrame, title: str):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.5, 4), dpi=100)
    ax = fig.subplots()
    for arm, color in zip(ARMS, ("tab:blue", "tab:orange", "tab:green")):
        agg = sweep.by_concurrency(frame[frame.arm == arm.slug], "output_tps")
        if agg.empty:
            continue
        ax.errorbar(agg["concurrency"], agg["mean"],
                    yerr=[agg["mean"] - agg["min"], agg["max"] - agg["mean"]],
                    marker="o", capsize=4, color=color, label=f"{arm.name} (bars: min-max)")
    ax.set_xscale("log", base=2)
    levels = sorted(frame["concurrency"].dropna().astype(int).unique())
    ax.set_xticks(levels, [str(c) for c in levels])
    ax.set_xlabel("concurrency")
    ax.set_ylabel("output tokens / s")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def ratio_table(ratios: list[dict]) -> pd.DataFrame:
    return pd.DataFrame([{"arm b / arm a": f"{r['b']} / {r['a']}", "concurrency": r["concurrency"],
                          "paired repeats": r["n"], "ratio": _r(r["ratio"]), "low": _r(r["low"]),
                          "high": _r(r["high"])} for r in ratios])


def show(stage: Stage, data: dict[str, Any]):
    from IPython.display import Image, display
    from lib.glue import glue

    if data.get("skipped"):
        print(f"not measured: {data['skipped']}")
        return None
    frame = data["summary"]
    display(Image(data=sweep.figure_png(plot_arms(frame, data["title"])), format="png"))
    table = ratio_table(data["ratios"])
    for r in data["ratios"]:
        key = "graphs" if r["b"].startswith("graphs") else "noep"
        for part in ("ratio", "low", "high"):
            if r[part] is not None:
                glue(f"ab_{key}_c{r['concurrency']}_{part}", _r(r[part]), display=False)
    for name, seconds in (data.get("ready_s") or {}).items():
        if seconds is not None:
            glue(f"ab_ready_s_{name.replace(' ', '').replace(',', '_').replace('+', '_')}",
                 seconds, display=False)
    return table
