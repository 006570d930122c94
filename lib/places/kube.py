"""The kube place: a Kubernetes cluster through kubectl (`kube_context`, `namespace`).

Every call is the real `kubectl` through the door (recorded, replayable): nothing here talks to
the API server on its own. Objects are rendered as data by lib.places.manifests from the
stage's parameters and the one vLLM argv/env builder, written into the stage's folder
(`manifests/<name>.yaml`, the evidence of what was applied) and applied with `kubectl apply -f`.

- `host_facts()`: every node of the instance type from `kubectl get nodes -o json` (allocatable
  GPUs, EFA devices, hugepages, readiness, taints), and one short probe pod per node that prints
  what only the node can say (gdrdrv's version, its EFA devices, hugepages) through its log.
- `run_ranks(job)`: one pod per node behind a headless Service (rank 0 the rendezvous), every
  pod's exit code and whole log (`kubectl logs`).
- `serve(spec)`: vLLM as a StatefulSet with a headless Service for rank discovery and a Service
  that selects only the leader for HTTP; ready when the leader's readiness probe (/health) holds;
  every pod's log saved whole and gated (the backend vLLM built, the EP split, NCCL's EFA
  provider on every rank, no legacy DeepEP buffer). Requests reach the server from inside the
  cluster (`kubectl exec` into the leader), never through a port opened on this machine.
- `run_job(...)`: a Job (AIPerf) whose files come back through its log (lib.places.stream).

A pod that cannot be scheduled FAILs with the scheduler's own reason after `schedule_timeout_s`.
Every object carries the run's label; a stage deletes what it applied when it ends (unless
`keep`), so nothing of a run is left behind.
"""
from __future__ import annotations

import json
import re
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from lib.core.door import CallResult, HttpResult
from lib.core.errors import PlaceError
from lib.core.evidence import Gate, gate, skip
from lib.engines import vllm_logs
from lib.engines.model_facts import routed_experts
import lib.places.manifests as manifests  # the renderers themselves, not lib.places (no cycle through it)
import lib.places.stream as stream
from lib.places.base import (ClusterServer, NodeNeeds, NodeRun, Place, RankJob, ServeSpec,
                             Unsupported, saved_model_config)

KUBECTL_TIMEOUT_S = 120.0
POLL_S = 2.0  # between two looks at a pod's status
DELETE_TIMEOUT_S = 300.0
DEEPEP_IN_IMAGE = "/opt/DeepEP"  # docker/Dockerfile stages and builds DeepEP there
# AIPerf in the image: `pip install --target /opt/aiperf` (docker/Dockerfile, layer 8), its
# console script run with its packages on PYTHONPATH; flags checked against 0.10.0's wheel
AIPERF_IN_IMAGE = "/opt/aiperf/bin/aiperf"
VERIFY_IN_IMAGE = "/usr/local/bin/verify-image.sh"  # docker/Dockerfile copies it there
AIPERF_ENV = {"PYTHONPATH": "/opt/aiperf", "HF_ENDPOINT": "http://127.0.0.1:9"}
# What a request from inside the cluster runs in the leader pod: python3 is in the image, curl
# may not be. It prints {"status", "body", "error"} as one JSON line.
_REQUEST_SCRIPT = (
    "import json,sys,urllib.request,urllib.error\n"
    "m,u,t,b=sys.argv[1],sys.argv[2],float(sys.argv[3]),sys.argv[4]\n"
    "r=urllib.request.Request(u,data=b.encode() if b else None,method=m,"
    "headers={'Content-Type':'application/json'} if b else {})\n"
    "try:\n"
    " with urllib.request.urlopen(r,timeout=t) as a: s,x,e=a.status,a.read().decode(),None\n"
    "except urllib.error.HTTPError as a: s,x,e=a.code,a.read().decode(),None\n"
    "except Exception as a: s,x,e=None,'',type(a).__name__+': '+str(a)\n"
    "print(json.dumps({'status':s,'body':x,'error':e}))\n")


_CONFIG_SCRIPT = ("import sys\nfrom huggingface_hub import hf_hub_download\n"
                  "print(open(hf_hub_download(sys.argv[1], 'config.json', revision=sys.argv[2]))"
                  ".read())\n")


class NotScheduled(Exception):
    """A pod stayed Pending past schedule_timeout_s; str(exc) is the scheduler's own reason."""


@dataclass
class KubeServer(ClusterServer):
    """A vLLM serve on the cluster: `url` is the leader Service's address inside the cluster."""
    pods: list[str] = field(default_factory=list)
    service: str = ""

    @property
    def url(self) -> str:
        return f"http://{self.service}:{manifests.HTTP_PORT}"

    def run_aiperf(self, stage, argv_for, *, timeout: float, out: Path, name: str):
        """AIPerf as a Job beside the serve (lib.places.manifests.aiperf_job), its files back
        through its log into `out` (lib.places.stream). `argv_for(aiperf, artifact_dir, cores)`
        builds AIPerf's argv (lib.measure.sweep's one builder)."""
        return self.place.run_aiperf_job(self, argv_for, timeout=timeout, out=out, name=name)

    def request(self, door, method: str, path: str, *, timeout: float, json_body=None):
        """From inside the cluster: python3 in the leader pod asks the leader's Service."""
        body = "" if json_body is None else json.dumps(json_body)
        call = door.run(self.place.kubectl("exec", self.pods[0], "--", "python3", "-c",
                                           _REQUEST_SCRIPT, method, self.url + path,
                                           str(timeout), body),
                        timeout=timeout + 30, check=False)
        try:
            got = json.loads(call.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            got = {"status": None, "body": "", "error": f"kubectl exec exited {call.rc}: "
                                                        f"{call.stderr.strip()[-300:]}"}
        return HttpResult(method, self.url + path, got.get("status"), got.get("body") or "",
                          got.get("error"), call.duration_s, call.seq)


class KubePlace(Place):
    kind = "kube"
    what = "the kube place (Kubernetes through kubectl)"
    applies = True  # a plan of this place (lib.places.plan.KubePlan) applies nothing

    def __init__(self, stage):
        super().__init__(stage)
        self.namespace = stage["namespace"]
        self._nodes: list[dict] | None = None
        stage.on_exit(self.clean_up)

    # ---- kubectl --------------------------------------------------------------------------
    def kubectl(self, *args: str) -> list[str]:
        context = self.stage.params.get("kube_context") or ""
        return ["kubectl", *(["--context", context] if context else []),
                "--namespace", self.namespace, *args]

    def _run(self, *args: str, timeout: float = KUBECTL_TIMEOUT_S):
        return self.door.run(self.kubectl(*args), timeout=timeout, check=False)

    def _json(self, *args: str) -> dict | None:
        call = self._run(*args, "-o", "json")
        try:
            return json.loads(call.stdout) if call.ok else None
        except ValueError:
            return None

    def apply(self, objects: list[dict], name: str) -> str:
        """Write the objects into the stage's manifests/ (the evidence), then apply them."""
        rel = self.stage.write_text(f"manifests/{name}.yaml", manifests.to_yaml(objects))
        call = self._run("apply", "-f", str(self.stage.run_dir / rel))
        if not call.ok:
            raise PlaceError(self.where(), f"the apply of {rel} was refused", call)
        return rel

    def where(self) -> str:
        """The cluster this place drives, as a refusal names it."""
        context = self.stage.params.get("kube_context") or ""
        named = f"kube context {context!r}" if context else "kubectl's current context"
        return f"{named} (namespace {self.namespace})"

    def clean_up(self) -> None:
        """Delete what this stage applied (its run and stage labels), unless `keep`."""
        if self.stage.params.get("keep"):
            return
        selector = stage_selector(self.stage.run_id, self.stage.name)
        self._run("delete", "statefulset,service,pod,job,configmap", "-l", selector,
                  "--ignore-not-found", "--wait=true", timeout=DELETE_TIMEOUT_S)

    # ---- nodes ----------------------------------------------------------------------------
    def nodes(self) -> list[dict]:
        """The nodes of the stage's instance type (kubectl get nodes), once per stage."""
        if self._nodes is None:
            got = self.door.run(self._nodes_argv(), timeout=KUBECTL_TIMEOUT_S, check=False)
            try:
                items = json.loads(got.stdout).get("items", []) if got.ok else []
            except ValueError:
                items = []
            if not got.ok:
                raise PlaceError(self.where(), "the API server did not list the nodes", got)
            kind = self.stage["instance_type"]
            self._nodes = [n for n in items if (n["metadata"].get("labels") or {}).get(
                manifests.INSTANCE_TYPE_LABEL) == kind]
        return self._nodes

    def _nodes_argv(self) -> list[str]:
        context = self.stage.params.get("kube_context") or ""
        return ["kubectl", *(["--context", context] if context else []), "get", "nodes",
                "-o", "json"]

    def gpus(self) -> int:
        found = [int((n["status"].get("allocatable") or {}).get(manifests.GPU_RESOURCE, 0))
                 for n in self.nodes()]
        return min(found) if found else int(self.stage["gpus_per_node"] or 0)

    def node_needs(self) -> NodeNeeds:
        p = self.stage.params
        return NodeNeeds(gpus=p["gpus_per_node"], efa=p["efa_per_node"], gdrdrv=True,
                         hugepages=True)

    def host_facts(self) -> list[dict[str, Any]]:
        version = self._run("version", "-o", "json")
        try:
            versions = json.loads(version.stdout) if version.stdout.strip() else {}
        except ValueError:
            versions = {}
        nodes = self.nodes()
        if not nodes:
            raise PlaceError(self.where(), f"no node of instance type {self.stage['instance_type']} in the "
                              "cluster (kubectl get nodes, label "
                              f"{manifests.INSTANCE_TYPE_LABEL})")
        facts = [node_facts(n, versions) for n in nodes]
        objects = [manifests.node_probe_pod(run_id=self.stage.run_id, node=f["node"],
                                            image=self._image(), namespace=self.namespace,
                                            stage=self.stage.name) for f in facts]
        self.apply(objects, "node-probes")
        names = [o["metadata"]["name"] for o in objects]
        try:
            statuses = self.wait_pods(names, done=True, timeout_s=self.stage["job_timeout_s"])
        except NotScheduled as why:  # pinned by nodeName: only a missing node does this
            raise PlaceError(self.where(), f"the node probes were not scheduled: {why}") from None
        for f, name in zip(facts, names):
            probe = manifests.parse_probe_log(self.pod_log(name, statuses.get(name)))
            f.update(probe_facts(probe))
            f["probe_exit_code"] = exit_code(statuses.get(name))
            f["evidence"] = [self.stage.rel(self.stage.path("pods", f"{name}.log"))]
        return facts

    # ---- pods -----------------------------------------------------------------------------
    def _where(self) -> dict[str, Any]:
        """Where every object of this stage goes, and what it carries."""
        p = self.stage.params
        return {"run_id": self.stage.run_id, "namespace": self.namespace,
                "stage": self.stage.name, "instance_type": p["instance_type"],
                "gpus_per_node": p["gpus_per_node"], "efa_per_node": p["efa_per_node"]}

    def _image(self) -> str:
        image = self.stage.params.get("image") or ""
        if not image:
            raise Unsupported("no image given: the kube place runs the guide's image on the "
                              "nodes (-p image <registry>/<name>@sha256:... or an immutable "
                              "tag; 02 builds it from pins.yaml)")
        return image

    def pod_status(self, names: list[str]) -> dict[str, dict]:
        got = self._json("get", "pods", "-l", stage_selector(self.stage.run_id, self.stage.name))
        pods = {p["metadata"]["name"]: p for p in (got or {}).get("items", [])}
        return {n: pods.get(n) for n in names}

    def wait_pods(self, names: list[str], *, done: bool, timeout_s: float) -> dict[str, dict]:
        """Until every pod is Ready (done=False) or finished (done=True), or time is up. A pod
        Pending past schedule_timeout_s raises NotScheduled with the scheduler's reason."""
        door = self.door
        started = door.now()
        schedule_by = self.stage["schedule_timeout_s"]
        what = "finished" if done else "ready"
        print(f"waiting up to {timeout_s:.0f} s for {len(names)} pod(s) {what}: "
              f"{', '.join(names)}", flush=True)
        while True:
            pods = self.pod_status(names)
            elapsed = door.now() - started
            pending = {n: unschedulable(p) for n, p in pods.items() if p and
                       p["status"].get("phase") == "Pending"}
            reasons = {n: r for n, r in pending.items() if r}
            if reasons and elapsed >= schedule_by:
                raise NotScheduled("; ".join(f"{n}: {r}" for n, r in reasons.items()))
            if all(p and (is_finished(p) if done else is_ready(p)) for p in pods.values()):
                return pods
            if not done and any(p and is_finished(p) for p in pods.values()):
                return pods  # a serve pod that exited will never be ready: the caller says why
            if elapsed >= timeout_s:
                return pods
            door.sleep(POLL_S)

    def pod_log(self, name: str, status: dict | None = None) -> str:
        """A pod's whole log (`kubectl logs`), kept in the stage's pods/ folder, with what its
        status said (its node, phase, exit code and the image's pulled digest, `imageID`)."""
        call = self._run("logs", name, "--all-containers=true", timeout=KUBECTL_TIMEOUT_S)
        text = call.stdout if call.ok else ""
        self.stage.write_text(f"pods/{name}.log", text)
        if status is not None:
            self.stage.write_json(f"pods/{name}.status.json", pod_record(status))
        return text

    # ---- ranks ----------------------------------------------------------------------------
    def run_ranks(self, job: RankJob) -> list[NodeRun]:
        """One pod per node behind a headless Service (node 0 the rendezvous); every pod's exit
        code and whole log. Its objects are deleted when it ends (unless `keep`)."""
        name = object_name(job.name)
        objects = manifests.rank_objects(**self._where(), name=name, image=self._image(),
                                         nodes=job.nodes, argv=job.argv, env=job.env,
                                         transport=self.transport, timeout_s=job.timeout_s)
        self.apply(objects, name)
        pods = [f"{name}-{rank}" for rank in range(job.nodes)]
        try:
            try:
                statuses = self.wait_pods(pods, done=True, timeout_s=job.timeout_s
                                          + self.stage["schedule_timeout_s"])
            except NotScheduled as why:
                self.stage.add(gate(f"{job.name}: pods scheduled", False, "Pending",
                                    "every pod scheduled", f"the scheduler: {why}", []))
                return [NodeRun(r, None, "", f"not scheduled: {why}", False, [])
                        for r in range(job.nodes)]
            runs = []
            for rank, pod in enumerate(pods):
                text = self.pod_log(pod, statuses.get(pod))
                runs.append(NodeRun(rank, exit_code(statuses.get(pod)), text, "",
                                    not is_finished(statuses.get(pod)),
                                    [self.stage.rel(self.stage.path("pods", f"{pod}.log"))]))
            return runs
        finally:
            self.delete(name)

    def delete(self, name: str) -> None:
        """Delete one group of this stage's objects (pods, services, a StatefulSet), unless
        `keep`."""
        if self.stage.params.get("keep"):
            return
        self._run("delete", "statefulset,service,pod,job", "-l",
                  f"{manifests.GROUP_LABEL}={name},"
                  f"{stage_selector(self.stage.run_id, self.stage.name)}",
                  "--ignore-not-found", "--wait=true", timeout=DELETE_TIMEOUT_S)

    def deepep_dir(self) -> str:
        return DEEPEP_IN_IMAGE

    def build_image(self, *, dockerfile: Path, context: Path, tag: str, repo: Path) -> dict:
        """The kube place runs the image it is given: 02 checks it there, its verify script
        (docker/verify-image.sh, in the image as /usr/local/bin/verify-image.sh) as a pod on one
        node with the node's GPUs (its import checks need the driver)."""
        image = self._image()
        name = "verify-image"
        objects = manifests.rank_objects(
            **self._where(), name=name, image=image, nodes=1,
            argv=lambda node: [VERIFY_IN_IMAGE], env=lambda node: {},
            transport=self.transport, needs_gdrcopy=False,
            timeout_s=self.stage["job_timeout_s"])
        self.apply(objects, name)
        pod = f"{name}-0"
        try:
            try:
                statuses = self.wait_pods([pod], done=True,
                                          timeout_s=self.stage["job_timeout_s"])
            except NotScheduled as why:
                self.stage.add(gate("verify-image.sh in the image", False, "Pending",
                                    "a pod on one node", f"the scheduler: {why}", []))
                return {"engine": False, "image": image, "scheduled": False}
            text = self.pod_log(pod, statuses.get(pod))
            rc = exit_code(statuses.get(pod))
            summary = next((line for line in reversed(text.splitlines())
                            if line.startswith("verify-image:")), "no summary line")
            node = ((statuses.get(pod) or {}).get("spec") or {}).get("nodeName")
            self.stage.add(skip("docker build", f"the kube place runs the image it is given "
                                f"({image}); 02 builds one where a Docker engine answers"))
            self.stage.add(gate("verify-image.sh in the image", rc == 0, summary,
                                "every check PASS", f"on node {node}: exit {rc}",
                                [self.stage.rel(self.stage.path("pods", f"{pod}.log"))]))
            return {"engine": False, "image": image, "verify_rc": rc, "node": node}
        finally:
            self.delete(name)

    # ---- serving --------------------------------------------------------------------------
    def model(self, engine: str, announce: bool = False):
        if engine != "vllm":
            raise Unsupported("the kube place serves with vLLM (engine 'vllm')")
        p = self.stage.params
        experts = routed_experts(p["model"])
        info = {"model_dir": p["model"], "revision": p["model_revision"],
                "num_experts": experts, "config_hash": p["model_revision"],
                "parameters": None, "seed": None, "built": False}
        if announce:
            print(f"serving {p['model']} at revision {p['model_revision']} (pins.yaml)",
                  flush=True)
        return info, gate("model named by its pin", bool(p["model"] and p["model_revision"]),
                          {"model": p["model"], "revision": p["model_revision"],
                           "routed_experts": experts}, {"revision": "40 hex"},
                          "the nodes download it into model_cache_dir at this revision", [])

    @contextmanager
    def serve(self, spec: ServeSpec) -> Iterator[KubeServer]:
        """vLLM as a StatefulSet (lib.places.manifests.vllm_objects), ready when the leader's
        probe holds; every pod's log kept and gated; deleted when the block ends (unless
        `keep`, then the next stage's apply finds it as it is)."""
        stage, p = self.stage, self.stage.params
        name = object_name(spec.log_name.rsplit(".", 1)[0] if spec.log_name else "vllm")
        if not p.get("model_cache_dir"):
            raise Unsupported("no model_cache_dir: the nodes keep the model's weights on their "
                              "instance storage (-p model_cache_dir /path/on/the/NVMe/mount)")
        lws = p.get("workload") == "leaderworkerset"
        if lws and self.applies:
            raise Unsupported("workload leaderworkerset needs the LeaderWorkerSet controller in "
                              "the cluster; this guide renders and checks it (context plan) "
                              "and serves the StatefulSet (workload statefulset)")
        render = manifests.leaderworkerset_objects if lws else manifests.vllm_objects
        objects = render(
            **self._where(), name=name, image=self._image(), nodes=p["nodes"],
            model_cache_dir=p["model_cache_dir"], model=spec.model["model_dir"],
            model_revision=p["model_revision"], backend=spec.backend,
            ep_num_comms=spec.num_comms, enforce_eager=spec.enforce_eager,
            hf_token_secret=p["hf_token_secret"] or None)
        gpus = int(p["gpus_per_node"])
        server = KubeServer(spec.model["model_dir"], manifests.HTTP_PORT,
                            stage.path("pods", f"{name}-0.log"), device="cuda", place=self,
                            backend=spec.backend, gpus=gpus * p["nodes"],
                            service=f"{manifests.http_service_name(name)}.{self.namespace}.svc")
        server.pods = [f"{name}-{k}" for k in range(p["nodes"])]
        prefix = f"{spec.gate_prefix}: " if spec.gate_prefix else ""

        def add(g):
            g = g if isinstance(g, Gate) else Gate(**g)
            if prefix:
                g = Gate(prefix + g.gate, g.status, g.observed, g.expected, g.reason, g.evidence)
            server.gates.append(g)
            stage.add(g)

        self.apply(objects, name)
        started = self.door.now()
        try:
            try:
                statuses = self.wait_pods(server.pods, done=False, timeout_s=spec.timeout_s)
            except NotScheduled as why:
                add(gate("server ready", False, "Pending", "every pod scheduled",
                         f"the scheduler: {why}", []))
                yield server
                return
            ready = all(s and is_ready(s) for s in statuses.values())
            logs = {pod: self.pod_log(pod, statuses.get(pod)) for pod in server.pods}
            server.ready = ready
            server.ready_s = round(self.door.now() - started, 1) if ready else None
            evidence = [stage.rel(stage.path("pods", f"{pod}.log")) for pod in server.pods]
            add(gate("server ready", ready, {pod: phase_of(s) for pod, s in statuses.items()},
                     {"leader": "Ready (GET /health)"},
                     f"the leader's readiness probe held after {server.ready_s} s" if ready
                     else "not ready within the timeout: the pods' logs are kept", evidence))
            if ready:
                server.backend_gates = serve_gates(
                    logs[server.pods[0]], logs, backend=spec.backend, dp_size=server.gpus,
                    num_experts=spec.model.get("num_experts"), enforce_eager=spec.enforce_eager,
                    api_servers=gpus, log_name=evidence[0], evidence=evidence)
                for g in server.backend_gates:
                    add(g)
            yield server
        finally:
            if self.applies and not p.get("keep"):
                self.delete(name)
                left = self.pod_status(server.pods)
                add(gate("server stopped", not any(left.values()),
                         sorted(n for n, s in left.items() if s), [],
                         "its StatefulSet and Services deleted, no pod of it left", []))

    def read_model_config(self, server, model: dict[str, Any]) -> tuple[dict | None, str | None]:
        """The served model's config.json, read where vLLM downloaded it (the leader pod's
        model cache, offline), kept as the stage's model_config.json."""
        p = self.stage.params
        call = self.door.run(self.kubectl(
            "exec", server.pods[0], "--", "env", "HF_HUB_OFFLINE=1", "python3", "-c",
            _CONFIG_SCRIPT, model["model_dir"], p["model_revision"] or "main"),
            timeout=KUBECTL_TIMEOUT_S, check=False)
        return saved_model_config(self.stage, call)

    def run_aiperf_job(self, server: KubeServer, argv_for, *, timeout: float, out: Path,
                       name: str) -> CallResult:
        """One AIPerf cell as a Job in the cluster against the leader's Service; what it wrote
        comes back through its log (a finished Job's pod cannot be copied from) into `out`,
        read by the same AIPerf reader as on the local place."""
        job_name = object_name(name)
        folder = f"{manifests.ARTIFACT_ROOT}/cell"
        argv = argv_for(AIPERF_IN_IMAGE, folder, None)
        job = manifests.aiperf_job(run_id=self.stage.run_id, image=self._image(), argv=argv,
                                   artifact_dir=folder, block=job_name, name=job_name,
                                   stage=self.stage.name, namespace=self.namespace,
                                   serve_name=server.pods[0].rsplit("-", 1)[0],
                                   timeout_s=timeout, env=AIPERF_ENV)
        started = self.door.now()
        self.apply([job], job_name)
        try:
            pod = self.wait_job(job_name, timeout_s=timeout + self.stage["schedule_timeout_s"])
            name_of = (pod or {}).get("metadata", {}).get("name")
            text = self.pod_log(name_of, pod) if name_of else ""
            try:
                stream.unpack(text, job_name, out)
                note = ""
            except stream.StreamError as why:
                note = f"\nthe job's files did not come back: {why}"
            rc = exit_code(pod)
            result = CallResult(argv, -1 if rc is None else rc, text, note,
                                round(self.door.now() - started, 3), not is_finished(pod))
            result.streams = ([self.stage.rel(self.stage.path("pods", f"{name_of}.log"))]
                              if name_of else [])
            return result
        finally:
            self.delete(job_name)

    def wait_job(self, name: str, *, timeout_s: float) -> dict | None:
        """The pod of Job `name` once it finished (None when none appeared in time)."""
        door = self.door
        started = door.now()
        print(f"waiting up to {timeout_s:.0f} s for the job {name}", flush=True)
        while True:
            got = self._json("get", "pods", "-l", f"job-name={name}")
            pods = (got or {}).get("items", [])
            pod = pods[0] if pods else None
            elapsed = door.now() - started
            if pod and is_finished(pod):
                return pod
            reason = unschedulable(pod) if pod else None
            if reason and elapsed >= self.stage["schedule_timeout_s"]:
                return pod
            if elapsed >= timeout_s:
                return pod
            door.sleep(POLL_S)


# ---- reading pods and nodes (pure) -------------------------------------------------------
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
        "cpu_cores": _cpu(alloc.get("cpu", "0")),
        "memory_gib": round(_bytes(alloc.get("memory", "0")) / 2 ** 30, 1),
        "gpus": [{"index": i} for i in range(int(alloc.get(manifests.GPU_RESOURCE, 0)))],
        "efa_allocatable": int(alloc.get(manifests.EFA_RESOURCE, 0)),
        "hugepages_2mi_bytes": _bytes(alloc.get("hugepages-2Mi", "0")),
        "kubectl_client": (versions.get("clientVersion") or {}).get("gitVersion"),
        "cluster_access": (f"kube-apiserver {(versions.get('serverVersion') or {}).get('gitVersion')}"
                           if versions.get("serverVersion") else None),
    }


def object_name(what: str) -> str:
    """A DNS-1123 name for a group of objects (`test_ep at 128 tokens` -> `test-ep-at-128-tokens`,
    cut to the manifests' limit)."""
    slug = re.sub(r"[^a-z0-9]+", "-", what.lower()).strip("-")
    return slug[:manifests.NAME_MAX].rstrip("-") or "job"


def stage_selector(run_id: str, stage: str) -> str:
    """The objects of one stage of one run."""
    found = manifests.labels(run_id, stage, "any")
    return ",".join(f"{k}={found[k]}" for k in (manifests.RUN_LABEL, manifests.STAGE_LABEL))


def probe_facts(probe: dict) -> dict[str, Any]:
    """A node probe's findings (lib.places.manifests.parse_probe_log), in 00's keys."""
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


def unschedulable(pod: dict) -> str | None:
    for c in (pod.get("status") or {}).get("conditions") or []:
        if c.get("type") == "PodScheduled" and c.get("status") == "False":
            return c.get("message") or c.get("reason") or "unschedulable"
    return None


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


def serve_gates(leader: str, logs: dict[str, str], *, backend: str, dp_size: int,
                num_experts: int | None, enforce_eager: bool, api_servers: int, log_name: str,
                evidence: list[str]) -> list[dict]:
    """What the pods' logs prove: lib.engines.vllm_logs' backend gates on the leader's log (vLLM
    logs them from rank 0 only), NCCL's EFA provider on every DP rank across every pod, no
    legacy DeepEP buffer anywhere."""
    # API servers: the leader's, one per local DP rank (vLLM's api_server_count default)
    gates = vllm_logs.assert_backend(leader, backend, dp_size=dp_size, num_experts=num_experts,
                                     log_name=log_name, api_servers=api_servers)
    gates.append(vllm_logs.compile_mode_gate(leader, enforce_eager, log_name=log_name))
    every = "\n".join(logs.values())
    sources = ", ".join(evidence)
    # the no-legacy gate over every pod's log, not the leader's alone
    gates = [vllm_logs.no_legacy_gate(every, backend, log_name=sources)
             if g["gate"] == "vllm_no_fallback_no_legacy_buffer" else g for g in gates]
    gates.append(vllm_logs.per_rank_nccl(every, dp_size, log_name=", ".join(evidence)))
    gates.append(vllm_logs.efa_provider_per_rank(every, dp_size, log_name=", ".join(evidence)))
    return gates


_UNITS = {"Ki": 2 ** 10, "Mi": 2 ** 20, "Gi": 2 ** 30, "Ti": 2 ** 40, "k": 10 ** 3,
          "M": 10 ** 6, "G": 10 ** 9, "T": 10 ** 12}


def _bytes(quantity: str) -> int:
    for unit, factor in _UNITS.items():
        if quantity.endswith(unit):
            return int(float(quantity[:-len(unit)]) * factor)
    return int(float(quantity or 0))


def _cpu(quantity: str) -> float:
    return float(quantity[:-1]) / 1000 if quantity.endswith("m") else float(quantity or 0)
