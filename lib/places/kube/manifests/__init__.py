"""Kubernetes objects as data, for the kube place and for what its plan records.

Values in, plain dicts out (JSON-able, in Kubernetes' own field names); nothing here talks to
a cluster, and nothing here checks a parameter (the stage's model accepted every value the
stage hands down: lib.stages.registry, lib.stages.rules_places). One read: the serve's render takes the default model and its revision from
pins.yaml (serve.pinned_model_default); nothing else reads a file. The kube place applies the
objects with kubectl; the plan place writes them (`to_yaml`) and checks them (`validate_argv`:
kubernetes-validate --strict; `embedded_scripts`: the shell scripts inside them, for shellcheck).

The modules, by what they render (every name below is re-exported here, so
`import lib.places.kube.manifests as manifests` is the one way in):

- `common`: labels and names, the `$(VAR)` expansion check of the scripts it renders, resources
  and the pieces of a pod spec.
- `probe`: `node_probe_pod`, one short pod per node that prints what 00 gates on (gdrdrv, EFA
  devices, hugepages) in the line format `PROBE_FORMAT` describes; `parse_probe_log` reads it.
- `ranks`: `rank_objects`, a multi-node job of one process per node (DeepEP's test_ep, which
  spawns its own per-GPU ranks, or torchrun): a headless Service plus one Pod per node; node 0
  is the rendezvous by DNS. `kernel_test_objects` fills it from lib.engines.deepep. The
  guide's files the job imports ride in its ConfigMap (`modules_configmap`), mounted at
  GUIDE_MOUNT.
- `serve`: `serve_render` takes a serve's values once into a ServeRender, which every serve
  renderer reads; `vllm_objects`: the serve as a StatefulSet (pod 0 the leader, the others
  `--headless` workers), a headless Service for the rendezvous and a second Service, for HTTP,
  that selects pod 0 only. Every vLLM argv and env comes from `engine_commands`, over
  lib.engines.vllm_args.vllm_serve, the one builder.
- `lws`: `leaderworkerset_objects`, the same render as a LeaderWorkerSet.
- `aiperf`: `aiperf_job`, a Job running AIPerf against the leader's Service, which then prints
  its artifact folder into its log (lib.places.stream.pack_command).
- `output`: `pod_specs`, `embedded_scripts`, `to_yaml`, `validate_argv`, `for_kube_1_20`.

What the public reproductions got wrong, and what the package does instead, is said beside
each choice; ANCHORS = ../shared/reference/ANCHORS.md (R, V, PR = the reproductions and the
public review as summarised there), DESIGN = ../shared/DESIGN.md "Kubernetes objects
(04_serve), from what the anchors got wrong". Every number and name is a constant of the module
that uses it (of `common` when several do).
"""
from __future__ import annotations

from lib.places.kube.manifests.aiperf import (  # noqa: F401
    AIPERF_CPU_MEMORY, AIPERF_TTL_S, ARTIFACT_ROOT, DEFAULT_AIPERF_NAME, SWEEP_STAGE, LeaderCache,
    aiperf_job, aiperf_script)
from lib.places.kube.manifests.common import (  # noqa: F401
    DEFAULT_NAMESPACE, DEFAULT_SERVE_NAME, DEFAULT_TOLERATIONS, EFA_RESOURCE, GPU_RESOURCE,
    GROUP_LABEL, HF_TOKEN_ENV, HF_TOKEN_KEY, HOSTNAME_LABEL, HTTP_PORT, HTTP_SERVICE_SUFFIX,
    HUGEPAGES_2MI, HUGEPAGES_RESOURCE, INSTANCE_TYPE_LABEL, LABEL_VALUE_MAX, LABEL_VALUE_RULE,
    NAME_MAX, NAME_RULE, POD_CPU_MEMORY, PRIVILEGED_WHY, PRIVILEGED_WHY_ANNOTATION, ROLE_LABEL,
    RUN_LABEL, RUN_LABEL_HASH, RUN_LABEL_HEAD, SHM_PATH, SHM_SIZE, STAGE_LABEL, TOKEN_VARS, Role,
    http_service_name, labels, leader_url, rendezvous_host, run_label_value, run_selector)
from lib.places.kube.manifests.lws import (  # noqa: F401
    LWS_API_VERSION, LWS_RESOURCE, leaderworkerset_objects, lws_addresses, lws_objects,
    lws_pod_names)
from lib.places.kube.manifests.output import (  # noqa: F401
    KUBE_VERSION, NEWER_THAN_1_20, VALIDATOR, embedded_scripts, for_kube_1_20, pod_specs, to_yaml,
    validate_argv)
from lib.places.kube.manifests.probe import (  # noqa: F401
    PROBE_CPU_MEMORY, PROBE_DEADLINE_S, PROBE_FORMAT, PROBE_HOST_ROOT, PROBE_KEYS,
    PROBE_NAME_PREFIX, PROBE_PREFIX, PROBE_STAGE, node_probe_pod, parse_probe_log, probe_pod_name,
    probe_script)
from lib.places.kube.manifests.ranks import (  # noqa: F401
    DEFAULT_RANK_NAME, GUIDE_MOUNT, KERNEL_STAGE, MODULES_MAX_BYTES, MODULES_SUFFIX,
    NODE_RANK_LABEL, PYTHONPATH_PREFIX, RDZV_PORT, kernel_test_objects, module_key,
    modules_configmap, rank_objects)
from lib.places.kube.manifests.serve import (  # noqa: F401
    DP_RPC_PORT, MODEL_CACHE_PATH, POD_NAME_LABEL, READINESS_PERIOD_S, SERVE_STAGE,
    EngineCommands, OrdinalFrom, ServeRender, engine_commands, entrypoint_script, leader_selector,
    pinned_model_default,
    render_entrypoint, serve_argv, serve_render, statefulset_objects, vllm_objects,
    worker_probe_script)
