"""The serve: one vLLM serve over `nodes` nodes, as Kubernetes objects.

`serve_render(**params)` takes a serve's values once and returns a ServeRender (frozen): the
values and what runs on each node. Every renderer reads that one render (no value is checked
here: the stage's model accepted them, lib.stages.registry):

- `vllm_objects`: the serve as a StatefulSet (pod 0 the leader, the others `--headless`
  workers), a headless Service for the rendezvous and a second Service, for HTTP, that selects
  pod 0 only (lib.places.kube.manifests.lws: the same render as a LeaderWorkerSet);
- `entrypoint_script`: the container's bash script, which finds its ordinal and execs its argv;
- `serve_argv`: one ordinal's (argv, env), as the entrypoint runs it.

The engine's part (each node's argv and env, the process a worker's readiness looks for) is
`engine_commands` alone, which asks the engine the stage names (lib.engines.base's protocol;
vLLM by default): no engine flag is named here.

One read, nothing else: pins.yaml's `model` pin (`pinned_model_default`), for the model and its
revision when the parameters name none. Otherwise pure: parameters in, plain dicts out.
"""
from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Iterable, Literal, Mapping, Sequence

from lib.engines.model_facts import routed_experts
from lib.engines.transport import DEFAULT_PLUGIN_PATH, unset_vars
from lib.engines import catalog
from lib.engines.base import EngineSpec, process_regex
from lib.places.instances import DEFAULT_INSTANCE_TYPE, INSTANCE_TYPES
from lib.places.kube.manifests.common import (DEFAULT_NAMESPACE, DEFAULT_SERVE_NAME, GROUP_LABEL,
                                         HTTP_PORT, HUGEPAGES_2MI, ROLE_LABEL, RUN_LABEL,
                                         SHM_PATH, _check_kube_expansion, _count, _cpu_memory,
                                         _env_list, _gpu_pod_spec, _headless_service, _image,
                                         _pod_annotations, _resources, _security,
                                         http_service_name, labels, rendezvous_host,
                                         run_label_value)
from lib.roots import pins as pins_mod
from lib.engines.deepep import DEFAULT_MODE

SERVE_STAGE = "04_serve"  # the stage that renders it (lib.stages.registry's name)
# Set by the StatefulSet controller on each pod it makes: `<statefulset>-<ordinal>`.
POD_NAME_LABEL = "statefulset.kubernetes.io/pod-name"
# The LeaderWorkerSet entrypoint's shell variable holding LWS_LEADER_ADDRESS (checked once).
LWS_LEADER_VAR = "leader"
# Where the entrypoint finds its pod's ordinal: a StatefulSet pod's hostname, or LWS's variables
OrdinalFrom = Literal["hostname", "lws"]
# vLLM's --data-parallel-rpc-port: R's README says 29570 (its script 29500: ANCHORS 4, drift);
# the README's value, and one port for every rendering.
DP_RPC_PORT = 29570
# The model weights on the node's instance storage (hostPath `model_cache_dir`), mounted here and
# named HF_HOME: one download per node, kept between runs, and not on the root EBS volume (PR's
# `emptyDir sizeLimit: 900Gi` landed on root-volume ephemeral storage: ANCHORS 4).
MODEL_CACHE_PATH = "/model-cache"
READINESS_PERIOD_S = 10


# ---- the render ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class EngineCommands:
    """What the engine runs (engine_commands): each ordinal's argv (0 the leader), the one
    environment every ordinal shares, and the bash regex of the serving process."""
    argvs: Mapping[int, tuple[str, ...]]
    env: Mapping[str, str]
    process_regex: str


@dataclass(frozen=True)
class ServeRender:
    """One serve's values, taken once (`serve_render`), with what runs on each node.
    The StatefulSet, the LeaderWorkerSet, the entrypoint and serve_argv all read this, never the
    parameters again. Read-only: its mappings are MappingProxyType, its sequences tuples."""
    run_id: str
    stage: str
    name: str  # the StatefulSet (or LeaderWorkerSet) and its rendezvous Service
    namespace: str
    image: str
    pull: str  # the imagePullPolicy the image's form asks for
    nodes: int
    gpus: int  # per node
    efa: int  # per node
    instance_type: str
    model: str
    model_revision: str | None  # weights and tokenizer (None: no --revision)
    model_cache_dir: str  # the node's hostPath mounted at MODEL_CACHE_PATH
    secret: str | None  # the HF token's Secret, or None
    backend: str
    engine: str  # lib.engines.catalog's name: the serve container is named by it
    argvs: Mapping[int, tuple[str, ...]]  # by ordinal (engine_commands)
    env: Mapping[str, str]  # every ordinal's: the engine's, and HF_HOME
    process_regex: str  # what a worker's readiness looks for (engine_commands)
    unset: tuple[str, ...]  # unset before exec (the transport's, lib.engines.transport)
    port: int
    rpc_port: int
    hugepages: str | None
    cpu: str
    memory: str
    tolerations: tuple[Mapping[str, Any], ...] | None  # None: DEFAULT_TOLERATIONS
    # DeepEP's backends run its GIN proxy over EFA, which needs gdrcopy: privileged.
    # vLLM's own all-to-all fallbacks use NCCL only.
    privileged: bool

    def argv(self, ordinal: int) -> list[str]:
        """The argv of the pod with this ordinal (0 = the leader; 0..nodes - 1)."""
        return list(self.argvs[ordinal])


def pinned_model_default() -> tuple[str, str]:
    """pins.yaml's `model` pin as (model id, revision): the serve's model when the parameters
    name none, and the revision of that model. The one file the package reads."""
    pin = pins_mod.load()["pins"]["model"]
    return pin["model"], pin["revision"]


def _model_and_revision(model: str | None, model_revision: str | None) -> tuple[str, str | None]:
    """pins.yaml `model`: the one source of the model and its revision. model_revision '' takes
    the pin's revision for the pinned model (none for another model); None asks for none. The
    model id and the 40-hex revision are the stage's, as its model accepted them."""
    pinned = pinned_model_default() if model is None or model_revision == "" else (None, None)
    model = pinned[0] if model is None else model
    if model_revision == "":
        model_revision = pinned[1] if model == pinned[0] else None
    return model, model_revision or None


def engine_commands(*, engine: str, model: str, model_revision: str | None, backend: str,
                    nodes: int, gpus: int, address: str, rpc_port: int, port: int,
                    enforce_eager: bool, max_model_len: int | None,
                    gpu_memory_utilization: float | None, ep_num_comms: int, plugin_path: str,
                    num_experts: int | None, python: str | None,
                    transport: str = "efa", deepep_v2_mode: str = DEFAULT_MODE) -> EngineCommands:
    """What the engine the stage names runs on each node (lib.engines.base's protocol: 0 the
    leader, k > 0 a worker starting at rank k x gpus), the environment every node shares, and
    the regex of its serving process. The package names no engine flag: the engine does."""
    serving = catalog.engine(engine)
    argvs: dict[int, tuple[str, ...]] = {}
    envs: list[dict[str, str]] = []
    spec = None
    for ordinal in range(nodes):
        spec = EngineSpec(
            model=model, role="leader" if ordinal == 0 else "worker", nodes=nodes,
            gpus_per_node=gpus, start_rank=ordinal * gpus, backend=backend,
            enforce_eager=enforce_eager, ep_num_comms=ep_num_comms, port=port,
            rendezvous=address, rpc_port=rpc_port, revision=model_revision, transport=transport,
            python=python, plugin_path=plugin_path, num_experts=num_experts,
            max_model_len=max_model_len, gpu_memory_utilization=gpu_memory_utilization,
            deepep_v2_mode=deepep_v2_mode)
        argv, env = serving.command(spec)
        argvs[ordinal] = tuple(argv)
        envs.append(dict(env))
    assert len({frozenset(e.items()) for e in envs}) == 1, \
        f"engine {engine} gave the roles different environments"
    return EngineCommands(argvs=MappingProxyType(argvs), env=MappingProxyType(envs[0]),
                          process_regex=process_regex(serving.process_words(spec)))


def leader_selector(run_id: str, name: str, lws: bool = False) -> dict[str, str]:
    """The labels that select serve `name`'s leader pod alone (pod 0 of the StatefulSet, or the
    LeaderWorkerSet's leader): its HTTP Service's selector, and where AIPerf's Job sits (beside
    it, on the node whose model cache holds the tokenizer)."""
    base = {RUN_LABEL: run_label_value(run_id), GROUP_LABEL: name}
    return {**base, ROLE_LABEL: "leader"} if lws else {**base, POD_NAME_LABEL: f"{name}-0"}


def serve_render(*, run_id: str, image: str, model_cache_dir: str, nodes: int = 2,
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
                 port: int = HTTP_PORT, engine: str = "vllm",
                 transport: str = "efa", deepep_v2_mode: str = DEFAULT_MODE) -> ServeRender:
    """Every value of a serve rendering (as vllm_objects lists them), with each node's argv and
    env (engine_commands): the stage's, as its model accepted them (lib.stages.registry: the
    EP divisibility of the model over nodes x GPUs, GPUs per node >= 1 on the kube place,
    lib.stages.rules_places), and the guide's own (`name`: lib.places.kube.pods.object_name)."""
    image, pull = _image(image)
    kind = INSTANCE_TYPES[instance_type]
    gpus = _count(gpus_per_node, kind.gpus)
    efa = _count(efa_per_node, kind.efa)
    model, model_revision = _model_and_revision(model, model_revision)
    secret = hf_token_secret or None
    commands = engine_commands(
        engine=engine, model=model, model_revision=model_revision, backend=backend, nodes=nodes, gpus=gpus,
        address=rendezvous_host(name, namespace), rpc_port=rpc_port, port=port,
        enforce_eager=enforce_eager, max_model_len=max_model_len,
        gpu_memory_utilization=gpu_memory_utilization, ep_num_comms=ep_num_comms,
        plugin_path=plugin_path, num_experts=routed_experts(model), python=python,
        transport=transport, deepep_v2_mode=deepep_v2_mode)
    env = dict(commands.env)
    env["HF_HOME"] = MODEL_CACHE_PATH
    cpu, memory = _cpu_memory(instance_type, cpu, memory)
    return ServeRender(
        run_id=run_id, stage=stage, name=name, namespace=namespace, image=image, pull=pull,
        nodes=nodes, gpus=gpus, efa=efa, instance_type=instance_type, model=model,
        model_revision=model_revision, model_cache_dir=model_cache_dir, secret=secret,
        backend=backend, engine=engine, argvs=commands.argvs, env=MappingProxyType(env),
        process_regex=commands.process_regex, unset=tuple(unset_vars(transport)), port=port,
        rpc_port=rpc_port, hugepages=hugepages_2mi, cpu=cpu, memory=memory,
        tolerations=None if tolerations is None else tuple(tolerations),
        privileged=backend.startswith("deepep"))


def serve_argv(ordinal: int, **params: Any) -> tuple[list[str], dict[str, str]]:
    """(argv, env) of the pod with this ordinal (0 = the leader), as the entrypoint runs it."""
    render = serve_render(**params)
    return render.argv(ordinal), dict(render.env)


# ---- the entrypoint ------------------------------------------------------------------------------
def _shell_word(token: str, addresses: Mapping[str, str]) -> str:
    """One argv token as a shell word: quoted, but for each rendered address in it, which
    becomes the shell expansion `addresses` maps it to (double-quoted: expanded, never split)."""
    if not addresses:
        return shlex.quote(token)
    # an address only where it starts a host name (a sibling `x-10.` is not `x-1.` with more)
    found = re.compile(r"(?<![A-Za-z0-9.-])(" + "|".join(
        re.escape(a) for a in sorted(addresses, key=len, reverse=True)) + r")")
    pieces = found.split(token)
    if len(pieces) == 1:
        return shlex.quote(token)
    return "".join(f'"{addresses[piece]}"' if i % 2 else (shlex.quote(piece) if piece else "")
                   for i, piece in enumerate(pieces))


def _argv_lines(argv: Sequence[str], indent: str,
                addresses: Mapping[str, str] | None = None) -> str:
    """argv as shell words: the program's words on the first line, then a flag (with its value,
    when one follows) per line."""
    argv = list(argv)
    first = next((i for i, t in enumerate(argv) if t.startswith("--")), len(argv))
    groups: list[Sequence[str]] = [argv[:first]] if first else []
    i = first
    while i < len(argv):
        step = 2 if i + 1 < len(argv) and not argv[i + 1].startswith("--") else 1
        groups.append(argv[i:i + step])
        i += step
    return f" \\\n{indent}".join(" ".join(_shell_word(t, addresses or {}) for t in g)
                                  for g in groups)


def _find_ordinal(name: str, ordinal_from: OrdinalFrom) -> str:
    """The script's lines that set `ordinal` (see entrypoint_script), or exit 64."""
    if ordinal_from == "hostname":
        return (f'host="${{HOSTNAME:-}}"\n'
                f'ordinal="${{host##*-}}"\n'
                f'if [[ ! "${{ordinal}}" =~ ^[0-9]+$ || "${{host}}" != "{name}-${{ordinal}}" ]]; then\n'
                f'  echo "guide-entrypoint: HOSTNAME=\'${{host}}\' is not {name}-<ordinal>: the '
                f'ordinal comes from a StatefulSet pod\'s hostname" >&2\n'
                f'  exit 64\n'
                f'fi\n')
    # "lws": LWS_LEADER_ADDRESS is `<leader pod>.<lws>.<namespace>` (LWS's pod webhook): the
    # leader's host, and a worker k's is the leader pod's name with `-k` on the same subdomain
    # (`${leader%%.*}-k.${leader#*.}`)
    return ('ordinal="${LWS_WORKER_INDEX:-}"\n'
            'if [[ ! "${ordinal}" =~ ^[0-9]+$ ]]; then\n'
            '  echo "guide-entrypoint: LWS_WORKER_INDEX=\'${ordinal}\' is not a number: the '
            'LeaderWorkerSet controller sets it" >&2\n'
            '  exit 64\n'
            'fi\n'
            f'{LWS_LEADER_VAR}="${{LWS_LEADER_ADDRESS:-}}"\n'
            f'if [[ ! "${{{LWS_LEADER_VAR}}}" =~ ^[a-z0-9-]+\\.[a-z0-9.-]+$ ]]; then\n'
            f'  echo "guide-entrypoint: LWS_LEADER_ADDRESS=\'${{{LWS_LEADER_VAR}}}\' is not '
            '<leader>.<service>.<namespace>: the LeaderWorkerSet controller sets it" >&2\n'
            '  exit 64\n'
            'fi\n')


def render_entrypoint(render: ServeRender, *, ordinal_from: OrdinalFrom = "hostname",
                      ordinals: Iterable[int] | None = None,
                      addresses: Mapping[str, str] | None = None) -> str:
    """entrypoint_script of a render. `ordinals`: the branches it holds (of 0..nodes - 1;
    default every node's). `addresses`: each rendered node address -> the shell expansion the
    script runs in its place (a LeaderWorkerSet's, from LWS_LEADER_ADDRESS:
    lib.places.kube.manifests.lws)."""
    chosen = sorted(render.argvs if ordinals is None else set(ordinals))
    find = _find_ordinal(render.name, ordinal_from)
    unset = f"unset {' '.join(render.unset)}\n" if render.unset else ""
    branches = ""
    for o in chosen:
        role = "leader" if o == 0 else "worker"
        branches += (f"  {o})\n"
                     f'    echo "guide-entrypoint: ordinal {o}, the {role}"\n'
                     f"    exec {_argv_lines(render.argvs[o], ' ' * 6, addresses)}\n"
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
    _check_kube_expansion("the serve's entrypoint", [script], render.env)
    return script


def entrypoint_script(*, ordinal_from: OrdinalFrom = "hostname", ordinals: Iterable[int] | None = None,
                      **params: Any) -> str:
    """The serve container's bash script (run as `bash -c`): find this pod's ordinal, then exec
    the argv engine_commands rendered for it: 0 the leader, k > 0 a `--headless` worker with
    start rank k x GPUs per node.

    ordinal_from 'hostname': a StatefulSet's pod is `<name>-<ordinal>`, and its hostname says so
    (the script refuses any other hostname, e.g. one a hostNetwork pod would have).
    ordinal_from 'lws': a LeaderWorkerSet sets LWS_WORKER_INDEX (0 for the leader).
    `ordinals`: the branches this script holds (default every node's).

    Embedded in the pod spec rather than a ConfigMap: what a pod ran is in its own spec (and in
    the plan), one object fewer, and a changed script changes the pod template, so the serve is
    rolled (a ConfigMap's change would reach no running pod)."""
    return render_entrypoint(serve_render(**params), ordinal_from=ordinal_from, ordinals=ordinals)


# ---- the serve's pods and Services ---------------------------------------------------------------
def _process_check(regex: str) -> str:
    """Plain bash over /proc: exit 0 when some process's command line matches `regex`."""
    return ("set -u\n"
            f"re='{regex}'\n"
            "for f in /proc/[0-9]*/cmdline; do\n"
            '  cmd="$(tr \'\\0\' \' \' < "$f" 2>/dev/null)" || continue\n'
            '  if [[ "${cmd}" =~ ${re} ]]; then\n'
            "    exit 0\n"
            "  fi\n"
            "done\n"
            "exit 1\n")


def worker_probe_script(regex: str) -> str:
    """A worker's readiness: some process's command line matches the engine's process regex
    (ServeRender.process_regex, whose first character in brackets keeps it from matching the
    probe itself). Plain bash over /proc (pgrep's procps is not in the guide's image:
    docker/Dockerfile installs none)."""
    return _process_check(regex)


def _serve_container(render: ServeRender, *, script: str, leader_probe: bool | None,
                     serves_http: bool = True) -> dict:
    """The serve container. leader_probe: True the leader's HTTP readiness, False the workers',
    None (a StatefulSet's one template for both) a probe that passes on either: HTTP /health on
    the leader, the process check on a worker."""
    port = render.port
    timing = {"periodSeconds": READINESS_PERIOD_S, "timeoutSeconds": 5, "failureThreshold": 3}
    if leader_probe is None:
        # One template serves every ordinal: pod 0 (the leader) is ready when /health answers
        # on its HTTP port (curl: docker/Dockerfile installs it); a headless worker serves no
        # HTTP, so its readiness is its process.
        either = ("set -u\n"
                  f"if [[ \"${{HOSTNAME:-}}\" == \"{render.name}-0\" ]]; then\n"
                  f"  exec curl -fsS -o /dev/null --max-time 4 http://127.0.0.1:{port}/health\n"
                  "fi\n"
                  + _process_check(render.process_regex).replace("set -u\n", "", 1))
        probe = {"exec": {"command": ["bash", "-c", either]}, **timing}
    elif leader_probe:
        probe = {"httpGet": {"path": "/health", "port": "http"}, **timing}
    else:
        probe = {"exec": {"command": ["bash", "-c", _process_check(render.process_regex)]},
                 **timing}
    mounts = [{"name": "dshm", "mountPath": SHM_PATH},
              {"name": "model-cache", "mountPath": MODEL_CACHE_PATH}]
    ports = ([{"name": "http", "containerPort": port, "protocol": "TCP"}] if serves_http else [])
    ports.append({"name": "dp-rpc", "containerPort": render.rpc_port, "protocol": "TCP"})
    return {
        "name": render.engine,
        "image": render.image,
        "imagePullPolicy": render.pull,
        "command": ["bash", "-c", script],
        "env": _env_list(render.env, render.secret),
        "ports": ports,
        "readinessProbe": probe,
        "resources": _resources(gpus=render.gpus, efa=render.efa, hugepages=render.hugepages,
                                cpu=render.cpu, memory=render.memory),
        "securityContext": _security(render.privileged),
        "volumeMounts": mounts,
    }


def _serve_pod_spec(render: ServeRender, container: dict, affinity_selector: Mapping[str, str]
                    ) -> dict[str, Any]:
    """A serve pod's spec: a GPU pod with the node's model cache (hostPath) beside /dev/shm."""
    cache = {"name": "model-cache", "hostPath": {"path": render.model_cache_dir,
                                                 "type": "DirectoryOrCreate"}}
    return _gpu_pod_spec(container=container, instance_type=render.instance_type,
                         tolerations=render.tolerations, affinity_selector=affinity_selector,
                         extra_volumes=[cache])


def _http_service(render: ServeRender, selector: Mapping[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": http_service_name(render.name), "namespace": render.namespace,
                     "labels": {**labels(render.run_id, render.stage, "http"),
                                GROUP_LABEL: render.name}},
        "spec": {
            "type": "ClusterIP",
            # The leader only: headless workers serve no HTTP, and a Service over every pod
            # refused about half the connections (the public review, ANCHORS 4).
            "selector": dict(selector),
            "ports": [{"name": "http", "port": render.port, "targetPort": "http",
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
    return statefulset_objects(serve_render(**params))


def statefulset_objects(r: ServeRender) -> list[dict]:
    """vllm_objects of a render already checked."""
    group = {RUN_LABEL: run_label_value(r.run_id), GROUP_LABEL: r.name}
    pod_labels = {**labels(r.run_id, r.stage, "serve"), GROUP_LABEL: r.name}
    container = _serve_container(r, script=render_entrypoint(r), leader_probe=None)
    statefulset = {
        "apiVersion": "apps/v1", "kind": "StatefulSet",
        "metadata": {"name": r.name, "namespace": r.namespace, "labels": dict(pod_labels)},
        "spec": {
            "serviceName": r.name,
            "replicas": r.nodes,
            # Every node at once: the leader waits for all its DP ranks, so an ordered rollout
            # would wait for a leader that cannot become ready alone.
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": dict(group)},
            "template": {"metadata": {"labels": dict(pod_labels),
                                      "annotations": _pod_annotations(r.privileged)},
                         "spec": _serve_pod_spec(r, container, group)},
        },
    }
    headless = _headless_service(
        name=r.name, namespace=r.namespace,
        meta_labels={**labels(r.run_id, r.stage, "rendezvous"), GROUP_LABEL: r.name},
        selector=group, ports=[("dp-rpc", r.rpc_port)])
    http = _http_service(r, leader_selector(r.run_id, r.name))
    return [headless, http, statefulset]
