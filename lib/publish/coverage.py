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
07_train covers the megatron-core training lane, its cell naming the EP each level ran at (from
its steps.json). NeMo-RL is a row no run covers, with what the public reproduction's gate 6 ran
and why the guide does not run it, each fact with its source and what was checked here.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from lib.engines import catalog as engines
from lib.measure import published
from lib.publish import results as figures
from lib.publish.catalog import Run, host_facts
from lib.publish.pages import _md_table, run_link

def served_engine(run_dir: Path) -> str:
    """The engine a run's 04 served with, as its params.json recorded it; runs recorded before
    the engine was a parameter served with transformers serve."""
    try:
        recorded = json.loads((Path(run_dir) / "04_serve" / "params.json").read_text())
    except (OSError, ValueError):
        return "transformers"
    return recorded.get("engine") or "transformers"


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
TRAINING_LANE = "megatron-core training (07)"
NEMO_RL_LANE = "NeMo-RL"


@dataclass(frozen=True)
class Covered:
    """One run's coverage of one lane: where, at which level, and its stage's state."""
    lane: str
    place: str
    level: str
    run_id: str
    state: str
    detail: str = ""  # what a cell says beside the level (the EP a training run ran at)
    # the stages after 04 that FAILed while serving this engine (a served engine's lane)
    failed_under_traffic: tuple[str, ...] = ()


# A served engine's lane is what 04 served and the stages that then put traffic through that
# serve (05's sweep; 06's serving A/B where 06 serves, lib.stages.registry.serving): a FAIL in
# any of them is the engine failing there. vLLM 0.24.0 with deepep_v2 and CUDA graphs served in
# 04 and died under 06's traffic (gpu-2xh200-deepep-vllm-20261130d): 04 alone counted it passing.
AFTER_THE_SERVE = ("05_sweep", "06_multicomm")


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


def lanes_of(run: Run) -> list[tuple[str, str, str, tuple[str, ...]]]:
    """(lane, its state, detail, the stages that FAILed after the serve) for every lane the run
    covered: its engine's title (FAIL where 04's serve or the traffic after it failed), kernels,
    megatron-core training with its EP."""
    def ran(stage: str) -> bool:
        state = run.stages.get(stage, "not run")
        return state in COVERED_STATES or (run.context == "plan" and state == "SKIP")

    lanes = []
    if ran("04_serve"):
        name = served_engine(run.path)
        title = engines.ENGINES[name].title if name in engines.ENGINES else name
        failed = served_then_failed(run, name)
        lanes.append((title, "FAIL" if failed else run.stages["04_serve"], "", failed))
    if ran("03_kernel_test"):
        lanes += [(lane, run.stages["03_kernel_test"], "", ()) for lane, result in
                  KERNEL_LANES.items() if (run.path / "03_kernel_test" / result).exists()]
    if ran(figures.TRAIN_STAGE):
        ep = figures.training_ep(run)
        lanes.append((TRAINING_LANE, run.stages[figures.TRAIN_STAGE],
                      f"EP {ep}" if ep else "", ()))
    return lanes


def served_then_failed(run: Run, engine: str) -> tuple[str, ...]:
    """The stages after 04 that FAILed putting traffic through the engine 04 served."""
    from lib.stages.registry import serving

    return tuple(stage for stage in AFTER_THE_SERVE
                 if run.stages.get(stage) == "FAIL"
                 and (stage != "06_multicomm" or serving(stage, engine)))


def coverage(runs: list[Run]) -> list[Covered]:
    """Every (run, lane) the committed runs cover, in the runs' order (oldest first)."""
    return [Covered(lane, place_of(run), level_of(run), run.run_id, state, detail, failed)
            for run in runs for lane, state, detail, failed in lanes_of(run)]


def lanes() -> list[str]:
    """The table's rows: every engine of lib.engines.catalog, the kernel lanes, megatron-core
    training, and NeMo-RL (which no run covers: its section says why)."""
    return ([e.title for e in engines.ENGINES.values()] + list(KERNEL_LANES)
            + [TRAINING_LANE, NEMO_RL_LANE])


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
        details = sorted({c.detail for c in mine if c.detail})
        at = f"; {', '.join(details)}" if details else ""
        said.append(f"**{level}**: {runs}, {passed} passing{under_traffic(mine)}{at}; "
                    f"latest {run_link(mine[-1].run_id)}")
    return "; ".join(said)


def under_traffic(covered: list[Covered]) -> str:
    """What a cell adds where runs served in 04 and then FAILed serving in 05 or 06: how many,
    in which stages, and the latest of them, so the failure is on the row, not only counted."""
    failed = [c for c in covered if c.failed_under_traffic]
    if not failed:
        return ""
    stages = sorted({s[:2] for c in failed for s in c.failed_under_traffic})
    them = "it" if len(failed) == 1 else f"{len(failed)} of them"
    return (f" ({them} served in 04, then FAILed in {', '.join(stages)}; the last: "
            f"{run_link(failed[-1].run_id)})")


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


# NeMo-RL, which the guide does not run. What the public reproduction's gate 6 ran, by its own
# record; then why the guide does not run NeMo-RL, each fact with its source and date and what
# was checked here on NEMO_RL_CHECKED (verified, partly, or not: said as such, never dropped).
NEMO_RL_RECORD = f"{published.SOURCE.split(' ')[0]}, results/nemo-rl-rollout-20260429/VALIDATION.md"
NEMO_RL_CHECKED = "2026-12-04"
NEMO_RL_RAN = (
    "By its own record, the public gate 6 ('NeMo-RL rollout', world 16 on 2x p5.48xlarge H100 "
    "over EFA) was not a NeMo-RL run: a rollout-shaped driver over Megatron's fused all-to-all "
    "(`fused_a2a`) through a DeepEP V1-to-V2 shim returned 64 tokens and log-probs shaped "
    "[64, 8192] in 9.45 s; a real end-to-end NeMo-RL rollout with a real model is named there "
    f"as a follow-up ({NEMO_RL_RECORD}, 2026-04-29; cited).")
NEMO_RL_FACTS = (
    {"fact": "NeMo-RL's main requires Python >= 3.13.14",
     "source, date": "NeMo-RL #2220, as found 2026-12-03",
     "checked here": "partly: NeMo Gym, a uv workspace member of NeMo-RL (3rdparty/Gym-workspace "
                     "in its pyproject.toml), moved to Python 3.13.14 (NVIDIA-NeMo/Gym #2194, "
                     "merged 2026-07-29), and NVIDIA-NeMo/RL #2562 (open, 2026-05-25) asks for a "
                     "Python 3.12 build; main's own pyproject.toml and #2220 were not seen "
                     "(the stored copies are older, >= 3.12)"},
    {"fact": "ray >= 2.55.1",
     "source, date": "the NeMo-RL repository, as found 2026-12-03",
     "checked here": "at NeMo-RL commit 7fa6e55, not main: a public recipe building that commit "
                     "rewrites its pyproject.toml's ray[default]>=2.55.1 (and NeMo Gym's "
                     ">=2.56.1) to ==2.55.1 (found by code search; it gives no date)"},
    {"fact": "Transformer Engine and vLLM come from outside the registries",
     "source, date": "the NeMo-RL repository ('TE 2.14.1 from git'), as found "
                     "2026-12-03",
     "checked here": "not verified: the stored NeMo-RL pyproject.toml (commit 00efe66) takes "
                     "transformer-engine 2.8.0 and vllm 0.11.2 from PyPI, DeepEP and DeepGEMM "
                     "from git; main's was not seen"},
    {"fact": "PyPI's nemo-rl is a placeholder",
     "source, date": "PyPI (pip index versions nemo-rl; its JSON API)",
     "checked here": "verified: one version, 0.0.0, uploaded 2025-06-03, with no dependencies"},
    {"fact": "the public reproduction's pin 46be4e8 needs torch 2.9.0 (the guide's GPU image "
             "has torch 2.11.0)",
     "source, date": f"the pin: its image tag 46be4e8-shim-h100-20260429 ({NEMO_RL_RECORD}, "
                     "2026-04-29); torch 2.9.0: issue 30",
     "checked here": "not verified: 46be4e8 is not in the stored sources; the stored NeMo-RL "
                     "pyproject.toml of commit 00efe66 (its date not stored) pins torch==2.9.0, "
                     "ray 2.49.2 and Python >= 3.12"},
)
NEMO_RL_WHY = (
    "Why the guide does not run NeMo-RL here: its main wants a Python (3.13.14) that neither the "
    "guide's environment (3.11) nor the GPU image (3.12) has, and (by the NeMo-RL repository "
    "as found on 2026-12-03, not verified here) Transformer Engine and vLLM from outside the "
    "registries, which the GPU machines cannot reach; the public reproduction's own pin wants another torch (2.9.0) than the image's "
    "(2.11.0). PyPI offers only a placeholder. And what the public gate ran was Megatron's fused "
    "all-to-all, the path 07 trains through with megatron-core's own dispatcher. No placeholder "
    "stage stands in for it.")


def nemo_rl_section() -> list[str]:
    """The NeMo-RL row's section: what the public gate 6 ran, the facts (each with its source,
    date and what was checked here), and why the guide does not run it."""
    table = pd.DataFrame(list(NEMO_RL_FACTS))
    return ["(nemo-rl)=", "## NeMo-RL: not run here, and why\n", NEMO_RL_RAN + "\n",
            _md_table(table.rename(columns={"checked here": f"checked here, {NEMO_RL_CHECKED}"})),
            "\n" + NEMO_RL_WHY + "\n"]


def claims_table(cited: list[dict]) -> pd.DataFrame:
    return pd.DataFrame([{"engine": c["engine"], "claim": c["claim"],
                          "source, date": f"{c['source']}, {c['date']}"} for c in cited])


def coverage_page(runs: list[Run], cited: list[dict]) -> str:
    return "\n".join([
        "# Coverage\n",
        "(ran)=", "## Where the guide ran each engine\n",
        "Computed from the committed runs (`results/`): a cell names each level a run reached "
        "there, how many runs did, how many passed, and the latest; *not run* where none did. "
        "An engine passes in a run when its serve (04) and the serving after it (05's sweep, "
        "06's serving A/B) passed: a run that served and then FAILed is named in its cell. "
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
        f"*{TRAINING_LANE}*: stage 07 at the place it ran, with the EP it ran at (a run on one "
        "GPU is EP 1: no token crosses a GPU there). "
        f"*{NEMO_RL_LANE}*: no run; {{ref}}`below <nemo-rl>`, what the public gate ran and why "
        "the guide does not run it.\n",
        "(cross-engine)=", "## The public reproduction's engines side by side\n",
        f"Cited from {published.SOURCE} ({published.CROSS_ENGINE_DATE}). Output tok/s at concurrency 4 / 8 / 32 on {published.HARDWARE}; "
        f"{published.CROSS_ENGINE_WORKLOAD}. The same model and workload on the same nodes, but "
        "not a single-variable A/B: each engine ran its own stack (version, seam or shim, "
        "the EP_NUM_COMMS overlay on the SGLang arm), so a ratio between rows says what the "
        "whole stack did, not what DeepEP-V2 did. None of it is measured here; *this guide* "
        "says the best level the committed runs reached for that engine.\n",
        _md_table(cross_engine_table(runs)),
        "\n(claims)=", "## What public sources claim\n",
        "For the engines and lanes above and those this guide does not run; each with its "
        "source and the date it gives (or the date it was found).\n",
        _md_table(claims_table(cited)) + "\n",
        *nemo_rl_section(),
    ])


def pin_sets_line(runs: list[Run]) -> str:
    from lib.roots import pins

    used: dict[str, int] = {}
    for run in runs:
        used[run.pin_set] = used.get(run.pin_set, 0) + 1
    levels = {name: (spec or {}).get("level", "") for name, spec in
              (pins.load().get("sets") or {}).items()}
    said = "; ".join(f"{name} ({levels.get(name, '')}): "
                     + (f"{used[name]} committed runs" if name in used else "no run yet")
                     for name in levels)
    return f"Pin sets ([pin sets](pin_sets.md)): {said}."
