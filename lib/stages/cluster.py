"""Stage 00: can this context run the guide? Host facts, then gates on what they allow."""
from __future__ import annotations

import re

from lib import places
from lib.core.evidence import gate, skip
from lib.core.stage import Stage
from lib.places import NodeNeeds, Unsupported

GDRDRV_MIN = (2, 5)  # gdrdrv 2.4 + libgdrapi 2.5 passes transport but breaks combine (ANCHORS §4)
MIN_CORES = 2  # two gloo ranks, or a server and AIPerf on their own cores
MIN_MEMORY_GIB = 8


def parse_version(text: str | None) -> tuple[int, ...] | None:
    match = re.search(r"(\d+)\.(\d+)(?:\.(\d+))?", text or "")
    return tuple(int(x) for x in match.groups() if x is not None) if match else None


def host_gates(facts: dict, needs: NodeNeeds, evidence: list[str]) -> list:
    """What a node must have here (`needs`: the place's), gated; what the place does not need is
    a SKIP with the place's reason when the node lacks it."""
    gpus = len(facts["gpus"])
    gates = [
        gate("CPU cores", facts["cpu_cores"] >= MIN_CORES, facts["cpu_cores"], f">= {MIN_CORES}",
             evidence=evidence),
        gate("memory GiB", facts["memory_gib"] >= MIN_MEMORY_GIB, facts["memory_gib"],
             f">= {MIN_MEMORY_GIB}", evidence=evidence),
    ]
    if gpus >= 2:
        gates.append(gate("GPUs for the GPU paths (NCCL bench, vLLM, DeepEP)", True, gpus, ">= 2",
                          evidence=evidence))
    else:
        gates.append(skip("GPUs for the GPU paths (NCCL bench, vLLM, DeepEP)",
                          needs.no_gpus.format(gpus=gpus), evidence))
    gates.append(efa_gate(facts, needs, evidence))
    gates.append(gdrdrv_gate(facts, needs, evidence))
    if facts["hugepages_total"]:
        gates.append(gate("hugepages", True, facts["hugepages_total"], "> 0", evidence=evidence))
    else:
        gates.append(skip("hugepages", needs.no_hugepages, evidence))
    gates.append(skip("kubectl access to a cluster",
                      needs.no_cluster_access.format(kubectl=facts['kubectl_client'] or 'absent'),
                      evidence))
    if facts["docker_engine"]:
        gates.append(gate("Docker engine", True, facts["docker_engine"], "answers",
                          evidence=evidence))
    else:
        gates.append(skip("Docker engine", "no Docker engine here (docker info: "
                          f"{facts['docker_error'] or 'failed'}): 02 lints and skips the build",
                          evidence))
    return gates


def efa_gate(facts: dict, needs: NodeNeeds, evidence: list[str]):
    if facts["efa_devices"]:
        return gate("EFA devices", True, len(facts["efa_devices"]), "> 0", evidence=evidence)
    return skip("EFA devices", needs.no_efa, evidence)


def gdrdrv_gate(facts: dict, needs: NodeNeeds, evidence: list[str]):
    version = parse_version(facts["gdrdrv_version"])
    if version is None:
        return skip("gdrdrv >= 2.5", needs.no_gdrdrv, evidence)
    return gate("gdrdrv >= 2.5", version[:2] >= GDRDRV_MIN, facts["gdrdrv_version"], ">= 2.5",
                evidence=evidence)


def run(stage: Stage) -> dict:
    place = places.for_stage(stage)
    try:
        nodes = place.host_facts()
    except Unsupported as why:
        stage.add(skip("cluster probe", str(why)))
        return {"facts": None}
    needs = place.node_needs()
    facts = nodes[0]  # one node today: this host (the cluster places gate each node)
    evidence = [stage.write_json("host.json", facts)]
    stage.add(gate("host facts recorded", True, len(facts), "> 0", evidence=evidence))
    stage.add(host_gates(facts, needs, evidence))
    return {"facts": facts}


def show(stage: Stage, data: dict):
    import pandas as pd

    if not data["facts"]:
        return None
    facts = {k: (", ".join(map(str, v)) if isinstance(v, list) and v and not isinstance(v[0], dict)
                 else v) for k, v in data["facts"].items() if k != "gpus"}
    facts["gpus"] = len(data["facts"]["gpus"])
    return pd.DataFrame({"fact": list(facts), "value": [str(v) for v in facts.values()]})
