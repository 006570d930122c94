"""AIPerf beside a slurm serve (what SlurmPlace.aiperf_beside runs): one more step of the
server's allocation, on node 0, against node 0's address. AIPerf writes its files straight into
the cell's folder on the file system the nodes share, its output into the stage folder
(`<cell>-<jobid>.out|.err`); a step that timed out is ended by its id.

Functions of the place (lib.places.slurm.place.SlurmPlace, or its plan): its steps go through
the place's `_run_step` and `_cancel_steps`, so a plan records them.
"""
from __future__ import annotations

from pathlib import Path

import lib.places.slurm.sbatch as sbatch  # the module itself, not lib.places (no cycle through it)
from lib.core.door import REPO_ROOT, CallResult
from lib.places.cluster import AIPERF_ENV, AIPERF_IN_IMAGE
from lib.places.slurm import waits
from lib.places.slurm.serve import SlurmServer


def aiperf_on_nodes(place) -> tuple[str, dict[str, str]]:
    """AIPerf on the nodes and what it needs set: the repository's `.venv-aiperf` beside
    `venv` (its sibling, as in this checkout), else the image's /opt/aiperf."""
    venv = place._venv()
    if venv:
        return str(Path(venv).parent / ".venv-aiperf" / "bin" / "aiperf"), {}
    return AIPERF_IN_IMAGE, {"PYTHONPATH": AIPERF_ENV["PYTHONPATH"]}


def aiperf_beside(place, server: SlurmServer, argv_for, *, timeout: float, out: Path,
                  name: str) -> CallResult:
    """One AIPerf cell as a step of the server's allocation on node 0, against node 0's
    address; AIPerf writes its files straight into `out` (the cell's folder, on the shared
    file system) and its output into `<name>-<jobid>.out|.err` in the stage folder. A
    CallResult of the step, with `streams` its output files (and srun's own report)."""
    from lib.measure import sweep  # AIPerf's environment (lib.measure: no import at load)

    stage = place.stage
    aiperf, extra = aiperf_on_nodes(place)
    argv = argv_for(aiperf, str(out), None)
    env = {**sweep.aiperf_env(stage.path(sweep.MMAP_FOLDER)), **extra}
    if server.tokenizer_revision and place.spec.model_cache_dir:
        env["HF_HOME"] = place.spec.model_cache_dir  # the engine's cache: its tokenizer there
    base = stage.path(f"{sbatch.slug(name)}-{server.jobid}")
    step_name = f"guide-{stage.name}-{sbatch.slug(name)}"
    if not stage.replay and not place.plans_only:
        out.mkdir(parents=True, exist_ok=True)
    call = place._run_step(sbatch.task_argv(
        jobid=server.jobid, node=server.nodes[0], name=step_name,
        time_min=place.spec.time_limit_min, chdir=str(REPO_ROOT), argv=argv,
        env=env, output=f"{base}.out", error=f"{base}.err", **place._in_image()),
        timeout=timeout, label=f"AIPerf {name}")
    if call.timed_out:  # srun was ended from here: its step is ended by its id
        waits.cancel_steps(place.door, server.jobid, [step_name])
    stdout = place.door.read_text(f"{base}.out")
    stderr = place.door.read_text(f"{base}.err")
    result = CallResult(call.argv, call.rc, stdout or "",
                        (stderr or "") + call.stderr, call.duration_s, call.timed_out,
                        call.seq)
    result.streams = ([stage.rel(Path(f"{base}.{kind}")) for kind, text
                       in (("out", stdout), ("err", stderr)) if text is not None]
                      + [f"calls/{stage.name}/{call.seq:04d}.stderr"])
    return result
