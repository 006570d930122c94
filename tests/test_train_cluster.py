"""Stage 07 (megatron-core training) on the clusters: the plan's objects, the real control plane
with two simulated p5en nodes, and the real two-node Slurm.

- plan: `papermill notebooks/07_train.ipynb ... -p context plan -p nodes 2` (and `-p plan_for
  slurm`) renders one pod per node whose argv is megatron's torchrun (--nnodes=2, its node rank,
  the rendezvous on pod 0, one rank per GPU: 8 a p5en node), and the sbatch/srun of one step
  over both nodes; the manifests validate, the scripts shellcheck.
- kube: the stage through the real kubectl and API server (tests/kubeplane.py); the kubelet
  double (tests/kubelet_double.py) serves each pod the log of a real two-node CPU run
  (tests/train_logs/, recorded by its record.py: gloo, one rank a node, world 2, the local
  shape), or one composed from it (tests/compose.py compose_train_pods: a NaN loss, a rank that
  built another dispatcher). The pods are asked for one rank on one GPU each (`ranks` 1,
  `gpus_per_node` 1) so that the world the stage gates (2) is the recording's.
- slurm: the training itself run by one srun step over both Slurm nodes (tests/slurmlocal.py,
  CPU, gloo, one rank a node), every gate PASS; then a node's rank made to die after its step 2
  (os._exit(3)) by a `venv` whose python is a wrapper around the repository's (it puts
  tests/train_logs/die_after_step/ on PYTHONPATH: no hook in lib/), and the gate that names the
  first to fail names that node.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lib.core.door import REPO_ROOT, read_transcript
from lib.measure import training, triage
from lib.places.kube import manifests
from lib.places.kube.pods import object_name
from lib.stages import train
from tests import compose
from tests.kubeplane import NOT_BUILT, plane_available
from tests.test_slurm_place import (VENV, assert_nothing_left, cluster,  # noqa: F401 (a fixture)
                                    needs_slurm, slurm_stage)
from tests.train_logs.record import local_shape

JOB = "megatron-core training"  # lib.stages.train's RankJob
POD = object_name(JOB)
ONE_RANK_A_NODE = {"ranks": 1, "gpus_per_node": 1}
EVERY_GATE = ("every rank exits 0", "every rank ran every step",
              "the dispatcher asked is the one that ran", "loss finite at every step",
              "loss lower after the last step than after the first",
              "grad norm finite at every step",
              "tokens cross ranks through the dispatcher at every step",
              "megatron-core training: node ranks on distinct nodes, together",
              "the all-to-all used the wire (EFA RDMA write bytes grew)")
EFA_GATE = EVERY_GATE[-1]
needs_plane = pytest.mark.skipif(not plane_available(), reason=NOT_BUILT)


def statuses(stage) -> dict[str, str]:
    return {g.gate: g.status for g in stage.gates}


def gate_of(stage, name: str):
    return next(g for g in stage.gates if g.gate == name)


# ---- plan: what a cluster would run ------------------------------------------------------------
def papermill_plan(tmp_path: Path, run_id: str, *more: str) -> Path:
    done = subprocess.run(
        [sys.executable, "-m", "papermill", str(REPO_ROOT / "notebooks" / "07_train.ipynb"),
         str(tmp_path / f"{run_id}.ipynb"), "--cwd", str(REPO_ROOT / "notebooks"),
         "-p", "context", "plan", "-p", "nodes", "2", "-p", "results_dir", str(tmp_path),
         "-p", "run_id", run_id, *more],
        capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return tmp_path / run_id / "07_train"


def torchrun_of(argv: list[str]) -> list[str]:
    return argv[argv.index("torch.distributed.run") - 2:]


def test_the_plan_renders_megatron_s_torchrun_per_pod_and_the_slurm_step(tmp_path):
    """The issue's commands: the kube plan's two pods (valid under kubernetes-validate --strict)
    each run megatron's torchrun with --nnodes=2, its own --node-rank, the rendezvous on pod 0
    through the headless Service, 8 ranks (one per GPU of a p5en node) and the cluster shape;
    the slurm plan's one step runs node N's own torchrun, and its scripts shellcheck clean."""
    stage_dir = papermill_plan(tmp_path, "kube")
    objects = list(yaml.safe_load_all((stage_dir / "manifests" / f"{POD}.yaml").read_text()))
    pods = [o for o in objects if o["kind"] == "Pod"]
    (service,) = [o for o in objects if o["kind"] == "Service"]
    assert [p["metadata"]["name"] for p in pods] == [f"{POD}-0", f"{POD}-1"]
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"]
    rendezvous = f"{POD}-0.{POD}.deepep-repro.svc"
    port = service["spec"]["ports"][0]["port"]
    for rank, pod in enumerate(pods):
        container = pod["spec"]["containers"][0]
        argv = torchrun_of(container["command"])
        assert argv[:10] == ["python3", "-m", "torch.distributed.run", "--nproc-per-node=8",
                             "--nnodes=2", f"--node-rank={rank}", f"--master-addr={rendezvous}",
                             f"--master-port={port}", "-m", "lib.bench.moe_train"]
        flags = dict(zip(argv[10::2], argv[11::2]))
        assert (flags["--experts"], flags["--topk"], flags["--hidden"], flags["--backend"],
                flags["--dispatcher"]) == ("128", "8", "2048", "nccl", "alltoall")
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "8"
        assert {"name": "MASTER_ADDR", "value": rendezvous} in container["env"]
        # lib.bench.moe_train is not in the image: the job's ConfigMap brings it (and what it
        # imports of the guide) to /opt/guide, first on PYTHONPATH at the process's start
        assert container["command"][:4] == manifests.PYTHONPATH_PREFIX
        assert {"name": "guide", "mountPath": "/opt/guide", "readOnly": True} \
            in container["volumeMounts"]
        (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == "guide"]
        assert volume["configMap"]["name"] == f"{POD}-modules"
        assert [i["path"] for i in volume["configMap"]["items"]] == list(train.TRAIN_MODULES)
    (config,) = [o for o in objects if o["kind"] == "ConfigMap"]
    assert config["metadata"]["name"] == f"{POD}-modules"
    assert config["data"] == {p.replace("/", "."): (REPO_ROOT / p).read_text()
                              for p in train.TRAIN_MODULES}
    gates = {g["gate"]: g for g in json.loads((stage_dir / "gates.json").read_text())}
    assert gates[f"{POD}: manifests valid (kubernetes-validate --strict 1.36)"]["status"] == "PASS"
    assert gates[JOB]["status"] == "SKIP" and "planned, not run" in gates[JOB]["reason"]

    stage_dir = papermill_plan(tmp_path, "slurm", "-p", "plan_for", "slurm")
    scripts = sorted(p.name for p in (stage_dir / "scripts").iterdir())
    assert scripts == ["01-megatron-core-training-on-2-node-s.sh",
                       "02-megatron-core-training-batch.sbatch"]
    batch = (stage_dir / "scripts" / scripts[1]).read_text()
    assert "#SBATCH --nodes=2" in batch and "#SBATCH --gres=gpu:8" in batch
    assert re.search(r"^srun --nodes=2 --ntasks=2 --ntasks-per-node=1 --gres=gpu:8 "
                     r"--kill-on-bad-exit=1 ", batch, re.M)
    for rank in (0, 1):
        assert (f"cmd=(python3 -m torch.distributed.run --nproc-per-node=8 --nnodes=2 "
                f"--node-rank={rank} --master-addr=node-0 --master-port=29500 -m "
                f"lib.bench.moe_train ") in batch
    gates = {g["gate"]: g["status"] for g in json.loads((stage_dir / "gates.json").read_text())}
    assert gates == {f"scripts/{scripts[0]}: shellcheck clean": "PASS",
                     f"scripts/{scripts[1]}: shellcheck clean": "PASS", JOB: "SKIP"}


# ---- kube: the real control plane, two simulated p5en nodes ------------------------------------
@pytest.fixture(scope="module")
def kube(tmp_path_factory):
    if not plane_available():
        pytest.skip(NOT_BUILT)
    from tests.kube_env import KubeEnv

    with KubeEnv(tmp_path_factory.mktemp("kube")) as env:
        yield env


def kube_07(kube, run: Path, logs: list[Path], exit_codes=(0, 0), replay: bool = False,
            exit_after=None):
    """07 on the control plane, its pods logging `logs`: the finished stage and its data."""
    if not replay:
        kube.ranks(POD, logs, exit_codes=list(exit_codes), exit_after=exit_after)
    stage = kube.stage("07_train", run, replay=replay, **local_shape(), **ONE_RANK_A_NODE)
    data = train.run(stage)
    train.show(stage, data)
    stage.finish()
    return stage, data


@needs_plane
def test_kube_two_pods_train_from_their_recorded_logs_every_gate_passes(kube, tmp_path):
    run = tmp_path / "run"
    stage, data = kube_07(kube, run, compose.recorded_train_pods("pass"))
    got = statuses(stage)
    assert got == {**{g: "PASS" for g in EVERY_GATE}, EFA_GATE: "SKIP"}, \
        [(g.gate, g.reason) for g in stage.gates if g.status != "PASS"]
    assert "on EFA nodes this is the evidence the wire was used" in gate_of(stage, EFA_GATE).reason
    assert data["world"] == 2 and [s["step"] for s in data["steps"]] == list(range(5))
    assert data["steps"][0]["loss"] == pytest.approx(4.8614, abs=1e-4)
    assert data["steps"][-1]["loss"] == pytest.approx(4.0162, abs=1e-4)
    assert all(s["ranks"] == 2 and s["sent to other ranks"] == s["routed to other ranks"] > 0
               for s in data["steps"])
    assert gate_of(stage, "every rank exits 0").observed == {"node 0": 0, "node 1": 0}
    # the pods ran megatron's torchrun: one rank each, node ranks 0 and 1, rendezvous on pod 0
    manifest = (run / "07_train" / "manifests" / f"{POD}.yaml").read_text()
    assert manifest.count("kind: Pod") == 2
    assert "--node-rank=1" in manifest and f"--master-addr={POD}-0.{POD}." in manifest
    # evidence: each pod's whole log (through kubectl logs), the step table, the gates
    for k, recorded in enumerate(compose.recorded_train_pods("pass")):
        assert (run / "07_train" / "pods" / f"{POD}-{k}.log").read_text() == recorded.read_text()
    assert json.loads((run / "07_train" / "steps.json").read_text()) == data["steps"]
    recorded = {g["gate"]: g["status"] for g in
                json.loads((run / "07_train" / "gates.json").read_text())}
    assert recorded == got
    logs = [e["key"] for e in read_transcript(run / "transcript.jsonl")
            if e["kind"] == "run" and e["key"][0] == "kubectl" and "logs" in e["key"]]
    assert len(logs) == 2
    assert kube.objects_left() == []
    left = kube.plane.get_json("configmaps", "-n", kube.namespace, "-l",
                               f"guide.repro/group={POD}")
    assert left["items"] == []  # the job's ConfigMap went with its pods
    kube_07(kube, run, [], replay=True)  # the recorded stage replays: the same gates


@needs_plane
def test_kube_a_rank_that_dies_mid_run_is_named_first(kube, tmp_path):
    """Pod 1's rank raised after its step 2 (a real run's traceback: tests/train_logs/) and its
    torchrun exited 1; pod 0's rank had failed on the broken process group (gloo's 'Connection
    closed by peer'), its torchrun still winding down (it exits 1 only much later here). The
    job's wait ends at pod 1's exit (issue 43: its peer would wait on it) and pod 0 is stopped,
    said so. 'first rank to fail' names rank 1 of pod 1, the other's error a symptom; 'every
    rank ran every step' names it with the steps it logged."""
    stage, _ = kube_07(kube, tmp_path / "run", compose.recorded_train_pods(
        "rank1-dies-after-step2"), exit_codes=(1, 1), exit_after=(60.0, 2.0))
    failed = {g.gate: g for g in stage.gates if g.status == "FAIL"}
    assert set(failed) == {"every rank exits 0", triage.GATE_FIRST_RANK,
                           "every rank ran every step",
                           "tokens cross ranks through the dispatcher at every step"}, list(failed)
    assert failed["every rank exits 0"].observed == {"node 0": None, "node 1": 1}
    assert "stopped when" in failed["every rank exits 0"].reason, failed["every rank exits 0"].reason
    first = failed[triage.GATE_FIRST_RANK]
    assert first.reason.startswith("rank 1 failed first: node 1:"), first.reason
    assert "RuntimeError: this rank dies after step 2" in first.reason
    assert first.observed["symptom_ranks"] == [0] and first.observed["source"] == "node 1"
    assert f"07_train/pods/{POD}-1.log" in first.evidence
    finished = failed["every rank ran every step"]
    assert finished.reason == "no 'done' line from rank(s) 0 (steps logged: 4), 1 (steps logged: 3)"
    # the steps both ranks finished are still gated and shown: the loss fell over steps 0-3
    assert statuses(stage)["loss finite at every step"] == "PASS"
    assert kube.objects_left() == []


@needs_plane
def test_kube_a_loss_that_goes_nan_fails_naming_rank_and_step(kube, tmp_path):
    stage, _ = kube_07(kube, tmp_path / "run",
                       compose.compose_train_pods(tmp_path / "logs", nan_from_step=3))
    failed = {g.gate: g.reason for g in stage.gates if g.status == "FAIL"}
    assert failed == {"loss finite at every step": "rank 0 step 3: loss nan",
                      "loss lower after the last step than after the first":
                          "observed '4.8614 -> nan', expected 'last < first (two or more steps)'",
                      "grad norm finite at every step": "rank 0 step 3: grad norm nan"}
    loss = gate_of(stage, "loss finite at every step")
    assert [(r, s) for r, s, _ in loss.observed] == [(0, 3), (0, 4), (1, 3), (1, 4)]
    assert statuses(stage)["every rank exits 0"] == "PASS"  # a NaN does not stop a rank
    assert kube.objects_left() == []


@needs_plane
def test_kube_a_dispatcher_other_than_the_one_asked_fails_naming_the_rank(kube, tmp_path):
    stage, _ = kube_07(kube, tmp_path / "run",
                       compose.compose_train_pods(tmp_path / "logs", dispatcher_rank=1))
    failed = {g.gate: g for g in stage.gates if g.status == "FAIL"}
    assert list(failed) == ["the dispatcher asked is the one that ran"]
    gate = failed["the dispatcher asked is the one that ran"]
    assert gate.reason == "rank(s) 1 built ['MoEAllGatherTokenDispatcher']"
    assert gate.expected.startswith("MoEAlltoAllTokenDispatcher (moe_token_dispatcher_type="
                                    "'alltoall')")
    assert kube.objects_left() == []


# ---- slurm: the real two-node Slurm, the training run for real ---------------------------------
TRAIN_ON_SLURM = {**local_shape(), "ranks": 1, "job_timeout_s": 120.0,
                  "schedule_timeout_s": 30.0}
DIE_AFTER_STEP = 2


def record_format(ranks: dict) -> dict:
    """Each record kind's field names (what a parser of the logs relies on)."""
    rank = ranks[0]
    return {"start": sorted(rank.start), "step": sorted(rank.steps[0]), "efa": sorted(rank.efa),
            "done": sorted(rank.done)}


@needs_slurm
def test_slurm_two_nodes_train_for_real_every_gate_passes(cluster, tmp_path):  # noqa: F811
    """One srun step over both nodes, each node's torchrun its own rank (gloo, world 2): every
    gate PASS (the EFA gate SKIPs: these nodes have no EFA counters), each node's output in the
    stage's folder; the records have the recorded kube fixture's kinds and fields."""
    stage = slurm_stage(tmp_path, "07_train", {"venv": VENV, **TRAIN_ON_SLURM})
    data = train.run(stage)
    stage.finish()
    got = statuses(stage)
    assert got == {**{g: "PASS" for g in EVERY_GATE}, EFA_GATE: "SKIP"}, \
        [(g.gate, g.reason) for g in stage.gates if g.status != "PASS"]
    assert data["world"] == 2 and data["config"]["backend"] == "gloo"
    assert data["steps"][-1]["loss"] < data["steps"][0]["loss"]
    (step,) = [e["key"] for e in read_transcript(tmp_path / "transcript.jsonl")
               if e["kind"] == "run" and e["key"][0] == "srun"]
    assert "--nodes=2" in step and "--kill-on-bad-exit=1" in step
    assert "--node-rank=0" in step[-2] and "--node-rank=1" in step[-2]
    outs = sorted(stage.dir.glob("megatron-core-training-*-node*.out"))
    assert len(outs) == 2
    ranks = training.parse_ranks("\n".join(p.read_text() for p in outs))
    assert sorted(ranks) == [0, 1] and ranks[1].start["local_experts"] == [4, 5, 6, 7]
    recorded = training.parse_ranks("\n".join(
        p.read_text() for p in compose.recorded_train_pods("pass")))
    assert record_format(ranks) == record_format(recorded)
    assert_nothing_left(cluster)


def dying_venv(root: Path, how: str = "exit") -> Path:
    """A `venv` whose python is the repository's, started with die_after_step/ on PYTHONPATH:
    the rank of Slurm node 1 dies after its step DIE_AFTER_STEP line."""
    python = root / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(
        "#!/bin/bash\n"
        f"export PYTHONPATH={REPO_ROOT / 'tests' / 'train_logs' / 'die_after_step'}"
        '${PYTHONPATH:+:$PYTHONPATH}\n'
        f"export TRAIN_DIE_NODE=1 TRAIN_DIE_AFTER_STEP={DIE_AFTER_STEP} TRAIN_DIE_HOW={how}\n"
        f'exec {REPO_ROOT / ".venv" / "bin" / "python"} "$@"\n')
    python.chmod(0o755)
    return root


@needs_slurm
def test_slurm_a_node_whose_rank_dies_mid_run_is_named_first(cluster, tmp_path):  # noqa: F811
    """Node 1's rank ends itself (os._exit(3), no word) after its step 2 line: its torchrun
    says so and exits 1, srun's --kill-on-bad-exit ends node 0; the gate names node 1's rank."""
    venv = dying_venv(tmp_path / "venv")
    stage = slurm_stage(tmp_path / "run", "07_train", {"venv": str(venv), **TRAIN_ON_SLURM})
    train.run(stage)
    stage.finish()
    failed = {g.gate: g for g in stage.gates if g.status == "FAIL"}
    assert {"every rank exits 0", triage.GATE_FIRST_RANK, "every rank ran every step"} <= \
        set(failed), list(failed)
    codes = failed["every rank exits 0"].observed
    assert codes["node 1"] == 1 and codes["node 0"] != 0, codes
    first = failed[triage.GATE_FIRST_RANK]
    assert first.reason.startswith("rank 1 failed first: node 1:"), first.reason
    # what node 1 says of it: torchrun's line that its rank exited 3 (then its agent's
    # ChildFailedError); node 0's dead-peer error (when gloo saw it before srun's SIGTERM came)
    # a symptom, its agent's SIGTERM a report of the step being ended
    assert (first.observed["source"], first.observed["kind"]) == ("node 1", "exit")
    node1 = "\n".join(p.read_text() for p in sorted(stage.dir.glob("*-node1.*")))
    assert "failed (exitcode: 3) local_rank: 0" in node1
    finished = failed["every rank ran every step"].reason
    assert f"1 (steps logged: {DIE_AFTER_STEP + 1})" in finished, finished
    assert_nothing_left(cluster)
