"""The one serving measurement loop: arms served by the stage's place, AIPerf cells interleaved
over them with repeats, every server watched through its cells.

05's sweep is this loop with one arm (the stage's serve); 05's backend A/B and 06's A/Bs are the
same loop with several arms. What the loop does, for one arm or several:

- serves each arm through the place (``place.serve``), one started at a time so each profiles
  its memory while the others idle; except the *exclusive* arms (two or more holding a DeepEP
  buffer), which are never up together: each is started for its block of cells
  (``exclusive_arms``), the blocks' order reversed on every other repeat;
- with several arms and ``answer_prompts``, asks each arm the fixed prompts of
  lib.measure.agreement before its cells (an exclusive arm: at its first start);
- runs one AIPerf cell per (repeat, concurrency, arm, shape) in ``cell_order``: warmup excluded,
  the measured requests raised to ``requests_per_slot`` x concurrency (lib.measure.sweep's
  SweepPlan, which the stage builds from its parameters and hands down with the backend and
  the prompts it asks: the loop looks no parameter up);
- with vLLM, reads /metrics before and after each cell (vLLM's own token count) and, when the
  closing read fails, whether the server died (``ServerLife``): an arm whose server is gone is not
  measured again, its cells are SKIPs;
- with ``memory``, reads the server's resident memory after ready (and, as every cell does,
  after each cell): 05 gates it on the CPU machine.

The stage then turns the `Measurement` into gates, tables and plots with the helpers below
(``summary``, ``exit_gates``, ``token_gates``, ``died_gates``, ``compare``), in its own order.
"""
from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any, Callable

import pandas as pd

from lib.core.evidence import Gate, gate, skip
from lib.measure import agreement, stats, sweep
from lib.measure.sweep import Shape, SweepPlan


@dataclass(frozen=True)
class Arm:
    name: str  # as the gates and the book say it
    slug: str  # as AIPerf's folders and the summary's `arm` column say it
    enforce_eager: bool = True
    expert_parallel: bool = True
    backend: str | None = None  # None: the stage's (measure's `backend`)
    num_comms: int = 1  # EP_NUM_COMMS of the arm's serve (the multicomm lever)
    transport: str | None = None  # its transport contract (None: the stage's; the GIN lever)


def shapes_of(decode: tuple[int, int],
              prefill: tuple[int, int] | None = None) -> tuple[Shape, ...]:
    """The decode-heavy shape (input tokens, output tokens), and the prefill-heavy one when
    given: the public review found the backend that wins flips with the shape."""
    shapes = (Shape("decode", *decode),)
    return shapes + ((Shape("prefill", *prefill),) if prefill else ())


def traffic_shapes(recorded: dict[str, Any], prefill: bool) -> tuple[Shape, ...]:
    """The shapes a recorded stage measured, from its params.json (the book reads a run's; a
    KeyError for a stage recorded before its shape was a parameter). A stage builds its own from
    its model (lib.stages.ab.sweep_plan)."""
    return shapes_of((recorded["input_tokens"], recorded["output_tokens"]),
                     (recorded["prefill_input_tokens"], recorded["prefill_output_tokens"])
                     if prefill else None)


def cell_order(repeats: int, concurrency: list[int], arms: tuple,
               shapes: tuple = (None,), by_arm: bool = False) -> list[tuple]:
    """(repeat, concurrency, arm[, shape]): every arm at every level (and shape) per repeat, the
    arms' order reversed on even repeats (A B C, C B A, ...). Within a repeat the arms alternate
    at each level; `by_arm`: each arm's cells of the repeat come together instead (one block per
    arm, so a server that may not stay up beside another is started for its block). One arm:
    r1 c1, r1 c2, ..., r2 c1, ... (interleaved by repeat, so drift spreads over every level)."""
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


@dataclass
class Problem:
    """Why a server is not measured: not ready, or its log does not prove the serve asked for
    (the backend gates that did not PASS)."""
    ready: bool
    failed: list[str] = field(default_factory=list)


def server_problem(server) -> Problem | None:
    if not server.ready:
        return Problem(False)
    gates = getattr(server, "backend_gates", None)
    if gates is not None and not server.backend_ok:
        return Problem(True, [g["gate"] for g in gates if g["status"] != "PASS"])
    return None


@dataclass
class Measurement:
    """What the loop measured, for the stage to gate and show."""
    arms: tuple[Arm, ...]
    plan: SweepPlan
    order: list[tuple]
    layout: str
    runs: dict[tuple, list] = field(default_factory=dict)  # (slug, shape) -> [CellRun]
    started: dict[str, list] = field(default_factory=dict)  # slug -> its servers, in order
    lives: dict[int, sweep.ServerLife] = field(default_factory=dict)  # id(server) -> its life
    answers: dict[str, list] = field(default_factory=dict)  # arm name -> its answers
    answer_files: dict[str, str] = field(default_factory=dict)
    # why nothing was measured: (the arm's slug, the start or None, its Problem)
    broken: list[tuple[str, int | None, Problem]] = field(default_factory=list)
    not_started: list[Arm] = field(default_factory=list)
    after_ready_rss: int | None = None  # `memory`: the one arm's server after ready
    answer_prompts: int = 0  # lib.measure.agreement's prompts each of several arms is asked

    @property
    def measured(self) -> bool:
        return not self.broken

    def servers(self, arm: Arm) -> list:
        return self.started[arm.slug]

    @property
    def shapes(self) -> tuple[Shape, ...]:
        return self.plan.shapes


def measure(stage, serve: Callable, arms: tuple[Arm, ...], plan: SweepPlan, *, engine: str,
            backend: str, answer_prompts: int = 0, memory: bool = False,
            header: Callable[[str, list[tuple]], None] | None = None,
            one_at_a_time: bool = False) -> Measurement:
    """Serve the arms and run `plan`'s cells at each of its shapes (see the module's docstring).

    `serve(arm, gate_prefix, log_name)` is a context manager yielding the arm's server (the
    stage's place serves it: lib.stages.ab.arm_servers); `serve.rss(server)` reads its resident
    memory. `backend`: the all-to-all backend of an arm that names none (the stage's);
    `answer_prompts`: how many of lib.measure.agreement's prompts each of several arms is asked
    (0: none). `header(layout, order)` prints the stage's line before anything starts; with one
    arm the loop prints each cell's requests before it and AIPerf's tally after it, with several
    one line per cell naming the arm. `one_at_a_time`: every arm is exclusive (each server holds
    every GPU of the place's nodes: lib.stages.ab)."""
    shapes = plan.shapes
    exclusive, why = exclusive_arms(arms, backend) if engine == "vllm" else (), "DeepEP"
    if one_at_a_time and 1 < len(arms) != len(exclusive):
        exclusive, why = arms, "each holds every GPU of its nodes"
    order = cell_order(plan.repeats, list(plan.concurrency), arms, shapes,
                       by_arm=bool(exclusive))
    resident = ", ".join(a.name for a in arms if a not in exclusive) or "no arm"
    layout = (f"{len(arms)} vLLM servers side by side" if not exclusive else
              f"{', '.join(a.name for a in exclusive)} one at a time ({why}), each started for "
              f"its block of cells; {resident} up throughout")
    m = Measurement(arms, plan, order, layout, answer_prompts=answer_prompts,
                    runs={(arm.slug, shape.name): [] for arm in arms for shape in shapes},
                    started={arm.slug: [] for arm in arms})
    if header:
        header(layout, order)
    with ExitStack() as stack:
        servers = _serve_resident(stage, serve, m, stack, exclusive)
        if m.broken:  # every server that came up stays evidence of its backend; none is measured
            return m
        if memory:
            m.after_ready_rss = serve.rss(servers[arms[0].slug])
        _run_cells(stage, serve, m, stack, exclusive, servers, engine)
    return m


def _serve_arm(stage, serve: Callable, m: Measurement, stack: ExitStack, arm: Arm,
               start: int | None):
    """Start the arm's server inside `stack`; `start`: which start of an exclusive arm."""
    one = len(m.arms) == 1
    ask = bool(m.answer_prompts) and not one  # answers are compared between arms
    where = "" if start is None else f", start {start}"
    server = stack.enter_context(serve(
        arm, "" if one else arm.name + where,
        None if one else (f"{arm.slug}.log" if start is None else f"{arm.slug}-{start}.log")))
    m.started[arm.slug].append(server)
    m.lives[id(server)] = sweep.ServerLife(arm.name + where)
    if ask and arm.name not in m.answers and not server_problem(server):
        # before its cells: what the arm computes, for the comparisons' answer gates
        m.answers[arm.name] = agreement.ask(stage, server,
                                            agreement.PROMPTS[:m.answer_prompts])
        m.answer_files[arm.name] = stage.write_json(
            agreement.ANSWERS_FILE.format(slug=arm.slug), m.answers[arm.name])
    return server


def _serve_resident(stage, serve: Callable, m: Measurement, stack: ExitStack,
                    exclusive: tuple[Arm, ...]) -> dict[str, Any]:
    """Start every arm that stays up throughout (all but the exclusive ones) inside `stack`;
    their servers by slug. A server with a problem goes to ``m.broken``."""
    arms = m.arms
    servers: dict[str, Any] = {}
    for arm in arms:  # one at a time: each profiles its memory while the others are idle
        if arm in exclusive:
            continue
        server = servers[arm.slug] = _serve_arm(stage, serve, m, stack, arm, None)
        problem = server_problem(server)
        if problem:
            m.broken.append((arm.slug, None, problem))
            if not problem.ready:
                break  # the arms after it would wait for nothing: stop here, gates say why
    if m.broken:
        m.not_started = [a for a in arms if a not in exclusive and not m.started[a.slug]]
    return servers


def _gone_life(m: Measurement, arm: Arm) -> sweep.ServerLife | None:
    """The life of the arm's server that died in an earlier cell, if one did."""
    return next((m.lives[id(s)] for s in m.started[arm.slug]
                 if m.lives[id(s)].exit_code is not None), None)


def _run_cells(stage, serve: Callable, m: Measurement, stack: ExitStack,
               exclusive: tuple[Arm, ...], servers: dict[str, Any], engine: str) -> None:
    """Every cell of ``m.order``, an exclusive arm's server started for its block (the one up
    before it stopped first); stops at an exclusive server with a problem (``m.broken``)."""
    one = len(m.arms) == 1
    order, shapes = m.order, m.shapes
    mmap_dir = stage.path(sweep.MMAP_FOLDER)
    up: Arm | None = None  # the exclusive arm whose server is up
    arm_stack = ExitStack()
    stack.callback(lambda: arm_stack.close())  # whichever exclusive server is up at the end
    try:
        for index, (repeat, concurrency, arm, shape) in enumerate(
                (o if len(o) == 4 else (*o, shapes[0])) for o in order):
            cell, name = sweep.Cell(repeat, concurrency), cell_arm(arm, shape, shapes)
            gone = _gone_life(m, arm)
            if gone:  # its server died in an earlier cell: the arm is not started again
                stage.add(skip(f"{cell.label(name)}: measured", gone.not_run()))
                if not one:
                    print(f"[{index + 1}/{len(order)}] repeat {repeat} c{concurrency} "
                          f"{arm.name}: not run, its server is gone", flush=True)
                continue
            if arm in exclusive and up != arm:
                arm_stack.close()  # the previous DeepEP server is gone before the next starts
                arm_stack, up = ExitStack(), arm
                start = len(m.started[arm.slug]) + 1
                server = servers[arm.slug] = _serve_arm(stage, serve, m, arm_stack, arm, start)
                problem = server_problem(server)
                if problem:
                    m.broken.append((arm.slug, start, problem))
                    return
            server = servers[arm.slug]
            _one_cell(stage, m, server, cell, arm, shape, name, engine,
                      f"[{index + 1}/{len(order)}]", mmap_dir)
    finally:  # AIPerf's datasets (a plan started nothing: nothing to remove)
        if not stage.door.planning:
            stage.door.run(["rm", "-rf", str(mmap_dir)], timeout=60, check=False)


def _one_cell(stage, m: Measurement, server, cell: sweep.Cell, arm: Arm, shape: Shape,
              name: str, engine: str, counter: str, mmap_dir) -> None:
    """One AIPerf cell against the arm's server, with vLLM's /metrics around it."""
    one = len(m.arms) == 1
    vllm = engine == "vllm"
    if one:
        requests = m.plan.requests(cell.concurrency)
        print(f"{counter} repeat {cell.repeat}, concurrency {cell.concurrency}: "
              f"{requests} requests ...", flush=True)
    when = (lambda w: w) if one else (lambda w: f"{name}.{w}")
    before = sweep.scrape_metrics(stage, server, cell, when("before")) if vllm else None
    r = sweep.run_cell(stage, server, cell, m.plan, shape, engine=engine, mmap_dir=mmap_dir,
                       arm=None if one else name)
    if before is not None:
        r.metrics = (before, sweep.scrape_metrics(stage, server, cell, when("after")))
        m.lives[id(server)].watch(stage, server, cell.label(name), r.metrics[1])
    m.runs[(arm.slug, shape.name)].append(r)
    row = sweep.read_cell_row(stage, cell, name, r.requests).iloc[0]
    if one:
        rss = f"{r.rss_bytes / 2 ** 20:.0f} MiB" if r.rss_bytes else "unknown"
        print(f"    AIPerf exit {r.rc} in {r.duration_s:.1f} s: {_count(row, 'requests_completed')}"
              f"/{r.requests} completed, {_count(row, 'errors')} errors, "
              f"{_fmt(row['output_tps'])} output tokens/s; server RSS {rss}", flush=True)
    else:
        print(f"{counter} repeat {cell.repeat} c{cell.concurrency} {arm.name}"
              f"{'' if len(m.shapes) == 1 else ', ' + shape.name}: AIPerf exit {r.rc}, "
              f"{_fmt(row['output_tps'])} output tok/s", flush=True)


# ---- what the stage makes of a Measurement -------------------------------------------------
def died_gates(stage, m: Measurement) -> list[Gate]:
    """A server that died under traffic: its FAIL, with the reason from its log."""
    gates = []
    for arm in m.arms:
        for server in m.started[arm.slug]:
            died = m.lives[id(server)].exit_gate(stage, server)
            if died:
                gates.append(died)
    return gates


def summary(stage, m: Measurement) -> pd.DataFrame:
    """lib.measure.aiperf's schema, a row per cell that ran (an arm whose server died is not
    measured after it)."""
    frames = [sweep.summary_table(stage, [r.cell for r in m.runs[(arm.slug, shape.name)]],
                                  cell_arm(arm, shape, m.shapes), m.plan.requests)
              for shape in m.shapes for arm in m.arms if m.runs[(arm.slug, shape.name)]]
    return frames[0] if len(frames) == 1 else pd.concat(frames, ignore_index=True)


def exit_gates(m: Measurement, arm: Arm, shape: Shape) -> list[Gate]:
    name = cell_arm(arm, shape, m.shapes)
    return [sweep.exit_gate(r, name) for r in m.runs[(arm.slug, shape.name)]]


def token_gates(m: Measurement, arm: Arm, shape: Shape) -> list[Gate]:
    return sweep.token_count_gates(m.runs[(arm.slug, shape.name)], m.plan.request_count,
                                   shape.output_tokens, cell_arm(arm, shape, m.shapes))


def answer_gates(m: Measurement, comparisons: tuple) -> list[Gate]:
    """Does each compared arm compute what its baseline computes (lib.measure.agreement)?"""
    return [agreement.agreement_gate(b, a, m.answers.get(a), m.answers.get(b),
                                     [m.answer_files[n] for n in (a, b) if n in m.answer_files])
            for b, a in comparisons]


def servers_record(stage, m: Measurement) -> dict[str, Any]:
    """How the servers were arranged and how long each took to come up (the book shows it)."""
    return {"layout": m.layout, "arms": {
        arm.name: [{"start": i, "log": stage.rel(s.log_path), "ready_s": s.ready_s,
                    "startup_s": s.startup_s} for i, s in enumerate(m.started[arm.slug], 1)]
        for arm in m.arms}}


# ---- ratios between arms --------------------------------------------------------------------
def compare(frame: pd.DataFrame, concurrency: list[int], seed: int, arms: tuple,
            shapes: tuple = (), comparisons: tuple = ()) -> list[dict]:
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


def ratio_gates(ratios: list[dict], shapes: tuple, evidence: list[str]) -> list[Gate]:
    gates = []
    for row in ratios:
        where = f"c{row['concurrency']}" + ("" if len(shapes) == 1 else f", {row['shape']}")
        name = f"output tok/s {row['b']} / {row['a']} at {where} with its interval"
        ok = row["n"] >= 2 and row["low"] is not None and row["low"] <= row["ratio"] <= row["high"]
        gates.append(gate(name, ok, [rounded(row["ratio"]), rounded(row["low"]),
                                     rounded(row["high"])],
                          "ratio, low, high over >= 2 paired repeats (scipy bootstrap)",
                          verdict(row) if ok else f"only {row['n']} paired repeat(s) measured",
                          evidence))
    return gates


def rounded(value):
    return None if value is None else round(float(value), 3)


def verdict(row: dict) -> str:
    if row["high"] < 1:
        return f"{row['b']} is slower than {row['a']} here (interval below 1)"
    if row["low"] > 1:
        return f"{row['b']} is faster than {row['a']} here (interval above 1)"
    return f"no difference between {row['b']} and {row['a']} resolved here (interval spans 1)"


def ratio_table(ratios: list[dict]) -> pd.DataFrame:
    return pd.DataFrame([{"arm b / arm a": f"{r['b']} / {r['a']}",
                          **({"shape": r["shape"]} if "shape" in r else {}),
                          "concurrency": r["concurrency"],
                          "paired repeats": r["n"], "ratio": rounded(r["ratio"]),
                          "low": rounded(r["low"]), "high": rounded(r["high"])} for r in ratios])


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


def _count(row, column: str) -> str:
    value = row[column]
    return "?" if value is None or pd.isna(value) else str(int(value))


def _fmt(value) -> str:
    return "?" if value is None or pd.isna(value) else f"{float(value):.0f}"
