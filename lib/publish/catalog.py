"""Every recorded run under a results directory, described from its evidence alone.

The book's results page, its appendix and its comparison read runs through this catalog, so one
rule decides which runs may feed a results figure: a run on real GPUs, recorded by the guide on
the place it names. A run whose nodes were simulated or that ran on this CPU host (a `level` in
its run.json, or no GPU in its host facts) never feeds a figure; it is listed in the appendix
with its level.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from lib.core import evidence
from lib.core.stage import INCOMPLETE_NAME
from lib.roots import pins
from lib.stages.registry import STAGES

REFERENCE_FILE = "REFERENCE"  # results/REFERENCE: the run the book publishes by default
REPLAYED_FILE = "REPLAYED"    # results/REPLAYED: the notebooks of further runs nbval replays
END_TO_END = "measured here end-to-end"


@dataclass
class Run:
    run_id: str
    path: Path
    record: dict
    date: str
    context: str
    hardware: str
    level: str
    kernel: str
    serving: str
    stages: dict[str, str]                 # stage -> PASS, FAIL, SKIP or "not run"
    replayed: list[str]
    seal: str                              # "sealed", "unsealed" (interrupted) or "tampered: ..."
    feeds_results: bool
    why_not_results: str = ""
    notes: str = ""
    superseded_by: str = ""
    failed_stages: list[str] = field(default_factory=list)
    interrupted: list[str] = field(default_factory=list)
    pin_set: str = ""  # the stack it ran (lib.roots.pins; runs before sets: the seed's)

    @property
    def measured(self) -> list[str]:
        return [s for s, state in self.stages.items() if state != "not run"]

    @property
    def verdict(self) -> str:
        if not self.seal == "sealed":
            return "incomplete" if self.seal == "unsealed" else "refused (evidence changed)"
        if self.interrupted:
            return "incomplete: " + ", ".join(s[:2] for s in self.interrupted) + " interrupted"
        if self.failed_stages:
            return "FAIL in " + ", ".join(s[:2] for s in self.failed_stages)
        return "PASS"

    @property
    def label(self) -> str:
        """What a reader of the appendix needs before trusting the run."""
        if self.seal != "sealed":
            return self.verdict
        if self.interrupted:
            return self.verdict + " (make run RUN=<id> resumes it)"
        if self.superseded_by:
            return f"superseded by {self.superseded_by}"
        if self.failed_stages:
            return "has FAIL gates, kept as recorded"
        return "current"


def stage_states(run_dir: Path) -> dict[str, str]:
    """PASS, FAIL or SKIP from a stage's gates; "interrupted" for a stage the runner stopped
    (its incomplete.json, lib.runner) and no attempt finished; else "not run"."""
    states = {}
    for stage in STAGES:
        gates = evidence.read_gates(run_dir / stage)
        if gates is None:
            interrupted = (run_dir / stage / INCOMPLETE_NAME).exists()
            states[stage] = "interrupted" if interrupted else "not run"
            continue
        counts = evidence.summarize_gates(gates)
        states[stage] = "FAIL" if counts["FAIL"] else ("PASS" if counts["PASS"] else "SKIP")
    return states


def seal_state(run_dir: Path, digests: evidence.DigestCache | None = None) -> str:
    """evidence.seal_state, with what changed named when the run was tampered with."""
    state = evidence.seal_state(run_dir, digests)
    return ("tampered: " + "; ".join(evidence.verify(run_dir, digests)[:5])
            if state == "tampered" else state)


def host_facts(run_dir: Path) -> dict:
    path = run_dir / "00_cluster" / "host.json"
    return evidence.read_json(path) if path.exists() else {}


def hardware_of(run_dir: Path, record: dict) -> str:
    if record.get("context") == "kube":
        return "Kubernetes control plane on a CPU host, nodes simulated"
    if record.get("context") == "slurm":
        params = record.get("parameters") or {}
        return f"Slurm, {params.get('nodes', '?')} nodes on one CPU host"
    host = host_facts(run_dir)
    gpus = host.get("gpus") or []
    if gpus:
        names = sorted({g.get("name", "GPU") for g in gpus})
        return f"{len(gpus)}x {' + '.join(names)}, one host"
    if host:
        return f"CPU only, {host.get('cpu_cores', '?')} cores"
    return "not recorded (no 00_cluster)"


def kernel_of(run_dir: Path) -> str:
    stage = run_dir / "03_kernel_test"
    if (stage / "test_ep.json").exists():
        return "DeepEP test_ep, torch benchmark, NCCL floor"
    if (stage / "result.json").exists():
        config = evidence.read_json(stage / "result.json").get("config", {})
        return f"torch benchmark ({config.get('backend', '?')})"
    return ""


def serving_of(run_dir: Path) -> str:
    """What 04 served: '<engine's title>, <backend>' for an expert-parallel engine (from its
    `<engine>_serve.json`, else, in a plan, from its parameters), or transformers serve."""
    from lib.engines import catalog as engines  # the engines' titles (one list)

    stage = run_dir / "04_serve"
    if not (stage / "gates.json").exists():
        return ""
    params = evidence.read_json(stage / "params.json") if (stage / "params.json").exists() else {}
    name = params.get("engine") or ("vllm" if (stage / "vllm_serve.json").exists()
                                    else "transformers")
    if name == "transformers":
        return "transformers serve (tiny model)"
    served = stage / f"{name}_serve.json"
    info = evidence.read_json(served) if served.exists() else {}
    return f"{engines.engine(name).title}, {info.get('backend') or params.get('all2all_backend', '?')}"


def why_not_results(run_dir: Path, record: dict) -> str:
    """Empty when the run may feed results figures; else the reason it may not."""
    if record.get("level"):
        return record["level"]
    if not (host_facts(run_dir).get("gpus")):
        return "CPU host: gloo kernels and a tiny served model, a check of the guide, not a figure"
    return ""


def read_run(run_dir: Path, replayed: list[str], reference: str = "",
             digests: evidence.DigestCache | None = None) -> Run:
    record = evidence.read_json(run_dir / "run.json")
    stages = stage_states(run_dir)
    if run_dir.name == reference:
        replayed = [s for s, state in stages.items() if state != "not run"]
    notes = run_dir.parent / f"{run_dir.name}.notes.md"  # beside the sealed run, never inside it
    why = why_not_results(run_dir, record)
    seal = seal_state(run_dir, digests)
    if seal != "sealed" and not why:
        why = f"evidence {seal}"
    return Run(
        run_id=run_dir.name, path=run_dir, record=record,
        date=str(record.get("created_utc", ""))[:10], context=record.get("context", "?"),
        hardware=hardware_of(run_dir, record), level=record.get("level") or END_TO_END,
        kernel=kernel_of(run_dir), serving=serving_of(run_dir), stages=stages,
        replayed=replayed, seal=seal, feeds_results=not why, why_not_results=why,
        notes=notes.read_text(encoding="utf-8") if notes.exists() else "",
        failed_stages=[s for s, state in stages.items() if state == "FAIL"],
        interrupted=[s for s, state in stages.items() if state == "interrupted"],
        pin_set=pins.pin_set_of(record))


def replayed_notebooks(results: Path) -> dict[str, list[str]]:
    """Further reference runs and which of their notebooks `make test` replays."""
    listing = Path(results) / REPLAYED_FILE
    runs: dict[str, list[str]] = {}
    if listing.exists():
        for line in listing.read_text(encoding="utf-8").split():
            parts = Path(line).parts  # results/<run>/notebooks/<stage>.ipynb
            runs.setdefault(parts[1], []).append(Path(line).stem)
    return runs


REMOVED_FILE = "REMOVED"  # results/REMOVED: re-recorded runs taken out of the tree (tests/rerecord.py)


@dataclass(frozen=True)
class RemovedRun:
    """A run taken out of the tree when it was re-recorded: the commit that still holds it."""
    run_id: str
    commit: str
    replaced_by: str


def removed_runs(results: Path) -> list[RemovedRun]:
    """results/REMOVED, a line per removed run: `<run id> <commit holding it> <replaced by>`."""
    listing = Path(results) / REMOVED_FILE
    if not listing.exists():
        return []
    rows = [line.split() for line in listing.read_text(encoding="utf-8").splitlines()
            if line.strip() and not line.startswith("#")]
    return [RemovedRun(*row) for row in rows]


def results_size(results: Path) -> str:
    """What results/ holds checked out: its files and bytes, and its runs."""
    files = [p for p in Path(results).rglob("*") if p.is_file()]
    size = sum(p.stat().st_size for p in files)
    runs = sum(1 for d in Path(results).iterdir() if (d / "run.json").is_file())
    return (f"results/: {len(files)} files, {size / 2 ** 20:.1f} MiB checked out, "
            f"{runs} runs")


def catalog(results: Path, digests: evidence.DigestCache | None = None) -> list[Run]:
    """Every directory of results/ holding a run.json, oldest first, superseded runs marked;
    `digests` remembers the files' sha256 between calls (evidence.DigestCache)."""
    results = Path(results)
    reference_file = results / REFERENCE_FILE
    reference = reference_file.read_text(encoding="utf-8").strip() if reference_file.exists() else ""
    replayed = replayed_notebooks(results)
    runs = [read_run(d, replayed.get(d.name, []), reference, digests)
            for d in sorted(results.iterdir()) if (d / "run.json").is_file()]
    runs.sort(key=lambda r: (r.record.get("created_utc", ""), r.run_id))
    mark_superseded(runs)
    return runs


def setup_keys(run: Run) -> set[tuple]:
    """What a run measured, stage by stage, in a form a later run can repeat."""
    keys = set()
    for stage, state in run.stages.items():
        if stage == "00_cluster" or state in ("not run", "SKIP"):
            continue
        kind = {"03_kernel_test": run.kernel, "04_serve": run.serving}.get(stage, run.serving)
        keys.add((stage, kind))
    return keys


def mark_superseded(runs: list[Run]) -> None:
    """A run is superseded when a later run on the same hardware and context measured everything
    it measured with the same kernel and engine, without a FAIL in those stages."""
    for i, run in enumerate(runs):
        mine = setup_keys(run)
        if not mine:
            continue
        for later in runs[i + 1:]:
            if (later.hardware, later.context) != (run.hardware, run.context):
                continue
            passed = {k for k in setup_keys(later) if later.stages[k[0]] == "PASS"}
            if mine <= passed:
                run.superseded_by = later.run_id
                break


def by_id(runs: list[Run]) -> dict[str, Run]:
    return {r.run_id: r for r in runs}
