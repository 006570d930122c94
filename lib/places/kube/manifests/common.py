"""What every object of the package shares: labels and names, the one check of what the
package renders itself (`$(VAR)` expansion in its scripts), resources, and the pieces of a pod
spec (GPU pods, headless Services, the serve's HTTP URL). No parameter is checked here: the
stage's model accepted every value (lib.stages.registry, lib.stages.rules_places).

Pure: parameters in, plain dicts out; nothing here reads a file or talks to a cluster.
ANCHORS, DESIGN, R, V, PR: as the package's docstring (lib.places.kube.manifests) says.
"""
from __future__ import annotations

import hashlib
import re
from typing import Any, Iterable, Literal, Mapping, Sequence

# ---- labels and annotations --------------------------------------------------------------------
# Every object carries the run, the stage and its role, so `kubectl delete -l <run_selector>`
# removes everything a run made, and the evidence can name what it looked at.
RUN_LABEL = "guide.repro/run"
STAGE_LABEL = "guide.repro/stage"
ROLE_LABEL = "guide.repro/role"
# Which group of objects (a serve, a rank job, an AIPerf job) an object belongs to: selectors
# use it, so two groups of one run and stage never select each other's pods.
GROUP_LABEL = "guide.repro/group"
# The reason written beside every `privileged: true` (DESIGN: "privileged only with its reason
# written beside it").
PRIVILEGED_WHY_ANNOTATION = "guide.repro/privileged-why"
PRIVILEGED_WHY = (
    "gdrcopy: DeepEP's GIN proxy over EFA opens /dev/gdrdrv; in a non-privileged container "
    "gdr_open fails with EPERM, NCCL reports ginType NONE and ElasticBuffer asserts (ANCHORS 1.4, "
    "R's as-run manifest; ANCHORS 4). Privileged grants every capability, so none is added "
    "(IPC_LOCK and the like are redundant under it: the public review, ANCHORS 4)")
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

# ---- ports -------------------------------------------------------------------------------------
# vLLM's HTTP port, as the public serve used it (ANCHORS 1.4: leader `--port 8000`).
HTTP_PORT = 8000

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
# The taints GPU and EFA node groups carry; V's manifest tolerated both (ANCHORS 1.4).
DEFAULT_TOLERATIONS: tuple[dict[str, str], ...] = (
    {"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"},
    {"key": EFA_RESOURCE, "operator": "Exists", "effect": "NoSchedule"},
)

# ---- paths in the containers ---------------------------------------------------------------------
SHM_PATH = "/dev/shm"

# ---- tokens ------------------------------------------------------------------------------------
# A Hugging Face token only ever comes from a Secret (key HF_TOKEN_KEY): never as a value.
HF_TOKEN_ENV = "HF_TOKEN"
HF_TOKEN_KEY = "token"
TOKEN_VARS = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")


# ---- labels --------------------------------------------------------------------------------------
# What an object is to its group: the role label's values (a Literal: nothing else is rendered)
Role = Literal["rendezvous", "http", "serve", "leader", "worker", "probe", "rank", "modules",
               "aiperf", "any"]


def run_label_value(run_id: str) -> str:
    """The run id as a label value: itself when valid, else the derivation RUN_LABEL_HEAD /
    RUN_LABEL_HASH describe (deterministic: the same run id always gives the same value). The
    run id is the run directory's name: the `run_id` parameter's rule, or the run id the guide
    made (lib.core.stage.new_run_id)."""
    if len(run_id) <= LABEL_VALUE_MAX and LABEL_VALUE_RULE.match(run_id):
        return run_id
    digest = hashlib.sha256(run_id.encode()).hexdigest()[:RUN_LABEL_HASH]
    return f"{run_id[:RUN_LABEL_HEAD].rstrip('._-')}-{digest}"


def labels(run_id: str, stage: str, role: Role) -> dict[str, str]:
    """The labels of every object: the run (see run_label_value), the stage (the registry's
    name, NN_name) and the role."""
    return {RUN_LABEL: run_label_value(run_id), STAGE_LABEL: stage, ROLE_LABEL: role}


def run_selector(run_id: str) -> str:
    """The label selector of everything a run made: `kubectl delete <kinds> -l <this>`."""
    return f"{RUN_LABEL}={run_label_value(run_id)}"


# ---- values as rendered ----------------------------------------------------------------------------
# Nothing here checks a parameter: the stage's model accepted them (lib.stages.registry: the
# namespace, the image by digest or an immutable tag, the instance type, the Secret's name, an
# absolute model_cache_dir), and the names, roles, ports and folders are the guide's own (object
# names from lib.places.kube.pods.object_name).
def _image(image: str) -> tuple[str, str]:
    """(image, imagePullPolicy): by digest -> IfNotPresent; by an explicit tag -> Always (a tag
    can be moved; ANCHORS 4: dated tags, never `:latest` with IfNotPresent)."""
    return image, ("IfNotPresent" if "@sha256:" in image else "Always")


def _count(value: int | None, default: int) -> int:
    """A count per node as given, else the instance type's (`default`)."""
    return default if value is None else value


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
    """A container's env: the values given (the guide's own: an engine's, a transport's,
    AIPerf's; a token is never one of them), then HF_TOKEN from the Secret `secret` by
    reference."""
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


def _by_hostname(kind: str, selector: Mapping[str, str]) -> dict[str, Any]:
    """A required pod (anti-)affinity `kind` to the pods `selector` selects, on the hostname."""
    return {kind: {"requiredDuringSchedulingIgnoredDuringExecution": [
        {"labelSelector": {"matchLabels": dict(selector)}, "topologyKey": HOSTNAME_LABEL}]}}


def _anti_affinity(selector: Mapping[str, str]) -> dict[str, Any]:
    """One pod of the group per node (required, on the hostname)."""
    return _by_hostname("podAntiAffinity", selector)


def _affinity_beside(selector: Mapping[str, str]) -> dict[str, Any]:
    """On the node of the pod that `selector` selects (required, on the hostname)."""
    return _by_hostname("podAffinity", selector)


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



# ---- Services ------------------------------------------------------------------------------------
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



def http_service_name(name: str = DEFAULT_SERVE_NAME) -> str:
    return f"{name}{HTTP_SERVICE_SUFFIX}"


def leader_url(name: str = DEFAULT_SERVE_NAME, namespace: str = DEFAULT_NAMESPACE,
               port: int = HTTP_PORT) -> str:
    """The serve's HTTP base URL inside the cluster: the leader-only Service."""
    return f"http://{http_service_name(name)}.{namespace}.svc:{port}"


