"""The AIPerf Job: AIPerf against the leader's Service, which then prints its artifact folder
into its log (lib.places.stream.pack_command).

Pure: values in, plain dicts out.
"""
from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from lib.places.kube.manifests.common import (DEFAULT_NAMESPACE, DEFAULT_SERVE_NAME, GROUP_LABEL,
                                         HTTP_PORT, _affinity_beside, _check_kube_expansion,
                                         _env_list, _image, _resources, _tolerations, labels,
                                         leader_url)
from lib.places.kube.manifests.serve import MODEL_CACHE_PATH
from lib.places.stream import pack_command

DEFAULT_AIPERF_NAME = "aiperf"
SWEEP_STAGE = "05_sweep"  # the stage that renders it (lib.stages.registry's name)
# AIPerf's artifacts: an emptyDir, printed into the log before the pod ends.
ARTIFACT_ROOT = "/artifacts"
# Small, and Guaranteed QoS like everything else.
AIPERF_CPU_MEMORY = ("8", "16Gi")
# A finished AIPerf Job (and its pod, and so its log) is deleted this long after it ends: long
# enough for the stage to read the log, short enough that nothing piles up in the namespace.
AIPERF_TTL_S = 3600


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


@dataclass(frozen=True)
class LeaderCache:
    """The leader node's model cache, where a hub model's tokenizer is: its hostPath (the
    stage's `model_cache_dir`) and the leader pod's labels (serve.leader_selector), which put
    the Job on that node. One value: a cache is never mounted but beside the leader."""
    model_cache_dir: str
    leader: Mapping[str, str]


def _leader_cache(cache: LeaderCache | None) -> dict[str, Any]:
    """The env, mounts, volumes and placement that put the Job beside the leader with its node's
    model cache (read-only, HF_HOME there); nothing without one."""
    if cache is None:
        return {"env": {}, "mounts": [], "volumes": [], "placement": {}}
    return {"env": {"HF_HOME": MODEL_CACHE_PATH},
            "mounts": [{"name": "model-cache", "mountPath": MODEL_CACHE_PATH, "readOnly": True}],
            # the directory must be there: the engine made it (DirectoryOrCreate would hide a
            # wrong path behind an empty cache)
            "volumes": [{"name": "model-cache", "hostPath": {"path": cache.model_cache_dir,
                                                             "type": "Directory"}}],
            "placement": {"affinity": _affinity_beside(cache.leader)}}


def aiperf_job(*, run_id: str, image: str,
               argv: Sequence[str] | Callable[[str], Sequence[str]],
               artifact_dir: str = f"{ARTIFACT_ROOT}/aiperf", block: str = "aiperf",
               name: str = DEFAULT_AIPERF_NAME, stage: str = SWEEP_STAGE,
               namespace: str = DEFAULT_NAMESPACE, serve_name: str = DEFAULT_SERVE_NAME,
               port: int = HTTP_PORT, timeout_s: float = 3600.0,
               ttl_s: int = AIPERF_TTL_S, env: Mapping[str, str] | None = None,
               tolerations: Sequence[Mapping[str, Any]] | None = None,
               leader_cache: LeaderCache | None = None) -> dict[str, Any]:
    """A Job (backoffLimit 0, restartPolicy Never, ttlSecondsAfterFinished) running AIPerf
    against the leader's Service URL (`leader_url`), then printing `artifact_dir` into its log
    as the block `block` (lib.places.stream), to be read back with `kubectl logs` and
    stream.unpack: a finished Job's pod cannot be copied from.

    `argv` is AIPerf's argv (lib.measure.sweep's builder, against the leader's Service), or a
    callable given the URL that returns it; it writes under `artifact_dir` (a folder inside
    ARTIFACT_ROOT, an emptyDir).

    `leader_cache` (the leader node's model cache and the leader pod's labels): the Job runs on
    the leader's node (required pod affinity on the hostname) with that node's model cache
    mounted read-only at MODEL_CACHE_PATH and HF_HOME there, so AIPerf loads a hub model's
    tokenizer from the files the engine downloaded (the cluster cannot reach the hub)."""
    image, pull = _image(image)
    url = leader_url(serve_name, namespace, port)
    argv = [str(a) for a in (argv(url) if callable(argv) else argv)]
    own = {str(k): str(v) for k, v in dict(env or {}).items()}
    cache = _leader_cache(leader_cache)
    own.update(cache["env"])
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
        "volumeMounts": [{"name": "artifacts", "mountPath": ARTIFACT_ROOT}, *cache["mounts"]],
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
                    **cache["placement"],
                    "containers": [container],
                    "volumes": [{"name": "artifacts", "emptyDir": {}}, *cache["volumes"]],
                },
            },
        },
    }

