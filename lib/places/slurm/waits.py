"""How long the slurm place waits on Slurm, and the waits that poll it: its clients' timeouts,
squeue until an allocation runs (`wait_running`) or is gone after scancel (`wait_gone`), `squeue
-s` until a server's steps are gone (`steps_gone`, `cancel_steps`), and scontrol until a failed
job has left COMPLETING (`job_fate`: Slurm's own account of why a step ended).

Each look is a call through the door (recorded, replayed in turn); the polling is the one
deadline loop (lib.places.cluster.wait_until) or, for steps, a doubling delay to the same bound.
"""
from __future__ import annotations

from typing import Any

import lib.places.slurm.sbatch as sbatch  # the module itself, not lib.places (no cycle through it)
from lib.core.errors import NotAllocated
from lib.places.cluster import wait_until
from lib.places.slurm import parse

SUBMIT_TIMEOUT_S = 60.0  # sbatch, scancel: they return once slurmctld answers
QUERY_TIMEOUT_S = 30.0  # sinfo, squeue, scontrol
RELEASE_TIMEOUT_S = 120.0  # scancel until squeue no longer shows the job (KillWait, epilogs)
POLL_FIRST_S, POLL_MAX_S = 0.25, 5.0  # squeue while a job is pending or completing
STARTING = ("PENDING", "CONFIGURING", "REQUEUED", "RESIZING")  # not yet running, still coming
FATE_TIMEOUT_S = 30.0  # a failed step's job until it leaves COMPLETING (KillWait, epilogs)
# Pending reasons that cannot clear by themselves: an administrator or a changed request must act,
# so waiting out schedule_timeout_s (900 s by default) would only delay the FAIL. From Slurm's
# "Job Reason Codes" (https://slurm.schedmd.com/job_reason_codes.html, read 2026-12-07), each
# with what it means there; Resources, Priority, Dependency, the Assoc*/QOS* limits and a plain
# ReqNodeNotAvail (nodes busy or reserved) clear as other jobs end, and are waited out.
HOPELESS_REASONS = {
    "PartitionDown": "the partition required by this job is in a DOWN state",
    "PartitionInactive": "the partition required by this job is inactive and not able to start "
                         "jobs",
    "PartitionConfig": "the job requests more resources than the partition allows (its "
                       "configuration)",
    "PartitionNodeLimit": "the nodes the job requires are outside its partition's limits",
    "PartitionTimeLimit": "the job's time limit exceeds its partition's",
    "AccountNotAllowed": "the job's account is not allowed in the partition",
    "InvalidAccount": "the job's account is invalid",
    "InvalidQOS": "the job's QOS is invalid",
    "BadConstraints": "the job's constraints can not be satisfied",
    "DependencyNeverSatisfied": "the job depends on a job that failed: it will never run",
    "JobHeldAdmin": "the job is held by a system administrator",
    "JobHeldUser": "the job is held by its user",
    # with UnavailableNodes: the nodes it names are DOWN, DRAINED or not responding
    "ReqNodeNotAvail, UnavailableNodes": "nodes the job requires are unavailable (down, "
                                         "drained or not responding)",
}


def hopeless(reason: str) -> str | None:
    """What a pending `reason` means when it cannot clear by itself (HOPELESS_REASONS), else
    None."""
    return HOPELESS_REASONS.get(reason.split(":")[0].strip())  # "<code>:<nodes>" names nodes


def wait_running(door, jobid: str, limit: float) -> str:
    """The job's nodelist once it runs; NotAllocated when it ends first, is pending for a
    reason that cannot clear by itself (HOPELESS_REASONS: at the first squeue that says so), or
    is still not running after `limit` s (`schedule_timeout_s`; the caller cancels it)."""
    last = "not yet in squeue"

    def look(elapsed) -> tuple[bool, str | None]:
        nonlocal last
        call = door.run(sbatch.queue_argv(jobid), timeout=QUERY_TIMEOUT_S, check=False)
        got = parse.parse_queue(call.stdout) if call.ok else None
        if got and got[0] == "RUNNING" and got[2]:
            return True, got[2]
        if got is None and (call.ok or "Invalid job id" in call.stderr):
            raise NotAllocated(f"job {jobid} left the queue before it ran ({last})")
        if got is not None:
            if got[0] not in STARTING and got[0] != "RUNNING":
                raise NotAllocated(f"job {jobid} is {got[0]} ({got[1]}) before it ran")
            last = f"{got[0]}, reason {got[1]}"
            meaning = hopeless(got[1]) if got[0] == "PENDING" else None
            if meaning:
                raise NotAllocated(f"job {jobid} is PENDING, reason {got[1]} ({meaning}): a "
                                   "reason that cannot clear by itself (Slurm's job reason "
                                   "codes), so the wait ends at once")
        return False, None

    nodelist = wait_until(door, look, limit, poll_s=POLL_FIRST_S, max_poll_s=POLL_MAX_S)
    if nodelist is None:
        raise NotAllocated(f"job {jobid} was not running after schedule_timeout_s = "
                           f"{limit:g} s ({last}); cancelled", timed_out=True)
    return nodelist


def wait_gone(door, jobid: str) -> bool | None:
    """After scancel: until squeue no longer shows the job (its processes are gone once it has
    left COMPLETING), for at most RELEASE_TIMEOUT_S: whether it is gone."""
    def look(elapsed) -> tuple[bool, bool]:
        call = door.run(sbatch.queue_argv(jobid), timeout=QUERY_TIMEOUT_S, check=False)
        gone = parse.parse_queue(call.stdout) is None and (call.ok or "Invalid job id"
                                                           in call.stderr)
        return gone, gone

    return wait_until(door, look, RELEASE_TIMEOUT_S, poll_s=POLL_FIRST_S,
                      max_poll_s=POLL_MAX_S)


def steps(door, jobid: str) -> list[tuple[str, str]] | None:
    """The job's steps (id, name) in `squeue -s`; [] once the job is gone, None when squeue
    could not say."""
    call = door.run(sbatch.steps_argv(jobid), timeout=QUERY_TIMEOUT_S, check=False)
    if call.ok:
        return parse.parse_steps(call.stdout)
    return [] if "Invalid job id" in call.stderr else None


def cancel_steps(door, jobid: str, names: list[str]) -> None:
    """scancel the steps of the job named `names` (a step whose srun was ended, or timed
    out, may outlive it)."""
    for step, name in steps(door, jobid) or []:
        if name in names:
            door.run(sbatch.cancel_argv(step), timeout=SUBMIT_TIMEOUT_S, check=False)


def steps_gone(door, jobid: str, names: list[str]) -> list[str] | None:
    """Until no step named `names` is left in `squeue -s` (each one still there cancelled
    by its id, once): the ones left at the deadline ([] when gone; None when squeue could
    not say)."""
    deadline = door.now() + RELEASE_TIMEOUT_S
    delay, cancelled = POLL_FIRST_S, False
    while True:
        found = steps(door, jobid)
        left = None if found is None else sorted(s for s, n in found if n in names)
        if not left or door.now() > deadline:
            return left
        if left and not cancelled:  # its srun is gone, the step not yet: ended by its id
            for step in left:
                door.run(sbatch.cancel_argv(step), timeout=SUBMIT_TIMEOUT_S,
                              check=False)
            cancelled = True
        door.sleep(delay)
        delay = min(delay * 2, POLL_MAX_S)


def job_fate(door, jobid: str, names: list[str]) -> dict[str, Any]:
    """After a step ended non-zero: the job as slurmctld says it once it has left
    COMPLETING (a node failure or a preemption requeues it: PENDING, Restarts counted; a
    time limit: TIMEOUT) and each of its nodes' State and Reason. scontrol, not sacct:
    sacct needs the cluster's accounting (the test Slurm has none: 'Slurm accounting
    storage is disabled'); scontrol answers on every cluster while slurmctld keeps the job
    (MinJobAge s after it ends)."""
    def look(elapsed) -> tuple[bool, dict[str, str]]:
        call = door.run(sbatch.show_job_argv(jobid), timeout=QUERY_TIMEOUT_S,
                             check=False)
        job = parse.parse_scontrol(call.stdout) if call.ok else {}
        return job.get("JobState") != "COMPLETING", job

    job = wait_until(door, look, FATE_TIMEOUT_S, poll_s=POLL_FIRST_S, max_poll_s=1.0)
    shown = door.run(sbatch.show_node_argv(",".join(names)), timeout=QUERY_TIMEOUT_S,
                          check=False)
    nodes = {raw["NodeName"]: {"state": raw.get("State", "?"),
                               "reason": raw.get("Reason", "")}
             for raw in map(parse.parse_scontrol, shown.stdout.splitlines())
             if "NodeName" in raw}
    return {"job": job or {}, "nodes": nodes}
