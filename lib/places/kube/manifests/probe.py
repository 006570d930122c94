"""The node probe: one short pod per node that prints what 00 gates on (gdrdrv, EFA devices,
hugepages) in the line format PROBE_FORMAT describes; `parse_probe_log` reads it back.

Pure: values in, plain dicts out.
"""
from __future__ import annotations

import hashlib
import re
from typing import Any, Mapping, Sequence

from lib.places.kube.manifests.common import (DEFAULT_NAMESPACE, LABEL_VALUE_MAX, RUN_LABEL_HASH,
                                         _check_kube_expansion, _image, _resources,
                                         _tolerations, labels)

PROBE_NAME_PREFIX = "guide-probe-"
PROBE_STAGE = "00_cluster"  # the stage that renders it (lib.stages.registry's name)
# The probe's read-only view of the host: /sys, and /proc/meminfo as one file.
PROBE_HOST_ROOT = "/host"
# Small, and Guaranteed QoS like everything else.
PROBE_CPU_MEMORY = ("100m", "64Mi")
PROBE_DEADLINE_S = 300  # the probe reads a few files; a pod still running after this is stuck

# The line format of the node probe (one `guide-probe KEY=VALUE` per fact, then `guide-probe end`).
PROBE_FORMAT = """\
guide-probe node=<the node's name, from the pod's spec.nodeName>
guide-probe gdrdrv=<the text of /sys/module/gdrdrv/version | absent | unreadable>
guide-probe efa=<comma-separated names under /sys/class/infiniband whose device/uevent holds the line DRIVER=efa | none>
guide-probe hugepages_total=<HugePages_Total of /proc/meminfo | absent>
guide-probe hugepagesize_kb=<Hugepagesize of /proc/meminfo, in kB | absent>
guide-probe hugepages_2mi=<pages in /sys/kernel/mm/hugepages/hugepages-2048kB/nr_hugepages | absent>
guide-probe end
"""
PROBE_PREFIX = "guide-probe"
PROBE_KEYS = ("node", "gdrdrv", "efa", "hugepages_total", "hugepagesize_kb", "hugepages_2mi")


def probe_script() -> str:
    """The probe's POSIX sh script (its output: PROBE_FORMAT). HOST_ROOT (default /host) is
    where the host's /sys and /proc/meminfo are mounted; a test points it at a fake tree."""
    p = PROBE_PREFIX
    return f"""\
set -eu
root="${{HOST_ROOT:-{PROBE_HOST_ROOT}}}"
echo "{p} node=${{NODE_NAME:-unknown}}"
f="$root/sys/module/gdrdrv/version"
if [ -e "$f" ]; then
  v=""
  read -r v < "$f" || true
  echo "{p} gdrdrv=${{v:-unreadable}}"
else
  echo "{p} gdrdrv=absent"
fi
efa=""
for d in "$root"/sys/class/infiniband/*; do
  [ -r "$d/device/uevent" ] || continue
  if grep -qx 'DRIVER=efa' "$d/device/uevent"; then
    efa="${{efa:+$efa,}}${{d##*/}}"
  fi
done
echo "{p} efa=${{efa:-none}}"
total=absent
size=absent
while read -r key value _; do
  case "$key" in
    HugePages_Total:) total="$value" ;;
    Hugepagesize:) size="$value" ;;
  esac
done < "$root/proc/meminfo"
echo "{p} hugepages_total=$total"
echo "{p} hugepagesize_kb=$size"
f="$root/sys/kernel/mm/hugepages/hugepages-2048kB/nr_hugepages"
n=absent
if [ -r "$f" ]; then
  read -r n < "$f" || true
fi
echo "{p} hugepages_2mi=${{n:-absent}}"
echo "{p} end"
"""


def probe_pod_name(node: str) -> str:
    """`guide-probe-<node>`: the node name (as `kubectl get nodes` lists it) lower-cased, every
    other character '-', and, when that changed, cut or emptied it, a hash of the node name (so
    two nodes never share a pod name, and every name is a valid one)."""
    slug = re.sub(r"[^a-z0-9-]+", "-", node.lower()).strip("-")
    room = LABEL_VALUE_MAX - len(PROBE_NAME_PREFIX)
    if slug and slug == node and len(slug) <= room:
        return PROBE_NAME_PREFIX + slug
    digest = hashlib.sha256(node.encode()).hexdigest()[:RUN_LABEL_HASH]
    head = slug[:room - RUN_LABEL_HASH - 1].strip("-")
    return f"{PROBE_NAME_PREFIX}{head + '-' if head else ''}{digest}"


def node_probe_pod(*, run_id: str, node: str, image: str, namespace: str = DEFAULT_NAMESPACE,
                   stage: str = PROBE_STAGE,
                   tolerations: Sequence[Mapping[str, Any]] | None = None) -> dict[str, Any]:
    """One short pod on `node` printing the facts PROBE_FORMAT lists.

    Pinned with nodeName (no scheduler: the node is probed even when its GPUs are all taken or
    its taints would repel the pod). It needs no privileges: not privileged, no capabilities
    (all dropped), a non-root user (65534), a read-only root file system; it only reads two
    read-only hostPath mounts (/sys, /proc/meminfo), which are world-readable. A namespace that
    enforces the `baseline` Pod Security level refuses hostPath volumes, though: run the probe
    where the `privileged` level is allowed (as the GPU pods need anyway).
    """
    image, pull = _image(image)
    meta_labels = labels(run_id, stage, "probe")
    cpu, memory = PROBE_CPU_MEMORY
    container = {
        "name": "probe",
        "image": image,
        "imagePullPolicy": pull,
        "command": ["sh", "-c", probe_script()],
        "env": [{"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}],
        "resources": _resources(cpu=cpu, memory=memory),
        "securityContext": {
            "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
            "runAsNonRoot": True, "runAsUser": 65534, "runAsGroup": 65534,
            "capabilities": {"drop": ["ALL"]},
        },
        "volumeMounts": [
            {"name": "host-sys", "mountPath": f"{PROBE_HOST_ROOT}/sys", "readOnly": True},
            {"name": "host-meminfo", "mountPath": f"{PROBE_HOST_ROOT}/proc/meminfo",
             "readOnly": True},
        ],
    }
    _check_kube_expansion("node probe", container["command"], ["NODE_NAME"])
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": probe_pod_name(node), "namespace": namespace,
                     "labels": meta_labels},
        "spec": {
            "nodeName": node,
            "restartPolicy": "Never",
            "activeDeadlineSeconds": PROBE_DEADLINE_S,
            "automountServiceAccountToken": False,
            "enableServiceLinks": False,
            "tolerations": _tolerations(tolerations),
            "containers": [container],
            "volumes": [
                {"name": "host-sys", "hostPath": {"path": "/sys", "type": "Directory"}},
                {"name": "host-meminfo", "hostPath": {"path": "/proc/meminfo", "type": "File"}},
            ],
        },
    }


_PROBE_LINE = re.compile(rf"(?:^|\s){PROBE_PREFIX} (?:(end)|([a-z_0-9]+)=(\S*))\s*$")


def parse_probe_log(text: str) -> dict[str, Any]:
    """The facts of one probe pod's log (lines of PROBE_FORMAT; other lines, and a `kubectl logs
    --prefix` before each, are ignored):

        node (str | None), gdrdrv (version str, None when absent; 'unreadable' as printed),
        efa_devices (list of names), hugepages_total, hugepagesize_kb, hugepages_2mi (int, None
        when absent), complete (the end line was seen, after every key).

    Raises ValueError when a key is printed twice with different values (two logs run together)
    or a number is not one."""
    raw: dict[str, str] = {}
    ended = False
    for line in text.splitlines():
        m = _PROBE_LINE.search(line)
        if not m:
            continue
        if m.group(1):
            ended = True
            continue
        key, value = m.group(2), m.group(3)
        if key not in PROBE_KEYS:
            continue
        if key in raw and raw[key] != value:
            raise ValueError(f"the probe log holds {key}={raw[key]} and {key}={value}: more than "
                             "one node's log in one text")
        raw[key] = value

    def number(key: str) -> int | None:
        value = raw.get(key)
        if value in (None, "", "absent"):
            return None
        if not value.isdigit():
            raise ValueError(f"the probe printed {key}={value!r}: not a number of pages or kB")
        return int(value)

    efa = raw.get("efa")
    gdrdrv = raw.get("gdrdrv")
    return {
        "node": raw.get("node"),
        "gdrdrv": None if gdrdrv in (None, "", "absent") else gdrdrv,
        "efa_devices": [] if efa in (None, "", "none") else efa.split(","),
        "hugepages_total": number("hugepages_total"),
        "hugepagesize_kb": number("hugepagesize_kb"),
        "hugepages_2mi": number("hugepages_2mi"),
        "complete": ended and all(k in raw for k in PROBE_KEYS),
    }
