"""Kubernetes objects as data, for the kube place and for what its plan records.

Pure functions: parameters in, plain dicts out (JSON-able, in Kubernetes' own field names);
nothing here talks to a cluster. The kube place applies them with kubectl; the plan place
writes them (`to_yaml`) and checks them (`validate_argv`: kubernetes-validate --strict;
`embedded_scripts`: the shell scripts inside them, for shellcheck).

What is rendered, and from what:

- `node_probe_pod`: one short pod per node that prints what 00 gates on (gdrdrv, EFA devices,
  hugepages) in the line format `PROBE_FORMAT` describes; `parse_probe_log` reads it back.
- `rank_objects`: a multi-node job of one process per node (DeepEP's test_ep, which spawns its
  own per-GPU ranks, or torchrun): a headless Service plus one Pod per node; node 0 is the
  rendezvous by DNS. `kernel_test_objects` fills it from lib.engines.deepep.
- `vllm_objects`: the serve as a StatefulSet (pod 0 the leader, the others `--headless`
  workers), a headless Service for the rendezvous and a second Service, for HTTP, that selects
  pod 0 only. `leaderworkerset_objects`: the same serve as a LeaderWorkerSet.
  Every vLLM argv and env comes from lib.engines.vllm_args.vllm_serve, the one builder.
- `aiperf_job`: a Job running AIPerf against the leader's Service, which then prints its
  artifact folder into its log (lib.places.stream.pack_command).

What the public reproductions got wrong, and what this module does instead, is said beside
each choice; ANCHORS = ../shared/reference/ANCHORS.md (R, V, PR = the reproductions and the
public review as summarised there), DESIGN = ../shared/DESIGN.md "Kubernetes objects
(04_serve), from what the anchors got wrong". Every number and name is a module constant below.
"""
from __future__ import annotations

import copy
import hashlib
import re
import shlex
from pathlib import PurePosixPath
from typing import Any, Callable, Iterable, Mapping, Sequence

import yaml

from lib.core.errors import ParameterError
from lib.core.params import DNS1123_LABEL, IMAGE_RULE, MODEL_ID_RULE, RUN_ID_RULE
from lib.engines.deepep import test_ep_argv, test_ep_env
from lib.engines.model_facts import routed_experts
from lib.engines.transport import DEFAULT_PLUGIN_PATH, transport_env, unset_vars
from lib.engines.vllm_args import CLI_MODULE, MAX_EP_NUM_COMMS, vllm_serve
from lib.places.base import NodeRank
from lib.places.instances import DEFAULT_INSTANCE_TYPE, INSTANCE_TYPES
from lib.places.stream import NAME_RULE as ARTIFACT_NAME_RULE
from lib.places.stream import pack_command
from lib.roots import pins as pins_mod

# ---- labels and annotations --------------------------------------------------------------------
# Every object carries the run, the stage and its role, so `kubectl delete -l <run_selector>`
# removes everything a run made, and the evidence can name what it looked at.
RUN_LABEL = "guide.repro/run"
STAGE_LABEL = "guide.repro/stage"
ROLE_LABEL = "guide.repro/role"
# Which group of objects (a serve, a rank job, an AIPerf job) an object belongs to: selectors
# use it, so two groups of one run and stage never select each other's pods.
GROUP_LABEL = "guide.repro/group"
NODE_RANK_LABEL = "guide.repro/node-rank"  # rank_objects: the pod's node rank
# The reason written beside every `privileged: true` (DESIGN: "privileged only with its reason
# written beside it").
PRIVILEGED_WHY_ANNOTATION = "guide.repro/privileged-why"
PRIVILEGED_WHY = (
    "gdrcopy: DeepEP's GIN proxy over EFA opens /dev/gdrdrv; in a non-privileged container "
    "gdr_open fails with EPERM, NCCL reports ginType NONE and ElasticBuffer asserts (ANCHORS 1.4, "
    "R's as-run manifest; ANCHORS 4). Privileged grants every capability, so none is added "
    "(IPC_LOCK and the like are redundant under it: the public review, ANCHORS 4)")
# Set by the StatefulSet controller on each pod it makes: `<statefulset>-<ordinal>`.
POD_NAME_LABEL = "statefulset.kubernetes.io/pod-name"
HOSTNAME_LABEL = "kubernetes.io/hostname"
# The well-known node label EKS sets to the EC2 instance type.
INSTANCE_TYPE_LABEL = "node.kubernetes.io/instance-type"

# Kubernetes label values: at most 63 characters, alphanumerics with '-', '_', '.' inside,
# beginning and ending with an alphanumeric (or empty).
LABEL_VALUE_MAX = 63
LABEL_VALUE_RULE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
# A run id that is not a valid label value (64 characters, or ending in '.', '_' or '-') is
# labelled as: its first RUN_LABEL_HEAD characters without trailing '.', '_', '-', then '-',
# then the first RUN_LABEL_HASH hex digits of its sha256 (54 + 1 + 8 = 63).
RUN_LABEL_HEAD = 54
RUN_LABEL_HASH = 8

# Object names: DNS-1035 labels (a Service's name must begin with a letter). At most 40
# characters: a StatefulSet's pods carry `controller-revision-hash: <name>-<10 characters>`,
# and `<name>-http` must stay a 63-character label.
NAME_RULE = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
NAME_MAX = 40

# ---- defaults ----------------------------------------------------------------------------------
DEFAULT_NAMESPACE = "deepep-repro"  # the `namespace` parameter's default (lib.stages.registry)
# vLLM's docs warn not to name a Service `vllm`: Kubernetes would inject VLLM_PORT and the like,
# which vLLM reads as its own settings. The pods and the rendezvous Service (headless: no
# variables are injected for it) are `vllm`; the HTTP Service is `vllm-http`; and every pod here
# sets enableServiceLinks: false, so no Service's variables reach any process.
DEFAULT_SERVE_NAME = "vllm"
HTTP_SERVICE_SUFFIX = "-http"
DEFAULT_RANK_NAME = "test-ep"
DEFAULT_AIPERF_NAME = "aiperf"
PROBE_NAME_PREFIX = "guide-probe-"
# The stages that render each kind (lib.stages.registry's names).
PROBE_STAGE = "00_cluster"
KERNEL_STAGE = "03_kernel_test"
SERVE_STAGE = "04_serve"
SWEEP_STAGE = "05_sweep"

# ---- ports -------------------------------------------------------------------------------------
# vLLM's HTTP port, as the public serve used it (ANCHORS 1.4: leader `--port 8000`).
HTTP_PORT = 8000
# vLLM's --data-parallel-rpc-port: R's README says 29570 (its script 29500: ANCHORS 4, drift);
# the README's value, and one port for every rendering.
DP_RPC_PORT = 29570
# test_ep's init_dist default MASTER_PORT at b306af06 (ANCHORS 1.3).
RDZV_PORT = 8361

# ---- resources ---------------------------------------------------------------------------------
GPU_RESOURCE = "nvidia.com/gpu"  # the NVIDIA device plugin's resource
EFA_RESOURCE = "vpc.amazonaws.com/efa"  # the EFA device plugin's resource
HUGEPAGES_RESOURCE = "hugepages-2Mi"
# libfabric's EFA provider backs its internal buffers with huge pages when the node has them;
# the public manifests asked hugepages-2Mi 8Gi (R) and 5120Mi (PR) (ANCHORS 1.4). What
# pre-allocates them: the node's kernel boot parameters (hugepagesz=2M hugepages=N) or a
# DaemonSet that writes vm.nr_hugepages on the node. The kubelet advertises hugepages-2Mi only
# for pages that exist: without that, every pod here stays Pending ("Insufficient
# hugepages-2Mi"), which 00's probe (hugepages_2mi) shows before anything is scheduled.
HUGEPAGES_2MI = "5120Mi"
# CPU and memory each GPU pod asks for (requests == limits: Guaranteed QoS), per instance type.
# Both p5en.48xlarge and p5.48xlarge have 192 vCPUs and 2048 GiB; the pod leaves ~1/6 of each to
# the kubelet's reservations, the DaemonSets (NVIDIA and EFA device plugins, CNI) and the huge
# pages, which come out of the node's memory. (R asked 32 CPUs and 1400Gi..1500Gi: ANCHORS 1.4.)
POD_CPU_MEMORY = {
    "p5en.48xlarge": ("160", "1600Gi"),
    "p5.48xlarge": ("160", "1600Gi"),
}
# /dev/shm as a Memory emptyDir (a container's default /dev/shm is 64 MB): NCCL's and torch's
# shared memory between the per-GPU processes of a node. It counts against the memory limit.
# V's manifest used 64Gi (ANCHORS 1.4).
SHM_SIZE = "64Gi"
# The node probe and the AIPerf client: small, and Guaranteed QoS like everything else.
PROBE_CPU_MEMORY = ("100m", "64Mi")
AIPERF_CPU_MEMORY = ("8", "16Gi")
# The taints GPU and EFA node groups carry; V's manifest tolerated both (ANCHORS 1.4).
DEFAULT_TOLERATIONS: tuple[dict[str, str], ...] = (
    {"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"},
    {"key": EFA_RESOURCE, "operator": "Exists", "effect": "NoSchedule"},
)

# ---- paths in the containers ---------------------------------------------------------------------
SHM_PATH = "/dev/shm"
# The model weights on the node's instance storage (hostPath `model_cache_dir`), mounted here and
# named HF_HOME: one download per node, kept between runs, and not on the root EBS volume (PR's
# `emptyDir sizeLimit: 900Gi` landed on root-volume ephemeral storage: ANCHORS 4).
MODEL_CACHE_PATH = "/model-cache"
# The probe's read-only view of the host: /sys, and /proc/meminfo as one file.
PROBE_HOST_ROOT = "/host"
# AIPerf's artifacts: an emptyDir, printed into the log before the pod ends.
ARTIFACT_ROOT = "/artifacts"

# ---- timing ------------------------------------------------------------------------------------
PROBE_DEADLINE_S = 300  # the probe reads a few files; a pod still running after this is stuck
# A finished AIPerf Job (and its pod, and so its log) is deleted this long after it ends: long
# enough for the stage to read the log, short enough that nothing piles up in the namespace.
AIPERF_TTL_S = 3600
READINESS_PERIOD_S = 10

# ---- tokens ------------------------------------------------------------------------------------
# A Hugging Face token only ever comes from a Secret (key HF_TOKEN_KEY): never as a value.
HF_TOKEN_ENV = "HF_TOKEN"
HF_TOKEN_KEY = "token"
TOKEN_VARS = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")

# ---- validation --------------------------------------------------------------------------------
VALIDATOR = "kubernetes-validate"
# The newest Kubernetes version EKS runs among those kubernetes-validate 1.37.0 bundles
# (1.25..1.37): 1.36. The EKS user guide's version-lifecycle page names 1.36 as its newest
# version (2026), and EKS Anywhere v0.26.1 (2026-08) supports 1.33..1.36; no EKS 1.37 was found
# when this was written (2026-12). Move it when EKS adds a version the package bundles.
KUBE_VERSION = "1.36"
# Fields that the test control plane (Kubernetes 1.20.2, tests/kubeplane.py) does not serve as
# they are served today, so kubernetes-validate at KUBE_VERSION is their only check. Dropped
# before a dry run against 1.20 (`for_kube_1_20`).
NEWER_THAN_1_20: dict[str, str] = {
    "Job spec.ttlSecondsAfterFinished":
        "beta and on by default from 1.21; 1.20's API server drops it unless the alpha "
        "TTLAfterFinished feature gate is on",
}

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


# ---- labels --------------------------------------------------------------------------------------
def run_label_value(run_id: str) -> str:
    """The run id as a label value: itself when valid, else the derivation RUN_LABEL_HEAD /
    RUN_LABEL_HASH describe (deterministic: the same run id always gives the same value)."""
    if not isinstance(run_id, str) or not RUN_ID_RULE.match(run_id) or ".." in run_id:
        raise ParameterError("run_id", run_id, "letters, digits, '.', '_', '-' (1-64 chars, "
                             "starting with a letter or digit, no '..')")
    if len(run_id) <= LABEL_VALUE_MAX and LABEL_VALUE_RULE.match(run_id):
        return run_id
    digest = hashlib.sha256(run_id.encode()).hexdigest()[:RUN_LABEL_HASH]
    return f"{run_id[:RUN_LABEL_HEAD].rstrip('._-')}-{digest}"


def _label_value(name: str, value: str) -> str:
    if not isinstance(value, str) or not value or len(value) > LABEL_VALUE_MAX \
            or not LABEL_VALUE_RULE.match(value):
        raise ParameterError(name, value, "a Kubernetes label value (1-63 letters, digits, '-', "
                             "'_', '.', beginning and ending with a letter or digit)")
    return value


def labels(run_id: str, stage: str, role: str) -> dict[str, str]:
    """The labels of every object: the run (see run_label_value), the stage and the role."""
    return {RUN_LABEL: run_label_value(run_id), STAGE_LABEL: _label_value("stage", stage),
            ROLE_LABEL: _label_value("role", role)}


def run_selector(run_id: str) -> str:
    """The label selector of everything a run made: `kubectl delete <kinds> -l <this>`."""
    return f"{RUN_LABEL}={run_label_value(run_id)}"


# ---- parameter checks ----------------------------------------------------------------------------
def _name(param: str, value: str) -> str:
    if not isinstance(value, str) or len(value) > NAME_MAX or not NAME_RULE.match(value):
        raise ParameterError(param, value, f"a name of 1-{NAME_MAX} lower-case letters, digits "
                             "and '-', beginning with a letter and ending with a letter or digit")
    return value


def _namespace(value: str) -> str:
    if not isinstance(value, str) or not DNS1123_LABEL.match(value):
        raise ParameterError("namespace", value, "a Kubernetes namespace (DNS-1123 label: "
                             "lower-case letters, digits, '-', at most 63)")
    return value


def _image(image: str) -> tuple[str, str]:
    """(image, imagePullPolicy): by digest -> IfNotPresent; by an explicit tag -> Always (a tag
    can be moved; ANCHORS 4: dated tags, never `:latest` with IfNotPresent)."""
    last = str(image).rsplit("/", 1)[-1]
    if not isinstance(image, str) or not image or not IMAGE_RULE.match(image) \
            or ("@sha256:" not in image and ":" not in last):
        raise ParameterError("image", image, "an image by digest (repo@sha256:<64 hex>) or by an "
                             "explicit tag other than 'latest' (repo:tag)")
    return image, ("IfNotPresent" if "@sha256:" in image else "Always")


def _positive(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ParameterError(name, value, "an integer >= 1")
    return value


def _count(name: str, value, default: int) -> int:
    value = default if value is None else value
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ParameterError(name, value, "an integer >= 0")
    return value


def _instance(instance_type: str):
    if instance_type not in INSTANCE_TYPES:
        raise ParameterError("instance_type", instance_type, ", ".join(INSTANCE_TYPES))
    return INSTANCE_TYPES[instance_type]


def _secret_name(value: str | None) -> str | None:
    if value in (None, ""):
        return None
    if not isinstance(value, str) or not DNS1123_LABEL.match(value):
        raise ParameterError("hf_token_secret", value, "'' or a Kubernetes Secret name "
                             "(DNS-1123 label)")
    return value


def _abs_path(name: str, value) -> str:
    if not isinstance(value, str) or not value.startswith("/") or "\x00" in value \
            or ".." in PurePosixPath(value).parts:
        raise ParameterError(name, value, "an absolute path without '..'")
    return value


def _no_token_values(name: str, env: Mapping[str, str]) -> None:
    clash = sorted(set(env) & set(TOKEN_VARS))
    if clash:
        raise ParameterError(name, sorted(env), f"variables other than {', '.join(clash)}: a "
                             "token is never a value here, only a Secret reference "
                             "(hf_token_secret)")


# ---- pieces of a pod -----------------------------------------------------------------------------
def _resources(*, gpus: int = 0, efa: int = 0, hugepages: str | None = None, cpu: str,
               memory: str) -> dict[str, dict[str, str]]:
    """requests == limits for every resource (Guaranteed QoS; the device plugins' resources
    must be equal anyway)."""
    amounts: dict[str, str] = {}
    if gpus:
        amounts[GPU_RESOURCE] = str(gpus)
    if efa:
        amounts[EFA_RESOURCE] = str(efa)
    if hugepages:
        amounts[HUGEPAGES_RESOURCE] = str(hugepages)
    amounts["cpu"] = str(cpu)
    amounts["memory"] = str(memory)
    return {"requests": dict(amounts), "limits": dict(amounts)}


def _env_list(env: Mapping[str, str], secret: str | None = None) -> list[dict[str, Any]]:
    _no_token_values("env", env)
    out: list[dict[str, Any]] = [{"name": k, "value": str(env[k])} for k in sorted(env)]
    if secret:
        # The Secret must exist when named (optional false): a gated model without its token
        # would fail much later, inside vLLM's download.
        out.append({"name": HF_TOKEN_ENV, "valueFrom": {"secretKeyRef": {
            "name": secret, "key": HF_TOKEN_KEY, "optional": False}}})
    return out


def _check_kube_expansion(where: str, texts: Iterable[str], env_names: Iterable[str]) -> None:
    """Kubernetes rewrites `$(NAME)` (NAME a variable of the container) and `$$` in command,
    args and env values before the shell sees them; the scripts here use neither."""
    names = set(env_names)
    for text in texts:
        if "$$" in text or any(f"$({n})" in text for n in names):
            raise ValueError(f"{where}: a command holds '$$' or '$(VAR)', which Kubernetes "
                             "would rewrite before the shell runs it")


def _anti_affinity(selector: Mapping[str, str]) -> dict[str, Any]:
    """One pod of the group per node (required, on the hostname)."""
    return {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
        {"labelSelector": {"matchLabels": dict(selector)}, "topologyKey": HOSTNAME_LABEL}]}}


def _tolerations(tolerations: Sequence[Mapping[str, Any]] | None) -> list[dict[str, Any]]:
    return [dict(t) for t in (DEFAULT_TOLERATIONS if tolerations is None else tolerations)]


def _gpu_pod_spec(*, container: dict[str, Any], instance_type: str,
                  tolerations: Sequence[Mapping[str, Any]] | None, affinity_selector: Mapping[str, str],
                  extra_volumes: Sequence[dict[str, Any]] = (), restart_policy: str | None = None
                  ) -> dict[str, Any]:
    spec: dict[str, Any] = {
        # Nothing here talks to the Kubernetes API, and no Service's variables may reach vLLM
        # (see DEFAULT_SERVE_NAME).
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "nodeSelector": {INSTANCE_TYPE_LABEL: instance_type},
        "tolerations": _tolerations(tolerations),
        "affinity": _anti_affinity(affinity_selector),
        "containers": [container],
        "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": SHM_SIZE}},
                    *extra_volumes],
    }
    if restart_policy:
        spec["restartPolicy"] = restart_policy
    return spec


def _security(privileged: bool) -> dict[str, Any]:
    if privileged:
        return {"privileged": True}  # no capabilities: all of them come with privileged
    return {"allowPrivilegeEscalation": False}


def _pod_annotations(privileged: bool) -> dict[str, str]:
    return {PRIVILEGED_WHY_ANNOTATION: PRIVILEGED_WHY} if privileged else {}


def _cpu_memory(instance_type: str, cpu: str | None, memory: str | None) -> tuple[str, str]:
    default_cpu, default_memory = POD_CPU_MEMORY[instance_type]
    return str(cpu or default_cpu), str(memory or default_memory)


def _unset_prefix(transport: str) -> list[str]:
    """`env -u VAR ...`: the transport's variables that must be absent (lib.engines.transport);
    an image's ENV cannot be removed from a pod spec, only from the process's start."""
    out = ["env"]
    for var in unset_vars(transport):
        out += ["-u", var]
    return out


# ---- the node probe ------------------------------------------------------------------------------
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
    """`guide-probe-<node>`: the node name lower-cased, every other character '-', and, when
    that changed or cut it, a hash of the node name (so two nodes never share a pod name)."""
    if not isinstance(node, str) or not node.strip():
        raise ParameterError("node", node, "a node name (as `kubectl get nodes` lists it)")
    slug = re.sub(r"[^a-z0-9-]+", "-", node.lower()).strip("-")
    room = LABEL_VALUE_MAX - len(PROBE_NAME_PREFIX)
    if slug == node and len(slug) <= room:
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
        "metadata": {"name": probe_pod_name(node), "namespace": _namespace(namespace),
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


# ---- rank jobs: one process per node ------------------------------------------------------------
def rendezvous_host(name: str, namespace: str) -> str:
    """Node 0's stable DNS name through the headless Service `name`: `<name>-0.<name>.<ns>.svc`
    (resolved through the pods' search path; the cluster domain is not assumed)."""
    return f"{name}-0.{name}.{namespace}.svc"


def _headless_service(*, name: str, namespace: str, meta_labels: Mapping[str, str],
                      selector: Mapping[str, str], ports: Sequence[tuple[str, int]]) -> dict:
    return {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": name, "namespace": namespace, "labels": dict(meta_labels)},
        "spec": {
            "clusterIP": "None",
            # A pod's DNS name exists before it is ready: node 0 resolves its own name to bind the
            # rendezvous before any readiness probe of it can pass.
            "publishNotReadyAddresses": True,
            "selector": dict(selector),
            "ports": [{"name": n, "port": p, "targetPort": p, "protocol": "TCP"} for n, p in ports],
        },
    }


def rank_objects(*, run_id: str, image: str, nodes: int,
                 argv: Callable[[NodeRank], Sequence[str]],
                 env: Callable[[NodeRank], Mapping[str, str]],
                 name: str = DEFAULT_RANK_NAME, stage: str = KERNEL_STAGE,
                 namespace: str = DEFAULT_NAMESPACE, rdzv_port: int = RDZV_PORT,
                 instance_type: str = DEFAULT_INSTANCE_TYPE, gpus_per_node: int | None = None,
                 efa_per_node: int | None = None, hugepages_2mi: str | None = HUGEPAGES_2MI,
                 cpu: str | None = None, memory: str | None = None,
                 tolerations: Sequence[Mapping[str, Any]] | None = None,
                 transport: str = "efa", plugin_path: str = DEFAULT_PLUGIN_PATH,
                 needs_gdrcopy: bool = True, timeout_s: float | None = None) -> list[dict]:
    """A headless Service `name` and one Pod per node (`<name>-<rank>`, hostname and subdomain
    set, so node 0 is `rendezvous_host(name, namespace)`), each running `argv(node)` with
    `env(node)` over the transport's contract (lib.engines.transport.transport_env; a value
    that contradicts the contract is refused; its unset variables are removed at the process's
    start with `env -u`). One pod per node (required anti-affinity), on `instance_type` nodes;
    requests == limits for GPUs, EFA devices, hugepages, memory and cpu; privileged only when
    `needs_gdrcopy` (DeepEP over EFA), with PRIVILEGED_WHY beside it."""
    nodes = _positive("nodes", nodes)
    name, namespace = _name("name", name), _namespace(namespace)
    image, pull = _image(image)
    kind = _instance(instance_type)
    gpus = _count("gpus_per_node", gpus_per_node, kind.gpus)
    efa = _count("efa_per_node", efa_per_node, kind.efa)
    cpu, memory = _cpu_memory(instance_type, cpu, memory)
    if isinstance(rdzv_port, bool) or not isinstance(rdzv_port, int) or not 1 <= rdzv_port <= 65535:
        raise ParameterError("rdzv_port", rdzv_port, "an integer port in 1..65535")
    if not isinstance(needs_gdrcopy, bool):
        raise ParameterError("needs_gdrcopy", needs_gdrcopy, "True or False")
    contract = transport_env(transport, plugin_path=plugin_path)
    master = rendezvous_host(name, namespace)
    group = {RUN_LABEL: run_label_value(run_id), GROUP_LABEL: _label_value("name", name)}
    objects: list[dict] = [_headless_service(
        name=name, namespace=namespace, meta_labels={**labels(run_id, stage, "rendezvous"), **group},
        selector=group, ports=[("rendezvous", rdzv_port)])]
    for rank in range(nodes):
        node = NodeRank(rank, nodes, master, rdzv_port)
        own = {str(k): str(v) for k, v in dict(env(node)).items()}
        _no_token_values("env", own)
        clash = sorted(k for k in own if k in contract and own[k] != contract[k])
        if clash:
            raise ParameterError("env", {k: own[k] for k in clash},
                                 f"the {transport} contract's values (lib.engines.transport): "
                                 + ", ".join(f"{k}={contract[k]}" for k in clash))
        gone = sorted(set(own) & set(unset_vars(transport)))
        if gone:
            raise ParameterError("env", gone, f"none of {', '.join(gone)}: the {transport} "
                                 "transport requires them unset")
        full_env = {**contract, **own}
        command = _unset_prefix(transport) + [str(a) for a in argv(node)]
        _check_kube_expansion(f"{name}-{rank}", command + list(full_env.values()), full_env)
        container = {
            "name": "rank",
            "image": image,
            "imagePullPolicy": pull,
            "command": command,
            "env": _env_list(full_env),
            "ports": [{"name": "rendezvous", "containerPort": rdzv_port, "protocol": "TCP"}],
            "resources": _resources(gpus=gpus, efa=efa, hugepages=hugepages_2mi, cpu=cpu,
                                    memory=memory),
            "securityContext": _security(needs_gdrcopy),
            "volumeMounts": [{"name": "dshm", "mountPath": SHM_PATH}],
        }
        spec = _gpu_pod_spec(container=container, instance_type=instance_type,
                             tolerations=tolerations, affinity_selector=group,
                             restart_policy="Never")
        spec["hostname"] = f"{name}-{rank}"
        spec["subdomain"] = name
        if timeout_s is not None:
            spec["activeDeadlineSeconds"] = max(1, int(timeout_s))
        objects.append({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": f"{name}-{rank}", "namespace": namespace,
                         "labels": {**labels(run_id, stage, "rank"), **group,
                                    NODE_RANK_LABEL: str(rank)},
                         "annotations": _pod_annotations(needs_gdrcopy)},
            "spec": spec,
        })
    return objects


def kernel_test_objects(*, run_id: str, image: str, nodes: int, tests_dir: str,
                        num_tokens: int, hidden: int, num_topk: int, num_experts: int,
                        python: str = "python3", extra: Iterable[str] = (),
                        deepep_commit: str | None = None, name: str = DEFAULT_RANK_NAME,
                        instance_type: str = DEFAULT_INSTANCE_TYPE,
                        gpus_per_node: int | None = None, plugin_path: str = DEFAULT_PLUGIN_PATH,
                        **pod_params: Any) -> list[dict]:
    """DeepEP's test_ep on `nodes` nodes: rank_objects with lib.engines.deepep's argv (one
    process per node, `--num-processes` = GPUs per node) and env (WORLD_SIZE = nodes, RANK =
    node rank, MASTER_ADDR = node 0's DNS name, MASTER_PORT = the rendezvous port)."""
    gpus = _count("gpus_per_node", gpus_per_node, _instance(instance_type).gpus)
    extra = list(extra)

    def argv(node: NodeRank) -> list[str]:
        return test_ep_argv(python=python, tests_dir=tests_dir, num_processes=gpus,
                            num_tokens=num_tokens, hidden=hidden, num_topk=num_topk,
                            num_experts=num_experts, extra=extra, deepep_commit=deepep_commit)

    def env(node: NodeRank) -> dict[str, str]:
        return test_ep_env(nodes=node.nodes, node_rank=node.rank, master_addr=node.master_addr,
                           rdzv_port=node.port, transport="efa", nccl_site=None,
                           plugin_path=plugin_path)

    return rank_objects(run_id=run_id, image=image, nodes=nodes, argv=argv, env=env, name=name,
                        instance_type=instance_type, gpus_per_node=gpus,
                        plugin_path=plugin_path, **pod_params)


# ---- the vLLM serve ------------------------------------------------------------------------------
def _serve(*, run_id: str, image: str, model_cache_dir: str, nodes: int = 2,
           name: str = DEFAULT_SERVE_NAME, stage: str = SERVE_STAGE,
           namespace: str = DEFAULT_NAMESPACE, instance_type: str = DEFAULT_INSTANCE_TYPE,
           gpus_per_node: int | None = None, efa_per_node: int | None = None,
           model: str | None = None, model_revision: str | None = "",
           backend: str = "deepep_v2", ep_num_comms: int = 1, enforce_eager: bool = True,
           hf_token_secret: str | None = None, max_model_len: int | None = None,
           gpu_memory_utilization: float | None = None, python: str | None = None,
           hugepages_2mi: str | None = HUGEPAGES_2MI, cpu: str | None = None,
           memory: str | None = None, tolerations: Sequence[Mapping[str, Any]] | None = None,
           plugin_path: str = DEFAULT_PLUGIN_PATH, rpc_port: int = DP_RPC_PORT,
           port: int = HTTP_PORT) -> dict[str, Any]:
    """Every parameter of a serve rendering, checked, with each node's (argv, env)."""
    nodes = _positive("nodes", nodes)
    name, namespace = _name("name", name), _namespace(namespace)
    if len(name) + len(HTTP_SERVICE_SUFFIX) > LABEL_VALUE_MAX:
        raise ParameterError("name", name, "a shorter name")
    image, pull = _image(image)
    kind = _instance(instance_type)
    gpus = _positive("gpus_per_node", kind.gpus if gpus_per_node is None else gpus_per_node)
    efa = _count("efa_per_node", efa_per_node, kind.efa)
    # pins.yaml `model`: the one source of the model and its revision. model_revision '' takes
    # the pin's revision for the pinned model (none for another model); None asks for none.
    pin = pins_mod.load()["pins"]["model"]
    model = pin["model"] if model is None else model
    if not isinstance(model, str) or not MODEL_ID_RULE.match(model):
        raise ParameterError("model", model, "an org/name model id")
    if model_revision == "":
        model_revision = pin["revision"] if model == pin["model"] else None
    if model_revision is not None and not re.fullmatch(r"[0-9a-f]{40}", str(model_revision)):
        raise ParameterError("model_revision", model_revision, "'', None or a 40-hex commit")
    model_cache_dir = _abs_path("model_cache_dir", model_cache_dir)
    secret = _secret_name(hf_token_secret)
    if not isinstance(ep_num_comms, int) or isinstance(ep_num_comms, bool) \
            or not 1 <= ep_num_comms <= MAX_EP_NUM_COMMS:
        raise ParameterError("ep_num_comms", ep_num_comms, f"an integer in 1..{MAX_EP_NUM_COMMS}")
    ep_size = nodes * gpus
    experts = routed_experts(model)
    if experts is not None and experts % ep_size:
        fits = [n for n in range(1, 17) if experts % (n * gpus) == 0]
        raise ParameterError(
            "nodes", nodes,
            f"a node count whose EP size (nodes x gpus_per_node = {nodes} x {gpus} = {ep_size}) "
            f"divides {model}'s {experts} routed experts (EP divisibility: each of the "
            f"{ep_size} ranks must hold the same number of experts): "
            + ", ".join(map(str, fits)))
    address = rendezvous_host(name, namespace)
    common = dict(model=model, backend=backend, dp_size=ep_size, dp_size_local=gpus,
                  dp_address=address, dp_rpc_port=rpc_port, port=port,
                  enforce_eager=enforce_eager, max_model_len=max_model_len,
                  gpu_memory_utilization=gpu_memory_utilization, ep_num_comms=ep_num_comms,
                  transport="efa", plugin_path=plugin_path, num_experts=experts, python=python)
    per_node: dict[int, tuple[list[str], dict[str, str]]] = {}
    for ordinal in range(nodes):
        role = "leader" if ordinal == 0 else "worker"
        argv, env = vllm_serve(role, dp_start_rank=ordinal * gpus, **common)
        if model_revision:
            # Weights and tokenizer both at the pinned revision (vLLM's --revision and
            # --tokenizer-revision; vllm_serve takes no revision).
            argv += ["--revision", model_revision, "--tokenizer-revision", model_revision]
        per_node[ordinal] = (argv, env)
    envs = {frozenset(e.items()) for _, e in per_node.values()}
    assert len(envs) == 1, "vllm_serve gave the roles different environments"
    env = dict(per_node[0][1])
    _no_token_values("env", env)
    env["HF_HOME"] = MODEL_CACHE_PATH
    default_cpu, default_memory = POD_CPU_MEMORY[instance_type]
    return dict(run_id=run_id, stage=stage, name=name, namespace=namespace, image=image,
                pull=pull, nodes=nodes, gpus=gpus, efa=efa, instance_type=instance_type,
                model=model, model_revision=model_revision or None,
                model_cache_dir=model_cache_dir, secret=secret, backend=backend,
                per_node=per_node, env=env, unset=unset_vars("efa"), port=port,
                rpc_port=rpc_port, hugepages=hugepages_2mi, cpu=str(cpu or default_cpu),
                memory=str(memory or default_memory), tolerations=tolerations,
                # DeepEP's backends run its GIN proxy over EFA, which needs gdrcopy: privileged.
                # vLLM's own all-to-all fallbacks use NCCL only.
                privileged=backend.startswith("deepep"))


def serve_argv(ordinal: int, **params: Any) -> tuple[list[str], dict[str, str]]:
    """(argv, env) of the pod with this ordinal (0 = the leader), as the entrypoint runs it."""
    s = _serve(**params)
    if ordinal not in s["per_node"]:
        raise ParameterError("ordinal", ordinal, f"0..{s['nodes'] - 1}")
    argv, _ = s["per_node"][ordinal]
    return list(argv), dict(s["env"])


def _argv_lines(argv: Sequence[str], indent: str) -> str:
    """argv as shell words: the program's words on the first line, then a flag (with its value,
    when one follows) per line."""
    first = next((i for i, t in enumerate(argv) if t.startswith("--")), len(argv))
    groups: list[Sequence[str]] = [argv[:first]] if first else []
    i = first
    while i < len(argv):
        step = 2 if i + 1 < len(argv) and not argv[i + 1].startswith("--") else 1
        groups.append(argv[i:i + step])
        i += step
    return f" \\\n{indent}".join(" ".join(shlex.quote(t) for t in g) for g in groups)


def entrypoint_script(*, ordinal_from: str = "hostname", ordinals: Iterable[int] | None = None,
                      **params: Any) -> str:
    """The serve container's bash script (run as `bash -c`): find this pod's ordinal, then exec
    the argv vllm_serve rendered for it: 0 the leader, k > 0 a `--headless` worker with start
    rank k x GPUs per node.

    ordinal_from 'hostname': a StatefulSet's pod is `<name>-<ordinal>`, and its hostname says so
    (the script refuses any other hostname, e.g. one a hostNetwork pod would have).
    ordinal_from 'lws': a LeaderWorkerSet sets LWS_WORKER_INDEX (0 for the leader).
    `ordinals`: the branches this script holds (default every node's).

    Embedded in the pod spec rather than a ConfigMap: what a pod ran is in its own spec (and in
    the plan), one object fewer, and a changed script changes the pod template, so the serve is
    rolled (a ConfigMap's change would reach no running pod)."""
    s = _serve(**params)
    chosen = sorted(s["per_node"] if ordinals is None else set(ordinals))
    for o in chosen:
        if o not in s["per_node"]:
            raise ParameterError("ordinals", chosen, f"ordinals in 0..{s['nodes'] - 1}")
    name = s["name"]
    if ordinal_from == "hostname":
        find = (f'host="${{HOSTNAME:-}}"\n'
                f'ordinal="${{host##*-}}"\n'
                f'if [[ ! "${{ordinal}}" =~ ^[0-9]+$ || "${{host}}" != "{name}-${{ordinal}}" ]]; then\n'
                f'  echo "guide-entrypoint: HOSTNAME=\'${{host}}\' is not {name}-<ordinal>: the '
                f'ordinal comes from a StatefulSet pod\'s hostname" >&2\n'
                f'  exit 64\n'
                f'fi\n')
    elif ordinal_from == "lws":
        find = ('ordinal="${LWS_WORKER_INDEX:-}"\n'
                'if [[ ! "${ordinal}" =~ ^[0-9]+$ ]]; then\n'
                '  echo "guide-entrypoint: LWS_WORKER_INDEX=\'${ordinal}\' is not a number: the '
                'LeaderWorkerSet controller sets it" >&2\n'
                '  exit 64\n'
                'fi\n')
    else:
        raise ParameterError("ordinal_from", ordinal_from, "'hostname' or 'lws'")
    unset = f"unset {' '.join(s['unset'])}\n" if s["unset"] else ""
    branches = ""
    for o in chosen:
        argv, _ = s["per_node"][o]
        role = "leader" if o == 0 else "worker"
        branches += (f"  {o})\n"
                     f'    echo "guide-entrypoint: ordinal {o}, the {role}"\n'
                     f"    exec {_argv_lines(argv, ' ' * 6)}\n"
                     f"    ;;\n")
    allowed = ", ".join(map(str, chosen)) or "none"
    script = (
        "set -euo pipefail\n"
        f"{find}"
        f"{unset}"
        'case "${ordinal}" in\n'
        f"{branches}"
        "  *)\n"
        f'    echo "guide-entrypoint: ordinal ${{ordinal}} is not one this pod serves ({allowed})" >&2\n'
        "    exit 64\n"
        "    ;;\n"
        "esac\n")
    _check_kube_expansion("the serve's entrypoint", [script], s["env"])
    return script


def _program_regex(argv: Sequence[str]) -> str:
    """A bash regex for the serve's process that cannot match the probe's own command line: its
    first character in brackets (`[v]llm serve`: the probe's text holds `[v]llm`, never
    `vllm`; the public review's fix for `pgrep -af 'vllm serve'` matching itself)."""
    words = ["vllm", "serve"] if argv[:2] == ["vllm", "serve"] else [CLI_MODULE, "serve"]
    text = " ".join(words)
    escaped = re.sub(r"([.])", r"\\\1", text)
    return f"[{escaped[0]}]{escaped[1:]}"


def worker_probe_script(argv: Sequence[str]) -> str:
    """A worker's readiness: some process's command line holds the serve's program words.
    Plain bash over /proc (pgrep's procps is not in the guide's image: docker/Dockerfile installs
    none), with the self-match guard of `_program_regex`."""
    regex = _program_regex(argv)
    return ("set -u\n"
            f"re='{regex}'\n"
            "for f in /proc/[0-9]*/cmdline; do\n"
            '  cmd="$(tr \'\\0\' \' \' < "$f" 2>/dev/null)" || continue\n'
            '  if [[ "${cmd}" =~ ${re} ]]; then\n'
            "    exit 0\n"
            "  fi\n"
            "done\n"
            "exit 1\n")


def _serve_container(s: dict[str, Any], *, script: str, leader_probe: bool | None,
                     serves_http: bool = True) -> dict:
    """The serve container. leader_probe: True the leader's HTTP readiness, False the workers',
    None (a StatefulSet's one template for both) a probe that passes on either: HTTP /health on
    the leader, the process check on a worker."""
    argv0, _ = s["per_node"][0]
    port = s["port"]
    http = {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": READINESS_PERIOD_S,
            "timeoutSeconds": 5, "failureThreshold": 3}
    process = {"exec": {"command": ["bash", "-c", worker_probe_script(argv0)]},
               "periodSeconds": READINESS_PERIOD_S, "timeoutSeconds": 5, "failureThreshold": 3}
    if leader_probe is None:
        # One template serves every ordinal: pod 0 (the leader) is ready when /health answers
        # on its HTTP port (curl: docker/Dockerfile installs it); a headless worker serves no
        # HTTP, so its readiness is its process.
        either = ("set -u\n"
                  f"if [[ \"${{HOSTNAME:-}}\" == \"{s['name']}-0\" ]]; then\n"
                  f"  exec curl -fsS -o /dev/null --max-time 4 http://127.0.0.1:{port}/health\n"
                  "fi\n"
                  + worker_probe_script(argv0).replace("set -u\n", "", 1))
        probe = {"exec": {"command": ["bash", "-c", either]}, "periodSeconds": READINESS_PERIOD_S,
                 "timeoutSeconds": 5, "failureThreshold": 3}
    else:
        probe = http if leader_probe else process
    mounts = [{"name": "dshm", "mountPath": SHM_PATH},
              {"name": "model-cache", "mountPath": MODEL_CACHE_PATH}]
    ports = ([{"name": "http", "containerPort": port, "protocol": "TCP"}] if serves_http else [])
    ports.append({"name": "dp-rpc", "containerPort": s["rpc_port"], "protocol": "TCP"})
    container = {
        "name": "vllm",
        "image": s["image"],
        "imagePullPolicy": s["pull"],
        "command": ["bash", "-c", script],
        "env": _env_list(s["env"], s["secret"]),
        "ports": ports,
        "readinessProbe": probe,
        "resources": _resources(gpus=s["gpus"], efa=s["efa"], hugepages=s["hugepages"],
                                cpu=s["cpu"], memory=s["memory"]),
        "securityContext": _security(s["privileged"]),
        "volumeMounts": mounts,
    }
    return container


def _model_cache_volume(s: dict[str, Any]) -> dict[str, Any]:
    return {"name": "model-cache", "hostPath": {"path": s["model_cache_dir"],
                                                "type": "DirectoryOrCreate"}}


def http_service_name(name: str = DEFAULT_SERVE_NAME) -> str:
    return f"{_name('name', name)}{HTTP_SERVICE_SUFFIX}"


def leader_url(name: str = DEFAULT_SERVE_NAME, namespace: str = DEFAULT_NAMESPACE,
               port: int = HTTP_PORT) -> str:
    """The serve's HTTP base URL inside the cluster: the leader-only Service."""
    return f"http://{http_service_name(name)}.{_namespace(namespace)}.svc:{port}"


def _http_service(s: dict[str, Any], selector: Mapping[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": http_service_name(s["name"]), "namespace": s["namespace"],
                     "labels": {**labels(s["run_id"], s["stage"], "http"),
                                GROUP_LABEL: s["name"]}},
        "spec": {
            "type": "ClusterIP",
            # The leader only: headless workers serve no HTTP, and a Service over every pod
            # refused about half the connections (the public review, ANCHORS 4).
            "selector": dict(selector),
            "ports": [{"name": "http", "port": s["port"], "targetPort": "http",
                       "protocol": "TCP"}],
        },
    }


def vllm_objects(**params: Any) -> list[dict]:
    """The serve as a StatefulSet `name` (replicas = nodes, Parallel), its headless Service
    `name` (the rendezvous, publishNotReadyAddresses) and the HTTP Service `name-http`, which
    selects pod 0 only (`statefulset.kubernetes.io/pod-name: <name>-0`).

    Parameters (keywords): run_id, image, model_cache_dir (required); nodes (2), name ('vllm'),
    stage, namespace, instance_type, gpus_per_node / efa_per_node (the instance type's), model
    and model_revision (pins.yaml's), backend ('deepep_v2'), ep_num_comms (1), enforce_eager
    (True), hf_token_secret (None: no HF_TOKEN), max_model_len, gpu_memory_utilization, python
    (None: `vllm serve`; a path: `<python> -m vllm.entrypoints.cli.main serve`), hugepages_2mi,
    cpu, memory, tolerations, plugin_path, rpc_port, port."""
    s = _serve(**params)
    group = {RUN_LABEL: run_label_value(s["run_id"]), GROUP_LABEL: s["name"]}
    pod_labels = {**labels(s["run_id"], s["stage"], "serve"), GROUP_LABEL: s["name"]}
    container = _serve_container(s, script=entrypoint_script(**params), leader_probe=None)
    spec = _gpu_pod_spec(container=container, instance_type=s["instance_type"],
                         tolerations=s["tolerations"], affinity_selector=group,
                         extra_volumes=[_model_cache_volume(s)])
    statefulset = {
        "apiVersion": "apps/v1", "kind": "StatefulSet",
        "metadata": {"name": s["name"], "namespace": s["namespace"], "labels": dict(pod_labels)},
        "spec": {
            "serviceName": s["name"],
            "replicas": s["nodes"],
            # Every node at once: the leader waits for all its DP ranks, so an ordered rollout
            # would wait for a leader that cannot become ready alone.
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": dict(group)},
            "template": {"metadata": {"labels": dict(pod_labels),
                                      "annotations": _pod_annotations(s["privileged"])},
                         "spec": spec},
        },
    }
    headless = _headless_service(
        name=s["name"], namespace=s["namespace"],
        meta_labels={**labels(s["run_id"], s["stage"], "rendezvous"), GROUP_LABEL: s["name"]},
        selector=group, ports=[("dp-rpc", s["rpc_port"])])
    http = _http_service(s, {**group, POD_NAME_LABEL: f"{s['name']}-0"})
    return [headless, http, statefulset]


# LeaderWorkerSet: the convention of vLLM's docs and llm-d (ANCHORS 6). Facts of its API used
# here: leaderworkerset.x-k8s.io/v1; the leader pod of group 0 is `<name>-0`, its workers
# `<name>-0-<index>`; LWS makes a headless Service named `<name>` (subdomainPolicy Shared) and
# sets LWS_WORKER_INDEX (0 for the leader) in every pod (natively since LWS v0.6.0).
LWS_API_VERSION = "leaderworkerset.x-k8s.io/v1"


def leaderworkerset_objects(**params: Any) -> list[dict]:
    """The same serve as one LeaderWorkerSet group (replicas 1, size = nodes) and the HTTP
    Service over its leader. LWS makes the rendezvous Service itself, so it is not rendered
    here. A custom resource: kubernetes-validate skips it (it has no schema for it), so the
    tests check it structurally. Parameters: as vllm_objects."""
    s = _serve(**params)
    base = {RUN_LABEL: run_label_value(s["run_id"]), GROUP_LABEL: s["name"]}

    def template(role: str, ordinals: list[int], leader: bool) -> dict:
        script = entrypoint_script(ordinal_from="lws", ordinals=ordinals, **params)
        container = _serve_container(s, script=script, leader_probe=leader, serves_http=leader)
        spec = _gpu_pod_spec(container=container, instance_type=s["instance_type"],
                             tolerations=s["tolerations"], affinity_selector=base,
                             extra_volumes=[_model_cache_volume(s)])
        return {"metadata": {"labels": {**labels(s["run_id"], s["stage"], role), **base},
                             "annotations": _pod_annotations(s["privileged"])},
                "spec": spec}

    lws = {
        "apiVersion": LWS_API_VERSION, "kind": "LeaderWorkerSet",
        "metadata": {"name": s["name"], "namespace": s["namespace"],
                     "labels": {**labels(s["run_id"], s["stage"], "serve"), **base}},
        "spec": {
            "replicas": 1,
            "startupPolicy": "LeaderCreated",
            "networkConfig": {"subdomainPolicy": "Shared"},
            "leaderWorkerTemplate": {
                "size": s["nodes"],
                # One rank's death ends every DP rank's collective: restart the whole group.
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": template("leader", [0], True),
                "workerTemplate": template("worker", list(range(1, s["nodes"])), False),
            },
        },
    }
    http = _http_service(s, {**base, ROLE_LABEL: "leader"})
    return [http, lws]


# ---- AIPerf --------------------------------------------------------------------------------------
def aiperf_script(argv: Sequence[str], artifact_dir: str, block: str) -> str:
    """Run AIPerf, then print the artifact folder (stream.pack_command) whatever AIPerf's exit
    code; exit with AIPerf's code (or 70 when only the printing failed)."""
    return ("set -u\n"
            "rc=0\n"
            f"{shlex.join([str(a) for a in argv])} || rc=$?\n"
            'echo "guide-aiperf: aiperf exited ${rc}"\n'
            f"if ! {{ {pack_command(artifact_dir, block)}; }}; then\n"
            '  echo "guide-aiperf: printing the artifacts failed" >&2\n'
            '  if [ "${rc}" -eq 0 ]; then rc=70; fi\n'
            "fi\n"
            'exit "${rc}"\n')


def aiperf_job(*, run_id: str, image: str,
               argv: Sequence[str] | Callable[[str], Sequence[str]],
               artifact_dir: str = f"{ARTIFACT_ROOT}/aiperf", block: str = "aiperf",
               name: str = DEFAULT_AIPERF_NAME, stage: str = SWEEP_STAGE,
               namespace: str = DEFAULT_NAMESPACE, serve_name: str = DEFAULT_SERVE_NAME,
               port: int = HTTP_PORT, timeout_s: float = 3600.0,
               ttl_s: int = AIPERF_TTL_S, env: Mapping[str, str] | None = None,
               tolerations: Sequence[Mapping[str, Any]] | None = None) -> dict[str, Any]:
    """A Job (backoffLimit 0, restartPolicy Never, ttlSecondsAfterFinished) running AIPerf
    against the leader's Service URL (`leader_url`), then printing `artifact_dir` into its log
    as the block `block` (lib.places.stream), to be read back with `kubectl logs` and
    stream.unpack: a finished Job's pod cannot be copied from.

    `argv` is AIPerf's argv, or a callable given the URL that returns it; either way it must
    name that URL and write under `artifact_dir` (inside ARTIFACT_ROOT, an emptyDir)."""
    name, namespace = _name("name", name), _namespace(namespace)
    image, pull = _image(image)
    url = leader_url(serve_name, namespace, port)
    argv = list(argv(url) if callable(argv) else argv)
    argv = [str(a) for a in argv]
    if not argv or not any(url in a for a in argv):
        raise ParameterError("argv", argv, f"an AIPerf argv naming the leader's URL {url}")
    artifact_dir = _abs_path("artifact_dir", artifact_dir)
    if not PurePosixPath(artifact_dir).is_relative_to(ARTIFACT_ROOT) or artifact_dir == ARTIFACT_ROOT:
        raise ParameterError("artifact_dir", artifact_dir, f"a folder inside {ARTIFACT_ROOT}")
    if not isinstance(block, str) or not ARTIFACT_NAME_RULE.match(block):
        raise ParameterError("block", block, "letters, digits, '.', '_', '-' (1-128)")
    if isinstance(ttl_s, bool) or not isinstance(ttl_s, int) or ttl_s < 0:
        raise ParameterError("ttl_s", ttl_s, "an integer number of seconds >= 0")
    own = {str(k): str(v) for k, v in dict(env or {}).items()}
    script = aiperf_script(argv, artifact_dir, block)
    _check_kube_expansion(name, [script, *own.values()], own)
    cpu, memory = AIPERF_CPU_MEMORY
    pod_labels = {**labels(run_id, stage, "aiperf"), GROUP_LABEL: name}
    container = {
        "name": "aiperf",
        "image": image,
        "imagePullPolicy": pull,
        "command": ["sh", "-c", script],
        "env": _env_list(own),
        "resources": _resources(cpu=cpu, memory=memory),
        "securityContext": {"allowPrivilegeEscalation": False},
        "volumeMounts": [{"name": "artifacts", "mountPath": ARTIFACT_ROOT}],
    }
    return {
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": name, "namespace": namespace, "labels": dict(pod_labels)},
        "spec": {
            "backoffLimit": 0,  # one try: a retry would measure a different run under one name
            "activeDeadlineSeconds": max(1, int(timeout_s)),
            "ttlSecondsAfterFinished": ttl_s,
            "template": {
                "metadata": {"labels": dict(pod_labels)},
                "spec": {
                    "restartPolicy": "Never",
                    "automountServiceAccountToken": False,
                    "enableServiceLinks": False,
                    "tolerations": _tolerations(tolerations),
                    "containers": [container],
                    "volumes": [{"name": "artifacts", "emptyDir": {}}],
                },
            },
        },
    }


# ---- walking, writing, checking --------------------------------------------------------------------
def pod_specs(objects: Iterable[Mapping[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """(where, pod spec) of every pod (template) in the objects: Pods, StatefulSets, Jobs and
    LeaderWorkerSets (leader and worker templates)."""
    out = []
    for obj in objects:
        kind, name = obj.get("kind"), obj.get("metadata", {}).get("name")
        spec = obj.get("spec", {})
        if kind == "Pod":
            out.append((f"Pod/{name}", spec))
        elif kind in ("StatefulSet", "Job", "Deployment", "DaemonSet"):
            out.append((f"{kind}/{name}", spec["template"]["spec"]))
        elif kind == "LeaderWorkerSet":
            lwt = spec["leaderWorkerTemplate"]
            for key in ("leaderTemplate", "workerTemplate"):
                if key in lwt:
                    out.append((f"{kind}/{name}/{key}", lwt[key]["spec"]))
    return out


def embedded_scripts(objects: Iterable[Mapping[str, Any]]) -> list[dict[str, str]]:
    """Every `bash -c` / `sh -c` script inside the objects (container commands and exec probes):
    {'where', 'shell', 'script'}, for shellcheck (`shellcheck -s <shell>`)."""
    found = []
    for where, spec in pod_specs(objects):
        for c in spec.get("containers", []) + spec.get("initContainers", []):
            commands = [("command", c.get("command") or [])]
            for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                if "exec" in c.get(probe, {}):
                    commands.append((probe, c[probe]["exec"]["command"]))
            for what, command in commands:
                if len(command) >= 3 and command[0] in ("bash", "sh") and command[1] == "-c":
                    found.append({"where": f"{where}/{c['name']}/{what}", "shell": command[0],
                                  "script": command[2]})
    return found


class _Dumper(yaml.SafeDumper):
    """Block style for multi-line strings (the scripts read as scripts)."""


def _str(dumper: yaml.SafeDumper, value: str):
    style = "|" if "\n" in value and not any(line != line.rstrip() for line in value.split("\n")) \
        else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def to_yaml(objects: Iterable[Mapping[str, Any]]) -> str:
    """The objects as one multi-document YAML text, keys sorted (so apiVersion, kind, metadata,
    spec come first and the same objects always give the same text)."""
    return yaml.dump_all([dict(o) for o in objects], Dumper=_Dumper, sort_keys=True,
                         explicit_start=True, default_flow_style=False, width=10_000,
                         allow_unicode=True)


def validate_argv(paths: Iterable[str], kube_version: str = KUBE_VERSION) -> list[str]:
    """kubernetes-validate --strict at `kube_version` (KUBE_VERSION: why that one) over the
    files: a misspelled or unknown field fails it; custom resources (LeaderWorkerSet) are
    skipped with a warning."""
    if not re.fullmatch(r"1\.(2[5-9]|3[0-9])(\.[0-9]+)?", str(kube_version)):
        raise ParameterError("kube_version", kube_version,
                             "a Kubernetes version kubernetes-validate bundles (1.25..1.37)")
    paths = [str(p) for p in paths]
    if not paths:
        raise ParameterError("paths", paths, "at least one file")
    return [VALIDATOR, "--strict", "-k", str(kube_version), *paths]


def for_kube_1_20(objects: Iterable[Mapping[str, Any]]) -> list[dict]:
    """Copies without the fields NEWER_THAN_1_20 lists, for a dry run against the 1.20 test
    control plane (kubernetes-validate at KUBE_VERSION checks them)."""
    out = []
    for obj in objects:
        obj = copy.deepcopy(dict(obj))
        if obj.get("kind") == "Job":
            obj.get("spec", {}).pop("ttlSecondsAfterFinished", None)
        out.append(obj)
    return out
