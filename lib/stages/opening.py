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
its reaper is started (lib.core.reaper: it stops what the kernel leaves should it die without
its exit hook), and SIGTERM/SIGHUP stop the stage (lib.core.stage `stop_on_signals`); the exit
hook stops what the stage started (`close_resources`).
"""
from __future__ import annotations

import ast
import atexit
import functools
import json
import os
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from lib import places
from lib.stages import profile
from lib.core import evidence
from lib.core import reaper
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
        engine = (recorded_engine(resolve_path(replay_of), name) if replay_of
                  else places.engine_default(specs.place_spec(resolved)))
        resolved = registry.resolve(name, {**given, "engine": engine})
    plan = places.plans(specs.place_spec(resolved)) and registry.SPECS[name].uses_place
    if replay_of:
        recorded = resolve_path(replay_of)
        stage = open_replay(name, resolved, recorded, registry.PARAMS, plan=plan,
                            injected=injected_parameters(recorded, name))
    else:
        stage = open_record(name, resolved, functools.partial(
            write_run_json, profile_read=profile.recorded(supplied)), plan=plan)
        ledger = reaper.Ledger(stage.run_dir)
        ledger.owner(name)  # the runner finds the kernel to stop here
        reaper.ensure_reaper(ledger)
        stop_on_signals()
    # what its place is handed, built once from the parameters it opened with (in a replay, the
    # recorded ones): lib.places reads these typed values, never a parameter by its name
    stage.place_spec = specs.place_spec(stage.params)
    atexit.register(stage.close_resources)
    print(f"{name} · context {stage.context} · run {stage.run_id}")
    return stage


def injected_parameters(recorded: Path, name: str) -> dict[str, Any]:
    """What papermill injected into the recorded run's own notebook of stage `name` (its cell
    tagged injected-parameters: the run's request, every parameter of it, whichever stage takes
    it), as literals; {} where the notebook or the cell is absent or holds anything else."""
    try:
        notebook = json.loads((recorded / "notebooks" / f"{name}.ipynb").read_text())
    except (OSError, ValueError):
        return {}
    found: dict[str, Any] = {}
    for cell in notebook.get("cells", []):
        if "injected-parameters" not in (cell.get("metadata") or {}).get("tags", []):
            continue
        source = cell.get("source")
        try:
            tree = ast.parse("".join(source) if isinstance(source, list) else source or "")
        except SyntaxError:
            return {}
        for node in tree.body:
            if (isinstance(node, ast.Assign) and len(node.targets) == 1
                    and isinstance(node.targets[0], ast.Name)):
                try:
                    found[node.targets[0].id] = ast.literal_eval(node.value)
                except ValueError:
                    continue
    return found


def recorded_engine(recorded: Path, name: str) -> str:
    """The engine a recorded stage resolved ('' picks by place; a replay takes the recorded
    machine's pick). Runs recorded before the vLLM engine existed served with transformers."""
    try:
        recorded_params = evidence.read_json(recorded / name / "params.json")
    except (OSError, ValueError):
        return "transformers"
    return recorded_params.get("engine") or "transformers"


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
