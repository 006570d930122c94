"""Record the guide on the slurm place against the test cluster, as a committed run.

    .venv/bin/python -m tests.record_slurm_run slurm-local-YYYYMMDD

The scheduler is real: Slurm (slurmctld, two slurmd, munged) on this host (tests/slurmlocal.py),
both nodes this host. The nodes are this CPU machine, so the run declares them as such
(`gpus_per_node` 0, `efa_per_node` 0: no GPU, no EFA, so 00 does not ask for gdrdrv nor
hugepages), serves with `transformers serve` (engine transformers) and runs 03's torch benchmark
on gloo, one rank per node. Every output is measured here. The guide runs exactly as a person
runs it on a Slurm login node: `python -m lib.runner run --context slurm ...` (papermill, every
notebook), the Slurm clients reaching the cluster through SLURM_CONF. Stages 00, 03, 04 and 05:
the probe of both nodes; the benchmark across them as one step; transformers serve as a step of
an allocation; AIPerf as another step against it. The run is written to results/<run_id>/ and
sealed; afterwards nothing of it may be left in the queue or alive (checked, said, exit 1
otherwise). Add its notebooks to results/REPLAYED to have `make test` replay it.
"""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from lib import runner
from lib.stages import registry
from lib.stages.opening import LEVEL_ENV

try:
    import slurmlocal
except ImportError:
    from tests import slurmlocal

STAGES = ["00_cluster", "03_kernel_test", "04_serve", "05_sweep"]
PARAMS = {
    # venv relative to the repository: the run replays in any checkout
    "venv": ".venv", "nodes": "2", "ranks": "1", "engine": "transformers",
    "gpus_per_node": "0", "efa_per_node": "0",
    "concurrency": "1", "repeats": "1", "request_count": "4", "requests_per_slot": "0",
    "warmup_requests": "1", "warmup_full_batch": "false", "input_tokens": "32",
    "output_tokens": "8", "server_timeout_s": "180", "schedule_timeout_s": "60",
    "job_timeout_s": "900",
}
CLIENT_PREFIXES = ("SLURM_", "SBATCH_", "SRUN_", "SALLOC_", "SQUEUE_")


def level(version: str) -> str:
    return (f"scheduler real (Slurm {version}: slurmctld and two slurmd, two nodes on one "
            "host), nodes are this CPU host (no GPU, no EFA), outputs measured here")


def left_behind(cluster: slurmlocal.LocalSlurm) -> list[str]:
    """What of the run is still queued or alive: job ids in squeue, then any process of the
    cluster other than its daemons (slurmctld, slurmd, munged, slurmscriptd)."""
    daemons = set(cluster.pids.values())
    left = [f"job {j}" for j in cluster.queue()]
    for pid in cluster.processes():
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if pid not in daemons and not cmd.startswith((b"slurmctld", b"/usr/sbin/")):
            said = cmd.replace(b"\0", b" ").decode(errors="replace")[:120]
            left.append(f"pid {pid}: {said}")
    return left


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    run_id = argv[0]
    registry.check_run_request("slurm", run_id, STAGES, PARAMS)
    if not slurmlocal.installed():
        print(f"not installed: {', '.join(slurmlocal.missing_commands())}; run "
              f"{slurmlocal.INSTALL_HINT}", file=sys.stderr)
        return 2
    # slurmd's step sockets live under the working directory: a short path (slurmlocal)
    with tempfile.TemporaryDirectory(prefix="slurm-run-", dir="/tmp") as work:
        cluster = slurmlocal.LocalSlurm()
        cluster.start(Path(work), nodes=2)
        saved = dict(os.environ)
        try:
            for key in [k for k in os.environ if k.startswith(CLIENT_PREFIXES)]:
                del os.environ[key]
            os.environ.update(cluster.env)  # papermill's kernels reach this cluster
            os.environ[LEVEL_ENV] = level(slurmlocal.slurm_version())  # run.json says so
            run_dir, rc = runner.run_guide("slurm", run_id, PARAMS, STAGES)
            cluster.wait_idle(timeout=60)
            left = left_behind(cluster)
        finally:
            os.environ.clear()
            os.environ.update(saved)
            cluster.stop(check=False)
    print(f"run {run_dir.name}: exit {rc}; left in the queue or alive: "
          f"{'; '.join(left) or 'nothing'}")
    return rc if not left else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
