"""Stage 06 with engine 'vllm': the serving A/B on this machine's GPUs, arms interleaved.

Three vLLM servers of the same seeded model, started one after another (each takes
lib.serve_vllm.GPU_MEMORY_UTILIZATION of every GPU, so all three fit) and then measured
alternately, so drift of the machine falls on every arm alike; a server idles while another
is measured. Except on DeepEP: two servers that each hold a DeepEP buffer are never up together
(``exclusive_arms``). Then a repeat measures one arm after another (all of an arm's cells in a
block), the arms' order reversed on every other repeat, so drift still falls on every arm alike;
a DeepEP arm's server is started when its block comes and stopped when the other DeepEP arm's
block comes (repeats eager+EP graphs+EP no-EP, no-EP graphs+EP eager+EP, ...: graphs+EP's blocks
of repeats 1 and 2 share one server, eager+EP is started again for repeat 2):

- ``eager+EP``: 04's serve (expert parallelism over the GPUs, the backend asked, --enforce-eager);
- ``graphs+EP``: the same without --enforce-eager (torch.compile and CUDA graphs: the seed
  sample's open question, where its non-eager path measured 239.7 against eager 301.8 tok/s at
  concurrency 64);
- ``eager, no EP``: the same model and DP without --enable-expert-parallel: vLLM 0.24.0 then
  makes every MoE layer tensor-parallel across the DP ranks (each rank a 1/DP slice of every
  expert) and gathers and reduce-scatters the tokens around it (its DP fallback, logged:
  AllGather+ReduceScatter, no expert all-to-all). Measured on 2x H200, not assumed: the first
  recording of this arm showed vLLM does not replicate the experts here.

Per repeat and concurrency one AIPerf cell per arm, the arms' order reversed on every other
repeat. Each ratio (graphs+EP / eager+EP, no EP / eager+EP) of output tokens/s at each concurrency
comes with a paired bootstrap interval (lib.stats). Every number is gated by its server's log (the
backend, the EP split or its absence, eager or graphs) and by vLLM's own token count. A server that
exits by itself during its cells FAILs `server up through its cells`, quoting the first fatal line
of its log; its arm's remaining cells are SKIPs and it is not started again. The
cluster's arms (deepep_v2 against allgather_reducescatter over EFA, EP_NUM_COMMS 1 against 8)
are SKIPs here with their reason.

Throughput says nothing of what an arm computes. So each arm, once its server is up and before
its cells (an exclusive arm: at its first start), is asked lib.agreement's fixed prompts (greedy,
top logprobs; `answer_prompts` of them, 0: none), and each comparison's arm b must answer as
its arm a does: gate `<b> answers as <a>` (a FAIL stands beside the measured numbers; runs
recorded before this were not asked and replay without it).

Artifacts: vllm-<arm>.log per server (vllm-<arm>-<start>.log for a DeepEP arm served one at a
time); aiperf/repeat_<r>/aiperf-<arm>-c<C>/; metrics/...; summary.csv / summary.json (lib.aiperf's
schema, a row per arm x concurrency x repeat); ratios.json; servers.json (the layout, each
server's seconds to ready); answers-<arm>.json (its answers to the fixed prompts);
throughput_ab.png.
"""
from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import pandas as pd

from lib import agreement, serve, serve_vllm, stats, sweep
from lib.evidence import gate, skip
from lib.hardware import cuda_device_count
from lib.stage import Stage


@dataclass(frozen=True)
class Arm:
    name: str  # as the gates and the book say it
    slug: str  # as AIPerf's folders and the summary's `arm` column say it
    enforce_eager: bool
    expert_parallel: bool
    backend: str | None = None  # None: the stage's all2all_backend


@dataclass(frozen=True)
class Shape:
    """A traffic shape: synthetic input tokens (mean) and forced output tokens per request."""
    name: str
    input_tokens: int
    output_tokens: int


BASELINE = Arm("eager+EP", "vllm-eager-ep", True, True)
ARMS = (BASELINE, Arm("graphs+EP", "vllm-graphs-ep", False, True),
        Arm("eager, no EP", "vllm-eager-noep", True, False))
# (arm b, over arm a): each ratio is b / a of output tokens per second
COMPARISONS = (("graphs+EP", "eager+EP"), ("eager, no EP", "eager+EP"))
SERVERS_FILE = "servers.json"  # the A/B's server layout and each server's time to ready
CLUSTER_ARMS = ("deepep_v2 against allgather_reducescatter over EFA, and EP_NUM_COMMS 1 against 8 "
                "(the multicomm overlay): both need DeepEP's ElasticBuffer with GIN over an RDMA "
                "NIC; this machine has NVLink and no RDMA NIC (GIN off: EP_DISABLE_GIN=1)")


def backend_arms(backends: list[str]) -> tuple[Arm, ...]:
    """One eager EP arm per all-to-all backend (05's backend A/B)."""
    return tuple(Arm(b, f"vllm-{b.replace('_', '-')}", True, True, b) for b in backends)


def traffic_shapes(p: dict[str, Any], prefill: bool) -> tuple[Shape, ...]:
    """The stage's own shape (decode-heavy by default), and the prefill-heavy one when asked:
    the public review found the backend that wins flips with the shape."""
    shapes = (Shape("decode", p["input_tokens"], p["output_tokens"]),)
    if prefill:
        shapes += (Shape("prefill", p["prefill_input_tokens"], p["prefill_output_tokens"]),)
    return shapes


def cell_order(repeats: int, concurrency: list[int], arms=ARMS,
               shapes: tuple = (None,), by_arm: bool = False) -> list[tuple]:
    """(repeat, concurrency, arm[, shape]): every arm at every level (and shape) per repeat, the
    arms' order reversed on even repeats (A B C, C B A, ...). Within a repeat the arms alternate
    at each level; `by_arm`: each arm's cells of the repeat come together instead (one block per
    arm, so a server that may not stay up beside another is started for its block)."""
    order = []
    for r in range(1, repeats + 1):
        ordered = arms if r % 2 else tuple(reversed(arms))
        cells = [(c, arm, shape) for shape in shapes for c in concurrency for arm in ordered]
        if by_arm:
            cells.sort(key=lambda cell: ordered.index(cell[1]))  # stable: levels keep their order
        order += [(r, c, arm) if shape is None else (r, c, arm, shape) for c, arm, shape in cells]
    return order


def holds_deepep_buffer(arm: Arm, backend: str) -> bool:
    """Whether the arm's server holds a DeepEP buffer on the GPUs (expert parallelism on one of
    vLLM's DeepEP backends; without EP vLLM builds no all-to-all of the backend asked)."""
    return arm.expert_parallel and (arm.backend or backend).startswith("deepep")


def exclusive_arms(arms: tuple[Arm, ...], backend: str) -> tuple[Arm, ...]:
    """The arms whose servers must not be up at the same time: every DeepEP arm, when there are
    two or more. Seen once on 2x H200 (results/gpu-2xh200-deepep-vllm-20261130c.notes.md): a
    second deepep_v2 server started beside the first crashed in CUDA graph capture with an
    illegal memory access. (The 85 s capture of an earlier run beside one was cold caches, not
    the neighbour: alone, a first start captured in 83 s and the next in 3 s, run
    gpu-2xh200-deepep-vllm-20261130d.) One DeepEP server beside allgather_reducescatter ones
    (05's backend A/B) was fine. The cost of caution: a DeepEP server started per block."""
    deepep = tuple(arm for arm in arms if holds_deepep_buffer(arm, backend))
    return deepep if len(deepep) > 1 else ()


def cell_arm(arm: Arm, shape: Shape, shapes: tuple) -> str:
    """The summary's arm name of a cell: the arm's slug, plus the shape when there are several."""
    return arm.slug if len(shapes) == 1 else f"{arm.slug}-{shape.name}"


def run(stage: Stage) -> dict[str, Any]:
    """06 with engine 'vllm': eager vs CUDA graphs, EP vs none, the decode shape."""
    p = stage.params
    stage.add(skip("EP_NUM_COMMS A/B (the kernel benchmark's K communicators)",
                   "engine 'vllm' measures the serving A/B; EP_NUM_COMMS is DeepEP's GIN lever, "
                   "off on one machine (EP_DISABLE_GIN=1); the torch analog is 06 with engine "
                   "'transformers'"))
    stage.add(skip("cluster arms", CLUSTER_ARMS))
    return measure_arms(stage, ARMS, traffic_shapes(p, prefill=False), COMPARISONS,
                        p["ab_repeats"], "throughput_ab.png")


def run_backends(stage: Stage) -> dict[str, Any]:
    """05 with ab_backends: the backends side by side (eager, EP), both traffic shapes."""
    p = stage.params
    backends = p["ab_backends"]
    comparisons = tuple((b, backends[0]) for b in backends[1:])
    return measure_arms(stage, backend_arms(backends), traffic_shapes(p, prefill=True),
                        comparisons, p["repeats"], "throughput_backends.png")


def measure_arms(stage: Stage, arms: tuple[Arm, ...], shapes: tuple[Shape, ...],
                 comparisons: tuple, repeats: int, plot_name: str) -> dict[str, Any]:
    """Serve every arm side by side (one started at a time), then AIPerf cells interleaved over
    arms, for every shape; gates, summary, ratios with intervals, one plot. The exclusive arms
    (two or more on DeepEP) are served one at a time instead, each for its block of a repeat."""
    from lib.stages.sweep import upstream_problem

    p = stage.params
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
    exclusive = exclusive_arms(arms, p["all2all_backend"])
    order = cell_order(repeats, p["concurrency"], arms, shapes, by_arm=bool(exclusive))
    resident = ", ".join(a.name for a in arms if a not in exclusive) or "no arm"
    layout = (f"{len(arms)} vLLM servers side by side" if not exclusive else
              f"{', '.join(a.name for a in exclusive)} one at a time (DeepEP), each started for "
              f"its block of cells; {resident} up throughout")
    print(f"serving A/B: {layout} on {gpus} GPUs, "
          f"{len(order)} cells ({repeats} repeats x concurrency {p['concurrency']} x "
          f"{len(arms)} arms x {len(shapes)} shape(s)), {sweep.requests_said(p)} requests each",
          flush=True)
    runs: dict[tuple, list] = {(arm.slug, shape.name): [] for arm in arms for shape in shapes}
    started: dict[str, list] = {arm.slug: [] for arm in arms}  # every server of an arm, in order
    lives: dict[int, sweep.ServerLife] = {}  # id(server) -> what its cells saw of it
    answers: dict[str, list] = {}  # arm name -> its answers to the fixed prompts (lib.agreement)
    answer_files: dict[str, str] = {}

    def serve_arm(stack: ExitStack, arm: Arm, start: int | None):
        """Start the arm's server inside `stack`. `start`: which start of an exclusive arm's
        server this is (1, 2, ...)."""
        where = "" if start is None else f", start {start}"
        server = stack.enter_context(serve_vllm.vllm_server(
            stage, model["model_dir"], gpus=gpus, backend=arm.backend or p["all2all_backend"],
            num_experts=model["num_experts"], enforce_eager=arm.enforce_eager,
            nccl_site=p["nccl_site"] or None, deepep_dir=p["deepep_dir"] or None,
            expert_parallel=arm.expert_parallel, timeout_s=p["server_timeout_s"],
            gate_prefix=arm.name + where,
            log_name=f"{arm.slug}.log" if start is None else f"{arm.slug}-{start}.log"))
        started[arm.slug].append(server)
        lives[id(server)] = sweep.ServerLife(arm.name + where)
        if p["answer_prompts"] and arm.name not in answers and not _server_problem(server):
            # before its cells: what the arm computes, for the comparisons' answer gates
            answers[arm.name] = agreement.ask(stage, server,
                                              agreement.PROMPTS[:p["answer_prompts"]])
            answer_files[arm.name] = stage.write_json(
                agreement.ANSWERS_FILE.format(slug=arm.slug), answers[arm.name])
        return server

    with ExitStack() as stack:
        servers: dict[str, Any] = {}
        broken: list[str] = []
        for arm in arms:  # one at a time: each profiles its memory while the others are idle
            if arm in exclusive:
                continue
            server = servers[arm.slug] = serve_arm(stack, arm, None)
            why = _server_problem(server)
            if why:
                broken.append(f"{arm.slug}: {why}")
                if not server.ready:
                    break  # the arms after it would wait for nothing: stop here, gates say why
        if broken:  # every server that came up stays evidence of its backend; none is measured
            return _not_measured(stage, "; ".join(broken), [a for a in arms if a not in exclusive
                                                            and not started[a.slug]])
        mmap_dir = stage.path(sweep.MMAP_FOLDER)
        up: Arm | None = None  # the exclusive arm whose server is up
        arm_stack = ExitStack()
        stack.callback(lambda: arm_stack.close())  # whichever exclusive server is up at the end
        try:
            for index, (repeat, concurrency, arm, shape) in enumerate(order, 1):
                cell, name = sweep.Cell(repeat, concurrency), cell_arm(arm, shape, shapes)
                gone = next((lives[id(s)] for s in started[arm.slug]
                             if lives[id(s)].exit_code is not None), None)
                if gone:  # its server died in an earlier cell: the arm is not started again
                    stage.add(skip(f"{cell.label(name)}: measured", gone.not_run()))
                    print(f"[{index}/{len(order)}] repeat {repeat} c{concurrency} {arm.name}: "
                          "not run, its server is gone", flush=True)
                    continue
                if arm in exclusive and up != arm:
                    arm_stack.close()  # the previous DeepEP server is gone before the next starts
                    arm_stack, up = ExitStack(), arm
                    start = len(started[arm.slug]) + 1
                    server = servers[arm.slug] = serve_arm(arm_stack, arm, start)
                    why = _server_problem(server)
                    if why:
                        return _not_measured(stage, f"{arm.slug}, start {start}: {why}", [])
                server = servers[arm.slug]
                before = sweep.scrape_metrics(stage, server, cell, f"{name}.before")
                r = sweep.run_cell(stage, server, cell, engine="vllm", mmap_dir=mmap_dir,
                                   arm=name, shape=(shape.input_tokens, shape.output_tokens))
                r.metrics = (before, sweep.scrape_metrics(stage, server, cell, f"{name}.after"))
                runs[(arm.slug, shape.name)].append(r)
                lives[id(server)].watch(stage, server, cell.label(name), r.metrics[1])
                row = sweep.read_cell_row(stage, cell, name, r.requests).iloc[0]
                print(f"[{index}/{len(order)}] repeat {repeat} c{concurrency} {arm.name}"
                      f"{'' if len(shapes) == 1 else ', ' + shape.name}: AIPerf exit {r.rc}, "
                      f"{_fmt(row['output_tps'])} output tok/s", flush=True)
        finally:
            stage.door.run(["rm", "-rf", str(mmap_dir)], timeout=60, check=False)
    for arm in arms:  # a server that died under traffic: its FAIL, with the reason from its log
        for server in started[arm.slug]:
            died = lives[id(server)].exit_gate(stage, server)
            if died:
                stage.add(died)
    # the cells that ran (an arm whose server died is not measured after it)
    frame = pd.concat([sweep.summary_table(stage, [r.cell for r in runs[(arm.slug, shape.name)]],
                                           cell_arm(arm, shape, shapes),
                                           lambda c: sweep.cell_requests(p, c))
                       for shape in shapes for arm in arms if runs[(arm.slug, shape.name)]],
                      ignore_index=True)
    summary_files = sweep.write_summary(stage, frame)
    for shape in shapes:
        for arm in arms:
            name = cell_arm(arm, shape, shapes)
            for r in runs[(arm.slug, shape.name)]:
                stage.add(sweep.exit_gate(r, name))
            stage.add(*sweep.token_count_gates(runs[(arm.slug, shape.name)],
                                               p["request_count"], shape.output_tokens, name))
    stage.add(*sweep.cell_gates(frame))
    stage.add(sweep.warmup_gate(frame))
    if p["answer_prompts"]:  # does each compared arm compute what its baseline computes?
        for b, a in comparisons:
            stage.add(agreement.agreement_gate(
                b, a, answers.get(a), answers.get(b),
                [answer_files[n] for n in (a, b) if n in answer_files]))
    ratios = compare(frame, p["concurrency"], p["seed"], arms, shapes, comparisons)
    ratio_file = stage.write_json("ratios.json", ratios)
    for row in ratios:
        where = f"c{row['concurrency']}" + ("" if len(shapes) == 1 else f", {row['shape']}")
        name = f"output tok/s {row['b']} / {row['a']} at {where} with its interval"
        ok = row["n"] >= 2 and row["low"] is not None and row["low"] <= row["ratio"] <= row["high"]
        stage.add(gate(name, ok, [_r(row["ratio"]), _r(row["low"]), _r(row["high"])],
                       f"ratio, low, high over >= 2 paired repeats (scipy bootstrap)",
                       _verdict(row) if ok else f"only {row['n']} paired repeat(s) measured",
                       summary_files + [ratio_file]))
    # how the servers were arranged and how long each took to come up: the book shows it
    stage.write_json(SERVERS_FILE, {"layout": layout, "arms": {
        arm.name: [{"start": i, "log": stage.rel(s.log_path), "ready_s": s.ready_s,
                    "startup_s": s.startup_s} for i, s in enumerate(started[arm.slug], 1)]
        for arm in arms}})
    backends = sorted({arm.backend or p["all2all_backend"] for arm in arms})
    title = f"vLLM on {gpus} GPUs, {', '.join(backends)}, {repeats} repeats per arm"
    plot = sweep.save_png(stage, plot_name, plot_arms(frame, title))
    return {"serving_ab": True, "summary": frame, "ratios": ratios, "title": title,
            "plots": [plot], "shapes": [s.__dict__ for s in shapes], "layout": layout,
            # an exclusive arm's server may start more than once: the first start, then each
            "startup_s": {arm.name: started[arm.slug][0].startup_s for arm in arms},
            "ready_s": {arm.name: started[arm.slug][0].ready_s for arm in arms},
            "ready_s_each": {arm.name: [s.ready_s for s in started[arm.slug]] for arm in arms}}


def _not_measured(stage: Stage, reason: str, not_started: list[Arm]) -> dict[str, Any]:
    """The A/B's SKIP when a server is not fit to measure: the arms after it wait for nothing."""
    reason = "; ".join([reason] + [f"{arm.slug}: not started: an earlier arm's server failed"
                                   for arm in not_started])
    stage.add(skip("serving A/B", f"not measured: {reason}"))
    return {"serving_ab": True, "skipped": reason}


def _server_problem(server) -> str | None:
    if not server.ready:
        return "not ready (see its gate 'server ready')"
    if not server.backend_ok:
        failed = [g["gate"] for g in server.backend_gates if g["status"] != "PASS"]
        return f"its log does not prove the serve asked for ({', '.join(failed)})"
    return None


def compare(frame: pd.DataFrame, concurrency: list[int], seed: int, arms=ARMS,
            shapes: tuple = (), comparisons=COMPARISONS) -> list[dict]:
    """Per comparison, shape and concurrency: the paired ratio of output tok/s by repeat."""
    by_name = {arm.name: arm for arm in arms}
    shapes = shapes or (Shape("decode", 0, 0),)
    rows = []
    for shape in shapes:
        for b, a in comparisons:
            for c in concurrency:
                def pick(arm_name):
                    slug = cell_arm(by_name[arm_name], shape, shapes)
                    return (frame[(frame.arm == slug) & (frame.concurrency == c)]
                            .sort_values("repeat")[["repeat", "output_tps"]].dropna())
                both = pick(a).merge(pick(b), on="repeat", suffixes=("_a", "_b"))
                row = {"b": b, "a": a, "concurrency": c, "n": len(both),
                       "a_tps": both["output_tps_a"].tolist(),
                       "b_tps": both["output_tps_b"].tolist(),
                       "ratio": None, "low": None, "high": None}
                if len(shapes) > 1:
                    row["shape"] = shape.name
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
    for arm in dict.fromkeys(frame["arm"]):  # in the summary's order
        agg = sweep.by_concurrency(frame[frame.arm == arm], "output_tps")
        if agg.empty:
            continue
        ax.errorbar(agg["concurrency"], agg["mean"],
                    yerr=[agg["mean"] - agg["min"], agg["max"] - agg["mean"]],
                    marker="o", capsize=4, label=f"{arm} (bars: min-max)")
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
    return pd.DataFrame([{"arm b / arm a": f"{r['b']} / {r['a']}",
                          **({"shape": r["shape"]} if "shape" in r else {}),
                          "concurrency": r["concurrency"],
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
        key = ("graphs" if r["b"].startswith("graphs") else "noep" if "no EP" in r["b"]
               else r["b"]) + (f"_{r['shape']}" if "shape" in r else "")
        for part in ("ratio", "low", "high"):
            if r[part] is not None:
                glue(f"ab_{key}_c{r['concurrency']}_{part}", _r(r[part]), display=False)
    for name, seconds in (data.get("ready_s") or {}).items():
        if seconds is not None:
            glue(f"ab_ready_s_{name.replace(' ', '').replace(',', '_').replace('+', '_')}",
                 seconds, display=False)
    return table
