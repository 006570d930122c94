"""The stages on the kube place, end to end through the real kubectl and the real API server
(tests/kubeplane.py: etcd, kube-apiserver, scheduler and controllers 1.20.2). The one simulated
part is the kubelet with GPUs (tests/kubelet_double.py): it sets pod status and answers logs and
exec with recorded and composed outputs (tests/compose.py, tests/kube_env.py). Every pod log a
gate reads arrives through `kubectl logs`, and the transcript holds each call.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

try:
    from kubeplane import NOT_BUILT, plane_available
except ImportError:
    from tests.kubeplane import NOT_BUILT, plane_available

from lib.core.door import read_transcript
from lib.places.kube import manifests
from lib.measure import triage
from lib.stages import cluster, kernel, serve as serve_stage
from tests import compose
from tests.kube_env import MODEL_CACHE, NODES, RECORDED_RUN, KubeEnv, model_config

pytestmark = pytest.mark.skipif(not plane_available(), reason=NOT_BUILT)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    with KubeEnv(tmp_path_factory.mktemp("kube")) as cluster_env:
        yield cluster_env


def statuses(stage) -> dict[str, str]:
    return {g.gate: g.status for g in stage.gates}


def kubectl_calls(run_dir: Path, verb: str) -> list[list[str]]:
    return [e["key"] for e in read_transcript(run_dir / "transcript.jsonl")
            if e["kind"] == "run" and e["key"][0] == "kubectl" and verb in e["key"]]


def test_00_gates_every_node_from_kubectl_and_its_probe_pod(env, tmp_path):
    env.probes(per_node={NODES[1]: {"gdrdrv": "2.4", "efa": 15}})
    run = tmp_path / "run"
    stage = env.stage("00_cluster", run)
    data = cluster.run(stage)
    cluster.show(stage, data)
    stage.finish()
    got = statuses(stage)
    assert got["access to the cluster"] == "PASS"
    assert got["nodes of the instance type, Ready"] == "PASS"
    a, b = NODES
    for name in ("GPUs", "EFA devices", "gdrdrv >= 2.5", "hugepages"):
        assert got[f"{a}: {name}"] == "PASS", name
    assert got[f"{b}: gdrdrv >= 2.5"] == "FAIL" and got[f"{b}: EFA devices"] == "FAIL"
    efa = next(g for g in stage.gates if g.gate == f"{b}: EFA devices")
    assert (efa.observed, efa.expected) == (15, 16)
    nodes = json.loads((run / "00_cluster" / "nodes.json").read_text())
    assert [n["node"] for n in nodes] == list(NODES) and nodes[0]["gdrdrv_version"] == "2.5.1"
    logs = kubectl_calls(run, "logs")
    assert len(logs) == 2  # each probe's output came through `kubectl logs`
    record = json.loads((run / "00_cluster" / "pods" / "guide-probe-p5en-a.status.json").read_text())
    assert record["containers"][0]["image_id"].endswith("ab" * 32)  # the pulled digest, kept
    assert env.objects_left() == []  # the probes were deleted when the stage ended
    replay = env.stage("00_cluster", run, replay=True)
    cluster.run(replay)
    replay.finish()


def test_03_test_ep_one_pod_per_node_over_efa_gated_and_replayed(env, tmp_path):
    env.ranks("test-ep-at-128-tokens", compose.compose_test_ep(tmp_path / "logs"))
    run = tmp_path / "run"
    stage = env.stage("03_kernel_test", run, test_ep_tokens="128")
    data = kernel.run(stage)
    kernel.show(stage, data)
    stage.finish()
    got = statuses(stage)
    prefix = "test_ep 128 tokens: "
    for name in ("test_ep exit code 0", "test_ep lines from every rank",
                 "dispatch+combine p50 recorded", "dispatch+combine p50 within the contract",
                 "EFA provider selected on every rank"):
        assert got[prefix + name] == "PASS", (name, [g.reason for g in stage.gates
                                                    if g.gate == prefix + name])
    assert got["the torch benchmark"] == "SKIP"
    apart = next(g for g in stage.gates if g.gate.endswith("node ranks on distinct nodes, "
                                                           "together"))
    assert apart.status == "PASS", apart.reason
    assert sorted(apart.observed.values()) == ["p5en-a", "p5en-b"]  # a node each
    ranks = next(g for g in stage.gates if g.gate == prefix + "test_ep lines from every rank")
    assert ranks.observed["ranks_seen"] == list(range(16))
    # the pods ran test_ep under torchrun, one rank per GPU (lib.bench.test_ep_rank the entry,
    # shipped in the job's ConfigMap), their logs in test_ep's own per-rank format: the ranks
    # print what the spawn form prints, and torchrun adds only its agent's lines
    objects = list(yaml.safe_load_all(
        (run / "03_kernel_test" / "manifests" / "test-ep-at-128-tokens.yaml").read_text()))
    pods = [o for o in objects if o["kind"] == "Pod"]
    (config,) = [o for o in objects if o["kind"] == "ConfigMap"]
    assert config["metadata"]["name"] == "test-ep-at-128-tokens-modules"
    assert sorted(config["data"]) == ["lib.__init__.py", "lib.bench.__init__.py",
                                      "lib.bench.test_ep_rank.py"]
    for rank, pod in enumerate(pods):
        command = pod["spec"]["containers"][0]["command"]
        torchrun = command[command.index("torch.distributed.run"):]
        assert torchrun[:4] == ["torch.distributed.run", "--nproc-per-node=8", "--nnodes=2",
                                f"--node-rank={rank}"]
        assert torchrun[torchrun.index("-m"):][:2] == ["-m", "lib.bench.test_ep_rank"]
    assert len(kubectl_calls(run, "logs")) == 2
    assert env.objects_left() == []
    left = env.plane.get_json("configmaps", "-n", env.namespace, "-l",
                              "guide.repro/group=test-ep-at-128-tokens")
    assert left["items"] == []  # deleted with the job's pods and Service
    deletes = kubectl_calls(run, "delete")
    assert any("statefulset,service,pod,job,configmap" in call
               and "guide.repro/group=test-ep-at-128-tokens," in " ".join(call) for call in deletes)
    replay = env.stage("03_kernel_test", run, replay=True, test_ep_tokens="128")
    kernel.run(replay)
    replay.finish()


def test_03_a_rank_without_the_efa_provider_fails_naming_it(env, tmp_path):
    env.ranks("test-ep-at-128-tokens",
              compose.compose_test_ep(tmp_path / "logs", drop_provider_rank=13))
    stage = env.stage("03_kernel_test", tmp_path / "run", test_ep_tokens="128")
    kernel.run(stage)
    stage.finish()
    efa = next(g for g in stage.gates if g.gate.endswith("EFA provider selected on every rank"))
    assert efa.status == "FAIL" and "13" in efa.reason


def test_03_the_first_of_sixteen_ranks_to_die_is_named_and_the_timeouts_are_symptoms(env,
                                                                                     tmp_path):
    logs = compose.compose_test_ep_failure(tmp_path / "logs", dead_rank=11)
    env.ranks("test-ep-at-128-tokens", logs, exit_codes=[1, 1])
    stage = env.stage("03_kernel_test", tmp_path / "run", test_ep_tokens="128")
    kernel.run(stage)
    stage.finish()
    first = next(g for g in stage.gates if g.gate.endswith(triage.GATE_FIRST_RANK))
    assert first.status == "FAIL" and first.reason.startswith("rank 11 failed first")
    assert "symptoms" in first.reason
    assert statuses(stage)["test_ep 128 tokens: test_ep exit code 0"] == "FAIL"


def test_00_an_apply_the_api_server_refuses_is_a_fail_naming_the_context_and_the_command(
        env, tmp_path):
    """A namespace that does not exist: the real API server refuses the probes' apply. The
    stage records one FAIL naming the context and `kubectl apply`, and its finish raises (the
    notebook exits non-zero); nothing is left behind."""
    from lib.core.errors import StageRefused
    from lib.core.stage import REFUSED_GATE

    env.probes()
    stage = env.stage("00_cluster", tmp_path / "run", namespace="no-such-namespace")
    data = cluster.run(stage)
    assert "refused" in data
    fails = [g for g in stage.gates if g.status == "FAIL"]
    assert [g.gate for g in fails] == [REFUSED_GATE]
    refused = fails[0]
    assert refused.observed["where"] == "kubectl's current context (namespace no-such-namespace)"
    assert refused.observed["command"].startswith("kubectl --namespace no-such-namespace apply -f ")
    assert 'namespaces "no-such-namespace" not found' in refused.reason
    with pytest.raises(StageRefused):
        stage.finish()
    assert env.objects_left() == []


def test_00_a_cluster_without_a_node_of_the_type_is_a_fail_naming_the_type(env, tmp_path):
    """The real API server lists two p5en nodes; a stage asking for p5 nodes finds none: one
    FAIL naming the type and the label read, nothing applied, the finish raises."""
    from lib.core.errors import StageRefused
    from lib.core.stage import REFUSED_GATE

    env.probes()
    stage = env.stage("00_cluster", tmp_path / "run", instance_type="p5.48xlarge",
                      efa_per_node=32)
    data = cluster.run(stage)
    assert "refused" in data
    fails = [g for g in stage.gates if g.status == "FAIL"]
    assert [g.gate for g in fails] == [REFUSED_GATE]
    assert "no node of instance type p5.48xlarge in the cluster" in fails[0].reason
    assert "node.kubernetes.io/instance-type" in fails[0].reason
    with pytest.raises(StageRefused):
        stage.finish()
    assert kubectl_calls(tmp_path / "run", "apply") == []  # nothing applied
    assert env.objects_left() == []


def test_03_a_pod_that_cannot_be_scheduled_fails_with_the_scheduler_s_reason(env, tmp_path):
    """32 EFA devices a pod (a p5's count) where the p5en nodes advertise 16: the real scheduler
    refuses, and says so. (More GPUs than an instance type has is refused before any effect.)"""
    env.ranks("test-ep-at-128-tokens", compose.compose_test_ep(tmp_path / "logs"))
    stage = env.stage("03_kernel_test", tmp_path / "run", test_ep_tokens="128",
                      efa_per_node=32, schedule_timeout_s=3)
    kernel.run(stage)
    stage.finish()
    pending = next(g for g in stage.gates if g.gate.endswith("pods scheduled"))
    assert pending.status == "FAIL" and "Insufficient vpc.amazonaws.com/efa" in pending.reason
    # beside the scheduler's words, which name no node: what each node lacks, from its object
    for node in NODES:
        assert f"{node}: vpc.amazonaws.com/efa allocatable 16, the pod asks 32" in pending.reason
    assert env.objects_left() == []


def test_04_vllm_statefulset_serves_through_the_leader_service(env, tmp_path):
    from lib.places.kube import manifests

    leader, worker = compose.compose_vllm_pods(tmp_path / "logs")
    p = env.stage("04_serve", tmp_path / "probe").params
    config = model_config(RECORDED_RUN / "model_config.json", experts=128, top_k=8)
    env.serve("vllm", [leader, worker], model=p["model"], revision=p["model_revision"],
              config=config)
    run = tmp_path / "run"
    stage = env.stage("04_serve", run, model_cache_dir=MODEL_CACHE)
    data = serve_stage.run(stage)
    serve_stage.show(stage, data)
    stage.finish()
    got = statuses(stage)
    assert {n: s for n, s in got.items() if s != "PASS"} == {}, \
        [(g.gate, g.reason) for g in stage.gates if g.status != "PASS"]
    for name in ("server ready", "vllm_all2all_manager", "vllm_ep_split",
                 "vllm_no_fallback_no_legacy_buffer", "nccl_init_per_rank",
                 "efa_provider_per_rank",
                 "/v1/models lists the model", "model config is a Mixture of Experts",
                 "chat request answers with content and usage", "server stopped"):
        assert any(g.startswith(name) for g in got), name
    manifest = (run / "04_serve" / "manifests" / "vllm.yaml").read_text()
    assert "statefulset.kubernetes.io/pod-name: vllm-0" in manifest  # the HTTP Service: pod 0
    assert manifests.HTTP_SERVICE_SUFFIX in manifest
    execs = kubectl_calls(run, "exec")
    assert len(execs) == 3 and all("vllm-0" in argv for argv in execs)
    assert len(kubectl_calls(run, "logs")) == 2
    assert env.objects_left() == []
    replay = env.stage("04_serve", run, replay=True, model_cache_dir=MODEL_CACHE)
    serve_stage.run(replay)
    replay.finish()


def serve_pods(env, tmp_path, engine: str, logs) -> dict:
    """The StatefulSet of `engine` on the control plane, its pods logging `logs` and answering
    the recorded vLLM serve's OpenAI bodies (the same API): the stage's parameters."""
    p = env.stage("04_serve", tmp_path / "probe", engine=engine).params
    config = model_config(RECORDED_RUN / "model_config.json", experts=128, top_k=8)
    env.serve(engine, logs, model=p["model"], revision=p["model_revision"], config=config)
    return p


def run_04(env, run, engine: str):
    """04 with `engine` run (and shown) into `run`: the finished stage."""
    stage = env.stage("04_serve", run, model_cache_dir=MODEL_CACHE, engine=engine)
    serve_stage.show(stage, serve_stage.run(stage))
    stage.finish()
    return stage


def assert_every_gate_passes(stage) -> dict[str, str]:
    got = statuses(stage)
    assert {n: s for n, s in got.items() if s != "PASS"} == {}, \
        [(g.gate, g.reason) for g in stage.gates if g.status != "PASS"]
    return got


def the_one_failure(stage, gate_name: str, said: str) -> None:
    failed = [g for g in stage.gates if g.status == "FAIL"]
    assert [g.gate for g in failed] == [gate_name]
    assert said in failed[0].reason, failed[0].reason


def test_04_sglang_serves_as_the_same_statefulset_and_its_logs_are_gated(env, tmp_path):
    """-p engine sglang on the real control plane: the same StatefulSet shape (pods
    sglang-0/-1, the container named by its engine, node ranks 0 and 1), the leader's /health
    probe, every pod's log gated as SGLang's formats say (the logs composed from SGLang 0.5.19's
    source, tests/compose.py; the answers are the recorded vLLM serve's OpenAI bodies, the
    same API). A rank whose ElasticBuffer line is missing FAILs its gate, naming it."""
    p = serve_pods(env, tmp_path, "sglang", compose.compose_sglang_pods(tmp_path / "logs"))
    assert p["pin_set"] == "sglang-0.5.19"
    run = tmp_path / "run"
    got = assert_every_gate_passes(run_04(env, run, "sglang"))
    for name in ("sglang_moe_a2a_backend", "sglang_deepep_v2_mode_per_node",
                 "sglang_elastic_buffer_per_rank", "sglang_server_fired_up",
                 "nccl_init_per_rank", "efa_provider_per_rank", "chat request answers with "
                 "content and usage", "server stopped"):
        assert name in got, name
    manifest = (run / "04_serve" / "manifests" / "sglang.yaml").read_text()
    assert "--node-rank 1" in manifest and "name: sglang" in manifest
    assert json.loads((run / "04_serve" / "sglang_serve.json").read_text())["gpus"] == 16
    assert env.objects_left() == []
    replay = env.stage("04_serve", run, replay=True, model_cache_dir=MODEL_CACHE,
                       engine="sglang")
    serve_stage.run(replay)
    replay.finish()
    serve_pods(env, tmp_path, "sglang",
               compose.compose_sglang_pods(tmp_path / "dropped", drop_buffer_rank=11))
    the_one_failure(run_04(env, tmp_path / "run-dropped", "sglang"),
                    "sglang_elastic_buffer_per_rank", "rank(s) 11 of 16")


TRTLLM_RECORDED = compose.TRTLLM_RECORDED


def test_04_trtllm_leader_s_recorded_log_is_gated_and_a_missing_rank_fails(env, tmp_path):
    """-p engine trtllm on the real control plane: the leader pod (mpirun over every rank) logs
    what R's TensorRT-LLM 0.21.0 serve logged on 2x p5en (its committed provider_evidence.log),
    the worker pod its sshd's one line (OpenSSH's "Server listening on ..." with -e, composed);
    every gate PASSes. The same log without rank 7's line FAILs naming rank 7."""
    pods = compose.compose_trtllm_pods(tmp_path / "logs")
    worker = pods[1]
    serve_pods(env, tmp_path, "trtllm", pods)
    got = assert_every_gate_passes(run_04(env, tmp_path / "run", "trtllm"))
    assert {"trtllm_alltoall_method_deepep", "trtllm_deepep_rank_per_rank",
            "efa_provider_per_rank", "trtllm_no_executor_error"} <= set(got)
    lines = TRTLLM_RECORDED.read_text().splitlines(keepends=True)
    dropped = tmp_path / "logs" / "composed-trtllm-without-rank7.log"
    dropped.write_text("".join(l for l in lines if "rank=7/16" not in l))
    serve_pods(env, tmp_path, "trtllm", [dropped, worker])
    the_one_failure(run_04(env, tmp_path / "run-dropped", "trtllm"),
                    "trtllm_deepep_rank_per_rank", "rank(s) 7 of 16")
    assert env.objects_left() == []


def test_04_a_legacy_buffer_or_a_rank_without_efa_fails_the_serve(env, tmp_path):
    p = env.stage("04_serve", tmp_path / "probe").params
    config = model_config(RECORDED_RUN / "model_config.json", experts=128, top_k=8)
    logs = compose.compose_vllm_pods(tmp_path / "logs", drop_provider_rank=13)
    env.serve("vllm", logs, model=p["model"], revision=p["model_revision"], config=config)
    stage = env.stage("04_serve", tmp_path / "run", model_cache_dir=MODEL_CACHE)
    serve_stage.run(stage)
    stage.finish()
    efa = next(g for g in stage.gates if "efa" in g.gate.lower() and "provider" in g.gate.lower())
    assert efa.status == "FAIL" and "13" in efa.reason
    # a legacy deep_ep.Buffer built on a worker's rank (its guard's line): FAIL, from every log
    logs = compose.compose_vllm_pods(tmp_path / "legacy", sitecustomize_legacy_rank=13,
                                     tag="-sitecustomize-rank13")
    env.serve("vllm", logs, model=p["model"], revision=p["model_revision"], config=config)
    stage = env.stage("04_serve", tmp_path / "run-legacy", model_cache_dir=MODEL_CACHE)
    serve_stage.run(stage)
    stage.finish()
    legacy = next(g for g in stage.gates if g.gate == "vllm_no_fallback_no_legacy_buffer")
    assert legacy.status == "FAIL" and "vllm-1.log" in " ".join(legacy.evidence)


def test_04_a_serve_that_never_comes_up_names_the_first_rank_to_die(env, tmp_path):
    """A vLLM serve whose rank 11 dies in the first all-to-all (an illegal memory access, in
    vLLM's recorded WorkerProc form) while the other 15 print DeepEP's Gin barrier timeout
    (composed, tests/compose.py): never Ready, and the gate 'first rank to fail' names rank 11
    from worker pod vllm-1's log, the 15 timeouts its symptoms; nothing left behind."""
    p = env.stage("04_serve", tmp_path / "probe").params
    config = model_config(RECORDED_RUN / "model_config.json", experts=128, top_k=8)
    env.serve("vllm", compose.compose_vllm_pods(tmp_path / "logs", dead_rank=11),
              model=p["model"], revision=p["model_revision"], config=config, ready=False)
    stage = env.stage("04_serve", tmp_path / "run", model_cache_dir=MODEL_CACHE,
                      server_timeout_s=3.0)
    serve_stage.run(stage)
    stage.finish()
    failed = {g.gate: g for g in stage.gates if g.status == "FAIL"}
    assert set(failed) == {"server ready", triage.GATE_FIRST_RANK}, list(failed)
    first = failed[triage.GATE_FIRST_RANK]
    assert first.reason.startswith("rank 11 (Worker_DP11_EP11) failed first"), first.reason
    assert "vllm-1.log" in first.reason and "15 timeout line(s)" in first.reason
    assert first.observed["symptom_ranks"] == [r for r in range(16) if r != 11]
    assert env.objects_left() == []


def test_an_interrupted_stage_leaves_no_object_behind(env, tmp_path):
    """A stage that stops half-way (an exception after its pods were applied): its clean-up,
    run when the stage closes (or the kernel exits), deletes everything of its run."""
    from lib.places import for_stage

    env.ranks("test-ep-at-128-tokens", compose.compose_test_ep(tmp_path / "logs"),
              pending=True)
    stage = env.stage("03_kernel_test", tmp_path / "run", test_ep_tokens="128")
    place = for_stage(stage)
    from lib.places.kube import manifests

    objects = manifests.rank_objects(**place._where(), name="test-ep-at-128-tokens",
                                     image=place._image(), nodes=2,
                                     argv=lambda n: ["sleep", "600"], env=lambda n: {})
    place.apply(objects, "interrupted")
    assert env.objects_left()  # applied, then the stage is interrupted:
    stage.close_resources()
    assert env.objects_left() == []


def serve_scripts(env, tmp_path, name="vllm", **kw):
    p = env.stage("04_serve", tmp_path / "probe").params
    config = model_config(RECORDED_RUN / "model_config.json", experts=128, top_k=8)
    env.serve(name, compose.compose_vllm_pods(tmp_path / f"logs-{name}"), model=p["model"],
              revision=p["model_revision"], config=config, **kw)


SWEEP = {"concurrency": "1,2,4", "repeats": 1, "request_count": 40, "requests_per_slot": 0,
         "warmup_requests": 4, "warmup_full_batch": False, "output_tokens": 32,
         "model_cache_dir": MODEL_CACHE}


def test_05_aiperf_runs_as_a_job_beside_the_serve_and_its_files_come_back(env, tmp_path):
    """04, then 05 on kube: the serve again, AIPerf as one Job per cell against the leader's
    Service, each Job's export folder back through its log (lib.places.stream) and read by the
    same AIPerf reader as on the local place; vLLM's own token counter read around each cell."""
    from lib.stages import sweep as sweep_stage

    serve_scripts(env, tmp_path, metrics_reads=6)
    env.aiperf_jobs([f"aiperf-vllm-c{c}-r1" for c in (1, 2, 4)],
                    [f"concurrency_{c}" for c in (1, 2, 4)])
    run = tmp_path / "run"
    s04 = env.stage("04_serve", run, model_cache_dir=MODEL_CACHE)
    serve_stage.run(s04)
    s04.finish()
    stage = env.stage("05_sweep", run, **SWEEP)
    data = sweep_stage.run(stage)
    stage.finish()
    got = statuses(stage)
    assert {n: s for n, s in got.items() if s == "FAIL"} == {}, \
        [(g.gate, g.reason) for g in stage.gates if g.status == "FAIL"]
    assert got["aiperf vllm c4 repeat 1: AIPerf exit 0"] == "PASS"
    assert got["aiperf vllm c4 repeat 1: vLLM counted the generated tokens"] == "PASS"
    assert len(data["summary"]) == 3 and list(data["summary"]["requests_completed"]) == [40] * 3
    cell = run / "05_sweep" / "aiperf" / "repeat_1" / "aiperf-vllm-c4"
    assert (cell / "profile_export_aiperf.json").exists()  # came back through the Job's log
    jobs = sorted((run / "05_sweep" / "manifests").glob("aiperf-vllm-c*-r1.yaml"))
    assert len(jobs) == 3
    # each Job ran on the leader's node (the real scheduler honoured its pod affinity), AIPerf
    # reading the tokenizer cache-only at the pinned revision from that node's model cache
    leader_node = json.loads((run / "05_sweep" / "pods" / "vllm-0.status.json").read_text())["node"]
    for path in jobs:
        pod = yaml.safe_load(path.read_text())["spec"]["template"]["spec"]
        script, env_set = pod["containers"][0]["command"][2], pod["containers"][0]["env"]
        assert "HF_HUB_OFFLINE=1 /opt/aiperf/bin/aiperf profile" in script
        assert f"--tokenizer-revision {stage['model_revision']}" in script
        assert {"name": "HF_HOME", "value": manifests.MODEL_CACHE_PATH} in env_set
        assert pod["volumes"][1]["hostPath"]["path"] == MODEL_CACHE
    statuses_of_jobs = sorted((run / "05_sweep" / "pods").glob("aiperf-vllm-c*-r1-*.status.json"))
    assert len(statuses_of_jobs) == 3
    assert {json.loads(p.read_text())["node"] for p in statuses_of_jobs} == {leader_node}
    assert env.objects_left() == []
    replay = env.stage("05_sweep", run, replay=True, **SWEEP)
    sweep_stage.run(replay)
    replay.finish()


def engine_pods(engine: str, logs: Path) -> list[Path]:
    """The pods' logs of an engine's serve: SGLang's composed, TensorRT-LLM's recorded leader
    (R's mpirun output) and its worker's sshd line (composed)."""
    if engine == "sglang":
        return compose.compose_sglang_pods(logs)
    return compose.compose_trtllm_pods(logs)


@pytest.mark.parametrize("engine", ["sglang", "trtllm"])
def test_05_sweeps_the_engine_through_the_same_aiperf_job_and_reader(engine, env, tmp_path):
    """04 then 05 with engine sglang or trtllm on kube: the engine's StatefulSet, AIPerf as a
    Job per cell against its leader's Service with ignore_eos (SGLang takes it,
    entrypoints/openai/protocol.py), the same reader and gates; no /metrics counter gate (that
    one reads vLLM's own counter)."""
    from lib.stages import sweep as sweep_stage

    serve_pods(env, tmp_path, engine, engine_pods(engine, tmp_path / "logs"))
    env.aiperf_jobs([f"aiperf-{engine}-c{c}-r1" for c in (1, 2, 4)],
                    [f"concurrency_{c}" for c in (1, 2, 4)])
    run = tmp_path / "run"
    s04 = env.stage("04_serve", run, model_cache_dir=MODEL_CACHE, engine=engine)
    serve_stage.run(s04)
    s04.finish()
    stage = env.stage("05_sweep", run, engine=engine, **SWEEP)
    data = sweep_stage.run(stage)
    stage.finish()
    got = statuses(stage)
    assert {n: s for n, s in got.items() if s == "FAIL"} == {}, \
        [(g.gate, g.reason) for g in stage.gates if g.status == "FAIL"]
    assert got[f"aiperf {engine} c4 repeat 1: AIPerf exit 0"] == "PASS"
    assert not any("counted the generated tokens" in n for n in got)
    assert list(data["summary"]["requests_completed"]) == [40] * 3
    job = (run / "05_sweep" / "manifests" / f"aiperf-{engine}-c4-r1.yaml").read_text()
    assert "ignore_eos" in job and f"{engine}-http" in job
    title = {"sglang": "SGLang", "trtllm": "TensorRT-LLM"}[engine]
    assert data["title"].startswith(f"{title}, deepep_v2, EP over 16 GPUs")
    assert env.objects_left() == []


def test_06_ep_num_comms_arms_each_a_whole_serve_interleaved_and_answers_checked(env, tmp_path):
    """06 on kube: EP_NUM_COMMS 1 against 8, each arm's StatefulSet recreated whole for its
    block of cells (delete, apply, wait ready), the arms' order reversed on the second repeat,
    each arm asked the fixed prompts before its cells and compared."""
    from lib.stages import lever

    extra = {**SWEEP, "concurrency": "1", "ab_repeats": 2}
    for arm in ("vllm-epnc1-1", "vllm-epnc8-1", "vllm-epnc1-2"):
        serve_scripts(env, tmp_path, name=arm, metrics_reads=4, answers="eager")
    env.aiperf_jobs([f"aiperf-{slug}-c1-r{r}" for r in (1, 2)
                     for slug in ("vllm-epnc1", "vllm-epnc8")], ["concurrency_1"] * 4)
    run = tmp_path / "run"
    s04 = env.stage("04_serve", run, model_cache_dir=MODEL_CACHE)
    serve_scripts(env, tmp_path, answers="eager")
    serve_stage.run(s04)
    s04.finish()
    stage = env.stage("06_multicomm", run, **extra)
    data = lever.run(stage)
    stage.finish()
    got = statuses(stage)
    assert {n: s for n, s in got.items() if s == "FAIL"} == {}, \
        [(g.gate, g.reason) for g in stage.gates if g.status == "FAIL"]
    assert got["EP_NUM_COMMS=8 answers as EP_NUM_COMMS=1"] == "PASS"
    assert [r["n"] for r in data["ratios"]] == [2]
    applied = [e["key"] for e in read_transcript(run / "transcript.jsonl")
               if e["stage"] == "06_multicomm" and e["kind"] == "run" and "apply" in e["key"]
               and any("vllm-epnc" in a and a.endswith(".yaml") and "aiperf" not in a
                       for a in e["key"])]
    order = [Path(next(a for a in k if a.endswith(".yaml"))).stem for k in applied]
    # repeat 1: EPNC 1 then 8; repeat 2 reversed: 8's server (adjacent blocks) goes on, then
    # EPNC 1 is served anew
    assert order == ["vllm-epnc1-1", "vllm-epnc8-1", "vllm-epnc1-2"]
    assert env.objects_left() == []


def test_02_checks_the_image_it_is_given_with_its_verify_script_on_a_node(env, tmp_path):
    from lib.stages import image

    env.verify(failed=("plugin present",))
    stage = env.stage("02_image", tmp_path / "run")
    image.run(stage)
    stage.finish()
    got = {g.gate: g for g in stage.gates}
    assert got["docker build"].status == "SKIP" and "runs the image it is given" in \
        got["docker build"].reason
    verify = got["verify-image.sh in the image"]
    assert verify.status == "FAIL" and "1 of" in verify.observed and "on node p5en-" in \
        verify.reason
    assert got["hadolint clean on the Dockerfile"].status == "PASS"  # the lint runs here
    assert env.objects_left() == []


def test_04_as_typed_with_a_kube_profile_serves_on_the_control_plane(env, tmp_path,
                                                                      monkeypatch):
    """`papermill notebooks/04_serve.ipynb out.ipynb -p nodes 2`, the guide's headline command,
    after `python -m lib.runner profile --context kube ...` once: the notebook takes the
    cluster's context, namespace, image and model cache from the profile (lib.stages.profile)."""
    import subprocess
    import sys

    from lib import runner
    from lib.core.door import REPO_ROOT
    from lib.stages import profile
    from tests.kube_env import IMAGE

    serve_pods(env, tmp_path, "vllm", compose.compose_vllm_pods(tmp_path / "logs"))
    monkeypatch.setenv(profile.PROFILE_ENV, str(tmp_path / "profile.yaml"))
    assert runner.main(["profile", "--context", "kube", "-p", "namespace", env.namespace,
                        "-p", "image", IMAGE, "-p", "model_cache_dir", MODEL_CACHE,
                        "-p", "schedule_timeout_s", "20", "-p", "server_timeout_s", "60"]) == 0
    results = tmp_path / "results"
    typed = [sys.executable, "-m", "papermill", str(REPO_ROOT / "notebooks" / "04_serve.ipynb"),
             str(tmp_path / "out.ipynb"), "-p", "nodes", "2",
             # where the test keeps its run (a person's lands in results/)
             "-p", "results_dir", str(results), "-p", "run_id", "typed"]
    done = subprocess.run(typed, capture_output=True, text=True, timeout=600,
                          cwd=REPO_ROOT / "notebooks")
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads((results / "typed" / "run.json").read_text())
    assert record["context"] == "kube" and record["parameters"]["namespace"] == env.namespace
    assert record["profile"]["values"]["image"] == IMAGE
    gates = json.loads((results / "typed" / "04_serve" / "gates.json").read_text())
    assert {g["gate"]: g["status"] for g in gates if g["status"] != "PASS"} == {}
    assert any(g["gate"] == "vllm_all2all_manager" for g in gates)
    assert env.objects_left() == []
