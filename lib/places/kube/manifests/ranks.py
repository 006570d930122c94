"""Rank jobs: a multi-node job of one process per node (DeepEP's test_ep, which spawns its own
per-GPU ranks, or torchrun): a headless Service plus one Pod per node; node 0 is the rendezvous
by DNS. `kernel_test_objects` fills it from lib.engines.deepep. The guide's files its processes
import (`modules`: the image holds no `lib/`) travel as the job's ConfigMap (`modules_configmap`),
mounted read-only at GUIDE_MOUNT in every pod and first on its PYTHONPATH.

Pure: values in, plain dicts out.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

from lib.engines.deepep import test_ep_argv, test_ep_env
from lib.engines.transport import DEFAULT_PLUGIN_PATH, transport_env, unset_vars
from lib.places.base import NodeRank
from lib.places.instances import DEFAULT_INSTANCE_TYPE, INSTANCE_TYPES
from lib.places.kube.manifests.common import (DEFAULT_NAMESPACE, GROUP_LABEL, HUGEPAGES_2MI,
                                         RUN_LABEL, SHM_PATH, _check_kube_expansion, _count,
                                         _cpu_memory, _env_list, _gpu_pod_spec,
                                         _headless_service, _image, _pod_annotations,
                                         _resources, _security, labels, rendezvous_host,
                                         run_label_value)

NODE_RANK_LABEL = "guide.repro/node-rank"  # rank_objects: the pod's node rank
DEFAULT_RANK_NAME = "test-ep"
KERNEL_STAGE = "03_kernel_test"  # the stage that renders it (lib.stages.registry's name)
# test_ep's init_dist default MASTER_PORT at b306af06 (ANCHORS 1.3).
RDZV_PORT = 8361
# Where a rank job's guide files are mounted (their package layout kept: lib/bench/x.py there).
GUIDE_MOUNT = "/opt/guide"
GUIDE_VOLUME = "guide"
MODULES_SUFFIX = "-modules"  # the job's ConfigMap: <job>-modules
# A ConfigMap holds at most 1 MiB of data, but `kubectl apply` (client-side) also copies the
# whole object into its kubectl.kubernetes.io/last-applied-configuration annotation, and an
# object's annotations may hold at most 256 KiB (apimachinery's TotalAnnotationSizeLimitB,
# 262144 bytes): that is the cap that binds. Half of it leaves room for the JSON escaping of
# the source (every newline and quote) and the object's metadata.
MODULES_MAX_BYTES = 128 * 1024
# The job's files first on PYTHONPATH, an image's own PYTHONPATH kept after them: a pod spec
# cannot read an image's ENV (Kubernetes expands only the container's own variables), so the
# process's start does it.
PYTHONPATH_PREFIX = ["sh", "-c",
                     f'export PYTHONPATH="{GUIDE_MOUNT}${{PYTHONPATH:+:$PYTHONPATH}}"; exec "$@"',
                     "guide-modules"]


def _unset_prefix(transport: str) -> list[str]:
    """`env -u VAR ...`: the transport's variables that must be absent (lib.engines.transport);
    an image's ENV cannot be removed from a pod spec, only from the process's start."""
    out = ["env"]
    for var in unset_vars(transport):
        out += ["-u", var]
    return out


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
                 needs_gdrcopy: bool = True, timeout_s: float | None = None,
                 modules: Mapping[str, str] | None = None) -> list[dict]:
    """A headless Service `name` and one Pod per node (`<name>-<rank>`, hostname and subdomain
    set, so node 0 is `rendezvous_host(name, namespace)`), each running `argv(node)` with
    `env(node)` over the transport's contract (lib.engines.transport.transport_env: its values
    hold over the job's own; its unset variables are never set, and are removed at the
    process's start with `env -u`, an image's ENV included). One pod per node (required anti-affinity), on `instance_type` nodes;
    requests == limits for GPUs, EFA devices, hugepages, memory and cpu; privileged only when
    `needs_gdrcopy` (DeepEP over EFA), with PRIVILEGED_WHY beside it. `modules` ({path relative
    to the repository root: text}, lib.places.kube.files.guide_files): the ConfigMap
    `<name>-modules` holding them, mounted read-only at GUIDE_MOUNT in every pod, GUIDE_MOUNT
    first on PYTHONPATH (PYTHONPATH_PREFIX)."""
    image, pull = _image(image)
    kind = INSTANCE_TYPES[instance_type]
    gpus = _count(gpus_per_node, kind.gpus)
    efa = _count(efa_per_node, kind.efa)
    cpu, memory = _cpu_memory(instance_type, cpu, memory)
    contract = transport_env(transport, plugin_path=plugin_path)
    master = rendezvous_host(name, namespace)
    group = {RUN_LABEL: run_label_value(run_id), GROUP_LABEL: name}
    objects: list[dict] = [_headless_service(
        name=name, namespace=namespace, meta_labels={**labels(run_id, stage, "rendezvous"), **group},
        selector=group, ports=[("rendezvous", rdzv_port)])]
    if modules:
        objects.append(modules_configmap(name=name, namespace=namespace, modules=modules,
                                         meta_labels={**labels(run_id, stage, "modules"),
                                                      **group}))
    for rank in range(nodes):
        node = NodeRank(rank, nodes, master, rdzv_port)
        full_env = _node_env(env(node), contract, transport)
        command = ((PYTHONPATH_PREFIX if modules else []) + _unset_prefix(transport)
                   + [str(a) for a in argv(node)])
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
            "volumeMounts": [{"name": "dshm", "mountPath": SHM_PATH}] + (
                [{"name": GUIDE_VOLUME, "mountPath": GUIDE_MOUNT, "readOnly": True}]
                if modules else []),
        }
        spec = _gpu_pod_spec(container=container, instance_type=instance_type,
                             tolerations=tolerations, affinity_selector=group,
                             restart_policy="Never",
                             extra_volumes=[modules_volume(name, modules)] if modules else ())
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


def _node_env(own: Mapping[str, str], contract: Mapping[str, str], transport: str) -> dict:
    """A node's env over the transport's contract: the job's own variables (the guide's: the
    engines' and the stages', built for this contract), the contract's values over them, and
    none of the variables the transport needs unset (`env -u` removes them at the start too)."""
    unset = set(unset_vars(transport))
    own = {str(k): str(v) for k, v in dict(own).items() if str(k) not in unset}
    return {**own, **contract}


def module_key(path: str) -> str:
    """A file's ConfigMap key: its path with '/' as '.' (a key holds no '/'; its volume item's
    `path` puts the file back at `path`)."""
    return str(path).replace("/", ".")


def modules_configmap(*, name: str, namespace: str, modules: Mapping[str, str],
                      meta_labels: Mapping[str, str]) -> dict:
    """The ConfigMap `<name>-modules`: one key per file (module_key). The files are the guide's
    own (a RankJob's `modules`: lib.engines.deepep.TEST_EP_MODULES, lib.stages.train's), whose
    keys are distinct and whose size is well under MODULES_MAX_BYTES (tests/test_manifests.py
    checks both)."""
    data = {module_key(path): str(text) for path, text in modules.items()}
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": name + MODULES_SUFFIX, "namespace": namespace,
                         "labels": dict(meta_labels)},
            "data": data}


def modules_volume(name: str, modules: Mapping[str, str]) -> dict:
    """The pods' volume of the job's ConfigMap: each key back at its path, read-only files."""
    return {"name": GUIDE_VOLUME, "configMap": {
        "name": name + MODULES_SUFFIX, "defaultMode": 0o444,
        "items": [{"key": module_key(path), "path": str(path)} for path in modules]}}



def kernel_test_objects(*, run_id: str, image: str, nodes: int, tests_dir: str,
                        num_tokens: int, hidden: int, num_topk: int, num_experts: int,
                        python: str = "python3", name: str = DEFAULT_RANK_NAME,
                        instance_type: str = DEFAULT_INSTANCE_TYPE,
                        gpus_per_node: int | None = None, plugin_path: str = DEFAULT_PLUGIN_PATH,
                        **pod_params: Any) -> list[dict]:
    """DeepEP's test_ep on `nodes` nodes, as the kube place runs it: rank_objects with
    lib.engines.deepep's torchrun form (one rank per GPU, `--nproc-per-node` = `--num-processes`
    = GPUs per node, --nnodes, the node rank, the rendezvous on node 0's DNS name and port) and
    env. `pod_params` may carry `modules` (the job's guide files: lib.engines.deepep's
    TEST_EP_MODULES as lib.places.kube.files.guide_files reads them)."""
    gpus = _count(gpus_per_node, INSTANCE_TYPES[instance_type].gpus)

    def argv(node: NodeRank) -> list[str]:
        return test_ep_argv(python=python, tests_dir=tests_dir, num_processes=gpus,
                            num_tokens=num_tokens, hidden=hidden, num_topk=num_topk,
                            num_experts=num_experts, launcher="torchrun", nodes=node.nodes, node_rank=node.rank,
                            master_addr=node.master_addr, rdzv_port=node.port)

    def env(node: NodeRank) -> dict[str, str]:
        return test_ep_env(nodes=node.nodes, node_rank=node.rank, master_addr=node.master_addr,
                           rdzv_port=node.port, transport="efa", nccl_site=None,
                           plugin_path=plugin_path, launcher="torchrun")

    return rank_objects(run_id=run_id, image=image, nodes=nodes, argv=argv, env=env, name=name,
                        instance_type=instance_type, gpus_per_node=gpus,
                        plugin_path=plugin_path, **pod_params)
