"""A stage's context object: validated parameters, its run directory, its door, its gates.

The first code cell of every notebook is ``stage = open_stage("NN_name", globals())``. It reads
the names the stage declares from the notebook's namespace (the `parameters` cell and papermill's
injected cell), validates them (ParameterError before any effect), then opens the run:

- record: ``<results_dir>/<run_id>/`` (a new run_id when empty), run.json on creation, the
  stage's params.json; refusing a stage already recorded in that run;
- replay (``REPRO_REPLAY=<run dir>``): first the recorded run must be intact (sealed, every file
  as SHA256SUMS lists it, none unlisted: lib.core.evidence.require_intact), else it is refused;
  then a private copy of it, so nothing is written into it; the door answers from its
  transcript; `finish` checks that the re-computed gates equal the recorded ones and that every
  recorded call was asked for.

A stage stopped before its gates were written (interrupted, killed, or its notebook raised) is
an **attempt**: when the run is resumed (lib.runner), `retire_attempt` keeps its files as
`NN_stage.attempt-K/`, `calls/NN_stage.attempt-K/` and `notebooks/NN_stage.attempt-K.*`, with an
`incomplete.json` saying how it ended, and the stage runs again into `NN_stage/`: the completed
run has the shape of an uninterrupted one, plus its attempts, all under SHA256SUMS. The
transcript keeps every attempt's calls (lib.core.door: `attempt`, `retired`).

In a notebook's kernel, SIGTERM and SIGHUP stop the stage (`StageInterrupted`, a
KeyboardInterrupt): the running cell unwinds, so its servers are stopped by the door and the
stop recorded; an idle kernel exits through its exit hooks (the same stops).
"""
from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

from lib.core import evidence
from lib.core.door import (REPO_ROOT, Door, attempt_of, in_attempt, read_transcript,
                           record_retired)
from lib.core.errors import (EvidenceError, PlaceError, ReplayMismatch,
                             StageRefused)
from lib.core.evidence import Gate, gate

REPLAY_ENV = "REPRO_REPLAY"
_shadows: dict[Path, Path] = {}
# A replay works on a copy of the recorded run (the recording is never written), made under
# tempfile's folder as SHADOW_PREFIX<pid>-<random>/. The copy is removed when the process exits
# normally, but a Jupyter kernel that nbval or papermill stops never runs its exit hooks, so
# each replayed notebook used to leave its copy behind (6.7 GB in /tmp after a few hundred
# `make test` runs). The pid in the name lets the next replay remove copies whose process is gone.
SHADOW_PREFIX = "repro-replay-"
# The version of what a run's notebooks output, recorded in run.json: 1 (or none recorded), the
# stages also glued values for the book that no page read; 2, they glue none. Only runs of
# version 2 replay (DESIGN.md, Reference runs age); a run of version 1 is shown through its
# evidence.
OUTPUTS_VERSION = 2
# A stage's attempt kept when its run is resumed: NN_stage.attempt-K (lib.core.door `attempt`)
ATTEMPT_MARK = ".attempt-"
INCOMPLETE_NAME = "incomplete.json"
# The signals that stop a stage in its kernel (SIGINT stays ipykernel's: an interrupt)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
# The FAIL gate a cluster's refusal is recorded as (Stage.refuse); the runner stops a run at it
REFUSED_GATE = "the cluster answers"


# What a stage's place is handed (lib.places.base.PlaceSpec) is built from the stage's
# parameters by the stage layer, lib.stages.specs, which registers its builder here when it is
# imported: core imports nothing above it. A Stage builds its spec once, on first use, unless
# lib.stages.opening attached it when the stage opened.
_place_spec_builders: list[Callable[[Any], Any]] = []


def register_place_spec(build: Callable[[Any], Any]) -> None:
    """The stage layer's builder of a place's values from a stage's parameters."""
    _place_spec_builders[:] = [build]


def build_place_spec(params: Any) -> Any:
    """The values a place is handed (lib.places.base.PlaceSpec), from a stage's parameters (its
    typed model, or a replay's recorded values), by the stage layer's registered builder."""
    if not _place_spec_builders:
        raise RuntimeError("no builder of a place's values is registered: import "
                           "lib.stages.specs (lib.stages.registry imports it) before a stage "
                           "asks its place")
    return _place_spec_builders[0](params)


class StageInterrupted(KeyboardInterrupt):
    """Raised in a stage's kernel by SIGTERM or SIGHUP: the stage is being stopped (lib.runner
    on SIGINT/SIGTERM/SIGHUP, or anyone's kill). A KeyboardInterrupt, so nothing that catches
    Exception keeps the stage going; the door's stops hold it back until they are recorded."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(f"stage stopped by {signal.Signals(signum).name}: the processes it "
                         "started are stopped by PID and process group; its files are kept as "
                         "an incomplete attempt")


def _raise_stage_interrupted(signum, _frame):
    raise StageInterrupted(signum)


def stop_on_signals() -> bool:
    """In a notebook's kernel (main thread), SIGTERM and SIGHUP raise StageInterrupted."""
    if threading.current_thread() is not threading.main_thread() or "ipykernel" not in sys.modules:
        return False
    for sig in STOP_SIGNALS:
        signal.signal(sig, _raise_stage_interrupted)
    return True


class Stage:
    def __init__(self, name: str, params: dict[str, Any], run_dir: Path, door: Door,
                 recorded_run: Path | None):
        self.name = name
        self.params = params
        self.context = params["context"]
        self.run_dir = run_dir
        self.run_id = run_dir.name
        self.dir = run_dir / name
        self.door = door
        self.replay = recorded_run is not None
        self.recorded_run = recorded_run
        self.gates: list[Gate] = []
        self._resources: list = []  # cleanups (servers) run by finish, or at exit
        self.refusal: PlaceError | None = None  # the cluster refused: finish raises after gates
        self._place_spec: Any = None  # what its place is handed (place_spec), built once

    # ---- parameters --------------------------------------------------------------------------
    def __getitem__(self, key: str) -> Any:
        return self.params[key]

    @property
    def place_spec(self) -> Any:
        """The typed values this stage hands its place (lib.places.base.PlaceSpec), built once
        from its parameters by the stage layer (build_place_spec)."""
        if self._place_spec is None:
            self._place_spec = build_place_spec(self.params)
        return self._place_spec

    @place_spec.setter
    def place_spec(self, spec: Any) -> None:
        self._place_spec = spec

    # ---- artifacts ---------------------------------------------------------------------------
    def path(self, *parts: str) -> Path:
        return self.dir.joinpath(*parts)

    def rel(self, path: Path) -> str:
        """A path as evidence names it: relative to the run directory."""
        return Path(path).resolve().relative_to(self.run_dir).as_posix()

    def write_json(self, name: str, obj: Any) -> str:
        """Write a stage artifact; in replay, verify it equals the recorded one instead."""
        return self.write_text(name, evidence.dumps(obj))

    def write_text(self, name: str, text: str) -> str:
        path = self.path(name)
        if self.replay and path.exists():
            # newline="": a carriage return (a progress bar's frame in a log) stays one
            with open(path, encoding="utf-8", newline="") as recorded:
                kept = recorded.read()
            # recorded through scrub: equal up to the consistent renaming of identities
            if kept != text and not self.door.same_as_recorded(kept, text):
                raise ReplayMismatch(f"replay: {self.rel(path)} re-computed differs from the "
                                     "recorded file")
            return self.rel(path)
        evidence.write_new(path, self.door.scrub(text))  # secrets masked, identities renamed
        return self.rel(path)

    def read_json(self, name: str) -> Any:
        return evidence.read_json(self.path(name))

    def upstream_gates(self, stage: str) -> list[dict] | None:
        """Another stage's recorded gates in this run (None when it has not run)."""
        return evidence.read_gates(self.run_dir / stage)

    # ---- gates -------------------------------------------------------------------------------
    def add(self, *gates: Gate | list[Gate] | dict) -> None:
        for g in gates:
            if isinstance(g, list):
                self.add(*g)
            elif isinstance(g, dict):
                self.gates.append(Gate(**g))
            else:
                self.gates.append(g)

    def refuse(self, refusal: PlaceError) -> None:
        """The cluster refused or could not be reached: one FAIL gate naming where and the
        command; the stage stops there and `finish` raises StageRefused once gates.json is
        written, so papermill and the runner exit non-zero."""
        self.refusal = refusal
        said = [f"calls/{self.name}/{refusal.seq:04d}.{kind}" for kind in ("stderr", "stdout")
                if refusal.seq is not None] if refusal.command else []
        self.add(gate(REFUSED_GATE, False, refusal.observed(), "answers", str(refusal),
                      [rel for rel in said if (self.run_dir / rel).exists()]))

    def on_exit(self, cleanup) -> None:
        self._resources.append(cleanup)

    def close_resources(self) -> None:
        while self._resources:
            self._resources.pop()()

    def finish(self):
        """Write gates.json (replay: compare), print the summary, return the gates table."""
        import pandas as pd

        self.close_resources()
        rows = [g.as_dict() for g in self.gates]
        if not rows:
            raise EvidenceError(f"{self.name} recorded no gate: a stage must gate something")
        if self.replay:
            if self.door.remaining():
                raise ReplayMismatch(
                    f"replay: stage {self.name} asked for fewer calls than recorded "
                    f"({self.door.remaining()} left unasked)")
            recorded = evidence.read_gates(self.dir)
            if recorded != json.loads(evidence.dumps(rows)):
                raise ReplayMismatch(f"replay: the gates of {self.name} re-computed from the "
                                     "transcript differ from the recorded gates.json (a run "
                                     "recorded by an older guide is shown through its evidence, "
                                     "not replayed: DESIGN.md, Reference runs age)")
        else:
            for path in self.dir.rglob("*"):  # what processes wrote: as the door writes text
                if path.is_file():
                    self.door.clean_file(path)
            evidence.write_json_new(self.dir / "gates.json", rows)
        counts = evidence.summarize_gates(rows)
        print(f"{self.name} done: " + ", ".join(f"{n} {s}" for s, n in counts.items()))
        if self.refusal is not None:
            raise StageRefused(f"{self.name} stopped: {self.refusal}. Its gates are recorded; "
                               "the stages after it cannot run on this context until it answers")
        table = pd.DataFrame(rows)[["gate", "status", "observed", "expected", "reason"]]
        return table


def resolve_path(text: str) -> Path:
    path = Path(text)
    if not path.is_absolute() and not path.exists():
        path = REPO_ROOT / path
    return path.resolve()


def results_root(resolved: dict[str, Any]) -> Path:
    root = Path(resolved["results_dir"])
    return (root if root.is_absolute() else REPO_ROOT / root).resolve()


def open_record(name: str, resolved: dict[str, Any],
                write_run_json: Callable[[Path, dict[str, Any]], None], *,
                plan: bool = False) -> Stage:
    root = results_root(resolved)
    run_id = resolved["run_id"] or new_run_id(root, resolved["context"])
    run_dir = root / run_id
    if (run_dir / name).exists():
        raise EvidenceError(
            f"stage {name} is already recorded in run {run_id} ({run_dir / name}); a run "
            "directory is append-only: run with a new run_id (run_id='' makes one), or, if it "
            f"was interrupted, resume the run: python -m lib.runner run --run-id {run_id}")
    resolved = (resolved.model_copy(update={"run_id": run_id}) if hasattr(resolved, "model_copy")
                else {**resolved, "run_id": run_id})
    if not (run_dir / "run.json").exists():  # the first stage of a run creates it
        run_dir.mkdir(parents=True, exist_ok=True)
        write_run_json(run_dir, resolved)
    door = Door(run_dir, name, plan=plan)
    stage = Stage(name, resolved, run_dir, door, None)
    evidence.write_json_new(stage.dir / "params.json", resolved)
    return stage


def open_replay(name: str, resolved: dict[str, Any], recorded: Path, *,
                plan: bool = False) -> Stage:
    """The stage `name` answering from its recorded run: today's stage must take exactly the
    parameters the run recorded, at the values it recorded (a run recorded by a guide whose
    stages took others is shown through its evidence, not replayed: DESIGN.md, Reference runs
    age)."""
    if not (recorded / "run.json").exists():
        raise EvidenceError(f"{REPLAY_ENV}={recorded}: no run.json there, not a recorded run")
    # Before anything is read from it: a replay that passed on changed evidence would vouch for
    # numbers nobody measured. Checked at every opening (not only when the copy is made), since
    # the recorded run, not this process's copy, is what the replay vouches for; the copy itself
    # is outside the run (under tempfile's folder), so it never counts as an extra file.
    try:
        evidence.require_intact(recorded)
    except evidence.RunNotIntact as refused:
        raise type(refused)(refused.run_dir, f"{REPLAY_ENV}={recorded}: replay refused: {refused}",
                            refused.problems) from None
    if not (recorded / name / "params.json").exists():
        raise EvidenceError(f"{REPLAY_ENV}={recorded}: stage {name} is not recorded in that run")
    run = evidence.read_json(recorded / "run.json")
    if run.get("outputs_version", 1) != OUTPUTS_VERSION:
        raise ReplayMismatch(
            f"replay: run {recorded.name} was recorded with outputs version "
            f"{run.get('outputs_version', 1)}, today's is {OUTPUTS_VERSION}: it was recorded by "
            "an older guide and is shown through its evidence, not replayed (DESIGN.md, "
            "Reference runs age)")
    shadow = _shadows.get(recorded)
    if shadow is None:
        remove_orphan_shadows()
        shadow = Path(tempfile.mkdtemp(prefix=f"{SHADOW_PREFIX}{os.getpid()}-")) / recorded.name
        shutil.copytree(recorded, shadow)
        _shadows[recorded] = shadow
        atexit.register(shutil.rmtree, shadow.parent, True)
    recorded_params = evidence.read_json(recorded / name / "params.json")
    for key, value in resolved.items():
        if key == "results_dir" or key == "run_id" and value in ("", recorded.name):
            continue
        if key not in recorded_params:
            raise ReplayMismatch(
                f"replay: stage {name} takes parameter {key!r}, which the recorded run "
                f"{recorded.name} did not record: it was recorded by an older guide (re-record "
                "it, or show it through its evidence: DESIGN.md, Reference runs age)")
        if recorded_params[key] != json.loads(json.dumps(value)):
            raise ReplayMismatch(
                f"replay: parameter {key!r} = {value!r} but the recorded run used "
                f"{recorded_params[key]!r}")
    door = Door(shadow, name, replay=True, plan=plan)
    return Stage(name, recorded_params, shadow, door, recorded)


def remove_orphan_shadows(folder: Path | None = None) -> list[Path]:
    """Removes replay copies (SHADOW_PREFIX<pid>-*) whose process no longer exists; returns them.

    A copy whose pid is alive is kept, even where the pid was reused by another process: it is
    removed by a later sweep. Names without a pid (copies made before pids were recorded) are
    left alone, since nothing tells whether their process still uses them.
    """
    removed = []
    for copy in sorted(Path(folder or tempfile.gettempdir()).glob(f"{SHADOW_PREFIX}*-*")):
        pid = copy.name[len(SHADOW_PREFIX):].split("-", 1)[0]
        if not pid.isdigit() or _process_exists(int(pid)):
            continue
        shutil.rmtree(copy, ignore_errors=True)
        removed.append(copy)
    return removed


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        return True
    return True


def new_run_id(root: Path, context: str) -> str:
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    base = f"{context}-{stamp}"
    candidate, n = base, 1
    while (root / candidate).exists():
        n += 1
        candidate = f"{base}-{n}"
    return candidate


# ---- attempts -----------------------------------------------------------------------------------
def attempt_name(stage: str, attempt: int) -> str:
    return f"{stage}{ATTEMPT_MARK}{attempt}"


def attempt_files(run_dir: Path, stage: str, name: str | None = None) -> dict[str, Path]:
    """Where an attempt's files live, by kind; `name` the attempt's (default: the stage's own)."""
    name = name or stage
    notebooks = Path(run_dir) / "notebooks"
    return {"stage": Path(run_dir) / name, "calls": Path(run_dir) / "calls" / name,
            "notebook": notebooks / f"{name}.ipynb",
            "papermill_log": notebooks / f"{name}.papermill.log"}


def unfinished_attempt(run_dir: Path, stage: str) -> bool:
    """Did an attempt of `stage` start in this run and end without its gates.json?"""
    run_dir = Path(run_dir)
    if (run_dir / stage / "gates.json").exists():
        return False
    if any(p.exists() for p in attempt_files(run_dir, stage).values()):
        return True
    entries = read_transcript(run_dir / "transcript.jsonl")
    attempt = attempt_of(entries, stage)
    return any(e.get("stage") == stage and in_attempt(e, attempt) for e in entries)


def unfinished_writes(folder: Path) -> list[Path]:
    """Writers' temporary files (lib.core.evidence) left under `folder` by a killed writer."""
    if not Path(folder).is_dir():
        return []
    return sorted(p for p in Path(folder).rglob(f".*{evidence.PARTIAL_SUFFIX}") if p.is_file())


def retire_attempt(run_dir: Path, stage: str, found: dict[str, Any] | None = None) -> dict:
    """Keep an unfinished attempt of `stage` as `NN_stage.attempt-K` (K its number, from the
    transcript), so the stage can run again into its own names. Nothing is overwritten: a name
    already taken refuses the whole move. The attempt's folder holds its incomplete.json: the
    one written when it stopped (lib.runner), else one written now from `found` (what the
    resuming runner knows). A writer's temporary file left by a killed writer is removed (never
    evidence: lib.core.evidence). The transcript gets the `retired` entry. Returns it."""
    run_dir = Path(run_dir)
    attempt = attempt_of(read_transcript(run_dir / "transcript.jsonl"), stage)
    name = attempt_name(stage, attempt)
    sources, targets = attempt_files(run_dir, stage), attempt_files(run_dir, stage, name)
    taken = [str(t.relative_to(run_dir)) for t in targets.values() if t.exists()]
    if taken:
        raise EvidenceError(f"attempt {attempt} of {stage} cannot be kept as {name}: "
                            f"{', '.join(taken)} exists already; nothing was moved")
    removed = [str(p.relative_to(run_dir)) for folder in (sources["stage"], sources["calls"])
               for p in unfinished_writes(folder)]
    for rel in removed:
        (run_dir / rel).unlink()
    moved = {}
    for kind, source in sources.items():
        if source.exists():
            os.rename(source, targets[kind])
            moved[str(source.relative_to(run_dir))] = str(targets[kind].relative_to(run_dir))
    marker = targets["stage"] / INCOMPLETE_NAME
    if not marker.exists():
        evidence.write_json_new(marker, {
            "stage": stage, "attempt": attempt, "how": "found without gates.json when the run "
            "was resumed (the runner did not see it end: killed, or papermill run alone)",
            **(found or {}), "removed_unfinished_writes": removed})
    elif removed:  # its incomplete.json was written when it stopped: kept as it is
        evidence.write_json_new(targets["stage"] / "removed-unfinished-writes.json", removed)
    return record_retired(run_dir, stage, attempt, moved,
                          incomplete=str(marker.relative_to(run_dir)))
