"""Reading what kubectl says of pods and nodes, for the kube place (lib.places.kube): pure
functions of the JSON `kubectl get ... -o json` prints (a pod's trouble in its status' own
words: a waiting reason it will not get past, OOMKilled, Evicted; a node's Ready condition;
whether a serve's pods held through it), and the names and selectors of the objects a stage
applies. The waits that poll them are lib.places.kube.waits."""
from __future__ import annotations

import json
import hashlib
import re
from typing import Any

from lib.core.errors import NotScheduled
import lib.places.kube.manifests as manifests  # the renderers themselves, not lib.places (no cycle through it)

POLL_S = 2.0  # between two looks at a pod's status (the kube place's waits)


# Taints that keep a pod off a node unless it tolerates them (PreferNoSchedule only steers)
BLOCKING_EFFECTS = ("NoSchedule", "NoExecute")


def untolerated(node: dict) -> list[str]:
    """The node's taints that no pod of the guide tolerates (its pods carry
    manifests.DEFAULT_TOLERATIONS), each as `key=value:effect`: the scheduler places none of
    them there (Kubernetes' taint and toleration matching: same key, or an Exists toleration
    without one; same effect, or a toleration without one; Equal needs the same value)."""
    return [f"{t['key']}" + (f"={t['value']}" if t.get("value") else "") + f":{t.get('effect')}"
            for t in (node.get("spec") or {}).get("taints") or []
            if t.get("effect") in BLOCKING_EFFECTS
            and not any(tolerates(toleration, t) for toleration in manifests.DEFAULT_TOLERATIONS)]


def tolerates(toleration: dict, taint: dict) -> bool:
    """Kubernetes' matching of one toleration and one taint."""
    if toleration.get("effect") and toleration["effect"] != taint.get("effect"):
        return False
    if toleration.get("operator", "Equal") == "Exists":
        return not toleration.get("key") or toleration["key"] == taint["key"]
    return (toleration.get("key") == taint["key"]
            and toleration.get("value", "") == taint.get("value", ""))


# A node condition that, True, keeps pods off the node or evicts them: the kubelet's pressure
# conditions (the node-pressure eviction signals) and the network's (Kubernetes' Node status,
# "Conditions": MemoryPressure, DiskPressure, PIDPressure, NetworkUnavailable).
TROUBLE_CONDITIONS = ("MemoryPressure", "DiskPressure", "PIDPressure", "NetworkUnavailable")


def troubled(node: dict) -> list[str]:
    """The node's conditions that say it cannot take the guide's pods, in the kubelet's words:
    Ready not True (its status and reason), and each of TROUBLE_CONDITIONS that is True, as
    `Type: reason: message`."""
    said = []
    conditions = (node.get("status") or {}).get("conditions") or []
    for c in conditions:
        bad = (c.get("status") != "True" if c.get("type") == "Ready"
               else c.get("type") in TROUBLE_CONDITIONS and c.get("status") == "True")
        if bad:
            words = [w for w in (c.get("reason"), c.get("message")) if w]
            said.append(f"{c['type']}={c.get('status')}" + (f": {': '.join(words)}" if words
                                                             else ""))
    if not any(c.get("type") == "Ready" for c in conditions):
        said.append("Ready: no such condition (the kubelet never reported)")
    return said


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
        "untolerated_taints": untolerated(node),
        "troubled_conditions": troubled(node),
        "cpu_cores": _cpu(alloc.get("cpu", "0")),
        "memory_gib": round(quantity_bytes(alloc.get("memory", "0")) / 2 ** 30, 1),
        "gpus": [{"index": i} for i in range(int(alloc.get(manifests.GPU_RESOURCE, 0)))],
        "efa_allocatable": int(alloc.get(manifests.EFA_RESOURCE, 0)),
        "hugepages_2mi_bytes": quantity_bytes(alloc.get("hugepages-2Mi", "0")),
        "kubectl_client": (versions.get("clientVersion") or {}).get("gitVersion"),
        "cluster_access": (f"kube-apiserver {(versions.get('serverVersion') or {}).get('gitVersion')}"
                           if versions.get("serverVersion") else None),
    }


def object_name(what: str) -> str:
    """A name for a group of objects, as the manifests' NAME_RULE takes it (a DNS-1035 label of at
    most NAME_MAX: `test_ep at 128 tokens` -> `test-ep-at-128-tokens`). A slug over the limit
    keeps its head and a digest of the whole, so two long names that differ only at the end (an
    A/B's AIPerf Jobs `...-decode-c1-r1` and `...-r2`) stay two names; a slug within the limit
    is itself (recorded runs name their objects so), with `job-` before one that does not begin
    with a letter (a Service's name must)."""
    slug = re.sub(r"[^a-z0-9]+", "-", what.lower()).strip("-") or "job"
    if not slug[0].isalpha():
        slug = f"job-{slug}"
    if len(slug) <= manifests.NAME_MAX:
        return slug
    digest = hashlib.sha256(slug.encode()).hexdigest()[:8]
    return f"{slug[:manifests.NAME_MAX - len(digest) - 1].rstrip('-')}-{digest}"


def stage_selector(run_id: str, stage: str) -> str:
    """The objects of one stage of one run."""
    found = manifests.labels(run_id, stage, "any")
    return ",".join(f"{k}={found[k]}" for k in (manifests.RUN_LABEL, manifests.STAGE_LABEL))


def probe_facts(probe: dict) -> dict[str, Any]:
    """A node probe's findings (lib.places.kube.manifests.parse_probe_log), in 00's keys."""
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


def ran_when(pod: dict | None) -> tuple[str | None, str | None]:
    """When the pod's first container started and finished (RFC 3339, the kubelet's), or
    None where its status does not say."""
    for c in ((pod or {}).get("status") or {}).get("containerStatuses") or []:
        state = c.get("state") or {}
        ran = state.get("terminated") or state.get("running") or {}
        return ran.get("startedAt"), ran.get("finishedAt")
    return None, None


def unschedulable(pod: dict) -> str | None:
    for c in (pod.get("status") or {}).get("conditions") or []:
        if c.get("type") == "PodScheduled" and c.get("status") == "False":
            return c.get("message") or c.get("reason") or "unschedulable"
    return None


def _quantity(resource: str, value: str) -> float:
    return _cpu(value) if resource == "cpu" else float(quantity_bytes(value))


def pod_requests(pod: dict) -> dict[str, str]:
    """What the pod asks of a node, by resource: its containers' requests, a limit standing for
    a request it lacks (Kubernetes defaults a missing request to the limit), summed."""
    total: dict[str, float] = {}
    shown: dict[str, str] = {}
    for c in (pod.get("spec") or {}).get("containers") or []:
        res = c.get("resources") or {}
        asked = {**(res.get("limits") or {}), **(res.get("requests") or {})}
        for name, value in asked.items():
            total[name] = total.get(name, 0.0) + _quantity(name, str(value))
            shown[name] = str(value) if name not in shown else f"{total[name]:g}"
    return shown


def why_not_on(pod: dict, node: dict) -> list[str]:
    """What keeps `pod` off `node`, from the node's own object: cordoned, a condition
    (`troubled`), a taint no toleration of the guide matches, a nodeSelector label it lacks, a
    resource whose allocatable is below the pod's request (what other pods already hold is not
    counted: the scheduler's own words say "Insufficient" for that)."""
    said = []
    spec, meta = node.get("spec") or {}, node.get("metadata") or {}
    if spec.get("unschedulable"):
        said.append("cordoned (spec.unschedulable)")
    said += troubled(node)
    said += [f"taint {t}" for t in untolerated(node)]
    labels = meta.get("labels") or {}
    for key, value in ((pod.get("spec") or {}).get("nodeSelector") or {}).items():
        if labels.get(key) != value:
            said.append(f"label {key}={labels.get(key)!r}, the pod selects {value!r}")
    alloc = (node.get("status") or {}).get("allocatable") or {}
    for name, value in pod_requests(pod).items():
        offered = alloc.get(name, "0")
        if _quantity(name, str(offered)) < _quantity(name, value):
            said.append(f"{name} allocatable {offered}, the pod asks {value}")
    return said


def nodes_said(pod: dict, nodes: list[dict]) -> str:
    """Per node, what keeps the pod off it (`why_not_on`), or that it offers all the pod asks
    (then other pods hold it)."""
    parts = []
    for node in nodes:
        name = (node.get("metadata") or {}).get("name", "?")
        why = why_not_on(pod, node)
        parts.append(f"{name}: " + ("; ".join(why) if why else
                                    "offers all the pod asks (other pods hold some of it?)"))
    return " | ".join(parts)


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


def quantity_bytes(quantity: str) -> int:
    """A Kubernetes quantity ('5120Mi', '5Gi', '16') in bytes or units."""
    for unit, factor in _UNITS.items():
        if quantity.endswith(unit):
            return int(float(quantity[:-len(unit)]) * factor)
    return int(float(quantity or 0))


def _cpu(quantity: str) -> float:
    return float(quantity[:-1]) / 1000 if quantity.endswith("m") else float(quantity or 0)


# ---- a pod's trouble, as its status says it ----------------------------------------------------
# Waiting reasons the kubelet does not get past by itself: it retries the pull (with a back-off
# up to 300 s) or the container's config, but the image or the missing Secret/ConfigMap will not
# change under it. A wait stops at once on them rather than at its schedule timeout (the pod is
# Pending throughout: kubernetes/kubernetes#96186), as Shopify/krane#124 does on its deploys.
STUCK_WAITING = ("ErrImagePull", "ImagePullBackOff", "ErrImageNeverPull", "InvalidImageName",
                 "CreateContainerConfigError", "CreateContainerError")


class PodStuck(NotScheduled):
    """A Pending pod that will not start: a container waits on one of STUCK_WAITING. str() is
    'pod <name> on node <node>: <reason>: <the kubelet's message>', one per pod, '; '-joined.
    A NotScheduled, so every wait's caller stops the same way."""


class PodsNotCreated(PodStuck):
    """A controller could not create a serve's pods: its FailedCreate events (an admission's
    refusal, a quota), quoted. Raised by the wait, so it stops there and not at its timeout."""


def failed_creations(got: dict | None) -> str | None:
    """What a controller's FailedCreate Warning events (`kubectl get events -o json`) say, each
    message once ('; '-joined), in the controller's words: 'create Pod vllm-0 in StatefulSet
    vllm failed error: pods "vllm-0" is forbidden: ...'; None when there are none."""
    said = []
    for e in (got or {}).get("items") or []:
        message = (e.get("message") or "").strip()
        if e.get("type") == "Warning" and e.get("reason") == "FailedCreate" and message \
                and message not in said:
            said.append(message)
    return "; ".join(said) or None


def node_of(pod: dict | None) -> str | None:
    return ((pod or {}).get("spec") or {}).get("nodeName")


def where_pod(name: str, pod: dict | None) -> str:
    return f"pod {name} on node {node_of(pod) or '(none yet)'}"


def _containers(pod: dict | None) -> list[dict]:
    status = (pod or {}).get("status") or {}
    return [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]


def stuck_reason(pod: dict | None) -> str | None:
    """'<reason>: <message>' of the first container waiting on a STUCK_WAITING reason."""
    for c in _containers(pod):
        waiting = (c.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") in STUCK_WAITING:
            message = waiting.get("message")
            return f"{waiting['reason']}: {message}" if message else waiting["reason"]
    return None


def restarted(pod: dict | None) -> bool:
    """Whether the kubelet restarted a container of the pod (restartCount > 0)."""
    return any(c.get("restartCount") for c in _containers(pod))


def trouble(pod: dict | None) -> str | None:
    """Why a pod is not running as asked, in the status' own words: the pod evicted
    ('Evicted: The node was low on resource: memory. ...'), a container terminated by the
    kernel or with an error ('OOMKilled (exit 137)', 'Error (exit 1)'; a serve pod's, restarted
    by its restartPolicy Always, from its lastState: 'OOMKilled (exit 137), restarted 1
    time(s); now CrashLoopBackOff'), or waiting stuck (stuck_reason); None when its status
    says nothing wrong."""
    status = (pod or {}).get("status") or {}
    if status.get("phase") == "Failed" and status.get("reason"):
        return f"{status['reason']}: {status.get('message') or ''}".rstrip(": ")
    for c in _containers(pod):
        state = c.get("state") or {}
        term, last = state.get("terminated"), (c.get("lastState") or {}).get("terminated")
        if term and (term.get("exitCode") or term.get("reason") not in (None, "Completed")):
            return f"{term.get('reason') or 'terminated'} (exit {term.get('exitCode')})"
        if last and c.get("restartCount"):  # restartPolicy Always: the kubelet started it anew
            now = (state.get("waiting") or {}).get("reason")
            return (f"{last.get('reason') or 'terminated'} (exit {last.get('exitCode')}), "
                    f"restarted {c['restartCount']} time(s)" + (f"; now {now}" if now else ""))
    return stuck_reason(pod)


def node_condition(node: dict | None) -> str | None:
    """'Ready=<status> (<reason>: <message>)' of a node whose Ready condition is not True
    ('Ready=Unknown (NodeStatusUnknown: Kubelet stopped posting node status.)', as the node
    lifecycle controller writes it); None when Ready or not known."""
    for c in ((node or {}).get("status") or {}).get("conditions") or []:
        if c.get("type") == "Ready" and c.get("status") != "True":
            return (f"Ready={c.get('status')} ({c.get('reason') or '?'}: "
                    f"{c.get('message') or ''})")
    return None


def uid_of(pod: dict | None) -> str | None:
    return ((pod or {}).get("metadata") or {}).get("uid")


def events_said(got: dict | None) -> str | None:
    """The Warning events of `kubectl get events -o json` as '<reason>: <message>' ('; '-joined):
    what the kubelet said of a pod that is gone (Evicted, with its eviction message)."""
    said = [f"{e.get('reason')}: {(e.get('message') or '').strip()}"
            for e in (got or {}).get("items") or [] if e.get("type") == "Warning"]
    return "; ".join(said) or None


def held_through(pods: dict[str, dict | None], nodes: dict[str, dict | None],
                 before: dict[str, dict] | None = None,
                 said_of: dict[str, str | None] | None = None) -> dict[str, str]:
    """Every pod of a serve that was Ready and is not now, with why: its status' trouble, else
    its node's Ready condition, else 'not Ready' (or 'gone'). `nodes`: node name -> the Node.
    A pod whose uid is not the one it had when Ready (`before`) was replaced by its controller
    (a StatefulSet deletes a Failed pod and makes it anew): why is what the events said of the
    first one (`said_of`: uid -> events_said), on the first one's node."""
    lost = {}
    for name, pod in pods.items():
        first = (before or {}).get(name)
        if first and uid_of(first) != uid_of(pod):
            said = (said_of or {}).get(uid_of(first)) or "no event kept of why"
            lost[name] = (f"{where_pod(name, first)}: {said} (the pod "
                          f"{'replaced by its controller' if pod else 'gone'})")
            continue
        if pod is None:
            lost[name] = f"pod {name}: gone"
            continue
        why = trouble(pod)
        if why is None and is_ready(pod):
            continue
        node = node_of(pod)
        said = node_condition(nodes.get(node)) if node else None
        lost[name] = (f"{where_pod(name, pod)}: {why or 'not Ready'}"
                      + (f"; node {node} {said}" if said else ""))
    return lost


def held_gate(pods: dict[str, dict | None], before: dict[str, dict], get_node, get_events,
              evidence: list[str]):
    """The gate of a serve that was Ready (`before`: its pods then), looked at once more as it
    ends: every pod the same and still Ready, none OOMKilled, evicted (or replaced after it),
    or on a node gone NotReady (held_through: the pod, its node and the reason).
    `get_node(name)`, `get_events(uid)`: the Node, the events of a pod, as kubectl gets them."""
    from lib.core.evidence import gate

    nodes = {node: get_node(node) for node in sorted(
        {node_of(p) for p in pods.values() if p and not is_ready(p)} - {None})}
    gone = [uid_of(p) for n, p in before.items() if uid_of(p) != uid_of(pods.get(n))]
    lost = held_through(pods, nodes, before, {uid: events_said(get_events(uid)) for uid in gone})
    return gate("every pod held through the serve", not lost,
                {pod: phase_of(p) for pod, p in pods.items()}, "every pod Ready",
                "; ".join(lost.values()) if lost else
                f"every pod of the serve Ready as it ends ({len(pods)})", evidence)


def foreign_objects(get_stdout: str, run_label: str) -> list[str]:
    """What `kubectl get -f <file> -o json --ignore-not-found` found of a file's objects that
    another run applied (its run label is not `run_label`): 'Kind/name (run <theirs>)'."""
    try:
        got = json.loads(get_stdout) if get_stdout.strip() else {}
    except ValueError:
        return []
    items = got.get("items") if got.get("kind") == "List" else ([got] if got else [])
    theirs = []
    for o in items or []:
        meta = o.get("metadata") or {}
        label = (meta.get("labels") or {}).get(manifests.RUN_LABEL)
        if label != run_label:
            theirs.append(f"{o.get('kind')}/{meta.get('name')} (run {label or 'unlabelled'})")
    return theirs
