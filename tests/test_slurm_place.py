"""The slurm place (lib.places.slurm) on a real two-node Slurm on this host
(tests/slurmlocal.py): stage 00's probe of both nodes, stage 03's torch benchmark across them
(gloo, one rank per node, the rendezvous on n1) and its replay, a node killed mid-run, a step
that times out, an interrupted run; stage 04 with `transformers serve` as a step of an
allocation and its replay, stage 05 with AIPerf as another step against it, the arms of an A/B
in one allocation; afterwards nothing of a job is queued or alive. And the plan for slurm
(the slurm place with its door planning, lib.places.slurm.plan.SlurmPlanned) of 03 and 04: scripts that shellcheck passes, every sbatch/srun/
scancel recorded, nothing run."""
from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from lib import places
from lib.core import evidence
from lib.core.door import REPO_ROOT, Door, read_transcript
from lib.core.stage import Stage
from lib.engines import transformers
from lib.places import RankJob, ServeSpec, Unsupported
from lib.places.local import LocalPlace
from lib.places.slurm import parse, sbatch
from lib.places.slurm.place import SlurmPlace
from lib.stages import cluster as stage00
from lib.stages import kernel, registry
from lib.stages import serve as stage04
from lib.stages import sweep as stage05

try:
    import slurmlocal
except ImportError:  # tests/ imported as a package
    from tests import slurmlocal

SHELLCHECK = REPO_ROOT / ".venv" / "bin" / "shellcheck"
VENV = ".venv"  # relative to the repository, as a run that replays anywhere records it
needs_slurm = pytest.mark.skipif(
    not slurmlocal.installed(),
    reason=(f"slurm-wlm/munge not installed (missing: {', '.join(slurmlocal.missing_commands())})"
            f"; install with {slurmlocal.INSTALL_HINT}"))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """One two-node Slurm for the module; its client environment (SLURM_CONF, the munge
    socket, the LOCALSLURM_ID every process of it carries) is this process's while it runs, so
    the door's subprocesses reach it."""
    c = slurmlocal.LocalSlurm()
    c.start(tmp_path_factory.mktemp("slurm"), nodes=2)
    with pytest.MonkeyPatch.context() as mp:
        for key in [k for k in os.environ if k.startswith(("SLURM_", "SBATCH_", "SRUN_",
                                                            "SALLOC_", "SQUEUE_"))]:
            mp.delenv(key)
        for key, value in c.env.items():
            if os.environ.get(key) != value:
                mp.setenv(key, value)
        try:
            yield c
        finally:
            c.stop()


def slurm_stage(run_dir: Path, name: str, given: dict | None = None, replay: bool = False):
    resolved = registry.resolve(name, {"context": "slurm", "nodes": 2, **(given or {})})
    return Stage(name, resolved, run_dir, Door(run_dir, name, replay=replay),
                 run_dir if replay else None)


def assert_nothing_left(cluster, pids=()):
    """squeue empty, the given PIDs gone, and no task of a job alive (only the daemons)."""
    assert cluster.queue() == []
    deadline = time.monotonic() + 10
    while (alive := [p for p in pids if slurmlocal._alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert alive == [], f"processes of the job still alive: {alive}"
    daemons = set(cluster.pids.values())
    while True:  # a slurmstepd may take a moment to exit after its job left the queue
        others = [p for p in cluster.processes() if p not in daemons and not _is_daemon(p)]
        if not others or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert others == [], [(p, _cmdline(p)) for p in others]


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _is_daemon(pid: int) -> bool:  # slurmctld's own helper (slurmscriptd), a daemon too
    return _cmdline(pid).startswith((b"slurmctld", b"/usr/sbin/slurm", b"/usr/sbin/munged"))


# ---- rendering (no cluster) --------------------------------------------------------------------
def test_scripts_pass_shellcheck_and_the_wrapper_picks_the_node_s_command(tmp_path):
    base = str(tmp_path / "a job-7")
    per_node = [(["printf", "%s|", "it's", "a b", "$HOME"], {"ONE": "x y", "TWO": "'q'"}),
                (["sh", "-c", "echo node1 \"$ONE\"; exit 3"], {"ONE": "1"})]
    wrapper = sbatch.wrapper_script("a job", per_node, base)
    for name, text in (("wrapper.sh", wrapper), ("probe.sh", sbatch.probe_script())):
        (tmp_path / name).write_text(text)
        checked = subprocess.run([str(SHELLCHECK), "-s", "bash", str(tmp_path / name)],
                                 capture_output=True, text=True, timeout=60)
        assert checked.returncode == 0, checked.stdout + checked.stderr
    for node, (want_rc, want_out) in enumerate([(0, "it's|a b|$HOME|"), (3, "node1 1\n")]):
        ran = subprocess.run(["bash", "-c", wrapper, "w"], capture_output=True, text=True,
                             env={**os.environ, "SLURM_NODEID": str(node)}, timeout=30)
        assert (ran.returncode, ran.stdout) == (want_rc, want_out)
        assert Path(f"{base}-node{node}.rc").read_text() == f"{want_rc}\n"
    assert subprocess.run(["bash", "-c", wrapper, "w"], capture_output=True, timeout=30,
                          env={**os.environ, "SLURM_NODEID": "5"}).returncode == 64
    with pytest.raises(ValueError, match="not an environment variable name"):
        sbatch.wrapper_script("x", [(["true"], {"A-B": "1"})], base)


def test_the_image_is_rendered_as_pyxis_options():
    argv = sbatch.step_argv(jobid="12", nodes=2, out_base="/fsx/run/03/bench-12", time_min=60,
                           script="true", script_name="w", chdir="/fsx/guide", gpus_per_node=8,
                           image="repo/guide@sha256:" + "a" * 64, mounts=("/fsx/run", "/fsx/guide"))
    assert "--container-image=repo/guide@sha256:" + "a" * 64 in argv
    assert "--container-mounts=/fsx/run:/fsx/run,/fsx/guide:/fsx/guide" in argv
    assert "--container-workdir=/fsx/guide" in argv and "--gres=gpu:8" in argv
    assert argv[-4:] == ["bash", "-c", "true", "w"]
    assert "--output=/fsx/run/03/bench-12-node%n.out" in argv


def test_parsers():
    assert [parse.gres_gpus(g) for g in ("gpu:8", "gpu:h200:8(S:0-1)", "gpu:4,shard:8",
                                          "(null)", "")] == [8, 8, 4, 0, 0]
    assert parse.srun_report("srun: error: n2: task 1: Exited with exit code 3\n"
                             "srun: error: n1: task 0: Terminated\n"
                             "srun: error: n[3-4]: tasks 2-3: Killed\n") == {
        1: 3, 0: 143, 2: 137, 3: 137}
    rows = parse.parse_sinfo("n1|test*|idle|2|1024|(null)|(null)\n"
                             "n1|other|idle|2|1024|(null)|(null)\nn2|test*|mixed|2|1024|gpu:8|a,b\n")
    assert [(r["node"], r["partition"], r["default"], r["gres_gpus"], r["features"])
            for r in rows] == [("n1", "test", True, 0, []), ("n2", "test", True, 8, ["a", "b"])]


def test_a_one_task_step_and_a_plan_s_batch_script(tmp_path):
    """A step beside the others on one node (its environment in its argv), and a plan's view of
    an allocation as one batch script, which shellcheck passes."""
    task = sbatch.task_argv(jobid="7", node="n2", name="guide-05-aiperf", time_min=5,
                           chdir="/c", argv=["aiperf", "profile", "--url", "http://n1:8000"],
                           env={"B": "x y", "A": "1"}, unset=("U",), output="/o.out",
                           error="/o.err")
    assert task[:7] == ["srun", "--jobid=7", "--overlap", "--nodes=1", "--ntasks=1",
                        "--nodelist=n2", "--job-name=guide-05-aiperf"]
    assert "--input=none" in task and "--output=/o.out" in task and "--error=/o.err" in task
    assert task[task.index("env"):] == ["env", "-u", "U", "A=1", "B=x y", "aiperf", "profile",
                                        "--url", "http://n1:8000"]
    assert sbatch.env_argv({}, ()) == []
    with pytest.raises(ValueError, match="not an environment variable name"):
        sbatch.env_argv({"A-B": "1"})
    ranks = sbatch.step_argv(jobid="7", nodes=2, out_base="/r/x-7", time_min=5, chdir="/c",
                            script=sbatch.wrapper_script("x", [(["true"], {})] * 2, "/r/x-7"),
                            script_name="guide-x")
    text = sbatch.batch_script("x", sbatch.alloc_argv(name="guide-x", nodes=2, time_min=5),
                              [(task, True, "a server"), (ranks, False, "the ranks")])
    assert "#SBATCH --nodes=2" in text and "--jobid=" not in text and "--wrap" not in text
    assert text.endswith("wait\n") and " &\n" in text
    (tmp_path / "x.sbatch").write_text(text)
    checked = subprocess.run([str(SHELLCHECK), "-s", "bash", str(tmp_path / "x.sbatch")],
                             capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout
    assert parse.parse_steps("1.batch|batch\n1.0|guide-x\n\n") == [("1.batch", "batch"),
                                                                    ("1.0", "guide-x")]


def test_without_an_image_or_a_venv_nothing_is_served_or_run(cluster, tmp_path):
    """A SKIP once the cluster answered (sinfo: its one call); where it does not answer, the
    refusal is said first, a FAIL (tests/test_refusals.py)."""
    stage = slurm_stage(tmp_path, "04_serve", {"engine": "transformers"})
    place = SlurmPlace(stage)
    for asked in (lambda: place.model("transformers"), lambda: place.model("vllm"),
                  lambda: place.serve(ServeSpec("transformers", {"model_dir": "/m"})).__enter__()):
        with pytest.raises(Unsupported, match="`image`.*or a `venv`.*neither is given"):
            asked()
    # without an image or a venv there is nothing to run ranks with: nothing submitted
    stage = slurm_stage(tmp_path, "03_kernel_test", {"ranks": 1})
    with pytest.raises(Unsupported, match="`image`.*or a `venv`"):
        SlurmPlace(stage).run_ranks(RankJob("x", lambda n: ["true"], lambda n: {}, 5, nodes=2))
    asked = [e["key"][0] for e in read_transcript(tmp_path / "transcript.jsonl")
             if e["kind"] == "run"]
    assert asked and set(asked) == {"sinfo"}, asked


def test_nodes_declared_without_efa_need_no_gdrdrv_nor_hugepages(tmp_path):
    needs = SlurmPlace(slurm_stage(tmp_path, "00_cluster", {"gpus_per_node": 0,
                                                            "efa_per_node": 0})).node_needs()
    assert (needs.gpus, needs.efa, needs.gdrdrv, needs.hugepages) == (0, 0, False, False)
    assert "efa_per_node 0" in needs.no_gdrdrv and "efa_per_node 0" in needs.no_hugepages


# ---- the plan for slurm (no cluster) -----------------------------------------------------------
def plan_stage(run_dir: Path, name: str, given: dict | None = None, replay: bool = False):
    resolved = registry.resolve(name, {"context": "plan", "plan_for": "slurm", **(given or {})})
    stage = Stage(name, resolved, run_dir, Door(run_dir, name, replay=replay, plan=True),
                  run_dir if replay else None)
    stage._place = SlurmPlace(stage)  # what lib.places.for_stage gives for plan_for slurm
    assert stage._place.plans_only
    return stage


def test_03_planned_for_slurm_in_an_image_runs_test_ep_under_torchrun_on_every_node(tmp_path):
    """With an image (DeepEP built in it), 03's test_ep as the slurm place plans it (the
    stage's run stops at the torch benchmark's plan, so its test_ep step is asked for
    directly), in the cluster form: node N's own torchrun, one rank per GPU, --nnodes=2, its
    node rank, the rendezvous on node 0, each rank entering test_ep through
    lib.bench.test_ep_rank (imported from the checkout the step starts in: the slurm place
    ignores RankJob.modules); the scripts shellcheck clean."""
    stage = plan_stage(tmp_path, "03_kernel_test", {
        "image": "registry.example/deepep-efa@sha256:" + "ab" * 32})
    cfg = kernel.bench_config(stage, stage._place.gpus())
    with pytest.raises(Unsupported, match="planned, not run"):
        kernel.run_test_ep(stage, cfg, 128)
    scripts = scripts_of(stage)
    test_ep = [n for n in scripts if "test_ep-at-128-tokens" in n]
    assert test_ep, scripts
    checks = {g.gate: g.status for g in stage.gates if g.gate.endswith(": shellcheck clean")}
    assert checks and set(checks.values()) == {"PASS"}, checks
    text = "\n".join((stage.path("scripts") / n).read_text() for n in test_ep)
    for rank in (0, 1):
        assert (f"python3 -m torch.distributed.run --nproc-per-node=8 --nnodes=2 "
                f"--node-rank={rank} --master-addr=node-0 --master-port=") in text
    assert "-m lib.bench.test_ep_rank " in text and "/tests/elastic/test_ep.py" in text
    assert "--num-processes 8" in text and "--skip-check" not in text


def test_03_and_04_planned_for_slurm_write_scripts_that_shellcheck_passes_and_replay(tmp_path):
    """The slurm place's own code, planning: each step's script and each allocation's batch
    script in scripts/, shellchecked (gates); sbatch, srun and scancel recorded; nothing run
    but shellcheck; the stages' work a SKIP with the plan's reason; a replay gives the same."""
    def plan(replay: bool = False):
        s03 = plan_stage(tmp_path, "03_kernel_test", replay=replay)
        kernel.run(s03)
        s03.finish()
        s04 = plan_stage(tmp_path, "04_serve", {"engine": "vllm"}, replay=replay)
        stage04.run(s04)
        s04.finish()
        return s03, s04

    s03, s04 = plan()
    for stage, scripts in ((s03, ["01-the-torch-benchmark-on-2-node-s.sh",
                                  "02-the-torch-benchmark-batch.sbatch"]),
                           (s04, ["01-the-server-on-node-0.sh", "02-the-server-on-node-1.sh",
                                  "03-serve-batch.sbatch"])):
        checks = [g for g in stage.gates if g.gate.endswith(": shellcheck clean")]
        assert [g.gate for g in checks] == [f"scripts/{n}: shellcheck clean" for n in scripts]
        assert {g.status for g in checks} == {"PASS"}, [g.reason for g in checks]
        assert sorted(p.name for p in stage.path("scripts").iterdir()) == scripts
        skipped = [g for g in stage.gates if g.status == "SKIP"]
        assert skipped and all("plan for slurm" in g.reason and "planned, not run" in g.reason
                               for g in skipped)
    assert "--node-rank=1" in (s03.path("scripts") / scripts_of(s03)[0]).read_text()
    batch04 = s04.path("scripts", "03-serve-batch.sbatch").read_text()
    assert "#SBATCH --nodes=2" in batch04 and "#SBATCH --gres=gpu:8" in batch04
    assert "--headless" in batch04 and "--data-parallel-size 16" in batch04
    assert "--nodelist=node-0" in batch04 and batch04.count(" &\n") == 2
    entries = read_transcript(tmp_path / "transcript.jsonl")
    assert {e["kind"] for e in entries} == {"plan", "run", "clock"}
    assert {e["key"][0] for e in entries if e["kind"] == "run"} == {"{bin}/shellcheck"}
    planned = [e["key"][0] for e in entries if e["kind"] == "plan" and e["key"][0] != "#"]
    assert planned == ["sbatch", "srun", "scancel", "sbatch", "srun", "srun", "scancel"]
    leader = next(e["key"] for e in entries if e["kind"] == "plan" and e["key"][0] == "srun"
                  and "--nodelist=node-0" in e["key"] and e["stage"] == "04_serve")
    assert "--jobid=<job-1>" in leader and "--overlap" in leader
    assert leader[leader.index("env"):][-4:] == ["--revision", s04["model_revision"],
                                                 "--tokenizer-revision", s04["model_revision"]]
    plan(replay=True)  # the same plan, the same gates (finish compares)


def scripts_of(stage) -> list[str]:
    return sorted(p.name for p in stage.path("scripts").iterdir())


# ---- on the two-node Slurm ---------------------------------------------------------------------
# ---- on the two-node Slurm ---------------------------------------------------------------------
@needs_slurm
def test_srun_here_has_no_pyxis_so_the_image_is_checked_by_plan_only(cluster):
    r = cluster.run("srun", "--container-image=ubuntu:22.04", "-N1", "true", check=False)
    assert r.returncode != 0 and "unrecognized option '--container-image" in r.stderr


@needs_slurm
def test_stage_00_probes_both_nodes(cluster, tmp_path):
    stage = slurm_stage(tmp_path, "00_cluster")
    data = stage00.run(stage)
    stage.finish()
    place = places.for_stage(stage)
    facts = place.last_facts
    assert [f["node"] for f in facts] == ["n1", "n2"] == [f["probed_node"] for f in facts]
    local = Stage("00_cluster", registry.resolve("00_cluster", {}), tmp_path / "local",
                  Door(tmp_path / "local", "00_cluster"), None)
    host_clients = {"kubectl_client", "docker_engine", "docker_error"}  # this machine's, no node's
    node_keys = set(LocalPlace(local).host_facts()[0]) - host_clients
    for node in facts:
        assert node_keys <= set(node), node_keys - set(node)  # stage 00's gates apply
        assert node["probe_complete"] and node["cpu_cores"] >= 1 and node["memory_gib"] > 0
        assert (node["slurm_state"], node["gres_gpus"], node["node_addr"]) == ("idle", 0,
                                                                             "127.0.0.1")
        assert node["slurm_cpus"] == cluster.cpus_per_node and node["efa_devices"] == []
        assert node["ready"] and slurmlocal.slurm_version() in node["cluster_access"]
        assert (tmp_path / node["evidence"][0]).read_text().startswith("probe:node=")
    gates = {g.gate: g for g in stage.gates}
    assert data["facts"]["node"] == "n1" and gates["node facts recorded"].status == "PASS"
    assert gates["access to the cluster"].status == "PASS"
    assert gates["nodes of the instance type, Ready"].status == "PASS"
    for name in ("n1", "n2"):  # every node gated; what a p5en node must have FAILs here
        assert gates[f"{name}: CPU cores"].status == "PASS"
        assert gates[f"{name}: EFA devices"].status == "FAIL"
        assert gates[f"{name}: gdrdrv >= 2.5"].status == "FAIL"
        assert gates[f"{name}: hugepages"].status == "FAIL"
    assert place.gpus() == 0
    needs = place.node_needs()
    # the counts the p5en brings, the EFA path's needs; no hugepages amount (a Slurm job asks
    # none: the node's pre-allocated pages are the job's)
    assert (needs.gpus, needs.efa, needs.gdrdrv, needs.hugepages, needs.hugepages_bytes) == (
        8, 16, True, True, None)
    assert len(place.jobs) == 1
    assert_nothing_left(cluster)


KERNEL = {"ranks": 1, "venv": VENV, "hidden": 64, "num_tokens": 16, "num_experts": 8,
          "num_topk": 2, "iters": 3, "warmup": 1, "job_timeout_s": 240.0}


@needs_slurm
@pytest.mark.parametrize("given, said", [
    ({"partition": "no-such-partition"}, "sinfo lists no node in it"),
    # two nodes here: refused before any allocation (Slurm would queue it for good,
    # PartitionNodeLimit)
    ({"nodes": 3, "schedule_timeout_s": 3}, "it has 2 node(s) (n1, n2), the run asks 3 (nodes)"),
])
def test_stage_00_a_refusal_of_the_real_slurm_is_a_fail_naming_the_partition(
        cluster, tmp_path, given, said):
    from lib.core.errors import StageRefused
    from lib.core.stage import REFUSED_GATE

    stage = slurm_stage(tmp_path, "00_cluster", {"gpus_per_node": 0, "efa_per_node": 0,
                                                 **given})
    data = stage00.run(stage)
    assert "refused" in data
    fails = [g for g in stage.gates if g.status == "FAIL"]
    assert [g.gate for g in fails] == [REFUSED_GATE]
    assert said in fails[0].reason, fails[0].reason
    assert fails[0].observed["where"].startswith("slurm")
    with pytest.raises(StageRefused):
        stage.finish()
    assert_nothing_left(cluster)


def test_stage_03_runs_across_the_two_nodes_and_replays(cluster, tmp_path):
    stage = slurm_stage(tmp_path, "03_kernel_test", KERNEL)
    data = kernel.run(stage)
    table = stage.finish()
    gates = {g.gate: g for g in stage.gates}
    bench = [g for g in stage.gates if not g.gate.startswith("DeepEP test_ep")]
    assert len(bench) == 7 and {g.status for g in bench} == {"PASS"}, table.to_string()
    apart = gates["the torch benchmark: node ranks on distinct nodes, together"]
    assert apart.observed == {"0": "n1", "1": "n2"}  # rank N on the allocation's node N
    assert gates["DeepEP test_ep (GPU)"].status == "SKIP"  # no GPU on this host
    assert "2/2 ranks correct" in str(gates["correctness"].observed)
    assert gates["all ranks exited 0"].status == "PASS"
    assert data["result"]["config"]["world_size"] == 2 and data["config"]["backend"] == "gloo"
    # one step, node N's own argv: the rendezvous on n1 (127.0.0.1), node ranks 0 and 1
    entries = read_transcript(tmp_path / "transcript.jsonl")
    (step,) = [e["key"] for e in entries if e["kind"] == "run" and e["key"][0] == "srun"]
    script = step[-2]
    assert "--nnodes=2" in script and "--node-rank=0" in script and "--node-rank=1" in script
    assert "--master-addr=127.0.0.1" in script and step[-1] == "guide-the-torch-benchmark"
    assert "{repo}/.venv/bin/python" in script or "{python}" in script
    (jobid,) = places.for_stage(stage).jobs
    for node in (0, 1):  # each node's whole output, in the stage's folder
        assert (stage.dir / f"the-torch-benchmark-{jobid}-node{node}.rc").read_text() == "0\n"
    assert_nothing_left(cluster)
    # the recorded stage replays from its transcript alone: the same gates (finish compares)
    replay = slurm_stage(tmp_path, "03_kernel_test", KERNEL, replay=True)
    kernel.run(replay)
    replay.finish()
    assert [g.as_dict() for g in replay.gates] == [g.as_dict() for g in stage.gates]


def _sleeps(job_argv_by_rank):
    return lambda node: job_argv_by_rank[node.rank]


@needs_slurm
def test_a_node_killed_mid_run_comes_back_with_its_code_and_nothing_is_left(cluster, tmp_path):
    stage = slurm_stage(tmp_path, "03_kernel_test", {**KERNEL, "job_timeout_s": 60.0})
    seen: dict[str, list[int]] = {}

    def kill_node_2s_sleep():
        deadline = time.monotonic() + 40
        while time.monotonic() < deadline:
            jobs = cluster.queue()
            if jobs:
                pids = cluster.job_pids(jobs[0])
                mine = [p for p in pids if _cmdline(p) == b"sleep\x0058\x00"]
                if mine and any(_cmdline(p) == b"sleep\x0057\x00" for p in pids):
                    seen["pids"] = pids
                    os.kill(mine[0], 9)
                    return
            time.sleep(0.2)

    killer = threading.Thread(target=kill_node_2s_sleep, daemon=True)
    killer.start()
    job = RankJob("sleepers", argv=_sleeps({0: ["sleep", "57"], 1: ["sleep", "58"]}),
                  env=lambda node: {"NODE": str(node.rank)}, timeout_s=60, nodes=2)
    started = time.monotonic()
    runs = SlurmPlace(stage).run_ranks(job)
    killer.join(5)
    assert seen.get("pids"), "the killer never found node 2's sleep"
    assert time.monotonic() - started < 40  # the step ended at the kill, not at a timeout
    assert [(r.rank, r.rc, r.timed_out) for r in runs] == [(0, 143, False), (1, 137, False)]
    assert "SIGTERM" in runs[0].stderr  # ended by --kill-on-bad-exit, its code still recorded
    assert runs[1].streams[0].endswith("node1.out") and runs[1].streams[-1].startswith("calls/")
    assert_nothing_left(cluster, seen["pids"])
    # the triage names the node that died first: killed without a word, the other stopped after
    first = kernel.first_failure(runs, [s for r in runs for s in r.streams])
    assert first["status"] == "FAIL" and "in node 1 failed first" in first["reason"]
    assert "Killed" in first["reason"]  # the wrapper's own line: the shell saw its child killed
    # a death with no line at all: the exit codes name the node, the launcher's SIGTERM a symptom
    from lib.measure import triage
    silent = triage.first_failure_gate({"node 0": "", "node 1": ""},
                                       {"node 0": 143, "node 1": 137})
    assert silent["reason"].startswith("node 1 (exit 137, killed: SIGKILL) failed first")
    assert "node 0 exited 143: stopped by the launcher after it" in silent["reason"]


@needs_slurm
def test_a_step_that_times_out_is_cancelled(cluster, tmp_path):
    stage = slurm_stage(tmp_path, "03_kernel_test", {**KERNEL, "job_timeout_s": 2.0})
    job = RankJob("too long", argv=lambda node: ["sleep", "300"], env=lambda node: {},
                  timeout_s=60, nodes=2)
    runs = SlurmPlace(stage).run_ranks(job)
    # the cancel kills the step (its code, where a node's TERM trap still wrote one, 143)
    assert [r.timed_out for r in runs] == [True, True]
    assert {r.rc for r in runs} <= {None, 143, 137}
    assert "CANCELLED" in runs[0].stderr  # slurmstepd's word, in node 0's own .err file
    cancels = [e["key"] for e in read_transcript(tmp_path / "transcript.jsonl")
               if e["kind"] == "run" and e["key"][0] == "scancel"]
    assert len(cancels) == 1
    assert_nothing_left(cluster)


@needs_slurm
def test_an_interrupted_run_and_an_ended_stage_cancel_their_job(cluster, tmp_path):
    stage = slurm_stage(tmp_path, "03_kernel_test", KERNEL)
    place = places.for_stage(stage)

    def interrupted(node):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        place.run_ranks(RankJob("interrupted", interrupted, lambda node: {}, 60, nodes=2))
    assert_nothing_left(cluster)
    # a job the stage still holds when it ends (pending or running) is cancelled by on_exit
    jobid = place._allocate("held", 2, 0)
    assert cluster.queue() == [jobid]
    stage.close_resources()
    assert_nothing_left(cluster)
    assert place.jobs[-1] == jobid and len(place.jobs) == 2


needs_gres = pytest.mark.skipif(os.geteuid() != 0, reason="stand-in GPU devices need root "
                                                            "(mknod)")


@contextmanager
def gres_cluster(tmp_path_factory, monkeypatch, gpus: int, cpus: int | None = None):
    """A second two-node Slurm whose nodes declare Gres=gpu:<gpus> (and `cpus` CPUs: a task
    per GPU needs one each), its client environment this process's while it runs."""
    gres = slurmlocal.LocalSlurm()
    gres.start(tmp_path_factory.mktemp(f"gres{gpus}"), nodes=2, gres_gpus=gpus,
               cpus_per_node=cpus)
    try:
        for key, value in gres.env.items():
            monkeypatch.setenv(key, value)
        yield gres
    finally:
        gres.stop()


@needs_slurm
@needs_gres
def test_nodes_with_gres_gpus_are_allocated_and_probed_with_them(tmp_path_factory, monkeypatch):
    """A second cluster whose nodes declare Gres=gpu:2: gpus() reads it, and the allocation and
    the probe step ask every GPU of a node (--gres=gpu:2), which this Slurm accepts."""
    with gres_cluster(tmp_path_factory, monkeypatch, 2) as gres:
        run_dir = tmp_path_factory.mktemp("run")
        stage = slurm_stage(run_dir, "00_cluster")
        place = places.for_stage(stage)
        assert place.gpus() == 2
        facts = place.host_facts()
        assert [(f["node"], f["gres_gpus"], f["gres"]) for f in facts] == [
            ("n1", 2, "gpu:2"), ("n2", 2, "gpu:2")]
        calls = [e["key"] for e in read_transcript(run_dir / "transcript.jsonl")
                 if e["kind"] == "run" and e["key"][0] in ("sbatch", "srun")]
        assert all("--gres=gpu:2" in argv for argv in calls) and len(calls) == 2
        assert all(f["probe_complete"] for f in facts)
        # 00's gates on a p5en run (8 GPUs a node): each node FAILs quoting Slurm's gpu:2
        from lib.stages.cluster import host_gates

        gated = {g.gate: g for f in facts
                 for g in host_gates(f, place.node_needs(), f["evidence"])}
        for node in ("n1", "n2"):
            gres_gate = gated[f"{node}: GPUs in Slurm's GRES"]
            assert (gres_gate.status, gres_gate.observed, gres_gate.expected) == ("FAIL", 2, 8)
            assert "Slurm reports GRES gpu:2 (2 GPU(s))" in gres_gate.reason
            assert "Slurm reports GRES gpu:2" in gated[f"{node}: GPUs"].reason
        assert_nothing_left(gres)


# ---- serving: 04 and 05 with transformers serve as a step ---------------------------------------
SERVE = {"venv": VENV, "engine": "transformers", "server_timeout_s": 120.0}
SWEEP = {**SERVE, "concurrency": "1", "repeats": 1, "request_count": 4, "requests_per_slot": 0,
         "warmup_requests": 1, "warmup_full_batch": False, "input_tokens": 32,
         "output_tokens": 8}


@pytest.fixture(scope="module")
def served(cluster, tmp_path_factory):
    """04 recorded on the two-node Slurm: transformers serve as a step of a one-node allocation."""
    run_dir = tmp_path_factory.mktemp("served") / "run"
    stage = slurm_stage(run_dir, "04_serve", SERVE)
    data = stage04.run(stage)
    stage.finish()
    return run_dir, stage, data


def _calls(run_dir: Path, stage: str, kind: str = "run") -> list[list[str]]:
    return [e["key"] for e in read_transcript(run_dir / "transcript.jsonl")
            if e["stage"] == stage and e["kind"] == kind]


@needs_slurm
def test_04_serves_transformers_as_a_step_and_replays(cluster, served):
    run_dir, stage, data = served
    gates = {g.gate: g for g in stage.gates}
    for name in ("model built from its seed", "server ready", "/v1/models lists the model",
                 "model config is a Mixture of Experts",
                 "chat request answers with content and usage", "server stopped"):
        assert gates[name].status == "PASS", (name, gates[name].reason)
    assert len(stage.gates) == 6
    stopped = gates["server stopped"].observed
    assert stopped["steps_left"] == [] and stopped["allocation_gone"] is True
    assert stopped["port_answering"] is False
    (jobid,) = places.for_stage(stage).jobs
    (alloc,) = [c for c in _calls(run_dir, "04_serve") if c[0] == "sbatch"]
    assert "--nodes=1" in alloc  # one node for transformers serve
    (start,) = _calls(run_dir, "04_serve", "start")
    assert start[:3] == ["srun", f"--jobid={jobid}", "--overlap"] and "--nodelist=n1" in start
    command = start[start.index("env"):]
    assert "HF_HUB_OFFLINE=1" in command and command[4:6] == ["{bin}/transformers", "serve"]
    assert ["scancel", jobid] in _calls(run_dir, "04_serve")
    log = stage.path("server.log").read_text()
    assert "Uvicorn running" in log or "Application startup complete" in log  # its whole output
    assert data["ready"] and data["rss_bytes"] is None  # its memory is a node's: not read here
    assert_nothing_left(cluster)
    replay = slurm_stage(run_dir, "04_serve", SERVE, replay=True)
    stage04.run(replay)
    replay.finish()
    assert [g.as_dict() for g in replay.gates] == [g.as_dict() for g in stage.gates]


@needs_slurm
def test_05_runs_aiperf_as_a_step_against_the_server_and_leaves_nothing(cluster, served):
    run_dir = served[0]
    stage = slurm_stage(run_dir, "05_sweep", SWEEP)
    stage05.run(stage)
    stage.finish()
    gates = evidence.read_gates(stage.dir)
    cells = [g for g in gates if g["gate"].startswith("aiperf transformers c1 repeat 1: ")]
    assert len(cells) >= 5 and {g["status"] for g in cells} == {"PASS"}, cells
    by_name = {g["gate"]: g for g in gates}
    for name in ("server ready", "server stopped", "warmup excluded from every cell",
                 "every planned cell measured", "the same model 04_serve served"):
        assert by_name[name]["status"] == "PASS", by_name[name]
    memory = by_name["server resident memory under 1.5 GiB"]
    assert memory["status"] == "SKIP" and "does not read" in memory["reason"]
    (jobid,) = places.for_stage(stage).jobs
    steps = [c for c in _calls(run_dir, "05_sweep") if c[0] == "srun"]
    (aiperf,) = steps
    assert aiperf[:3] == ["srun", f"--jobid={jobid}", "--overlap"] and "--nodelist=n1" in aiperf
    assert "{repo}/.venv-aiperf/bin/aiperf" in aiperf and "--request-count" in aiperf
    out = stage.path("aiperf", "repeat_1", "aiperf-transformers-c1")
    assert (out / "profile_export_aiperf.json").exists()  # written by the step, on the share
    assert by_name["aiperf transformers c1 repeat 1: AIPerf exit 0"]["evidence"][0] == (
        f"05_sweep/aiperf-transformers-c1-r1-{jobid}.out")
    pids = [e["pid"] for e in read_transcript(run_dir / "transcript.jsonl")
            if e["stage"] == "05_sweep" and e["kind"] == "start"]
    assert_nothing_left(cluster, pids)


def _answering_step(monkeypatch):
    """transformers serve stood in for by a server that answers every GET with 200 (the
    allocation's bookkeeping under test, not transformers): a second a start, not ten."""
    code = ("import http.server,sys\n"
            "class H(http.server.BaseHTTPRequestHandler):\n"
            " def do_GET(self):\n"
            "  self.send_response(200); self.end_headers(); self.wfile.write(b'{}')\n"
            "http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), H).serve_forever()\n")
    monkeypatch.setattr(transformers, "serve_argv",
                        lambda model, port, cores=None, device="cpu", host="127.0.0.1",
                        console_script=None: [console_script, "-c", code, str(port)])
    monkeypatch.setattr("lib.places.slurm.place.SlurmPlace._program",
                        lambda self, name: str(REPO_ROOT / ".venv" / "bin" / "python"))


@needs_slurm
def test_the_arms_of_an_a_b_share_one_allocation_until_the_stage_closes(cluster, tmp_path,
                                                                         monkeypatch):
    """Arms (a serve whose gates carry the arm's name) run side by side and one after the
    other in one allocation: each arm's step is stopped when its block ends, the allocation
    stays until the stage closes; an exception out of a block cancels it at once."""
    _answering_step(monkeypatch)
    stage = slurm_stage(tmp_path, "05_sweep", SERVE)
    place = places.for_stage(stage)
    model = {"model_dir": "/m"}
    with place.serve(ServeSpec("transformers", model, gate_prefix="A", log_name="a.log")) as a:
        with place.serve(ServeSpec("transformers", model, gate_prefix="B",
                                   log_name="b.log")) as b:
            assert a.ready and b.ready and a.jobid == b.jobid and a.port != b.port
    with place.serve(ServeSpec("transformers", model, gate_prefix="A, start 2",
                               log_name="a-2.log")) as again:
        assert again.ready and again.jobid == a.jobid
    assert cluster.queue() == [a.jobid]  # held for the stage's other arms
    stopped = [g for g in stage.gates if g.gate.endswith("server stopped")]
    assert [g.gate for g in stopped] == ["B: server stopped", "A: server stopped",
                                         "A, start 2: server stopped"]
    assert all(g.status == "PASS" and "allocation_gone" not in g.observed for g in stopped)
    stage.close_resources()  # the stage closes: the allocation is cancelled
    assert_nothing_left(cluster)
    with pytest.raises(RuntimeError, match="boom"):
        with place.serve(ServeSpec("transformers", model, gate_prefix="C", log_name="c.log")):
            raise RuntimeError("boom")
    assert place.jobs[-1] != a.jobid and len(place.jobs) == 2
    last = [g for g in stage.gates if g.gate == "C: server stopped"][0]
    assert last.status == "PASS" and last.observed["allocation_gone"] is True
    assert_nothing_left(cluster)


# ---- serving: 04 with an expert-parallel engine, a step per node ---------------------------------
@needs_slurm
@needs_gres
def test_04_serves_sglang_as_a_step_per_node_and_gates_every_node_s_log(tmp_path_factory,
                                                                      monkeypatch):
    """-p engine sglang on a two-node Slurm whose nodes declare 8 GPUs each (Gres=gpu:8): one
    allocation, a step per node with its node rank, every node's log gated as SGLang's formats
    say, the model's config read on node 0 from the HF cache, nothing left. What runs in each
    step is tests/engine_double.py (no GPU here): it prints the argv SGLang would have run and
    the node's log composed from SGLang 0.5.19's formats, and node 0 answers the API with a
    recorded vLLM serve's bodies. A rank without its EFA provider line FAILs that gate."""
    from lib.engines.sglang import SglangEngine
    from tests import compose
    from tests.kube_env import RECORDED_RUN, model_config

    with gres_cluster(tmp_path_factory, monkeypatch, 8) as gres:
        base = tmp_path_factory.mktemp("sglang")
        given = {"venv": VENV, "engine": "sglang", "server_timeout_s": 60.0}
        p = slurm_stage(base / "probe", "04_serve", given).params
        cache = base / "hf"
        snapshot = (cache / "hub" / f"models--{p['model'].replace('/', '--')}" / "snapshots"
                    / p["model_revision"])
        snapshot.mkdir(parents=True)
        (snapshot / "config.json").write_text(json.dumps(
            model_config(RECORDED_RUN / "model_config.json", experts=128, top_k=8)))
        real = SglangEngine.command
        double = REPO_ROOT / "tests" / "engine_double.py"

        def stood_in(logs):
            def command(self, spec):
                argv, env = real(self, spec)
                return [argv[0], str(double), str(logs), str(RECORDED_RUN), "--", *argv], env
            return command

        monkeypatch.setattr(SglangEngine, "command",
                            stood_in(compose.compose_sglang_pods(base / "logs")[0].parent))
        run_dir = base / "run"
        stage = slurm_stage(run_dir, "04_serve", {**given, "model_cache_dir": str(cache)})
        data = stage04.run(stage)
        stage.finish()
        got = {g.gate: g for g in stage.gates}
        assert {n: g.reason for n, g in got.items() if g.status != "PASS"} == {}
        for name in ("sglang_moe_a2a_backend", "sglang_elastic_buffer_per_rank",
                     "nccl_init_per_rank", "efa_provider_per_rank",
                     "model config is a Mixture of Experts", "server stopped"):
            assert name in got, name
        starts = _calls(run_dir, "04_serve", "start")
        assert len(starts) == 2 and all(f"--gres=gpu:8" in s for s in starts)
        assert [s[s.index("--node-rank") + 1] for s in starts] == ["0", "1"]
        assert data["gpus"] == 16
        assert (stage.dir / "sglang-node1.log").exists()
        assert_nothing_left(gres)
        monkeypatch.setattr(SglangEngine, "command", stood_in(compose.compose_sglang_pods(
            base / "dropped", drop_provider_rank=12)[0].parent))
        stage = slurm_stage(base / "run-dropped", "04_serve", {**given,
                                                               "model_cache_dir": str(cache)})
        stage04.run(stage)
        stage.finish()
        failed = [g for g in stage.gates if g.status == "FAIL"]
        assert [g.gate for g in failed] == ["efa_provider_per_rank"]
        assert "rank(s) 12 of 16" in failed[0].reason
        assert_nothing_left(gres)
        # node 1's output reaching the run folder 3 s after node 0 answers (as srun forwarded
        # it once under load): its log is awaited until two looks read it the same, then gated
        monkeypatch.setattr(SglangEngine, "command",
                            stood_in(compose.compose_sglang_pods(base / "late")[0].parent))
        monkeypatch.setenv("ENGINE_DOUBLE_LATE_S", "3")
        stage = slurm_stage(base / "run-late", "04_serve", {**given,
                                                            "model_cache_dir": str(cache)})
        stage04.run(stage)
        stage.finish()
        assert {g.gate: g.reason for g in stage.gates if g.status != "PASS"} == {}
        assert "Selected provider is efa" in (stage.dir / "sglang-node1.log").read_text()
        assert_nothing_left(gres)
