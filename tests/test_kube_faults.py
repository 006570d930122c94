"""A cluster's bad day on the real control plane (tests/kubeplane.py: kube-apiserver, scheduler
and controllers 1.20.2): each fault a p5en user meets, made to happen by the kubelet double
(tests/kubelet_double.py: a pod status in the kubelet's own form) or by the plane itself (its
API server stopped and started, its admission), and the stage's answer: a FAIL gate naming the
pod, the node and the reason, nothing of the run left behind, gates.json written.
"""
from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path

import pytest

try:
    from kubeplane import NOT_BUILT, plane_available
except ImportError:
    from tests.kubeplane import NOT_BUILT, plane_available

from lib.core.door import read_transcript
from lib.core.errors import StageRefused
from lib.core.stage import REFUSED_GATE
from lib.measure import triage
from lib.places.kube import manifests
from lib.stages import cluster as cluster_stage, kernel, serve as serve_stage
from tests import compose
from tests import kubelet_double as kubelet
from tests.kube_env import (IMAGE, IMAGE_ID, MODEL_CACHE, NODES, RECORDED_RUN, KubeEnv,
                            image_cannot_be_pulled, model_config, on_request)
from tests.kubelet_double import Container, Script

pytestmark = pytest.mark.skipif(not plane_available(), reason=NOT_BUILT)

HELD = "every pod held through the serve"


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    with KubeEnv(tmp_path_factory.mktemp("kube-faults")) as cluster_env:
        yield cluster_env


def fails(stage) -> dict[str, str]:
    return {g.gate: g.reason for g in stage.gates if g.status == "FAIL"}


def serve_vllm(env, tmp_path, **kw) -> None:
    """The StatefulSet vllm's two pods as test_kube_stages serves them (recorded vLLM logs and
    answers), the leader's /v1/models request able to carry a fault."""
    p = env.stage("04_serve", tmp_path / "probe").params
    config = model_config(RECORDED_RUN / "model_config.json", experts=128, top_k=8)
    env.serve("vllm", compose.compose_vllm_pods(tmp_path / "logs"), model=p["model"],
              revision=p["model_revision"], config=config, **kw)


def run_04(env, run: Path, **given):
    stage = env.stage("04_serve", run, model_cache_dir=MODEL_CACHE, **given)
    serve_stage.run(stage)
    stage.finish()
    return stage


def sealed(run: Path, stage_name: str) -> None:
    """The evidence complete: gates.json written for the stage."""
    assert (run / stage_name / "gates.json").exists()


def test_an_image_that_cannot_be_pulled_fails_at_once_quoting_the_registry(env, tmp_path):
    """ErrImagePull with containerd's NotFound message (then ImagePullBackOff): the wait stops
    on its first look at it, long before its schedule timeout, and the FAIL names each pod, its
    node and the kubelet's message."""
    serve_vllm(env, tmp_path)
    # ErrImagePull held 90 s before the BackOff: on a busy machine the first look at the pods can
    # come after 10 s (seen once), and this test is about the registry's message; the timeouts
    # far above the bound on `took`, so a slow machine is never mistaken for a wait to its end
    message = image_cannot_be_pulled(env, "vllm-*", IMAGE, backoff_after=90.0)
    run = tmp_path / "run"
    started = time.monotonic()
    stage = run_04(env, run, schedule_timeout_s=240, server_timeout_s=480)
    took = time.monotonic() - started
    failed = fails(stage)
    assert list(failed) == ["server ready"], failed
    reason = failed["server ready"]
    # the wait stops at the first stuck pod it sees: vllm-1's may not be posted yet then (seen
    # once in a full run), so every pod named is named with its node, and at least one is
    named = re.findall(rf"pod (vllm-[01]) on node ({'|'.join(NODES)}): ErrImagePull: ", reason)
    assert named, reason
    assert message in reason and "code = NotFound" in reason
    assert took < 120, took  # not at the 240 s schedule timeout, nor the 480 s server timeout
    sealed(run, "04_serve")
    assert env.objects_left() == []


def test_03_s_rank_pods_whose_image_cannot_be_pulled_fail_as_not_started_quoting_the_kubelet(
        env, tmp_path):
    """The same fault under 03's rank pods: scheduled, so the FAIL says 'pods started' and
    quotes the kubelet's waiting reason with the registry's message (never 'the scheduler'),
    at the first look, and the job's objects are deleted."""
    message = image_cannot_be_pulled(env, "test-ep-at-128-tokens-*", IMAGE, backoff_after=90.0)
    run = tmp_path / "run"
    stage = env.stage("03_kernel_test", run, test_ep_tokens="128", schedule_timeout_s=240)
    started = time.monotonic()
    kernel.run(stage)
    stage.finish()
    took = time.monotonic() - started
    failed = fails(stage)
    (gate_name,) = [g for g in failed if g.endswith("test_ep at 128 tokens: pods started")]
    assert failed[gate_name].startswith("the kubelet: pod test-ep-at-128-tokens-"), failed
    assert "ErrImagePull: " in failed[gate_name] and message in failed[gate_name]
    assert not [g for g in failed if g.endswith("pods scheduled")]
    assert took < 120, took  # not at the 240 s schedule timeout
    sealed(run, "03_kernel_test")
    assert env.objects_left() == []


def fault_mid_serve(env, tmp_path, fault) -> tuple:
    """04 with vLLM's pods: the fault done to pod vllm-1 as the leader is asked /v1/models
    (after every pod was Ready); the finished stage and vllm-1's node."""
    serve_vllm(env, tmp_path)
    where = {}

    def strike():
        where["node"] = env.double.find(env.namespace, "vllm-1").node
        fault("vllm-1")

    on_request(env, "vllm", "/v1/models", strike)
    run = tmp_path / "run"
    stage = run_04(env, run)
    sealed(run, "04_serve")
    return stage, where["node"]


def test_a_container_oomkilled_mid_serve_fails_naming_pod_node_and_exit(env, tmp_path):
    """The kernel's OOM killer ends vLLM in pod vllm-1 after the serve was ready: the kubelet
    restarts it (a StatefulSet's restartPolicy Always), the exit in lastState. The serve's
    last look FAILs naming pod, node and 'OOMKilled (exit 137)'."""
    stage, node = fault_mid_serve(env, tmp_path, lambda pod: kubelet.end_now(
        env.double, env.namespace, pod, exit_code=137, reason="OOMKilled", restarted=True))
    failed = fails(stage)
    assert list(failed) == [HELD], failed
    assert f"pod vllm-1 on node {node}: OOMKilled (exit 137), restarted 1 time(s); now " \
           "CrashLoopBackOff" in failed[HELD]
    assert "vllm-0" not in failed[HELD]  # the leader held
    assert env.objects_left() == []


def test_a_pod_evicted_mid_serve_fails_quoting_the_kubelet(env, tmp_path):
    """The node's memory pressure: the kubelet evicts vllm-1 (phase Failed, reason Evicted, its
    eviction message, its Evicted event); the real StatefulSet controller then deletes the
    Failed pod and makes it anew (measured: by the serve's last look it has). The FAIL names the
    first pod's node and quotes the eviction message, read from the kubelet's event."""
    said = {}

    def evict(pod):
        said["message"] = kubelet.evict(env.double, env.namespace, pod, usage="2013265920Ki",
                                        request="1800Gi")

    stage, node = fault_mid_serve(env, tmp_path, evict)
    failed = fails(stage)
    assert list(failed) == [HELD], failed
    assert f"pod vllm-1 on node {node}: Evicted: The node was low on resource: memory. " \
           "Container vllm was using 2013265920Ki, which exceeds its request of 1800Gi." \
           in failed[HELD]
    assert "(the pod replaced by its controller)" in failed[HELD]
    assert said["message"].startswith("The node was low on resource: memory. ")
    assert env.objects_left() == []


def test_a_node_gone_notready_mid_serve_fails_naming_the_node_and_its_condition(env, tmp_path):
    """vllm-1's node stops posting status while 04 runs: its Ready condition Unknown with
    NodeStatusUnknown (as the node lifecycle controller writes it), its pods not Ready. The
    FAIL names the pod, the node and the condition. Measured here: the plane runs without the
    node lifecycle controller (tests/kubeplane.py), so nothing evicts the pods (they are still
    bound and Running when the stage looks); on a real cluster its taint manager deletes them
    after their tolerationSeconds (300 s by default), far past this stage's look."""
    lost = {}

    def lose(pod):
        lost["node"] = env.double.find(env.namespace, pod).node
        kubelet.lose_node(env.double, lost["node"])

    try:
        stage, node = fault_mid_serve(env, tmp_path, lose)
    finally:
        if "node" in lost:
            kubelet.restore_node(env.double, lost["node"])
    failed = fails(stage)
    assert list(failed) == [HELD], failed
    assert (f"pod vllm-1 on node {node}: not Ready; node {node} Ready=Unknown "
            "(NodeStatusUnknown: Kubelet stopped posting node status.)") in failed[HELD]
    held = next(g for g in stage.gates if g.gate == HELD)
    assert held.observed == {"vllm-0": "Running", "vllm-1": "Running"}  # not evicted
    assert env.objects_left() == []


def kubectl_runs(run: Path, verb: str) -> list[dict]:
    return [e for e in read_transcript(run / "transcript.jsonl")
            if e["kind"] == "run" and e["key"][0] == "kubectl" and verb in e["key"]]


def looks_at_pods(run: Path, stage_name: str) -> list[dict]:
    """What each of the stage's looks at its pods (`kubectl get pods -l ...`) read, up to its
    first log read (the FAIL's own): per look, each pod's restart count."""
    looks = []
    for entry in read_transcript(run / "transcript.jsonl"):
        if entry["stage"] != stage_name or entry["kind"] != "run" or entry["key"][0] != "kubectl":
            continue
        if "logs" in entry["key"]:
            break
        if {"get", "pods", "-l"} <= set(entry["key"]) and entry["rc"] == 0:
            pods = json.loads((run / entry["stdout"]).read_text())["items"]
            looks.append({pod["metadata"]["name"]: sum(
                c.get("restartCount", 0) for c in pod["status"].get("containerStatuses", []))
                for pod in pods})
    return looks


def stderr_of(run: Path, entry: dict) -> str:
    return (run / entry["stderr"]).read_text() if entry.get("stderr") else ""


def restart_when(plane, ready, down_s: float = 2.0) -> tuple[threading.Thread, dict]:
    """A thread that restarts the plane's real kube-apiserver (down `down_s`) once `ready()`."""
    took = {}

    def restart():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not ready():
            time.sleep(0.2)
        took.update(plane.restart_apiserver(down_s=down_s))

    thread = threading.Thread(target=restart, daemon=True)
    thread.start()
    return thread, took


def test_the_api_server_restarting_while_a_stage_waits_is_retried_within_its_deadline(
        env, tmp_path):
    """The real kube-apiserver stopped and started again while 03 waits on its pods: each look
    that met a refused connection was tried again (each try in the transcript, kubectl's own
    "connection ... refused" in its stderr), the pods' end seen once it was back; applied once;
    every gate PASSes."""
    name = "test-ep-at-128-tokens"
    # each rank runs 15 s, as a job's ranks wait on one another: the restart holds the double's
    # status posts for seconds, and with 0.5 s one rank was seen started after the other had
    # finished (the distinct-nodes gate FAILed it: a real rank never finishes alone)
    for rank, log in enumerate(compose.compose_test_ep(tmp_path / "logs")):
        env.double.add_script(Script(f"{name}-{rank}", {
            "*": Container(log=log, exit_code=0, image_id=IMAGE_ID)},
            running_after=5.0, exit_after=15.0, pod_ips="10.244.0.0/16"))
    plane = env.plane
    thread, took = restart_when(plane, lambda: bool(env.objects_left()))
    run = tmp_path / "run"
    try:
        stage = env.stage("03_kernel_test", run, test_ep_tokens="128")
        kernel.run(stage)
        stage.finish()
    finally:
        thread.join(timeout=90)
        if not plane.is_running():
            plane.start_apiserver()
    assert took["start_s"] > 0  # it was restarted, during the wait
    assert fails(stage) == {}, fails(stage)
    looks = [e for e in kubectl_runs(run, "pods") if "get" in e["key"]]
    refused = [e for e in looks if e["rc"] != 0]
    assert refused and all("was refused - did you specify the right host or port?"
                           in stderr_of(run, e) for e in refused)
    assert looks[-1]["rc"] == 0
    assert [e["rc"] for e in kubectl_runs(run, "apply")] == [0]  # applied once
    sealed(run, "03_kernel_test")
    assert env.objects_left() == []


def test_an_apply_whose_answer_was_lost_is_looked_for_not_applied_twice(env, tmp_path):
    """lib.places.kube.retry.apply_landed against the real plane: the file's objects are there
    (an apply that landed), the API server is down when it is applied again; the refused apply
    is followed by `kubectl get -f` (tried until the API server is back), which finds every
    object: not applied a second time."""
    from lib.core.door import Door
    from lib.places.kube.retry import apply_landed

    service = {"apiVersion": "v1", "kind": "Service",
               "metadata": {"name": "landed", "namespace": env.namespace,
                            "labels": {manifests.RUN_LABEL: "run-landed"}},
               "spec": {"clusterIP": "None", "selector": {"app": "landed"},
                        "ports": [{"port": 80}]}}
    path = tmp_path / "landed.yaml"
    path.write_text(manifests.to_yaml([service]))
    env.plane.apply(service)  # it landed
    run = tmp_path / "run"
    door = Door(run, "fault")
    base = ["kubectl", "--namespace", env.namespace]
    env.plane.stop_apiserver()
    thread = threading.Thread(target=lambda: (time.sleep(2.0), env.plane.start_apiserver()),
                              daemon=True)
    thread.start()
    try:
        got = apply_landed(door, [*base, "apply", "-f", str(path)],
                           [*base, "get", "-f", str(path), "-o", "json", "--ignore-not-found"],
                           1, timeout=30)
    finally:
        thread.join(timeout=60)
        if not env.plane.is_running():
            env.plane.start_apiserver()
        env.plane.kubectl("delete", "service", "landed", "-n", env.namespace,
                          "--ignore-not-found")
    assert got.ok and "get" in got.argv
    calls = [e for e in read_transcript(run / "transcript.jsonl") if e["kind"] == "run"]
    verbs = [e["key"][3] for e in calls]
    assert verbs[0] == "apply" and calls[0]["rc"] != 0
    assert verbs.count("apply") == 1 and set(verbs[1:]) == {"get"}  # looked for, not re-applied
    assert calls[-1]["rc"] == 0


RESTRICTED_PSP = {
    "apiVersion": "policy/v1beta1", "kind": "PodSecurityPolicy",
    "metadata": {"name": "guide-test-restricted"},
    "spec": {"privileged": False, "allowPrivilegeEscalation": False,
             "runAsUser": {"rule": "RunAsAny"}, "seLinux": {"rule": "RunAsAny"},
             "supplementalGroups": {"rule": "RunAsAny"}, "fsGroup": {"rule": "RunAsAny"},
             "volumes": ["*"]}}


def test_a_namespace_without_privileged_pods_is_refused_by_admission_quoted(env, tmp_path):
    """The API server restarted with the PodSecurityPolicy admission plugin (1.20 has
    policy/v1beta1 PSP; the PodSecurity admission came in 1.22) and one policy, which forbids
    privileged containers: 03's rank pods (privileged for gdrcopy, their reason beside it) are
    refused at their apply, and the FAIL quotes the admission's words naming the pod."""
    plane = env.plane
    plane.restart_apiserver(extra_flags=["--enable-admission-plugins=PodSecurityPolicy"])
    try:
        plane.apply(RESTRICTED_PSP)
        env.ranks("test-ep-at-128-tokens", compose.compose_test_ep(tmp_path / "logs"))
        run = tmp_path / "run"
        stage = env.stage("03_kernel_test", run, test_ep_tokens="128")
        kernel.run(stage)
        with pytest.raises(StageRefused):
            stage.finish()
    finally:
        plane.kubectl("delete", "podsecuritypolicy", RESTRICTED_PSP["metadata"]["name"],
                      "--ignore-not-found")
        plane.restart_apiserver()
    failed = fails(stage)
    assert list(failed) == [REFUSED_GATE], failed
    reason = failed[REFUSED_GATE]
    assert re.search(r'pods "test-ep-at-128-tokens-\d" is forbidden: PodSecurityPolicy: unable '
                     r"to admit pod: \[.*Privileged containers are not allowed", reason), reason
    sealed(run, "03_kernel_test")
    assert env.objects_left() == []


def test_a_serve_whose_pods_admission_refuses_fails_at_once_quoting_the_controller(env, tmp_path):
    """The same restricted namespace under 04: kubectl apply stores the StatefulSet (admission
    judges pods, not their controllers), then the StatefulSet controller's every try to create
    vllm-0 and vllm-1 is refused. The wait reads the controller's FailedCreate events (of this
    StatefulSet's uid) and FAILs 'server ready' quoting them, long before its timeouts; nothing
    is left behind."""
    plane = env.plane
    plane.restart_apiserver(extra_flags=["--enable-admission-plugins=PodSecurityPolicy"])
    try:
        plane.apply(RESTRICTED_PSP)
        serve_vllm(env, tmp_path)
        run = tmp_path / "run"
        started = time.monotonic()
        stage = run_04(env, run, schedule_timeout_s=300, server_timeout_s=600)
        took = time.monotonic() - started
    finally:
        plane.kubectl("delete", "podsecuritypolicy", RESTRICTED_PSP["metadata"]["name"],
                      "--ignore-not-found")
        plane.restart_apiserver()
    failed = fails(stage)
    assert list(failed) == ["server ready"], failed
    reason = failed["server ready"]
    assert reason.startswith("the StatefulSet controller: create Pod vllm-"), reason
    assert re.search(r'pods "vllm-[01]" is forbidden: PodSecurityPolicy: unable to admit pod: '
                     r"\[.*Privileged containers are not allowed", reason), reason
    gate_row = next(g for g in stage.gates if g.gate == "server ready")
    assert (gate_row.observed, gate_row.expected) == ("no pod", "every pod created")
    assert took < 150, took  # not at the 300 s schedule timeout, nor the 600 s server timeout
    sealed(run, "04_serve")
    assert env.objects_left() == []


def rank_objects(env, stage, name: str) -> tuple:
    from lib.places import for_stage

    place = for_stage(stage)
    return place, manifests.rank_objects(**place._where(), name=name, image=place._image(),
                                         nodes=2, argv=lambda n: ["sleep", "600"],
                                         env=lambda n: {})


def runs_of_objects(env) -> dict[str, str]:
    got = env.plane.get_json("pods,services", "-n", env.namespace)
    return {f"{o['kind']}/{o['metadata']['name']}": o["metadata"]["labels"][manifests.RUN_LABEL]
            for o in got["items"]}


def test_two_runs_in_one_namespace_neither_takes_over_nor_deletes_the_other_s_objects(
        env, tmp_path):
    """Run A's pods (Pending) in the namespace; run B's 03 would apply objects of the same
    names: refused, naming A's objects and its run, nothing of A changed; B's clean-up deletes
    by B's run label, so A's objects stay. Then B's objects of other names beside A's: B's
    clean-up deletes its own only; A's clean-up its own; nothing left."""
    env.ranks("test-ep-at-128-tokens", compose.compose_test_ep(tmp_path / "logs"), pending=True)
    stage_a = env.stage("03_kernel_test", tmp_path / "run-a", test_ep_tokens="128")
    place_a, objects = rank_objects(env, stage_a, "test-ep-at-128-tokens")
    place_a.apply(objects, "test-ep-at-128-tokens")
    a_objects = runs_of_objects(env)
    assert set(a_objects.values()) == {"run-a"} and len(a_objects) == 3  # 2 pods, 1 Service

    run_b = tmp_path / "run-b"
    stage_b = env.stage("03_kernel_test", run_b, test_ep_tokens="128")
    kernel.run(stage_b)
    with pytest.raises(StageRefused):
        stage_b.finish()  # its clean-up (run-b's labels) has run
    reason = fails(stage_b)[REFUSED_GATE]
    assert "Pod/test-ep-at-128-tokens-0 (run run-a)" in reason and "of another run" in reason
    assert kubectl_runs(run_b, "apply") == []  # refused before any apply
    assert runs_of_objects(env) == a_objects  # A's objects as A applied them
    sealed(run_b, "03_kernel_test")

    stage_c = env.stage("03_kernel_test", tmp_path / "run-c", test_ep_tokens="128")
    place_c, others = rank_objects(env, stage_c, "other-ranks")
    place_c.apply(others, "other-ranks")
    both = runs_of_objects(env)
    assert set(both.values()) == {"run-a", "run-c"} and len(both) == 6
    stage_c.close_resources()  # C's clean-up: by C's run and stage labels
    assert runs_of_objects(env) == a_objects
    stage_a.close_resources()
    assert env.objects_left() == []


def test_00_fails_a_node_its_pods_cannot_use_naming_the_node(env, tmp_path):
    """Issue 43: a node tainted NoSchedule with a taint the guide's pods do not tolerate, and a
    node whose allocatable vpc.amazonaws.com/efa is 0 (the EFA device plugin not running) and
    whose allocatable 2 MiB huge pages are fewer than a pod asks, each FAIL 00 naming the node
    and the fact, although their probes see every device and page; so does a
    node whose kubelet reports disk pressure (the kubelet's own reason and message:
    kubernetes pkg/kubelet/nodestatus/setters.go)."""
    a, b = NODES
    api = env.double._api
    api.patch(f"/api/v1/nodes/{a}/status", {"status": {"allocatable": {
        manifests.EFA_RESOURCE: "0", manifests.HUGEPAGES_RESOURCE: "2Gi"}}}, kind="strategic")
    pressure = {"type": "DiskPressure", "reason": "KubeletHasDiskPressure",
                "message": "kubelet has disk pressure"}
    api.patch(f"/api/v1/nodes/{b}/status", {"status": {"conditions": [
        {**pressure, "status": "True"}]}}, kind="strategic")
    api.patch(f"/api/v1/nodes/{b}", {"spec": {"taints": [
        {"key": "example.com/maintenance", "value": "true", "effect": "NoSchedule"},
        {"key": manifests.GPU_RESOURCE, "effect": "NoSchedule"},  # the guide tolerates this one
        {"key": "example.com/soon", "effect": "PreferNoSchedule"}]}}, kind="merge")
    try:
        env.probes()
        run = tmp_path / "run"
        stage = env.stage("00_cluster", run)
        cluster_stage.run(stage)
        stage.finish()
    finally:
        api.patch(f"/api/v1/nodes/{b}", {"spec": {"taints": None}}, kind="merge")
        api.patch(f"/api/v1/nodes/{a}/status", {"status": {"allocatable": {
            manifests.EFA_RESOURCE: "16", manifests.HUGEPAGES_RESOURCE: "5120Mi"}}},
            kind="strategic")
        api.patch(f"/api/v1/nodes/{b}/status", {"status": {"conditions": [
            {**pressure, "status": "False", "reason": "KubeletHasNoDiskPressure",
             "message": "kubelet has no disk pressure"}]}}, kind="strategic")
    failed = fails(stage)
    assert set(failed) == {f"{a}: EFA devices allocatable", f"{a}: hugepages-2Mi allocatable",
                           f"{b}: taints the guide's pods tolerate",
                           f"{b}: Ready, no pressure"}, failed
    assert failed[f"{b}: Ready, no pressure"].startswith(
        "the kubelet reports: DiskPressure=True: KubeletHasDiskPressure: kubelet has disk pressure")
    assert "0: the EFA device plugin is not running on the node" in failed[
        f"{a}: EFA devices allocatable"]
    assert failed[f"{a}: hugepages-2Mi allocatable"] == (
        "2 MiB huge pages the node offers its pods (allocatable); every rank and serve pod asks "
        "5120 MiB")
    assert failed[f"{b}: taints the guide's pods tolerate"].endswith(
        "places none on the node: example.com/maintenance=true:NoSchedule")
    passed = {g.gate for g in stage.gates if g.status == "PASS"}
    assert {f"{a}: EFA devices", f"{b}: EFA devices allocatable",
            f"{a}: taints the guide's pods tolerate", f"{a}: Ready, no pressure",
            f"{b}: hugepages-2Mi allocatable"} <= passed
    sealed(run, "00_cluster")
    assert env.objects_left() == []


def test_a_serve_pod_restarted_before_ready_fails_04_at_once_naming_node_and_reason(env,
                                                                                     tmp_path):
    """Issue 43: one node's serve pod exits 1 before the serve is ready (a gated model's 401,
    say) and its StatefulSet's restartPolicy restarts it (CrashLoopBackOff next): 04 FAILs
    within two polls of the restart, naming the pod, its node and the exit, not at
    server_timeout_s (120 s here)."""
    from lib.places.kube.pods import POLL_S

    p = env.stage("04_serve", tmp_path / "probe").params
    config = model_config(RECORDED_RUN / "model_config.json", experts=128, top_k=8)
    env.serve("vllm", compose.compose_vllm_pods(tmp_path / "logs"), model=p["model"],
              revision=p["model_revision"], config=config, ready=False)
    got: dict = {}
    worker = threading.Thread(target=lambda: got.update(stage=run_04(
        env, tmp_path / "run", server_timeout_s=120)), daemon=True)
    worker.start()
    deadline = time.monotonic() + 60
    while True:
        pod = env.double.find(env.namespace, "vllm-1")
        if pod is not None and pod.phase == "Running":
            break
        assert time.monotonic() < deadline, "vllm-1 never ran"
        time.sleep(0.1)
    node = pod.node
    kubelet.end_now(env.double, env.namespace, "vllm-1", exit_code=1, reason="Error",
                    restarted=True)
    struck = time.monotonic()
    worker.join(120)
    assert not worker.is_alive()
    # the wait ends at the first look that reads the restart, in the transcript's own looks (a
    # loaded machine stretches a poll, never adds one), the look after the one before the
    # restart (a poll apart: POLL_S); then the logs kept and the objects deleted, far from the
    # 120 s of server_timeout_s
    looks = looks_at_pods(tmp_path / "run", "04_serve")
    assert looks[-1]["vllm-1"] == 1 and all(look.get("vllm-1", 0) == 0 for look in looks[:-1])
    assert time.monotonic() - struck < 120 - 2 * POLL_S
    failed = fails(got["stage"])
    assert f"pod vllm-1 on node {node}: Error (exit 1), restarted 1 time(s); now " \
           "CrashLoopBackOff" in failed["server ready"], failed
    sealed(tmp_path / "run", "04_serve")
    assert env.objects_left() == []


def test_a_rank_pod_that_exits_non_zero_ends_the_job_at_once_its_peer_stopped(env, tmp_path):
    """Issue 43: node 0's rank pod exits 1 while node 1's still runs (it would wait on its dead
    peer in NCCL's init until the job's timeout, 300 s here): the wait ends at the next poll,
    the peer is stopped and said so (not "timed out"), the first rank to die is named, nothing
    is left behind."""
    logs = compose.compose_test_ep_failure(tmp_path / "logs", dead_rank=3)
    name = "test-ep-at-128-tokens"
    for rank, (log, code, exits) in enumerate(zip(logs, (1, 0), (0.5, None))):
        env.double.add_script(Script(f"{name}-{rank}", {
            "*": Container(log=log, exit_code=code, image_id=IMAGE_ID)},
            running_after=0.1, exit_after=exits, pod_ips="10.244.0.0/16"))
    stage = env.stage("03_kernel_test", tmp_path / "run", test_ep_tokens="128",
                      job_timeout_s=300)
    started = time.monotonic()
    kernel.run(stage)
    stage.finish()
    assert time.monotonic() - started < 150  # not the 300 s of job_timeout_s
    failed = fails(stage)
    first = next(reason for gate, reason in failed.items()
                 if gate.endswith(triage.GATE_FIRST_RANK))
    assert first.startswith("rank 3 failed first"), failed
    stopped = json.dumps(failed)
    assert "stopped when rank 0 exited 1" in stopped and "timed out" not in stopped, failed
    sealed(tmp_path / "run", "03_kernel_test")
    assert env.objects_left() == []


def scheduler_sees_cordoned(env, node: str, timeout_s: float = 60.0) -> None:
    """Until the real scheduler's cache holds `node` cordoned (its informer can lag the API
    server: under make test's load a rank pod was once placed on the node just cordoned): a
    pod that fits only that node (node affinity on its name) is reported Unschedulable, saying
    so; a probe placed there (not seen yet) is deleted and asked again."""
    probe = {"apiVersion": "v1", "kind": "Pod",
             "metadata": {"name": "cordon-probe", "namespace": env.namespace},
             "spec": {"containers": [{"name": "probe", "image": IMAGE}],
                      "affinity": {"nodeAffinity": {
                          "requiredDuringSchedulingIgnoredDuringExecution": {
                              "nodeSelectorTerms": [{"matchFields": [{
                                  "key": "metadata.name", "operator": "In",
                                  "values": [node]}]}]}}}}}
    deadline = time.monotonic() + timeout_s
    try:
        env.plane.apply(probe)
        while True:
            pod = env.plane.get_json("pod", "cordon-probe", "-n", env.namespace)
            said = [c.get("message", "") for c in pod["status"].get("conditions", [])
                    if c["type"] == "PodScheduled" and c["status"] == "False"]
            if any("unschedulable" in message for message in said):
                return
            assert time.monotonic() < deadline, f"the scheduler never saw {node} cordoned"
            if pod["spec"].get("nodeName"):  # placed before the cordon reached the scheduler
                env.plane.kubectl("delete", "pod", "cordon-probe", "-n", env.namespace,
                                  "--grace-period=0", "--force", "--wait=true")
                env.plane.apply(probe)
            time.sleep(0.2)
    finally:
        env.plane.kubectl("delete", "pod", "cordon-probe", "-n", env.namespace,
                          "--grace-period=0", "--force", "--ignore-not-found", "--wait=true")


def test_two_node_ranks_placed_on_one_node_fail_03_naming_the_node(env, tmp_path):
    """Issue 43: one node cordoned (unschedulable), so the scheduler places both rank pods of
    test_ep on the other: each rank passes on its own, but the job measured one node's links,
    not EFA between nodes: the gate that node ranks ran on distinct nodes FAILs naming it."""
    a, b = NODES
    api = env.double._api
    api.patch(f"/api/v1/nodes/{b}", {"spec": {"unschedulable": True}}, kind="merge")
    try:
        scheduler_sees_cordoned(env, b)
        env.ranks("test-ep-at-128-tokens", compose.compose_test_ep(tmp_path / "logs"))
        stage = env.stage("03_kernel_test", tmp_path / "run", test_ep_tokens="128")
        kernel.run(stage)
        stage.finish()
    finally:
        api.patch(f"/api/v1/nodes/{b}", {"spec": {"unschedulable": None}}, kind="merge")
    failed = fails(stage)
    apart = failed["test_ep at 128 tokens: node ranks on distinct nodes, together"]
    assert apart.startswith(f"ranks 0, 1 all ran on node {a}"), failed
    sealed(tmp_path / "run", "03_kernel_test")
    assert env.objects_left() == []
