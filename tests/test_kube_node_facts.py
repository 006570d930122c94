"""00's reading of a Kubernetes Node (lib.places.kube.pods): the taints the guide's pods do not
tolerate and the conditions that keep pods off a node, from Node objects in the API's own shape
(the condition reasons and messages are the kubelet's: kubernetes pkg/kubelet/nodestatus)."""
from lib.places import NodeNeeds
from lib.places.kube import manifests, pods
from lib.stages.cluster import schedulable_gates


def node(conditions=None, taints=None) -> dict:
    return {"metadata": {"name": "p5en-a", "labels": {}},
            "spec": {"taints": taints} if taints else {},
            "status": {"allocatable": {"cpu": "192", "memory": "2000Gi",
                                       manifests.GPU_RESOURCE: "8", manifests.EFA_RESOURCE: "16"},
                       "conditions": conditions if conditions is not None else READY}}


READY = [{"type": "Ready", "status": "True", "reason": "KubeletReady",
          "message": "kubelet is posting ready status"},
         {"type": "MemoryPressure", "status": "False", "reason": "KubeletHasSufficientMemory",
          "message": "kubelet has sufficient memory available"},
         {"type": "DiskPressure", "status": "False", "reason": "KubeletHasNoDiskPressure",
          "message": "kubelet has no disk pressure"}]


def test_a_ready_node_without_pressure_is_not_troubled():
    assert pods.troubled(node()) == []
    assert pods.node_facts(node(), {})["troubled_conditions"] == []


def test_pressure_and_not_ready_are_said_in_the_kubelet_s_words():
    pressed = [READY[0], {**READY[2], "status": "True", "reason": "KubeletHasDiskPressure",
                          "message": "kubelet has disk pressure"},
               {"type": "PIDPressure", "status": "True", "reason": "KubeletHasInsufficientPID",
                "message": "kubelet has insufficient PID available"}]
    assert pods.troubled(node(pressed)) == [
        "DiskPressure=True: KubeletHasDiskPressure: kubelet has disk pressure",
        "PIDPressure=True: KubeletHasInsufficientPID: kubelet has insufficient PID available"]
    lost = [{"type": "Ready", "status": "Unknown", "reason": "NodeStatusUnknown",
             "message": "Kubelet stopped posting node status."}]
    assert pods.troubled(node(lost)) == [
        "Ready=Unknown: NodeStatusUnknown: Kubelet stopped posting node status."]
    assert pods.troubled(node([])) == ["Ready: no such condition (the kubelet never reported)"]


def test_only_a_blocking_taint_no_toleration_matches_is_untolerated():
    taints = [{"key": "example.com/maintenance", "value": "true", "effect": "NoSchedule"},
              {"key": manifests.GPU_RESOURCE, "effect": "NoSchedule"},
              {"key": "example.com/soon", "effect": "PreferNoSchedule"}]
    assert pods.untolerated(node(taints=taints)) == ["example.com/maintenance=true:NoSchedule"]


def test_what_keeps_a_pod_off_each_node_is_said_per_node():
    pod = {"spec": {"nodeSelector": {manifests.INSTANCE_TYPE_LABEL: "p5en.48xlarge"},
                    "containers": [{"resources": {
                        "limits": {manifests.GPU_RESOURCE: "8", manifests.EFA_RESOURCE: "16"},
                        "requests": {"memory": "64Gi"}}}]}}
    fits = node()
    fits["metadata"]["labels"] = {manifests.INSTANCE_TYPE_LABEL: "p5en.48xlarge"}
    assert pods.why_not_on(pod, fits) == []
    lacking = node(taints=[{"key": "example.com/maintenance", "effect": "NoSchedule"}])
    lacking["metadata"]["name"] = "p5en-b"
    lacking["spec"]["unschedulable"] = True
    lacking["status"]["allocatable"][manifests.EFA_RESOURCE] = "0"
    assert pods.why_not_on(pod, lacking) == [
        "cordoned (spec.unschedulable)", "taint example.com/maintenance:NoSchedule",
        f"label {manifests.INSTANCE_TYPE_LABEL}=None, the pod selects 'p5en.48xlarge'",
        f"{manifests.EFA_RESOURCE} allocatable 0, the pod asks 16"]
    said = pods.nodes_said(pod, [fits, lacking])
    assert said.startswith("p5en-a: offers all the pod asks (other pods hold some of it?) | "
                           "p5en-b: cordoned")


def test_a_node_offering_fewer_huge_pages_than_a_pod_asks_fails_00_naming_it():
    """The kubelet advertises hugepages-2Mi only for pages the node pre-allocated; 00 gates the
    amount against what every rank and serve pod asks (manifests.HUGEPAGES_2MI), PASS at
    exactly that, FAIL below it with the node's name and the figures."""
    asked = pods.quantity_bytes(manifests.HUGEPAGES_2MI)
    needs = NodeNeeds(gpus=8, efa=16, gdrdrv=True, hugepages=True, hugepages_bytes=asked)

    def hugepages_gate(offered: str | None):
        n = node()
        if offered is not None:
            n["status"]["allocatable"][manifests.HUGEPAGES_RESOURCE] = offered
        got = {g.gate: g for g in schedulable_gates(pods.node_facts(n, {}), needs, [],
                                                     lambda g: f"p5en-a: {g}")}
        return got["p5en-a: hugepages-2Mi allocatable"]

    assert asked == 5120 * 2 ** 20
    enough = hugepages_gate("5Gi")  # 5120Mi, as the API server writes it back
    assert (enough.status, enough.observed, enough.expected) == ("PASS", "5120 MiB", ">= 5120 MiB")
    short = hugepages_gate("2Gi")
    assert (short.status, short.observed) == ("FAIL", "2048 MiB")
    none = hugepages_gate(None)
    assert none.status == "FAIL" and none.reason.endswith(
        "; 0: none pre-allocated on the node (kernel boot parameters hugepagesz=2M hugepages=N, "
        "or vm.nr_hugepages)")
