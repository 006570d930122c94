"""A kube serve (what KubePlace.serve runs): the engine as a StatefulSet with a headless Service
for rank discovery and a Service that selects only the leader for HTTP, or (kube_workload
leaderworkerset) as one LeaderWorkerSet group, whose pods the cluster's LWS controller makes
(`<name>-0` the leader, `<name>-0-<k>` the workers); ready when the leader's readiness probe
(/health) holds; every pod's log saved whole and gated (lib.places.cluster: backend, EP split,
EFA on every rank, settings); looked at once more as it ends (every pod held through it), then
deleted unless `keep`.

Its handle is KubeServer: requests reach the server from inside the cluster (`kubectl exec`
of REQUEST_SCRIPT in the leader pod), never from here. Functions of the place
(lib.places.kube.place.KubePlace, or its plan, whose apply and waits are records).
"""
from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import lib.places.kube.manifests as manifests  # the renderers themselves, not lib.places (no cycle through it)
from lib.core.door import HttpResult
from lib.core.errors import NotScheduled, Unsupported
from lib.core.evidence import gate
from lib.places.base import ClusterServer, ServeSpec
from lib.places.cluster import first_rank_gate, gate_adder, serve_gates, settings_gates
from lib.places.kube.pods import (PodsNotCreated, PodStuck, held_gate, is_ready, object_name,
                                  phase_of, trouble, where_pod)
from lib.engines.deepep import DEFAULT_MODE


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


@dataclass
class KubeServer(ClusterServer):
    """A serve on the cluster (any engine): `url` is the leader Service's address inside the
    cluster."""
    name: str = ""  # its objects' name (the StatefulSet's or the LeaderWorkerSet's)
    pods: list[str] = field(default_factory=list)
    service: str = ""
    ready_pods: dict[str, dict] = field(default_factory=dict)  # as they were when Ready

    @property
    def url(self) -> str:
        return f"http://{self.service}:{manifests.HTTP_PORT}"

    def request(self, door, method: str, path: str, *, timeout: float, json_body=None):
        """From inside the cluster: python3 in the leader pod asks the leader's Service."""
        body = "" if json_body is None else json.dumps(json_body)
        call = door.run(self.place.kubectl("exec", self.pods[0], "--", "python3", "-c",
                                           REQUEST_SCRIPT, method, self.url + path,
                                           str(timeout), body),
                        timeout=timeout + 30, check=False)
        try:
            got = json.loads(call.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            got = {"status": None, "body": "", "error": f"kubectl exec exited {call.rc}: "
                                                        f"{call.stderr.strip()[-300:]}"}
        return HttpResult(method, self.url + path, got.get("status"), got.get("body") or "",
                          got.get("error"), call.duration_s, call.seq)


@contextmanager
def serve(place, spec: ServeSpec) -> Iterator[KubeServer]:
    """The serve as a StatefulSet (lib.places.kube.manifests.vllm_objects) or, with
    kube_workload leaderworkerset, as one LeaderWorkerSet group (leaderworkerset_objects:
    the cluster's LWS controller makes its pods); ready when the leader's probe holds; every
    pod's log kept and gated; deleted when the block ends (unless `keep`, then the next
    stage's apply finds it as it is)."""
    stage = place.stage
    name = object_name(spec.log_name.rsplit(".", 1)[0] if spec.log_name else spec.engine)
    cache = place._model_cache_dir()
    if not cache:
        raise Unsupported("no model_cache_dir: the nodes keep the model's weights on their "
                          "instance storage (-p model_cache_dir /path/on/the/NVMe/mount)")
    lws = place.spec.leaderworkerset
    render = manifests.leaderworkerset_objects if lws else manifests.vllm_objects
    objects = render(
        **place._where(), name=name, image=place._image(), nodes=spec.nodes,
        model_cache_dir=cache, model=spec.model["model_dir"],
        model_revision=place.spec.model_revision, backend=spec.backend,
        ep_num_comms=spec.num_comms, enforce_eager=spec.enforce_eager,
        hf_token_secret=place.spec.hf_token_secret or None, engine=spec.engine,
        transport=place.transport_of(spec), deepep_v2_mode=place.spec.deepep_v2_mode or DEFAULT_MODE)
    gpus = int(place.spec.gpus_per_node)
    server = KubeServer(spec.model["model_dir"], manifests.HTTP_PORT,
                        stage.path("pods", f"{name}-0.log"), device="cuda", place=place,
                        backend=spec.backend, gpus=gpus * spec.nodes,
                        service=f"{manifests.http_service_name(name)}.{place.namespace}.svc")
    server.pods = (manifests.lws_pod_names(name, spec.nodes) if lws
                   else [f"{name}-{k}" for k in range(spec.nodes)])
    server.name = name
    server.tokenizer_revision = spec.model.get("revision") or None  # AIPerf's, in the cache
    add = gate_adder(stage, server, spec.gate_prefix)
    place.apply(objects, name)
    try:
        gate_serve(place, server, spec, add, lws)
        yield server
    finally:
        if not place.plans_only and server.ready:  # looked at once more as it ends
            add(held_gate(place.pod_status(server.pods), server.ready_pods,
                          lambda n: place._json("get", "node", n), lambda uid: place._json(
                              "get", "events", "--field-selector", f"involvedObject.uid={uid}"),
                          [stage.rel(stage.path("pods", f"{pod}.log")) for pod in server.pods]))
        if not place.plans_only and not place.spec.keep:
            if lws:
                place.delete_lws(name)
            place.delete(name)
            left = place.pod_status(server.pods)
            add(gate("server stopped", not any(left.values()),
                     sorted(n for n, s in left.items() if s), [],
                     ("its LeaderWorkerSet (and with it the pods and headless Service its "
                      "controller made) and its HTTP Service deleted, no pod of it left")
                     if lws else "its StatefulSet and Services deleted, no pod of it left",
                     []))

def gate_serve(place, server: KubeServer, spec: ServeSpec, add, lws: bool) -> None:
    """Wait for the serve's pods (by their StatefulSet or LeaderWorkerSet names), keep
    every pod's log and gate them: ready, then the engine's gates over every log."""
    stage, gpus = place.stage, int(place.spec.gpus_per_node)
    started = place.door.now()
    try:
        statuses = place.wait_pods(server.pods, done=False, timeout_s=spec.timeout_s,
                                  made_by=None if lws else server.name)
    except PodsNotCreated as why:
        add(gate("server ready", False, "no pod", "every pod created", str(why), []))
        return
    except PodStuck as why:
        add(gate("server ready", False, "Pending", "every pod running", str(why), []))
        return
    except NotScheduled as why:
        add(gate("server ready", False, "Pending", "every pod scheduled",
                 f"the scheduler: {why}", []))
        return
    ready = all(s and is_ready(s) for s in statuses.values())
    logs = {pod: place.pod_log(pod, statuses.get(pod)) for pod in server.pods}
    server.ready, server.ready_pods = ready, (statuses if ready else {})
    server.ready_s = round(place.door.now() - started, 1) if ready else None
    evidence = [stage.rel(stage.path("pods", f"{pod}.log")) for pod in server.pods]
    absent = [pod for pod, s in statuses.items() if not s]
    if ready:
        why = f"the leader's readiness probe held after {server.ready_s} s"
    elif lws and absent:  # the LWS was stored, but nothing made its pods
        why = (f"no pod {', '.join(absent)} within the timeout: the cluster's "
               "LeaderWorkerSet controller makes a group's pods (is it running? kubectl "
               f"get {manifests.LWS_RESOURCE} {server.pods[0].rsplit('-', 1)[0]})")
    elif any(trouble(s) for s in statuses.values()):
        why = "; ".join(f"{where_pod(pod, s)}: {trouble(s)}"
                        for pod, s in statuses.items() if trouble(s))
    else:
        why = "not ready within the timeout: the pods' logs are kept"
    add(gate("server ready", ready, {pod: phase_of(s) for pod, s in statuses.items()},
             {"leader": "Ready (GET /health)"}, why, evidence))
    if not ready and any(logs.values()):
        add(first_rank_gate(dict(zip(evidence, logs.values())), gpus, evidence))
    if ready:
        server.backend_gates = serve_gates(
            spec.engine, logs[server.pods[0]], logs, backend=spec.backend,
            nodes=spec.nodes, gpus_per_node=gpus,
            num_experts=spec.model.get("num_experts"), enforce_eager=spec.enforce_eager,
            api_servers=gpus, log_name=evidence[0], evidence=evidence,
            transport=place.transport_of(spec), deepep_v2_mode=place.spec.deepep_v2_mode)
        for g in (server.backend_gates or []) + settings_gates(
                spec.engine, logs, backend=spec.backend, nodes=spec.nodes,
                gpus_per_node=gpus, evidence=evidence,
                deepep_v2_mode=place.spec.deepep_v2_mode):
            add(g)
