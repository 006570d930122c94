"""The kube place: a Kubernetes cluster through kubectl (`kube_context`, `namespace`).

Every call is the real `kubectl` through the door (recorded, replayable): nothing here talks to
the API server on its own. Objects are rendered as data by lib.places.kube.manifests from the
stage's parameters and the one vLLM argv/env builder, written into the stage's folder
(`manifests/<name>.yaml`, the evidence of what was applied) and applied with `kubectl apply -f`.

- `host_facts()`: every node of the instance type from `kubectl get nodes -o json` (allocatable
  GPUs, EFA devices, hugepages, readiness, taints), and one short probe pod per node that prints
  what only the node can say (gdrdrv's version, its EFA devices, hugepages) through its log.
- `run_ranks(job)`: one pod per node behind a headless Service (rank 0 the rendezvous), every
  pod's exit code and whole log (`kubectl logs`); the guide's files the job's processes import
  (`job.modules`: the image holds no `lib/`) in the job's ConfigMap, mounted into every pod
  (lib.places.kube.files).
- `serve(spec)`: the engine as a StatefulSet with a headless Service for rank discovery and a
  Service that selects only the leader for HTTP, or (kube_workload leaderworkerset) as one
  LeaderWorkerSet group, whose pods the cluster's LWS controller makes (`<name>-0` the leader,
  `<name>-0-<k>` the workers); ready when the leader's readiness probe (/health) holds; every
  pod's log saved whole and gated (lib.places.cluster: backend, EP split, EFA on every rank,
  settings; lib.places.kube.serve). Requests reach the server from inside the cluster (`kubectl
  exec`), never here.
- its Server's `run_aiperf(...)`: a Job (AIPerf) beside the serve's leader, its files back
  through its log (lib.places.kube.aiperf).

kubectl's JSON of pods and nodes is read by lib.places.kube.pods (pure); the waits on it are
lib.places.kube.waits; what this place shares with the slurm place (the pinned model, the log
gates, the deadline loop) is lib.places.cluster.

A pod that cannot be scheduled FAILs with the scheduler's own reason after `schedule_timeout_s`.
Every object carries the run's label; a stage deletes what it applied when it ends (unless
`keep`), so nothing of a run is left behind.
"""
from __future__ import annotations

import json
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import lib.places.kube.manifests as manifests  # the renderers themselves, not lib.places (no cycle through it)
from lib.core.errors import NotScheduled, PlaceError, Unsupported
from lib.core.evidence import gate, skip
from lib.places.base import NodeNeeds, NodeRun, Place, RankJob, ServeSpec, saved_model_config
from lib.places.cluster import CONFIG_SCRIPT, DEEPEP_IN_IMAGE, pinned_model, ranks_apart_gate
from lib.places.kube import aiperf, serve as serving, waits
from lib.places.kube.files import guide_files
from lib.places.kube.pods import (PodStuck, exit_code, is_finished, node_facts, object_name,
                                  pod_record, probe_facts, quantity_bytes, ran_when, stage_selector)
from lib.places.kube.retry import SAFE_VERBS, apply_once, retry_budget, run_retrying
from lib.places.kube.plan import KubePlanned
from lib.places.kube.serve import KubeServer  # the serve's handle, with its requests

KUBECTL_TIMEOUT_S = 120.0
DELETE_TIMEOUT_S = 300.0
VERIFY_IN_IMAGE = "/usr/local/bin/verify-image.sh"  # docker/Dockerfile copies it there


class KubePlace(Place):
    """The kube place (see the module's docstring). What it does with kubectl is its own; its
    waits (lib.places.kube.waits), its serve (lib.places.kube.serve) and AIPerf's Jobs
    (lib.places.kube.aiperf) are functions it hands itself to. While its door plans (context
    plan), its effects are records instead (`planned`: lib.places.kube.plan.KubePlanned)."""
    kind = "kube"
    what = "the kube place (Kubernetes through kubectl)"
    engines = ("vllm", "sglang", "trtllm")

    def __init__(self, stage, spec=None):
        super().__init__(stage, spec)
        self.namespace = self.spec.namespace
        self._nodes: list[dict] | None = None
        self._answered = False  # whether the API server has answered in this stage (retries)
        # the door's plan mode: what this place would do to a cluster, recorded and checked
        self.planned = KubePlanned(self) if self.door.planning else None
        if self.planned:
            self.what = self.planned.what
        stage.on_exit(self.clean_up)

    # ---- kubectl --------------------------------------------------------------------------
    def kubectl(self, *args: str) -> list[str]:
        context = self.spec.kube_context
        return ["kubectl", *(["--context", context] if context else []),
                "--namespace", self.namespace, *args]

    def _run(self, *args: str, timeout: float = KUBECTL_TIMEOUT_S):
        """One kubectl call; a read or a delete tried again while the API server does not
        answer (lib.places.kube.retry says which calls are safe to retry, and why), once it
        has answered in this stage: a cluster that never answered is refused at its first call."""
        if self.planned:
            return self.planned.run(*args)
        if args and args[0] in SAFE_VERBS:
            call = run_retrying(self.door, self.kubectl(*args), timeout=timeout,
                                budget_s=retry_budget(self._answered))
        else:
            call = self.door.run(self.kubectl(*args), timeout=timeout, check=False)
        self._answered = self._answered or call.ok
        return call

    def _json(self, *args: str) -> dict | None:
        call = self._run(*args, "-o", "json")
        try:
            return json.loads(call.stdout) if call.ok else None
        except ValueError:
            return None

    def apply(self, objects: list[dict], name: str) -> str:
        """Write the objects into the stage's manifests/ (the evidence), then apply them."""
        if self.planned:
            return self.planned.apply(objects, name)
        rel = self.stage.write_text(f"manifests/{name}.yaml", manifests.to_yaml(objects))
        call = apply_once(self.door, self.kubectl, str(self.stage.run_dir / rel), len(objects),
                          manifests.run_label_value(self.stage.run_id), self.where(),
                          answered=self._answered,
                          timeout=KUBECTL_TIMEOUT_S)
        if not call.ok:
            raise PlaceError(self.where(), f"the apply of {rel} was refused", call)
        return rel

    def where(self) -> str:
        """The cluster this place drives, as a refusal names it."""
        context = self.spec.kube_context
        named = f"kube context {context!r}" if context else "kubectl's current context"
        return f"{named} (namespace {self.namespace})"

    def clean_up(self) -> None:
        """Delete what this stage applied (its run and stage labels), unless `keep` (a plan
        applied nothing)."""
        if self.spec.keep or self.planned:
            return
        selector = stage_selector(self.stage.run_id, self.stage.name)
        if self.spec.leaderworkerset:  # first: no pod remade
            self._run("delete", manifests.LWS_RESOURCE, "-l", selector, "--ignore-not-found",
                      "--wait=true", timeout=DELETE_TIMEOUT_S)
        self._run("delete", "statefulset,service,pod,job,configmap", "-l", selector,
                  "--ignore-not-found", "--wait=true", timeout=DELETE_TIMEOUT_S)

    # ---- nodes ----------------------------------------------------------------------------
    def nodes(self) -> list[dict]:
        """The nodes of the stage's instance type (kubectl get nodes), once per stage."""
        if self._nodes is None and self.planned:
            self._nodes = self.planned.nodes()
        if self._nodes is None:
            got = run_retrying(self.door, self._nodes_argv(), timeout=KUBECTL_TIMEOUT_S,
                               budget_s=retry_budget(self._answered))
            self._answered = self._answered or got.ok
            try:
                items = json.loads(got.stdout).get("items", []) if got.ok else []
            except ValueError:
                items = []
            if not got.ok:
                raise PlaceError(self.where(), "the API server did not list the nodes", got)
            kind = self.spec.instance_type
            self._nodes = [n for n in items if (n["metadata"].get("labels") or {}).get(
                manifests.INSTANCE_TYPE_LABEL) == kind]
        return self._nodes

    def _nodes_argv(self) -> list[str]:
        context = self.spec.kube_context
        return ["kubectl", *(["--context", context] if context else []), "get", "nodes",
                "-o", "json"]

    def gpus(self) -> int:
        found = [int((n["status"].get("allocatable") or {}).get(manifests.GPU_RESOURCE, 0))
                 for n in self.nodes()]
        return min(found) if found else int(self.spec.gpus_per_node or 0)

    def node_needs(self) -> NodeNeeds:
        return NodeNeeds(gpus=self.spec.gpus_per_node, efa=self.spec.efa_per_node, gdrdrv=True,
                         hugepages=True,
                         hugepages_bytes=quantity_bytes(manifests.HUGEPAGES_2MI))

    def host_facts(self) -> list[dict[str, Any]]:
        if self.planned:
            return self.planned.host_facts()
        version = self._run("version", "-o", "json")
        try:
            versions = json.loads(version.stdout) if version.stdout.strip() else {}
        except ValueError:
            versions = {}
        nodes = self.nodes()
        if not nodes:
            raise PlaceError(self.where(), f"no node of instance type {self.spec.instance_type} in the "
                              "cluster (kubectl get nodes, label "
                              f"{manifests.INSTANCE_TYPE_LABEL})")
        facts = [node_facts(n, versions) for n in nodes]
        objects = [manifests.node_probe_pod(run_id=self.stage.run_id, node=f["node"],
                                            image=self._image(), namespace=self.namespace,
                                            stage=self.stage.name) for f in facts]
        self.apply(objects, "node-probes")
        names = [o["metadata"]["name"] for o in objects]
        try:
            statuses = self.wait_pods(names, done=True, timeout_s=self.spec.job_timeout_s)
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
        spec = self.spec
        return {"run_id": self.stage.run_id, "namespace": self.namespace,
                "stage": self.stage.name, "instance_type": spec.instance_type,
                "gpus_per_node": spec.gpus_per_node, "efa_per_node": spec.efa_per_node}

    def _image(self) -> str:
        if self.planned:
            return self.planned.image()
        image = self.spec.image
        if not image:
            raise Unsupported("no image given: the kube place runs the guide's image on the "
                              "nodes (-p image <registry>/<name>@sha256:... or an immutable "
                              "tag; 02 builds it from pins.yaml)")
        return image

    def pod_status(self, names: list[str]) -> dict[str, dict]:
        got = self._json("get", "pods", "-l", stage_selector(self.stage.run_id, self.stage.name))
        pods = {p["metadata"]["name"]: p for p in (got or {}).get("items", [])}
        return {n: pods.get(n) for n in names}

    def wait_pods(self, names: list[str], *, done: bool, timeout_s: float,
                  made_by: str | None = None, peers: bool = False) -> dict[str, dict]:
        """Until every pod is Ready (done=False) or finished (done=True), or time is up
        (lib.places.kube.waits.wait_pods says how each way it can stop)."""
        if self.planned:
            return self.planned.wait_pods(names, done=done, timeout_s=timeout_s)
        return waits.wait_pods(self, names, done=done, timeout_s=timeout_s, made_by=made_by,
                               peers=peers)

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
                                         transport=job.transport or self.transport,
                                         timeout_s=job.timeout_s,
                                         modules=guide_files(job.modules))
        self.apply(objects, name)
        pods = [f"{name}-{rank}" for rank in range(job.nodes)]
        try:
            try:
                statuses = self.wait_pods(pods, done=True, timeout_s=job.timeout_s
                                          + self.spec.schedule_timeout_s, peers=True)
            except NotScheduled as why:  # PodStuck: scheduled, but its container cannot start
                what, who = (("started", "the kubelet") if isinstance(why, PodStuck)
                             else ("scheduled", "the scheduler"))
                self.stage.add(gate(f"{job.name}: pods {what}", False, "Pending",
                                    f"every pod {what}", f"{who}: {why}", []))
                return [NodeRun(r, None, "", f"not {what}: {why}", False, [])
                        for r in range(job.nodes)]
            if job.nodes > 1 and not self.plans_only:  # the pods' own nodes and times
                self.stage.add(ranks_apart_gate(
                    job.name, {r: (statuses.get(pod) or {}).get("spec", {}).get("nodeName")
                               for r, pod in enumerate(pods)},
                    {r: ran_when(statuses.get(pod)) for r, pod in enumerate(pods)},
                    [self.stage.rel(self.stage.path("pods", f"{pod}.log")) for pod in pods],
                    " (each pod's spec.nodeName; its container's startedAt and finishedAt)"))
            failed = [(rank, exit_code(statuses.get(pod))) for rank, pod in enumerate(pods)
                      if is_finished(statuses.get(pod)) and exit_code(statuses.get(pod)) != 0]
            runs = []
            for rank, pod in enumerate(pods):
                text = self.pod_log(pod, statuses.get(pod))
                finished = is_finished(statuses.get(pod))
                # a peer still running when a rank failed: stopped by the guide, not timed out
                stopped = (f"stopped when rank {failed[0][0]} exited {failed[0][1]} (its peers "
                           "would wait on it until the job's timeout)"
                           if failed and not finished else "")
                runs.append(NodeRun(rank, exit_code(statuses.get(pod)), text, stopped,
                                    not finished and not failed,
                                    [self.stage.rel(self.stage.path("pods", f"{pod}.log"))]))
            return runs
        finally:
            self.delete(name, configmap=bool(job.modules))

    def delete(self, name: str, configmap: bool = False) -> None:
        """Delete one group of this stage's objects (pods, services, a StatefulSet; with
        `configmap`, a rank job's ConfigMap of guide files too), unless `keep`."""
        if self.spec.keep:
            return
        self._run("delete", "statefulset,service,pod,job" + (",configmap" if configmap else ""),
                  "-l",
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
            timeout_s=self.spec.job_timeout_s)
        self.apply(objects, name)
        pod = f"{name}-0"
        try:
            try:
                statuses = self.wait_pods([pod], done=True,
                                          timeout_s=self.spec.job_timeout_s)
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
        """The cluster model named by its pin (lib.places.cluster.pinned_model), for an engine
        this place serves with."""
        if engine not in self.engines:
            raise Unsupported(f"{self.what} serves with {', '.join(self.engines)}, not engine "
                              f"{engine!r}")
        return pinned_model(self.spec.model, self.spec.model_revision, announce,
                            "the nodes download it into model_cache_dir at this revision")

    def _model_cache_dir(self) -> str:
        """Where the nodes keep the model's weights (`model_cache_dir`; '' when not given, a
        placeholder in a plan)."""
        if self.planned:
            return self.planned.model_cache_dir()
        return self.spec.model_cache_dir or ""

    def serve(self, spec: ServeSpec) -> AbstractContextManager[KubeServer]:
        """The serve as a StatefulSet or a LeaderWorkerSet group, ready when the leader's probe
        holds, every pod's log kept and gated, deleted when the block ends unless `keep`
        (lib.places.kube.serve.serve)."""
        if self.planned:
            self.planned.before_serve()
        return serving.serve(self, spec)

    def delete_lws(self, name: str) -> None:
        """Delete the LeaderWorkerSet `name` of this stage and wait until it is gone: its
        controller then makes no pod again, and the garbage collector deletes what it made."""
        self._run("delete", manifests.LWS_RESOURCE, "-l",
                  f"{manifests.GROUP_LABEL}={name},"
                  f"{stage_selector(self.stage.run_id, self.stage.name)}",
                  "--ignore-not-found", "--wait=true", timeout=DELETE_TIMEOUT_S)

    def read_model_config(self, server, model: dict[str, Any]) -> tuple[dict | None, str | None]:
        """The served model's config.json, read where vLLM downloaded it (the leader pod's
        model cache, offline), kept as the stage's model_config.json."""
        call = self.door.run(self.kubectl(
            "exec", server.pods[0], "--", "env", "HF_HUB_OFFLINE=1", "python3", "-c",
            CONFIG_SCRIPT, model["model_dir"], self.spec.model_revision or "main"),
            timeout=KUBECTL_TIMEOUT_S, check=False)
        return saved_model_config(self.stage, call)

    def aiperf_beside(self, server: KubeServer, argv_for, *, timeout: float, out: Path,
                      name: str):
        """One AIPerf cell as a Job beside the serve (lib.places.kube.aiperf): a CallResult."""
        return aiperf.aiperf_beside(self, server, argv_for, timeout=timeout, out=out, name=name)
