"""Opening a stage: the first code cell of every notebook is
``stage = open_stage("NN_name", globals())``.

It reads the parameters the stage declares (lib.stages.registry) from the notebook's namespace
(the `parameters` cell and papermill's injected cell), validates them (ParameterError before any
effect; the engine against this machine: lib.stages.rules_places), settles the engine ('' : the
place's pick, lib.places), then opens the run through
lib.core.stage: record (a new or named run under results_dir, run.json on creation), plan (the
same, its door in plan mode: nothing run against a cluster or a server) or replay
(``REPRO_REPLAY=<run dir>``: a private copy of the recorded run, the door answering from its
transcript). The opened stage carries what its place is handed (`stage.place_spec`, built once
from its parameters by lib.stages.specs).

Recording, the kernel is written into the run's ledger as the owner of what its doors start,
its reaper is started (lib.core.processes: it stops what the kernel leaves should it die without
its exit hook), and SIGTERM/SIGHUP stop the stage (lib.core.stage `stop_on_signals`); the exit
hook stops what the stage started (`close_resources`).
"""
from __future__ import annotations

import atexit
import functools
import os
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from lib import places
from lib.stages import profile
from lib.core import evidence
from lib.core import processes
from lib.core.door import Door, REPO_ROOT
from lib.core.errors import ParameterError
from lib.core.stage import (OUTPUTS_VERSION, REPLAY_ENV, Stage, open_record, open_replay,
                            resolve_path, stop_on_signals)
from lib.stages import registry, rules_places, specs


# A run on a test cluster (tests/record_kube_run.py) states what was real and what simulated;
# run.json keeps it as "level" and the book labels the run's numbers with it.
LEVEL_ENV = "REPRO_LEVEL"


def open_stage(name: str, namespace: dict[str, Any]) -> Stage:
    declared = registry.STAGE_PARAMS.get(name)
    if declared is None:
        raise ParameterError("stage", name, "one of " + ", ".join(registry.STAGES))
    given = {k: namespace[k] for k in declared if k in namespace}
    replay_of = os.environ.get(REPLAY_ENV)
    supplied: dict[str, Any] = {}
    if not replay_of:  # a replay's parameters are what its notebooks were given, never a profile
        given, supplied = profile.fill(declared, given)
    resolved = registry.resolve(name, given)  # raises before any effect
    if not replay_of:  # a replay's recorded run already proves what its machine could do
        rules_places.check_engine_here(specs.place_spec(resolved))
    if "engine" in resolved and not resolved["engine"]:
        # '' : the place's pick; the engine then decides the defaults (registry "local:vllm")
        # a replay: the recorded machine's pick (this one may have other GPUs)
        engine = (evidence.read_json(resolve_path(replay_of) / name / "params.json")["engine"]
                  if replay_of else places.engine_default(specs.place_spec(resolved)))
        resolved = registry.resolve(name, {**given, "engine": engine})
    plan = places.plans(specs.place_spec(resolved)) and registry.SPECS[name].uses_place
    if replay_of:
        recorded = resolve_path(replay_of)
        stage = open_replay(name, resolved, recorded, plan=plan)
    else:
        stage = open_record(name, resolved, functools.partial(
            write_run_json, profile_read=profile.recorded(supplied)), plan=plan)
        ledger = processes.Ledger(stage.run_dir)
        ledger.owner(name)  # the runner finds the kernel to stop here
        processes.ensure_reaper(ledger)
        stop_on_signals()
    # what its place is handed, built once from the parameters it opened with (in a replay, the
    # recorded ones): lib.places reads these typed values, never a parameter by its name
    stage.place_spec = specs.place_spec(stage.params)
    atexit.register(stage.close_resources)
    print(f"{name} · context {stage.context} · run {stage.run_id}")
    return stage


def write_run_json(run_dir: Path, resolved: dict[str, Any],
                   profile_read: dict[str, Any] | None = None) -> None:
    """run.json, written by the first stage of a run: what ran, where, with which guide."""
    door = Door(run_dir, "_run")
    sha = door.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, timeout=30, check=False)
    dirty = door.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_ROOT,
                     timeout=30, check=False)
    from lib.engines import site_patches  # late: they read files, only when a run is created
    from lib.roots import pins

    record = {
        "run_id": run_dir.name,
        "created_utc": datetime.fromtimestamp(door.now(), timezone.utc).isoformat(),
        "context": resolved["context"],
        "seed": resolved["seed"],
        "parameters": resolved,
        "guide": {"git_sha": sha.stdout.strip() if sha.ok else None,
                  "dirty": bool(dirty.stdout.strip()) if dirty.ok else None},
        "pins_digest": pins.digest(),
        # the pin set the run uses (pins.yaml `sets:`); a run.json without it predates sets and
        # used pins.RECORDED_BEFORE_SETS (pins.pin_set_of)
        "pin_set": resolved.get("pin_set"),
        # patched sites on this process's path (scripts/vllm-site.sh patches vLLM's): which
        # patched code the run's servers import, each file checked against its recorded sha256
        "site_patches": site_patches.applied_on(os.environ.get("PYTHONPATH")),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "replay_with": f"{REPLAY_ENV}=results/{run_dir.name}",
        "outputs_version": OUTPUTS_VERSION,
    }
    if profile_read:  # the cluster profile whose defaults the run took (lib.stages.profile)
        record["profile"] = profile_read
    if os.environ.get(LEVEL_ENV):  # a test cluster says what of it was real (the book shows it)
        record["level"] = os.environ[LEVEL_ENV]
    evidence.write_json_new(run_dir / "run.json", record)
