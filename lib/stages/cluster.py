"""Stage 00: can this context run the guide? Host facts, then gates on what they allow."""
from __future__ import annotations

import re

from lib import places
from lib.core.evidence import gate, skip
from lib.core.stage import Stage
from lib.places import NodeNeeds, Unsupported
from lib.stages.refusal import refusals_fail, shows_refusal

GDRDRV_MIN = (2, 5)  # gdrdrv 2.4 + libgdrapi 2.5 passes transport but breaks combine (ANCHORS §4)
MIN_CORES = 2  # two gloo ranks, or a server and AIPerf on their own cores
MIN_MEMORY_GIB = 8


def parse_version(text: str | None) -> tuple[int, ...] | None:
    match = re.search(r"(\d+)\.(\d+)(?:\.(\d+))?", text or "")
    return tuple(int(x) for x in match.groups() if x is not None) if match else None


def host_gates(facts: dict, needs: NodeNeeds, evidence: list[str]) -> list:
    """What a node must have here (`needs`: the place's), gated; what the place does not need
    is a SKIP with the place's reason when the node lacks it. A cluster node's gates are named
    after it ("<node>: EFA devices")."""
    name = (lambda g: f"{facts['node']}: {g}") if "node" in facts else (lambda g: g)
    gpus = len(facts["gpus"])
    gates = [
        gate(name("CPU cores"), facts["cpu_cores"] >= MIN_CORES, facts["cpu_cores"],
             f">= {MIN_CORES}", evidence=evidence),
        gate(name("memory GiB"), facts["memory_gib"] >= MIN_MEMORY_GIB, facts["memory_gib"],
             f">= {MIN_MEMORY_GIB}", evidence=evidence),
    ]
    if needs.gpus is not None and "gres" in facts:  # a Slurm node: its GRES beside the probe
        declared = facts.get("gres_gpus") or 0
        slurm_said = f"Slurm reports GRES {facts['gres'] or '(none)'} ({declared} GPU(s))"
        gates.append(gate(name("GPUs"), gpus == needs.gpus, gpus, needs.gpus,
                          f"GPUs the node's probe saw (nvidia-smi); {slurm_said}; the run asks "
                          f"{needs.gpus} per node (gpus_per_node)", evidence))
        gates.append(gate(name("GPUs in Slurm's GRES"), declared == needs.gpus, declared,
                          needs.gpus, f"{slurm_said}: an allocation asks --gres=gpu:"
                          f"{needs.gpus} of every node", evidence))
    elif needs.gpus is not None:
        gates.append(gate(name("GPUs"), gpus == needs.gpus, gpus, needs.gpus,
                          evidence=evidence))
    elif gpus >= 2:
        gates.append(gate("GPUs for the GPU paths (NCCL bench, vLLM, DeepEP)", True, gpus, ">= 2",
                          evidence=evidence))
    else:
        gates.append(skip(name("GPUs for the GPU paths (NCCL bench, vLLM, DeepEP)"),
                          needs.no_gpus.format(gpus=gpus), evidence))
    gates.append(efa_gate(facts, needs, evidence, name))
    gates += schedulable_gates(facts, needs, evidence, name)
    gates.append(gdrdrv_gate(facts, needs, evidence, name))
    if facts["hugepages_total"]:
        gates.append(gate(name("hugepages"), True, facts["hugepages_total"], "> 0",
                          evidence=evidence))
    elif needs.hugepages:
        gates.append(gate(name("hugepages"), False, facts["hugepages_total"], "> 0",
                          needs.no_hugepages or "no hugepages allocated on the node: the EFA "
                          "path (libfabric) needs them", evidence))
    else:
        gates.append(skip(name("hugepages"), needs.no_hugepages, evidence))
    if "cluster_access" not in facts:  # this host: which cluster clients it has
        gates.append(skip("kubectl access to a cluster", needs.no_cluster_access.format(
            kubectl=facts['kubectl_client'] or 'absent'), evidence))
    if "docker_engine" not in facts:
        return gates
    if facts["docker_engine"]:
        gates.append(gate("Docker engine", True, facts["docker_engine"], "answers",
                          evidence=evidence))
    else:
        gates.append(skip("Docker engine", "no Docker engine here (docker info: "
                          f"{facts['docker_error'] or 'failed'}): 02 lints and skips the build",
                          evidence))
    return gates


def schedulable_gates(facts: dict, needs: NodeNeeds, evidence: list[str], name) -> list:
    """What a cluster's scheduler says of a node before any pod asks (a Kubernetes node's facts
    carry them): the EFA devices its device plugin offers, which the later stages' pods ask for
    (a probe can see the devices while the plugin offers none), and the taints none of the
    guide's pods tolerate; each FAIL names the node and the fact, so 03 and 04 do not wait for
    the scheduler's "0/2 nodes are available", which names no node."""
    gates = []
    if "efa_allocatable" in facts and needs.efa is not None:
        offered = facts["efa_allocatable"]
        gates.append(gate(name("EFA devices allocatable"), offered >= needs.efa, offered,
                          f">= {needs.efa}",
                          f"EFA devices the node offers its pods (allocatable, the EFA device "
                          f"plugin's count); every rank and serve pod asks {needs.efa}"
                          + ("; 0: the EFA device plugin is not running on the node"
                             if offered == 0 else ""), evidence))
    if "hugepages_2mi_bytes" in facts and needs.hugepages_bytes:
        offered, asked = facts["hugepages_2mi_bytes"], needs.hugepages_bytes
        gates.append(gate(name("hugepages-2Mi allocatable"), offered >= asked,
                          f"{offered // 2 ** 20} MiB", f">= {asked // 2 ** 20} MiB",
                          f"2 MiB huge pages the node offers its pods (allocatable); every rank "
                          f"and serve pod asks {asked // 2 ** 20} MiB"
                          + ("; 0: none pre-allocated on the node (kernel boot parameters "
                             "hugepagesz=2M hugepages=N, or vm.nr_hugepages)"
                             if offered == 0 else ""), evidence))
    if "troubled_conditions" in facts:
        trouble = facts["troubled_conditions"]
        gates.append(gate(name("Ready, no pressure"), not trouble, trouble or "Ready",
                          "Ready, no pressure or network condition",
                          ("the kubelet reports: " + "; ".join(trouble)
                           + " (a pod is not placed there, or is evicted)") if trouble else
                          "Ready; no memory, disk or PID pressure, network available", evidence))
    if "untolerated_taints" in facts:
        blocked = facts["untolerated_taints"]
        gates.append(gate(name("taints the guide's pods tolerate"), not blocked,
                          blocked or "none", "none untolerated",
                          ("taints no pod of the guide tolerates, so the scheduler places none "
                           "on the node: " + ", ".join(blocked)) if blocked else
                          "no taint keeps the guide's pods off the node", evidence))
    return gates


def efa_gate(facts: dict, needs: NodeNeeds, evidence: list[str], name=lambda g: g):
    found = len(facts["efa_devices"])
    if needs.efa is not None:  # a cluster node: every EFA device of its instance type
        return gate(name("EFA devices"), found == needs.efa, found, needs.efa,
                    f"EFA devices the node's probe saw (DRIVER=efa); the instance type has "
                    f"{needs.efa}", evidence)
    if found:
        return gate("EFA devices", True, found, "> 0", evidence=evidence)
    return skip(name("EFA devices"), needs.no_efa, evidence)


def gdrdrv_gate(facts: dict, needs: NodeNeeds, evidence: list[str], name=lambda g: g):
    version = parse_version(facts["gdrdrv_version"])
    if version is None and not needs.gdrdrv:
        return skip(name("gdrdrv >= 2.5"), needs.no_gdrdrv, evidence)
    if version is None:
        return gate(name("gdrdrv >= 2.5"), False, None, ">= 2.5",
                    needs.no_gdrdrv or "gdrdrv is not loaded on the node (/sys/module/gdrdrv/"
                    "version absent): GPUDirect RDMA over EFA needs it (2.4 breaks the combine: "
                    "ANCHORS 4)", evidence)
    return gate(name("gdrdrv >= 2.5"), version[:2] >= GDRDRV_MIN, facts["gdrdrv_version"],
                ">= 2.5", evidence=evidence)


def cluster_gates(stage: Stage, nodes: list[dict], evidence: list[str]) -> list:
    """A cluster's own gates: access, enough nodes of the instance type, each Ready."""
    asked = stage["nodes"]
    access = nodes[0].get("cluster_access")
    ready = [n["node"] for n in nodes if n.get("ready")]
    return [
        gate("access to the cluster", bool(access), access, "answers",
             "the cluster's control plane answered", evidence),
        gate("nodes of the instance type, Ready", len(ready) >= asked,
             {"ready": ready, "found": [n["node"] for n in nodes]}, f">= {asked} Ready",
             f"{len(ready)} Ready of {len(nodes)} found; the run asks {asked}", evidence),
    ]


@refusals_fail
def run(stage: Stage) -> dict:
    place = places.for_stage(stage)
    try:
        nodes = place.host_facts()
    except Unsupported as why:
        stage.add(skip("cluster probe", str(why)))
        return {"facts": None}
    needs = place.node_needs()
    if len(nodes) == 1 and "node" not in nodes[0]:  # this host, as one node
        facts = nodes[0]
        evidence = [stage.write_json("host.json", facts)]
        stage.add(gate("host facts recorded", True, len(facts), "> 0", evidence=evidence))
        stage.add(host_gates(facts, needs, evidence))
        return {"facts": facts}
    evidence = [stage.write_json("nodes.json", nodes)]
    stage.add(gate("node facts recorded", bool(nodes), len(nodes), "> 0", evidence=evidence))
    stage.add(cluster_gates(stage, nodes, evidence))
    for facts in nodes:
        stage.add(host_gates(facts, needs, evidence + facts.get("evidence", [])))
    return {"facts": nodes[0], "nodes": nodes}


@shows_refusal
def show(stage: Stage, data: dict):
    import pandas as pd

    if not data["facts"]:
        return None
    if data.get("nodes"):  # a cluster: a row per node
        keep = ("node", "instance_type", "ready", "cpu_cores", "memory_gib", "gpus",
                "efa_devices", "gdrdrv_version", "hugepages_total", "taints")
        return pd.DataFrame([{k: (len(n[k]) if k in ("gpus", "efa_devices") else n.get(k))
                              for k in keep if k in n} for n in data["nodes"]])
    facts = {k: (", ".join(map(str, v)) if isinstance(v, list) and v and not isinstance(v[0], dict)
                 else v) for k, v in data["facts"].items() if k != "gpus"}
    facts["gpus"] = len(data["facts"]["gpus"])
    return pd.DataFrame({"fact": list(facts), "value": [str(v) for v in facts.values()]})
