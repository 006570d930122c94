"""The test cluster itself: a real control plane (etcd, kube-apiserver, scheduler, controllers
1.20.2) driven by the real kubectl, with the kubelet double as the only simulated part.

Skipped, with the reason, only when the binaries are not built (scripts/kube-plane.sh build).
One plane for the module; the last test stops it and checks nothing is left behind."""
from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest

from kubelet_double import Container, Exec, KubeletDouble, Script
from kubeplane import KubePlane, NOT_BUILT, REPO, pid_alive, plane_available, port_open, wait_until

pytestmark = pytest.mark.skipif(not plane_available(), reason=NOT_BUILT)

# A recorded log: a real vLLM server log from two H200s (shared fixtures), or one of the
# repository's recorded runs. Read as bytes, never copied.
LOG_CANDIDATES = [REPO.parent / "shared" / "fixtures" / "vllm-0.24.0-2xh200" / "vllm-deepep_v2-run2.log",
                  *sorted(REPO.glob("results/*/04_serve/server.log"))]
RECORDED_LOG = next((p for p in LOG_CANDIDATES if p.is_file()), None)
IMAGE_ID = "docker-pullable://vllm/vllm-openai@sha256:" + "5e" * 32
NODES = ("p5en-a", "p5en-b")
GPU_LIST = "".join(f"GPU {i}: NVIDIA H200 (UUID: GPU-0000000{i})\n" for i in range(8))


def gpu_container(name: str, gpus: int | str, limit: int | str | None = None, **extra) -> dict:
    limit = gpus if limit is None else limit
    return {"name": name, "image": "vllm/vllm-openai:v0.24.0", "command": ["vllm", "serve"],
            "resources": {"requests": {"nvidia.com/gpu": str(gpus), "cpu": "1"},
                          "limits": {"nvidia.com/gpu": str(limit)}}, **extra}


def pod_manifest(name: str, container: dict) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"restartPolicy": "Never", "containers": [container]}}


def job_manifest(name: str) -> dict:
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name},
            "spec": {"backoffLimit": 0, "template": {"spec": {
                "restartPolicy": "Never",
                "containers": [{"name": "bench", "image": "busybox:1.36", "command": ["run-bench"],
                                "resources": {"requests": {"cpu": "1"}}}]}}}}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if RECORDED_LOG is None:
        pytest.skip(f"no recorded log to serve: neither {LOG_CANDIDATES[0]} nor results/*/04_serve/server.log")
    wd = tmp_path_factory.mktemp("kubeplane")
    plane = KubePlane()
    double = None
    try:
        plane.start(wd)
        double = KubeletDouble(plane).start()
        for n in NODES:
            double.add_node(n)
        yield plane, double
    finally:
        if double is not None:
            double.stop()
        plane.stop()


def wait_pods(plane: KubePlane, selector: str, count: int, timeout: float = 30) -> list[dict]:
    def probe():
        items = plane.get_json("pods", "-l", selector)["items"]
        return len(items) == count, [(p["metadata"]["name"], p["status"].get("phase")) for p in items]

    wait_until(f"{count} pods with {selector}", probe, timeout)
    return plane.get_json("pods", "-l", selector)["items"]


def test_plane_serves_two_p5en_nodes_with_gpus_and_efa(cluster):
    plane, _ = cluster
    assert plane.started_in is not None and plane.started_in < 60
    nodes = {n["metadata"]["name"]: n for n in plane.get_json("nodes")["items"]}
    assert sorted(nodes) == sorted(NODES)
    for name, node in nodes.items():
        labels, status = node["metadata"]["labels"], node["status"]
        assert labels["node.kubernetes.io/instance-type"] == "p5en.48xlarge"
        assert labels["kubernetes.io/hostname"] == name
        for key in ("capacity", "allocatable"):
            assert status[key]["nvidia.com/gpu"] == "8" and status[key]["vpc.amazonaws.com/efa"] == "16"
            assert status[key]["hugepages-2Mi"] == "5Gi"  # 5120Mi, in canonical form
        assert {c["type"]: c["status"] for c in status["conditions"]}["Ready"] == "True"
        assert not node["spec"].get("taints")
    table = plane.kubectl("get", "nodes").stdout
    assert all(re.search(rf"^{n}\s+Ready\s", table, re.M) for n in NODES), table


def test_statefulset_one_pod_per_node_ready_logs_and_exec(cluster):
    plane, double = cluster
    double.add_script(Script("ep-*", {"vllm": Container(
        log=RECORDED_LOG, image_id=IMAGE_ID,
        execs={("nvidia-smi", "-L"): Exec(GPU_LIST),
               ("sh", "-c", "exit 3"): Exec(stderr="failing on purpose\n", exit_code=3)})},
        running_after=0.3, ready_after=0.4, pod_ips="10.244.0.0/16"))
    plane.apply(
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "ep"},
         "spec": {"clusterIP": "None", "selector": {"app": "ep"}, "ports": [{"port": 8000}]}},
        {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": {"name": "ep"},
         "spec": {"replicas": 2, "podManagementPolicy": "Parallel", "serviceName": "ep",
                  "selector": {"matchLabels": {"app": "ep"}},
                  "template": {"metadata": {"labels": {"app": "ep"}},
                               "spec": {"containers": [gpu_container("vllm", 8)]}}}})
    wait_pods(plane, "app=ep", 2)
    plane.kubectl("wait", "--for=condition=Ready", "pod/ep-0", "pod/ep-1", "--timeout=30s")

    pods = {p["metadata"]["name"]: p for p in plane.get_json("pods", "-l", "app=ep")["items"]}
    assert sorted(p["spec"]["nodeName"] for p in pods.values()) == sorted(NODES)  # one per node
    for p in pods.values():
        st = p["status"]
        assert st["phase"] == "Running" and st["podIP"].startswith("10.244.") and st["hostIP"] == "127.0.0.1"
        (cs,) = st["containerStatuses"]
        assert cs["ready"] and "running" in cs["state"] and cs["imageID"] == IMAGE_ID
        assert re.fullmatch(r"docker-pullable://[^@]+@sha256:[0-9a-f]{64}", cs["imageID"])

    # the real controllers follow: the StatefulSet counts ready replicas, Endpoints list both
    def ready_replicas():
        status = plane.get_json("statefulset", "ep")["status"]
        return status.get("readyReplicas") == 2, status

    def endpoint_addresses():
        subsets = plane.get_json("endpoints", "ep").get("subsets", [])
        addresses = {a["ip"] for s in subsets for a in s.get("addresses", [])}
        return addresses == {p["status"]["podIP"] for p in pods.values()}, subsets

    wait_until("StatefulSet ep readyReplicas == 2", ready_replicas, 20)
    wait_until("2 ready addresses in Endpoints ep", endpoint_addresses, 20)

    recorded = RECORDED_LOG.read_bytes()
    assert plane.kubectl("logs", "ep-0", "-c", "vllm", text=False).stdout == recorded
    lines = recorded.splitlines(keepends=True)
    assert plane.kubectl("logs", "ep-1", "--tail=5", text=False).stdout == b"".join(lines[-5:])
    assert plane.kubectl("logs", "ep-1", "--limit-bytes=100", text=False).stdout == recorded[:100]
    stamped = plane.kubectl("logs", "ep-0", "--timestamps", "--tail=2", text=False).stdout.splitlines()
    assert len(stamped) == 2
    for got, want in zip(stamped, lines[-2:]):
        stamp, _, rest = got.partition(b" ")
        assert re.fullmatch(rb"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{9}Z", stamp) and rest == want.rstrip(b"\n")

    assert plane.kubectl("exec", "ep-0", "-c", "vllm", "--", "nvidia-smi", "-L").stdout == GPU_LIST
    failed = plane.kubectl("exec", "ep-1", "--", "sh", "-c", "exit 3", check=False)
    assert failed.returncode == 3, failed
    assert "command terminated with exit code 3" in failed.stderr
    assert "failing on purpose" in failed.stderr
    unknown = plane.kubectl("exec", "ep-1", "--", "ls", check=False)
    assert unknown.returncode == 127 and "no scripted answer" in unknown.stderr


def test_deleted_pod_is_finalized_and_the_statefulset_recreates_it(cluster):
    plane, double = cluster
    old_uid = plane.get_json("pod", "ep-0")["metadata"]["uid"]
    plane.kubectl("delete", "pod", "ep-0", "--timeout=90s", timeout=120)  # the double finalizes
    assert old_uid not in double.pods
    plane.kubectl("wait", "--for=condition=Ready", "pod/ep-0", "--timeout=30s")
    assert plane.get_json("pod", "ep-0")["metadata"]["uid"] != old_uid


def test_nine_gpus_stay_pending_and_unscripted_pods_are_untouched(cluster):
    plane, double = cluster
    plane.apply(pod_manifest("too-big", gpu_container("vllm", 9)),
                pod_manifest("no-script", {"name": "idle", "image": "busybox:1.36",
                                           "resources": {"requests": {"cpu": "1"}}}))

    def unschedulable():
        conds = {c["type"]: c for c in plane.get_json("pod", "too-big")["status"].get("conditions", [])}
        c = conds.get("PodScheduled", {})
        return c.get("status") == "False" and "Insufficient nvidia.com/gpu" in c.get("message", ""), c

    cond = wait_until("PodScheduled=False for too-big", unschedulable, 20)
    assert cond["reason"] == "Unschedulable", cond
    assert plane.get_json("pod", "too-big")["status"]["phase"] == "Pending"

    wait_until("no-script bound and seen by the double",
               lambda: (("default", "no-script") in double.unscripted, sorted(double.unscripted)), 20)
    time.sleep(3 * double.poll)
    status = plane.get_json("pod", "no-script")["status"]
    assert status["phase"] == "Pending" and "containerStatuses" not in status and "podIP" not in status
    assert {c["type"] for c in status["conditions"]} == {"PodScheduled"}
    plane.kubectl("delete", "pod", "too-big", "no-script", "--timeout=20s")


def test_server_dry_run_refuses_gpu_request_different_from_limit(cluster):
    plane, _ = cluster
    bad = pod_manifest("gpu-mismatch", gpu_container("vllm", 4, limit=8))
    proc = plane.kubectl("apply", "--dry-run=server", "-f", "-", input=json.dumps(bad), check=False)
    assert proc.returncode != 0
    assert "nvidia.com/gpu" in proc.stderr and "must be equal" in proc.stderr, proc.stderr
    assert plane.kubectl("get", "pod", "gpu-mismatch", check=False).returncode != 0
    good = pod_manifest("gpu-match", gpu_container("vllm", 8))
    plane.kubectl("apply", "--dry-run=server", "-f", "-", input=json.dumps(good))


def test_jobs_complete_or_fail_through_the_job_controller(cluster):
    plane, double = cluster
    bench = {"bench": Container(log=RECORDED_LOG, image_id=IMAGE_ID)}
    double.add_script(Script("bench-ok-*", bench, running_after=0.2, exit_after=2.0))
    double.add_script(Script("bench-bad-*", {"bench": Container(log=RECORDED_LOG, exit_code=2)},
                             running_after=0.2, exit_after=0.5))
    plane.apply(job_manifest("bench-ok"), job_manifest("bench-bad"))

    # Like a real kubelet, the double refuses logs of a container that has not started yet
    # ("waiting to start"), so follow from Running on.
    wait_pods(plane, "job-name=bench-ok", 1)
    plane.kubectl("wait", "--for=condition=Ready", "pod", "-l", "job-name=bench-ok", "--timeout=30s")
    followed = plane.kubectl("logs", "-f", "job/bench-ok", text=False, timeout=40)
    assert followed.stdout == RECORDED_LOG.read_bytes()  # follow ends when the container ends
    assert any("follow=true" in path for _, path in double.requests if path.startswith("/containerLogs/"))
    (ok,) = plane.get_json("pods", "-l", "job-name=bench-ok")["items"]
    assert "terminated" in ok["status"]["containerStatuses"][0]["state"]
    plane.kubectl("wait", "--for=condition=complete", "job/bench-ok", "--timeout=30s")
    plane.kubectl("wait", "--for=condition=failed", "job/bench-bad", "--timeout=30s")

    (ok,) = plane.get_json("pods", "-l", "job-name=bench-ok")["items"]
    assert ok["status"]["phase"] == "Succeeded" and ok["status"]["podIP"] == "127.0.0.1"
    assert ok["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 0
    (bad,) = plane.get_json("pods", "-l", "job-name=bench-bad")["items"]
    assert bad["status"]["phase"] == "Failed"
    assert bad["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 2
    assert plane.get_json("job", "bench-ok")["status"]["succeeded"] == 1
    assert not double.errors, double.errors


def test_stop_leaves_no_process_and_no_listener(cluster):
    plane, double = cluster
    pids = plane.pids
    ports = {**plane.ports, "kubelet-double": double.port}
    assert set(pids) == {"etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler"}
    assert all(pid_alive(p) for p in pids.values())
    assert all(port_open(p) for name, p in ports.items() if name != "etcd-peer")
    double.stop()
    plane.stop()
    assert not plane.is_running()
    for name, pid in pids.items():
        assert not pid_alive(pid), f"{name} (pid {pid}) still running"
        with pytest.raises(ProcessLookupError):
            os.killpg(pid, 0)  # its process group is empty
    for name, port in ports.items():
        assert not port_open(port), f"{name} port {port} still open"
