"""The serve as a LeaderWorkerSet: the same render (lib.places.kube.manifests.serve.serve_render) as
the StatefulSet, as one LWS group and the HTTP Service over its leader.

Pure: values in, plain dicts out (the render reads pins.yaml for the default model).
"""
from __future__ import annotations

from typing import Any

from lib.places.kube.manifests.common import (GROUP_LABEL, RUN_LABEL, _pod_annotations,
                                         labels, rendezvous_host, run_label_value)
from lib.places.kube.manifests.serve import (LWS_LEADER_VAR, ServeRender, _http_service,
                                        _serve_container, _serve_pod_spec, leader_selector,
                                        render_entrypoint, serve_render)

# LeaderWorkerSet: the convention of vLLM's docs and llm-d (ANCHORS 6). Facts of its API used
# here (kubernetes-sigs/lws): leaderworkerset.x-k8s.io/v1; the leader pod of group 0 is
# `<name>-0`, its workers `<name>-0-<index>` (index 1..size-1: the worker StatefulSet
# `<name>-0` starts its ordinals at 1, pkg/controllers/pod_controller.go); LWS makes a headless
# Service named `<name>` (subdomainPolicy Shared) and its pod webhook sets LWS_LEADER_ADDRESS
# (`<name>-0.<name>.<namespace>`), LWS_GROUP_SIZE and LWS_WORKER_INDEX (0 for the leader) in
# every container (site/content/en/docs/reference/labels-annotations-and-environment-variables.md).
LWS_API_VERSION = "leaderworkerset.x-k8s.io/v1"
LWS_RESOURCE = "leaderworkersets.leaderworkerset.x-k8s.io"  # what kubectl names it by
LWS_GROUP = 0  # the one group (replicas 1) a serve is


def lws_pod_names(name: str, nodes: int) -> list[str]:
    """The pods of group 0 of LeaderWorkerSet `name`, leader first: `<name>-0`, then
    `<name>-0-<k>` for k in 1..nodes-1."""
    leader = f"{name}-{LWS_GROUP}"
    return [leader] + [f"{leader}-{k}" for k in range(1, nodes)]


def lws_addresses(r: ServeRender) -> dict[str, str]:
    """Each node's address as the render names it (a StatefulSet sibling of the rendezvous,
    `<name>-k.<name>.<namespace>.svc`) -> the shell expansion the LWS entrypoint runs instead:
    the leader's LWS_LEADER_ADDRESS, a worker k's the leader pod's name with `-k` on the same
    subdomain (as lws_pod_names names it)."""
    leader_pod = f"{r.name}-0"
    host = rendezvous_host(r.name, r.namespace)
    assert host.startswith(leader_pod + "."), host
    subdomain = host[len(leader_pod):]
    out = {host: f"${{{LWS_LEADER_VAR}}}"}
    for k in range(1, r.nodes):
        out[f"{r.name}-{k}{subdomain}"] = f"${{{LWS_LEADER_VAR}%%.*}}-{k}.${{{LWS_LEADER_VAR}#*.}}"
    return out


def leaderworkerset_objects(**params: Any) -> list[dict]:
    """The same serve as one LeaderWorkerSet group (replicas 1, size = nodes) and the HTTP
    Service over its leader. LWS makes the rendezvous Service itself, so it is not rendered
    here. A custom resource: kubernetes-validate skips it (it has no schema for it), so the
    tests check it structurally. Parameters: as vllm_objects."""
    return lws_objects(serve_render(**params))


def lws_objects(r: ServeRender) -> list[dict]:
    """leaderworkerset_objects of a render already checked."""
    base = {RUN_LABEL: run_label_value(r.run_id), GROUP_LABEL: r.name}

    def template(role: str, ordinals: list[int], leader: bool) -> dict:
        script = render_entrypoint(r, ordinal_from="lws", ordinals=ordinals,
                                   addresses=lws_addresses(r))
        container = _serve_container(r, script=script, leader_probe=leader, serves_http=leader)
        return {"metadata": {"labels": {**labels(r.run_id, r.stage, role), **base},
                             "annotations": _pod_annotations(r.privileged)},
                "spec": _serve_pod_spec(r, container, base)}

    lws = {
        "apiVersion": LWS_API_VERSION, "kind": "LeaderWorkerSet",
        "metadata": {"name": r.name, "namespace": r.namespace,
                     "labels": {**labels(r.run_id, r.stage, "serve"), **base}},
        "spec": {
            "replicas": 1,
            "startupPolicy": "LeaderCreated",
            "networkConfig": {"subdomainPolicy": "Shared"},
            "leaderWorkerTemplate": {
                "size": r.nodes,
                # One rank's death ends every DP rank's collective: restart the whole group.
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": template("leader", [0], True),
                "workerTemplate": template("worker", list(range(1, r.nodes)), False),
            },
        },
    }
    http = _http_service(r, leader_selector(r.run_id, r.name, lws=True))
    return [http, lws]
