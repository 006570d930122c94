"""Reading what kubectl says of pods and nodes, for the kube place (lib.places.kube): pure
functions of the JSON `kubectl get ... -o json` prints, the names and selectors of the
objects a stage applies, and the script a request from inside the cluster runs."""
from __future__ import annotations

import re
from typing import Any

import lib.places.manifests as manifests  # the renderers themselves, not lib.places (no cycle through it)


# What a request from inside the cluster runs in the leader pod: python3 is in the image, curl
# may not be. It prints {"status", "body", "error"} as one JSON line.
REQUEST_SCRIPT = (
    "import json,sys,urllib.request,urllib.error\n"
    "m,u,t,b=sys.argv[1],sys.argv[2],float(sys.argv[3]),sys.argv[4]\n"
    "r=urllib.request.Request(u,data=b.encode() if b else None,method=m,"
    "headers={'Content-Type':'application/json'} if b else {})\n"
    "try:\n"
    " with urllib.request.urlopen(r,timeout=t) as a: s,x,e=a.status,a.read().decode(),None\n"
    "except urllib.error.HTTPError as a: s,x,e=a.code,a.read().decode(),None\n"
    "except Exception as a: s,x,e=None,'',type(a).__name__+': '+str(a)\n"
    "print(json.dumps({'status':s,'body':x,'error':e}))\n")


def node_facts(node: dict, versions: dict) -> dict[str, Any]:
    """What `kubectl get nodes` says of one node, in the keys 00 gates."""
    meta, status = node["metadata"], node.get("status") or {}
    alloc = status.get("allocatable") or {}
    ready = next((c["status"] == "True" for c in status.get("conditions") or []
                  if c["type"] == "Ready"), False)
    return {
        "node": meta["name"],
        "instance_type": (meta.get("labels") or {}).get(manifests.INSTANCE_TYPE_LABEL),
        "ready": ready,
        "taints": [f"{t['key']}:{t.get('effect')}" for t in
                   (node.get("spec") or {}).get("taints") or []],
        "cpu_cores": _cpu(alloc.get("cpu", "0")),
        "memory_gib": round(_bytes(alloc.get("memory", "0")) / 2 ** 30, 1),
        "gpus": [{"index": i} for i in range(int(alloc.get(manifests.GPU_RESOURCE, 0)))],
        "efa_allocatable": int(alloc.get(manifests.EFA_RESOURCE, 0)),
        "hugepages_2mi_bytes": _bytes(alloc.get("hugepages-2Mi", "0")),
        "kubectl_client": (versions.get("clientVersion") or {}).get("gitVersion"),
        "cluster_access": (f"kube-apiserver {(versions.get('serverVersion') or {}).get('gitVersion')}"
                           if versions.get("serverVersion") else None),
    }


def object_name(what: str) -> str:
    """A DNS-1123 name for a group of objects (`test_ep at 128 tokens` -> `test-ep-at-128-tokens`,
    cut to the manifests' limit)."""
    slug = re.sub(r"[^a-z0-9]+", "-", what.lower()).strip("-")
    return slug[:manifests.NAME_MAX].rstrip("-") or "job"


def stage_selector(run_id: str, stage: str) -> str:
    """The objects of one stage of one run."""
    found = manifests.labels(run_id, stage, "any")
    return ",".join(f"{k}={found[k]}" for k in (manifests.RUN_LABEL, manifests.STAGE_LABEL))


def probe_facts(probe: dict) -> dict[str, Any]:
    """A node probe's findings (lib.places.manifests.parse_probe_log), in 00's keys."""
    gdrdrv = probe.get("gdrdrv")
    return {"gdrdrv_version": None if gdrdrv in (None, "absent", "unreadable") else gdrdrv,
            "efa_devices": list(probe.get("efa_devices") or []),
            "hugepages_total": probe.get("hugepages_total"),
            "hugepage_size_kib": probe.get("hugepagesize_kb"),
            "probe_complete": bool(probe.get("complete"))}


def pod_record(pod: dict | None) -> dict[str, Any]:
    """What a pod's status says, as evidence: its node, phase, and per container the exit code
    and the image's pulled digest (imageID)."""
    status = (pod or {}).get("status") or {}
    return {"node": ((pod or {}).get("spec") or {}).get("nodeName"),
            "phase": status.get("phase"),
            "containers": [{"name": c.get("name"), "image": c.get("image"),
                            "image_id": c.get("imageID"),
                            "exit_code": ((c.get("state") or {}).get("terminated") or {}).get(
                                "exitCode")} for c in status.get("containerStatuses") or []]}


def unschedulable(pod: dict) -> str | None:
    for c in (pod.get("status") or {}).get("conditions") or []:
        if c.get("type") == "PodScheduled" and c.get("status") == "False":
            return c.get("message") or c.get("reason") or "unschedulable"
    return None


def is_ready(pod: dict | None) -> bool:
    return bool(pod) and any(c.get("type") == "Ready" and c.get("status") == "True"
                             for c in (pod.get("status") or {}).get("conditions") or [])


def is_finished(pod: dict | None) -> bool:
    return bool(pod) and (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed")


def phase_of(pod: dict | None) -> str:
    if not pod:
        return "absent"
    return (pod.get("status") or {}).get("phase") or "?"


def exit_code(pod: dict | None) -> int | None:
    for c in ((pod or {}).get("status") or {}).get("containerStatuses") or []:
        term = (c.get("state") or {}).get("terminated")
        if term is not None:
            return int(term.get("exitCode", -1))
    return None


_UNITS = {"Ki": 2 ** 10, "Mi": 2 ** 20, "Gi": 2 ** 30, "Ti": 2 ** 40, "k": 10 ** 3,
          "M": 10 ** 6, "G": 10 ** 9, "T": 10 ** 12}


def _bytes(quantity: str) -> int:
    for unit, factor in _UNITS.items():
        if quantity.endswith(unit):
            return int(float(quantity[:-len(unit)]) * factor)
    return int(float(quantity or 0))


def _cpu(quantity: str) -> float:
    return float(quantity[:-1]) / 1000 if quantity.endswith("m") else float(quantity or 0)
