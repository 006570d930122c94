"""Stage 00: can this context run the guide? Host facts, then gates on what they allow."""
from __future__ import annotations

import json
import re

from lib.evidence import gate, skip
from lib.stage import Stage

GDRDRV_MIN = (2, 5)  # gdrdrv 2.4 + libgdrapi 2.5 passes transport but breaks combine (ANCHORS §4)
MIN_CORES = 2  # two gloo ranks, or a server and AIPerf on their own cores
MIN_MEMORY_GIB = 8
EFA_NICS_PER_INSTANCE = {"p5en.48xlarge": 16, "p5.48xlarge": 32}
CLUSTER_MODEL_EXPERTS = 128  # Qwen3-30B-A3B: EP size must divide it


def meminfo_kib(text: str | None, key: str) -> int | None:
    match = re.search(rf"^{key}:\s+(\d+)", text or "", re.M)
    return int(match.group(1)) if match else None


def parse_version(text: str | None) -> tuple[int, ...] | None:
    match = re.search(r"(\d+)\.(\d+)(?:\.(\d+))?", text or "")
    return tuple(int(x) for x in match.groups() if x is not None) if match else None


def host_facts(stage: Stage) -> dict:
    """Everything observed about this host, each value through the door."""
    door = stage.door
    cpuinfo = door.read_text("/proc/cpuinfo")
    meminfo = door.read_text("/proc/meminfo")
    facts: dict = {
        "cpu_cores": len(re.findall(r"^processor\s*:", cpuinfo or "", re.M)),
        "cpu_model": (re.findall(r"^model name\s*:\s*(.+)$", cpuinfo or "", re.M) or [None])[0],
        "memory_gib": round((meminfo_kib(meminfo, "MemTotal") or 0) / 2**20, 1),
        "hugepages_total": meminfo_kib(meminfo, "HugePages_Total"),
        "hugepage_size_kib": meminfo_kib(meminfo, "Hugepagesize"),
    }
    facts["gpus"] = gpu_facts(stage)
    rdma = door.listdir("/sys/class/infiniband") or []
    facts["rdma_devices"] = rdma
    facts["efa_devices"] = [d for d in rdma if (door.read_text(
        f"/sys/class/infiniband/{d}/device/uevent") or "").find("DRIVER=efa") >= 0]
    facts["gdrdrv_version"] = (door.read_text("/sys/module/gdrdrv/version") or "").strip() or None
    kubectl = door.run(["kubectl", "version", "--client", "-o", "json"], timeout=30, check=False)
    facts["kubectl_client"] = (
        json.loads(kubectl.stdout).get("clientVersion", {}).get("gitVersion")
        if kubectl.ok else None)
    docker = door.run(["docker", "info", "--format", "{{.ServerVersion}}"], timeout=30,
                      check=False)
    facts["docker_engine"] = docker.stdout.strip() if docker.ok else None
    facts["docker_error"] = None if docker.ok else (docker.stderr.strip().splitlines() or [""])[0]
    return facts


def gpu_facts(stage: Stage) -> list[dict]:
    if not stage.door.which("nvidia-smi"):
        return []
    out = stage.door.run(
        ["nvidia-smi", "--query-gpu=index,name,memory.total,driver_version",
         "--format=csv,noheader,nounits"], timeout=60, check=False)
    gpus = []
    for line in out.stdout.splitlines() if out.ok else []:
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 4:
            gpus.append({"index": int(parts[0]), "name": parts[1],
                         "memory_mib": int(float(parts[2])), "driver": parts[3]})
    return gpus


def local_gates(stage: Stage, facts: dict, evidence: list[str]) -> list:
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
                          f"{gpus} GPU(s) here: the kernel test runs on gloo/CPU and serving on "
                          "transformers serve; the GPU paths need 2 or more", evidence))
    gates.append(efa_gate(facts, evidence))
    gates.append(gdrdrv_gate(facts, evidence))
    if facts["hugepages_total"]:
        gates.append(gate("hugepages", True, facts["hugepages_total"], "> 0", evidence=evidence))
    else:
        gates.append(skip("hugepages", "none allocated here; only the EFA path needs them",
                          evidence))
    gates.append(skip("kubectl access to a cluster",
                      f"the local context uses no cluster (kubectl client "
                      f"{facts['kubectl_client'] or 'absent'})", evidence))
    if facts["docker_engine"]:
        gates.append(gate("Docker engine", True, facts["docker_engine"], "answers",
                          evidence=evidence))
    else:
        gates.append(skip("Docker engine", "no Docker engine here (docker info: "
                          f"{facts['docker_error'] or 'failed'}): 02 lints and skips the build",
                          evidence))
    return gates


def efa_gate(facts: dict, evidence: list[str]):
    if facts["efa_devices"]:
        return gate("EFA devices", True, len(facts["efa_devices"]), "> 0", evidence=evidence)
    return skip("EFA devices", "no EFA device under /sys/class/infiniband: the EFA transport is "
                "measured on the kube context only", evidence)


def gdrdrv_gate(facts: dict, evidence: list[str]):
    version = parse_version(facts["gdrdrv_version"])
    if version is None:
        return skip("gdrdrv >= 2.5", "gdrdrv is not loaded here (/sys/module/gdrdrv/version "
                    "absent); GPUDirect RDMA is a cluster fact", evidence)
    return gate("gdrdrv >= 2.5", version[:2] >= GDRDRV_MIN, facts["gdrdrv_version"], ">= 2.5",
                evidence=evidence)


def run(stage: Stage) -> dict:
    if stage.context != "local":
        stage.add(skip("cluster probe", f"the {stage.context} context's probe (nodes, GPUs and EFA "
                       "NICs per node through kubectl) is not built yet; this guide runs it on "
                       "the local context only for now"))
        return {"facts": None}
    facts = host_facts(stage)
    evidence = [stage.write_json("host.json", facts)]
    stage.add(gate("host facts recorded", True, len(facts), "> 0", evidence=evidence))
    stage.add(local_gates(stage, facts, evidence))
    return {"facts": facts}


def show(stage: Stage, data: dict):
    import pandas as pd

    if not data["facts"]:
        return None
    facts = {k: (", ".join(map(str, v)) if isinstance(v, list) and v and not isinstance(v[0], dict)
                 else v) for k, v in data["facts"].items() if k != "gpus"}
    facts["gpus"] = len(data["facts"]["gpus"])
    return pd.DataFrame({"fact": list(facts), "value": [str(v) for v in facts.values()]})
