"""The coverage page: where the guide ran each engine and kernel lane, and at which level,
computed from the committed runs; beside it, in tables of their own, the public reproduction's
serving figures per engine and what public sources claim (each cited with its source and date).

A run covers a lane at a place when the lane's stage ran there (PASS or FAIL; a plan counts as
rendered even though its gates SKIP): 04_serve for the engine it served, 03_kernel_test for the
kernel whose result file it wrote. Its level follows from what its run.json says was real: a
run with no `level` was measured on the place it names; a `kube` run with one ran on the real
control plane with simulated nodes (tests/record_kube_run.py); a `slurm` run with one on the real
two-node Slurm, its nodes this CPU host (no GPU declared: every output measured there) or GPUs
simulated (tests/record_slurm_run.py); a `plan` run rendered and checked, ran nothing.
"""
from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from lib.engines import catalog as engines
from lib.measure import published
from lib.publish.catalog import Run, host_facts
from lib.publish.pages import _md_table, run_link
from lib.stages.opening import recorded_engine

PLACES = ("one CPU host", "one GPU host", "Kubernetes", "Slurm")
_CLUSTER_PLACES = {"kube": "Kubernetes", "slurm": "Slurm"}
MEASURED = "measured"
SLURM_CPU_NODES = "real Slurm, its nodes one CPU host"
SLURM_SIMULATED_GPUS = "real Slurm, GPUs simulated"
SIMULATED_NODES = "real control plane, nodes simulated"
RENDERED = "rendered only"
LEVELS = (MEASURED, SLURM_CPU_NODES, SLURM_SIMULATED_GPUS, SIMULATED_NODES, RENDERED)  # best first
NOT_RUN = "not run"
# A kernel lane: the file 03 writes when it ran that kernel (lib.stages.kernel).
KERNEL_LANES = {"DeepEP test_ep": "test_ep.json", "torch benchmark": "result.json"}
COVERED_STATES = ("PASS", "FAIL")


@dataclass(frozen=True)
class Covered:
    """One run's coverage of one lane: where, at which level, and its stage's state."""
    lane: str
    place: str
    level: str
    run_id: str
    state: str


def place_of(run: Run) -> str:
    """The place a run ran on (a plan: the place it planned for)."""
    params = run.record.get("parameters") or {}
    context = params.get("plan_for") if run.context == "plan" else run.context
    if context in _CLUSTER_PLACES:
        return _CLUSTER_PLACES[context]
    if context == "local":
        return "one GPU host" if host_facts(run.path).get("gpus") else "one CPU host"
    return f"{context} (a context this page does not know)"


def level_of(run: Run) -> str:
    """The run's level, from its run.json (the module's docstring says the rule)."""
    if run.context == "plan":
        return RENDERED
    if not run.record.get("level"):
        return MEASURED
    if run.context == "kube":
        return SIMULATED_NODES
    if run.context == "slurm":
        gpus = (run.record.get("parameters") or {}).get("gpus_per_node")
        return SLURM_CPU_NODES if gpus is not None and int(gpus) == 0 else SLURM_SIMULATED_GPUS
    return f"not measured ({run.context}: {run.record['level']})"


def lanes_of(run: Run) -> list[tuple[str, str]]:
    """(lane, its stage's state) for every lane the run covered: its engine's title, kernels."""
    def ran(stage: str) -> bool:
        state = run.stages.get(stage, "not run")
        return state in COVERED_STATES or (run.context == "plan" and state == "SKIP")

    lanes = []
    if ran("04_serve"):
        name = recorded_engine(run.path, "04_serve")
        title = engines.ENGINES[name].title if name in engines.ENGINES else name
        lanes.append((title, run.stages["04_serve"]))
    if ran("03_kernel_test"):
        lanes += [(lane, run.stages["03_kernel_test"]) for lane, result in KERNEL_LANES.items()
                  if (run.path / "03_kernel_test" / result).exists()]
    return lanes


def coverage(runs: list[Run]) -> list[Covered]:
    """Every (run, lane) the committed runs cover, in the runs' order (oldest first)."""
    return [Covered(lane, place_of(run), level_of(run), run.run_id, state)
            for run in runs for lane, state in lanes_of(run)]


def lanes() -> list[str]:
    """The table's rows: every engine of lib.engines.catalog, then the kernel lanes."""
    return [e.title for e in engines.ENGINES.values()] + list(KERNEL_LANES)


def _rank(level: str) -> int:
    return LEVELS.index(level) if level in LEVELS else len(LEVELS)


def cell(covered: list[Covered]) -> str:
    """One engine x place cell: each level reached, best first, with its count of runs, how many
    passed, and the latest run; 'not run' where no run covered it."""
    if not covered:
        return NOT_RUN
    said = []
    for level in sorted({c.level for c in covered}, key=_rank):
        mine = [c for c in covered if c.level == level]
        passed = sum(c.state == "PASS" for c in mine)
        runs = f"{len(mine)} run" + ("s" if len(mine) > 1 else "")
        said.append(f"**{level}**: {runs}, {passed} passing; latest {run_link(mine[-1].run_id)}")
    return "; ".join(said)


def coverage_table(runs: list[Run]) -> pd.DataFrame:
    """The engine x place table: a row per lane, a column per place (and any other place a run
    ran on), every cell computed by `cell` from the committed runs."""
    covered = coverage(runs)
    places = list(PLACES) + sorted({c.place for c in covered} - set(PLACES))
    rows = []
    for lane in lanes() + sorted({c.lane for c in covered} - set(lanes())):
        row = {"engine / lane": lane}
        for place in places:
            row[place] = cell([c for c in covered if c.lane == lane and c.place == place])
        rows.append(row)
    return pd.DataFrame(rows)


def best_level(runs: list[Run], lane: str) -> str:
    """The best level any committed run reached for a lane, at the place where it did."""
    mine = sorted((c for c in coverage(runs) if c.lane == lane), key=lambda c: _rank(c.level))
    return f"{mine[0].level}, {mine[0].place}" if mine else NOT_RUN


def cross_engine_table(runs: list[Run]) -> pd.DataFrame:
    """The public reproduction's output tok/s per engine and arm (cited), each row with its
    level and, computed, the best level this guide reached for that engine."""
    figures = published.cross_engine_figures()
    table = pd.DataFrame({
        "engine, stack": figures["stack"],
        **{f"c{c} tok/s": figures[f"c{c}"].map(lambda v: f"{v:.1f}") for c in (4, 8, 32)},
        "level": [f"cited: {source}, {date}"
                  for source, date in zip(figures["source"], figures["date"])],
        "this guide": [best_level(runs, engines.ENGINES[name].title)
                       for name in figures["engine"]]})
    return table


def claims_table(cited: list[dict]) -> pd.DataFrame:
    return pd.DataFrame([{"engine": c["engine"], "claim": c["claim"],
                          "source, date": f"{c['source']}, {c['date']}"} for c in cited])


def coverage_page(runs: list[Run], cited: list[dict]) -> str:
    return "\n".join([
        "# Coverage\n",
        "(ran)=", "## Where the guide ran each engine\n",
        "Computed from the committed runs (`results/`): a cell names each level a run reached "
        "there, how many runs did, how many passed, and the latest; *not run* where none did. "
        f"Levels: **{MEASURED}** (every process real on the place named); **{SLURM_CPU_NODES}** "
        f"(a real two-node Slurm on this CPU host, every output measured there); "
        f"**{SLURM_SIMULATED_GPUS}**; **{SIMULATED_NODES}** (a real kube-apiserver, scheduler "
        f"and controllers; a test kubelet plays the nodes, with logs recorded on 2x H200 or "
        f"composed from an engine's own formats); **{RENDERED}** (a plan: manifests or batch "
        "scripts rendered and validated, nothing started). `make test` exercises further engines "
        "and places (`tests/test_sglang.py`, `tests/test_trtllm.py`) without committing a run: "
        "they count here once a run of theirs is committed.\n",
        _md_table(coverage_table(runs)),
        "\n" + pin_sets_line(runs) + "\n",
        "(cross-engine)=", "## The public reproduction's engines side by side (cited)\n",
        f"Output tok/s at concurrency 4 / 8 / 32 on {published.HARDWARE}; "
        f"{published.CROSS_ENGINE_WORKLOAD}. The same model and workload on the same nodes, but "
        "not a single-variable A/B: each engine ran its own stack (version, seam or shim, "
        "the EP_NUM_COMMS overlay on the SGLang arm), so a ratio between rows says what the "
        "whole stack did, not what DeepEP-V2 did. None of it is measured here; *this guide* "
        "says the best level the committed runs reached for that engine.\n",
        _md_table(cross_engine_table(runs)),
        "\n(claims)=", "## What public sources claim (cited)\n",
        "For the engines and lanes above and those this guide does not run; each with its "
        "source and the date it gives (or the date it was found).\n",
        _md_table(claims_table(cited)) + "\n",
    ])


def pin_sets_line(runs: list[Run]) -> str:
    from lib.roots import pins

    used: dict[str, int] = {}
    for run in runs:
        used[run.pin_set] = used.get(run.pin_set, 0) + 1
    levels = {name: (spec or {}).get("level", "") for name, spec in
              (pins.load().get("sets") or {}).items()}
    said = "; ".join(f"`{name}` ({levels.get(name, '')}): "
                     + (f"{used[name]} committed runs" if name in used else "no run yet")
                     for name in levels)
    return f"Pin sets ([pin sets](pin_sets.md)): {said}."
