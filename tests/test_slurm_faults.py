"""A cluster's bad day on the real Slurm (tests/slurmlocal.py, Slurm 22.05.8 here): a node going
DOWN mid-step, a job preempted by a higher-priority partition, a job past its time limit. Each
is a real administrator's or scheduler's action on a real step of the slurm place
(lib.places.slurm.place), no hook in lib/: each ends in the FAIL `<job>: Slurm's account of the step`
that names the step, the node and the reason as Slurm says them (slurmstepd's "CANCELLED ... DUE
TO" line, `scontrol show job`'s JobState/Reason/Restarts, `scontrol show node`'s State/Reason),
written into the stage's gates.json, and nothing of the run left in squeue.

This cluster has three nodes: n1 and n2 for the faults, n3 alone in partition `slow` for the job
past its limit, which runs beside the others (a time limit is whole minutes and slurmctld checks
it every 30 s: measured 74 s from start to the kill, too long to wait for alone). Its slurm.conf
differs from tests/test_slurm_place.py's in what a fault needs:

- ReturnToService=1: with the fixture's 2, a node an administrator set DOWN registered again at
  once and was IDLE before the step had ended (measured), so no one could see it DOWN;
- preemption by partition priority (PreemptType=preempt/partition_prio, PreemptMode=REQUEUE) and
  a partition `urgent` over n1 and n2 with PriorityTier=2: a job there preempts the guide's.
  Without preemption configured, `scontrol requeue` would be the nearest real action.
"""
from __future__ import annotations

import threading
import time

import pytest

from lib.core import evidence
from lib.places import RankJob
from lib.places.slurm.place import SlurmPlace
from lib.stages import kernel

try:
    import slurmlocal
    from test_slurm_place import KERNEL, _cmdline, assert_nothing_left, needs_slurm, slurm_stage
except ImportError:  # tests/ imported as a package
    from tests import slurmlocal
    from tests.test_slurm_place import (KERNEL, _cmdline, assert_nothing_left, needs_slurm,
                                        slurm_stage)

pytestmark = needs_slurm
CONF = ("ReturnToService=1", "PreemptType=preempt/partition_prio", "PreemptMode=REQUEUE",
        "PartitionName=urgent Nodes=n1,n2 MaxTime=INFINITE State=UP PriorityTier=2",
        "PartitionName=slow Nodes=n3 MaxTime=INFINITE State=UP",
        "PartitionName=downed Nodes=n1,n2 MaxTime=INFINITE State=DOWN")
ACCOUNT = ": Slurm's account of the step"
DOWN_REASON = "fault test: down mid-step"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """One three-node Slurm for the module, its client environment this process's."""
    c = slurmlocal.LocalSlurm()
    c.start(tmp_path_factory.mktemp("slurm"), nodes=3, conf_lines=CONF)
    with pytest.MonkeyPatch.context() as mp:
        for key, value in c.env.items():
            mp.setenv(key, value)
        try:
            yield c
        finally:
            c.stop()


@pytest.fixture(scope="module")
def past_its_limit(cluster, tmp_path_factory):
    """A sleep of 600 s on n3 (partition slow) with time_limit_min 1, started at once in a
    thread; it runs while the other faults run on n1 and n2; its test joins it."""
    run_dir = tmp_path_factory.mktemp("timeout")
    stage = slurm_stage(run_dir, "03_kernel_test", {**KERNEL, "partition": "slow",
                                                    "time_limit_min": 1,
                                                    "job_timeout_s": 240.0})
    got: dict = {"stage": stage}
    job = RankJob("past its limit", argv=lambda node: ["sleep", "600"], env=lambda node: {},
                  timeout_s=240, nodes=1)
    thread = threading.Thread(target=lambda: got.update(runs=SlurmPlace(stage).run_ranks(job)),
                              daemon=True)
    got["started"] = time.monotonic()
    thread.start()
    deadline = time.monotonic() + 30
    while "RUNNING|n3" not in cluster.run("squeue", "-h", "-p", "slow", "-o", "%T|%N").stdout:
        assert time.monotonic() < deadline, "the job past its limit never ran on n3"
        time.sleep(0.2)
    got["thread"] = thread
    yield got
    thread.join(200)


def the_account(stage) -> evidence.Gate:
    """The one Slurm account gate, as the stage recorded it and as gates.json holds it."""
    (account,) = [g for g in stage.gates if g.gate.endswith(ACCOUNT)]
    assert account.status == "FAIL"
    written = {g["gate"]: g for g in evidence.read_gates(stage.dir)}
    assert written[account.gate]["reason"] == account.reason
    for path in account.evidence:  # each node's output, and srun's own stderr
        assert (stage.run_dir / path).exists(), path
    return account


def job_nodes(cluster, predicate, timeout: float = 60.0) -> tuple[str, list[str]]:
    """(job id, its nodes) once a job of n1/n2 runs processes that `predicate` accepts on
    every one of its nodes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in cluster.run("squeue", "-h", "-p", "test", "-t", "R", "-o",
                                "%i|%N").stdout.split():
            jobid, nodelist = line.split("|")
            names = cluster.run("scontrol", "show", "hostnames", nodelist).stdout.split()
            pids = [p for p in cluster.job_pids(jobid) if predicate(_cmdline(p))]
            if len(pids) >= len(names) == 2:
                return jobid, names
        time.sleep(0.2)
    raise AssertionError("no two-node job of the stage ran its processes in time")


@pytest.mark.usefixtures("past_its_limit")  # started first: it runs beside this one
def test_a_node_set_down_mid_step_fails_naming_the_node_its_state_and_reason(cluster, tmp_path):
    """03's torch benchmark over two nodes (gloo, a rank per node, iterations enough to outlast
    the fault); an administrator sets its second node DOWN. Slurm 22.05 cancels the step
    ("DUE TO NODE FAILURE") and requeues the job (its holder is a batch job, requeueable by
    default: PENDING, reason BeginTime, Restarts=1); the guide then cancels it."""
    stage = slurm_stage(tmp_path, "03_kernel_test", {**KERNEL, "iters": 10_000, "hidden": 1024,
                                                      "num_tokens": 256})
    downed: dict = {}

    def set_down():
        jobid, names = job_nodes(cluster, lambda cmd: b"lib.bench.moe_a2a" in cmd)
        time.sleep(1.0)  # the ranks past their rendezvous, iterating
        downed["node"] = names[1]
        cluster.run("scontrol", "update", f"nodename={names[1]}", "state=down",
                    f"reason={DOWN_REASON}")

    admin = threading.Thread(target=set_down, daemon=True)
    admin.start()
    try:
        kernel.run(stage)
        stage.finish()
        admin.join(5)
        node = downed["node"]
        account = the_account(stage)
        assert "CANCELLED DUE TO NODE FAILURE (slurmstepd)" in account.reason, account.reason
        # Slurm appends who set the reason, and when: "... [root@2026-12-04T03:16:12]"
        assert f"node {node} DOWN, reason '{DOWN_REASON} [" in account.reason
        seen = account.observed
        assert seen["nodes"][node]["state"].startswith("DOWN")
        assert seen["nodes"][node]["reason"].startswith(DOWN_REASON)
        assert (seen["job_state"], seen["job_reason"], seen["restarts"]) == (
            "PENDING", "BeginTime", "1")
        assert "requeued by Slurm: Restarts=1), then cancelled by the guide" in account.reason
        statuses = {g.gate: g.status for g in stage.gates}
        assert statuses["all ranks exited 0"] == "FAIL"
        assert cluster.queue() == cluster.run("squeue", "-h", "-p", "slow", "-o",
                                              "%i").stdout.split()  # only the slow job left
    finally:
        if "node" in downed:
            cluster.run("scontrol", "update", f"nodename={downed['node']}", "state=resume")
    slurmlocal_wait_node(cluster, downed["node"], "idle")


def slurmlocal_wait_node(cluster, node: str, state: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while cluster.node_states().get(node) != state:
        assert time.monotonic() < deadline, (node, cluster.node_states())
        time.sleep(0.2)


@pytest.mark.usefixtures("past_its_limit")
def test_a_job_preempted_by_a_higher_priority_partition_fails_saying_so(cluster, tmp_path):
    """Two sleepers on n1 and n2; a job submitted to partition `urgent` (PriorityTier=2) takes
    both nodes: Slurm cancels the step "DUE TO PREEMPTION" and requeues the guide's job
    (PreemptMode=REQUEUE); the guide cancels it, the urgent job runs and ends."""
    stage = slurm_stage(tmp_path, "03_kernel_test", {**KERNEL, "job_timeout_s": 120.0})
    urgent: dict = {}

    def preempt():
        job_nodes(cluster, lambda cmd: cmd == b"sleep\x00300\x00")
        urgent["job"] = cluster.run("sbatch", "--parsable", "--partition=urgent", "--nodes=2",
                                    "--exclusive", "--time=1", "--output=/dev/null",
                                    "--wrap=sleep 1").stdout.strip()

    thread = threading.Thread(target=preempt, daemon=True)
    thread.start()
    job = RankJob("sleepers", argv=lambda node: ["sleep", "300"], env=lambda node: {},
                  timeout_s=120, nodes=2)
    started = time.monotonic()
    runs = SlurmPlace(stage).run_ranks(job)
    thread.join(5)
    assert time.monotonic() - started < 60  # ended by the preemption, not its timeout
    assert [r.rc for r in runs] == [143, 143]  # SIGTERM'd by slurmstepd, the codes recorded
    stage.finish()
    account = the_account(stage)
    assert "CANCELLED DUE TO PREEMPTION (slurmstepd)" in account.reason, account.reason
    assert account.observed["restarts"] == "1" and "requeued by Slurm" in account.reason
    cluster.wait_gone(urgent["job"], timeout=30)  # the urgent job ran on the nodes, and ended
    assert cluster.queue() == cluster.run("squeue", "-h", "-p", "slow", "-o", "%i").stdout.split()


def test_slurmstepd_s_lines_are_read_as_slurm_wrote_them():
    from lib.places.slurm import parse

    text = ("slurmstepd-n1: error: *** STEP 1.0 ON n1 CANCELLED AT 2026-12-04T03:16:12 DUE TO "
            "NODE FAILURE, SEE SLURMCTLD LOG FOR DETAILS ***\n"
            "slurmstepd-n1: error: *** JOB 4 ON n1 CANCELLED AT 2026-12-04T03:17:36 DUE TO TIME "
            "LIMIT ***\nslurmstepd-n2: error: *** STEP 5.0 ON n2 CANCELLED AT 2026-12-04T03:17:36 "
            "***\nsrun: error: n2: task 1: Terminated\n")
    assert parse.parse_ended(text) == [
        {"what": "STEP", "id": "1.0", "node": "n1", "due": "NODE FAILURE"},
        {"what": "JOB", "id": "4", "node": "n1", "due": "TIME LIMIT"},
        {"what": "STEP", "id": "5.0", "node": "n2", "due": ""}]  # a plain scancel: no cause
    assert parse.parse_ended("") == [] and parse.parse_ended(None) == []


@pytest.mark.usefixtures("past_its_limit")
def test_a_rank_that_fails_by_itself_gets_no_slurm_account(cluster, tmp_path):
    """A node's command exits 3: the job stays RUNNING, its nodes up, no slurmstepd cause:
    Slurm ended nothing, so no account gate (the first-failure triage names the node)."""
    stage = slurm_stage(tmp_path, "03_kernel_test", KERNEL)
    job = RankJob("fails by itself", argv=lambda node: ["sh", "-c", f"exit {3 * node.rank}"],
                  env=lambda node: {}, timeout_s=60, nodes=2)
    runs = SlurmPlace(stage).run_ranks(job)
    assert [r.rc for r in runs][1] == 3
    assert not [g for g in stage.gates if g.gate.endswith(ACCOUNT)]
    assert cluster.queue() == cluster.run("squeue", "-h", "-p", "slow", "-o", "%i").stdout.split()


def test_a_job_past_its_time_limit_fails_saying_timeout_with_the_limit(cluster, past_its_limit):
    """time_limit_min 1 (the place's --time, on sbatch and srun): slurmctld ends the job at
    its next time check after 60 s, "DUE TO TIME LIMIT", JobState TIMEOUT."""
    past_its_limit["thread"].join(200)
    took = time.monotonic() - past_its_limit["started"]
    stage = past_its_limit["stage"]
    runs = past_its_limit["runs"]
    assert 60 <= took < 150 and [r.rc for r in runs] == [143], (took, runs)
    stage.finish()
    account = the_account(stage)
    assert "CANCELLED DUE TO TIME LIMIT (slurmstepd)" in account.reason, account.reason
    assert (account.observed["job_state"], account.observed["job_reason"]) == ("TIMEOUT",
                                                                               "TimeLimit")
    assert "time limit 00:01:00 = time_limit_min 1" in account.reason
    assert_nothing_left(cluster)


def test_a_down_partition_fails_00_and_03_at_the_first_squeue_quoting_partitiondown(cluster,
                                                                                     tmp_path):
    """A partition that is DOWN (issue 43): the allocation pends with reason PartitionDown,
    which cannot clear by itself, so 00's probe and 03's ranks end at the first squeue that
    says so, not after schedule_timeout_s; 03's exit gate quotes why no rank started (never
    "exited None"); the job is cancelled, nothing left behind."""
    from lib.bench import result as bench_result
    from lib.core.errors import PlaceError

    limit = 120.0
    probe = slurm_stage(tmp_path / "00", "00_cluster", {"partition": "downed",
                                                        "schedule_timeout_s": limit})
    started = time.monotonic()
    with pytest.raises(PlaceError, match="PENDING, reason PartitionDown .*cannot clear by "
                                         "itself"):
        SlurmPlace(probe).host_facts()
    assert time.monotonic() - started < 15  # the first squeues, not the 120 s

    stage = slurm_stage(tmp_path / "03", "03_kernel_test", {**KERNEL, "partition": "downed",
                                                            "schedule_timeout_s": limit})
    job = RankJob("never runs", argv=lambda node: ["true"], env=lambda node: {},
                  timeout_s=60, nodes=2)
    started = time.monotonic()
    runs = SlurmPlace(stage).run_ranks(job)
    assert time.monotonic() - started < 15
    assert [r.rc for r in runs] == [None, None] and not any(r.timed_out for r in runs)
    assert all("reason PartitionDown (the partition required by this job is in a DOWN state)"
               in r.stderr for r in runs), runs[0].stderr
    (exit_gate,) = [g for g in bench_result.gates_from_result(None, None, runs[0].stderr)
                    if g["gate"] == bench_result.GATE_EXIT]
    assert exit_gate["status"] == "FAIL" and "None" not in exit_gate["reason"]
    assert exit_gate["reason"].startswith("no rank exited: job ")
    assert "PartitionDown" in exit_gate["reason"]
    stage.close_resources()
    deadline = time.monotonic() + 30
    while "downed" in cluster.run("squeue", "-h", "-o", "%P").stdout.split():
        assert time.monotonic() < deadline, "the pending jobs were not cancelled"
        time.sleep(0.2)


def test_00_fails_at_once_naming_a_drained_node_its_state_and_reason(cluster, tmp_path):
    """A node an administrator drained (issue 43): partition urgent (n1, n2) has one node that
    runs jobs for a run of two, so 00 FAILs before any allocation, naming n2, the state sinfo
    says and the reason scontrol holds; nothing is queued."""
    from lib.core.errors import PlaceError

    cluster.run("scontrol", "update", "NodeName=n2", "State=DRAIN",
                "Reason=fault test: drained for 00")
    try:
        probe = slurm_stage(tmp_path / "00", "00_cluster", {"partition": "urgent",
                                                            "schedule_timeout_s": 120.0})
        started = time.monotonic()
        with pytest.raises(PlaceError) as refused:
            SlurmPlace(probe).host_facts()
        assert time.monotonic() - started < 10
        said = str(refused.value)
        assert "1 of its 2 node(s) in a state that runs jobs, the run asks 2" in said, said
        assert "n2 is drained (sinfo), reason 'fault test: drained for 00" in said, said
        assert "urgent" not in cluster.run("squeue", "-h", "-o", "%P").stdout.split()
    finally:
        cluster.run("scontrol", "update", "NodeName=n2", "State=RESUME")


def test_only_the_reasons_slurm_says_cannot_clear_end_a_wait():
    """The list and its source (lib.places.slurm.waits.HOPELESS_REASONS): a reason that clears
    as other jobs end is waited out; one with the nodes it names is read by its code."""
    from lib.places.slurm import waits

    assert waits.hopeless("PartitionDown") == ("the partition required by this job is in a "
                                               "DOWN state")
    assert waits.hopeless("ReqNodeNotAvail, UnavailableNodes:n1") is not None
    for clears in ("Resources", "Priority", "Dependency", "ReqNodeNotAvail", "None",
                   "AssocGrpGRES", "QOSMaxNodePerJobLimit", "BeginTime"):
        assert waits.hopeless(clears) is None, clears
