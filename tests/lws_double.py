"""The LeaderWorkerSet controller, played for the test control plane (not a test file).

The LWS controller (kubernetes-sigs/lws) cannot be built here, so this double does its part for
the objects the guide renders, against the real API server of a KubePlane that has the LWS CRD
registered (tests/lws_crd.yaml, KubePlane.register_crd). Every object it makes is a real API
object: the real scheduler places the pods, the kubelet double (tests/kubelet_double.py) runs
them, and the real garbage collector of kube-controller-manager deletes them with their
LeaderWorkerSet (their ownerReferences).

For each LeaderWorkerSet (polled every `poll` seconds) that is not being deleted, it makes what
the real controller documents:

* the headless Service `<name>` (clusterIP None, publishNotReadyAddresses, selecting the
  `leaderworkerset.sigs.k8s.io/name` label, labelled with it, owned by the LWS):
  pkg/utils/controller/controller_utils.go CreateHeadlessServiceIfNotExists, with
  subdomainPolicy Shared (the guide's);
* per group g < replicas the leader pod `<name>-g` from leaderTemplate and the workers
  `<name>-g-<k>`, k = 1..size-1, from workerTemplate (or leaderTemplate's absence: the worker
  template for both): pkg/controllers/leaderworkerset_controller.go (the leader StatefulSet
  `<name>`) and pod_controller.go constructWorkerStatefulSetApplyConfiguration (the worker
  StatefulSet `<leader pod>`, replicas size-1, ordinals starting at 1);
* on each pod what LWS's pod webhook sets (pkg/webhooks/pod_webhook.go, its environment by
  pkg/utils/pod/pod_utils.go AddLWSVariables; the reference page
  site/content/en/docs/reference/labels-annotations-and-environment-variables.md): the labels
  leaderworkerset.sigs.k8s.io/name, /group-index, /worker-index and /group-key, the
  annotation /size (and /leader-name on a worker), hostname `<leader pod>[-k]` and subdomain
  `<name>`, and the environment LWS_LEADER_ADDRESS (`<leader pod>.<name>.<namespace>`),
  LWS_GROUP_SIZE and LWS_WORKER_INDEX prepended to every container's.

Where it differs from the real controller, and why:

* it creates the pods itself, owned by the LWS, rather than through the leader and worker
  StatefulSets (owned by the LWS and by the leader pod): the worker StatefulSet's ordinals
  start at 1 (`spec.ordinals.start`, Kubernetes 1.26+), which the plane's 1.20 cannot do. The
  names, labels, environment and the deletion with the LWS are the same;
* one pod template revision: no rolling update, no template-revision-hash label, and
  restartPolicy RecreateGroupOnPodRestart is not acted on (the kubelet double models no
  restart);
* no status is written on the LeaderWorkerSet (the guide reads its pods, not its status).

    lws = LwsControllerDouble(plane).start()
    ...
    lws.stop()
"""
from __future__ import annotations

import copy
import hashlib
import threading
from typing import Any

try:  # tests/ on sys.path (pytest's default rootdir-less import mode)
    from kubeplane import Api, ApiError, KubePlane
except ImportError:  # imported as tests.lws_double from the repository root
    from tests.kubeplane import Api, ApiError, KubePlane

GROUP, VERSION, PLURAL = "leaderworkerset.x-k8s.io", "v1", "leaderworkersets"
API_VERSION = f"{GROUP}/{VERSION}"
# api/leaderworkerset/v1/leaderworkerset_types.go
NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"
GROUP_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/group-index"
WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"
GROUP_KEY_LABEL = "leaderworkerset.sigs.k8s.io/group-key"
SIZE_ANNOTATION = "leaderworkerset.sigs.k8s.io/size"
LEADER_NAME_ANNOTATION = "leaderworkerset.sigs.k8s.io/leader-name"
LEADER_ADDRESS_ENV, GROUP_SIZE_ENV, WORKER_INDEX_ENV = (
    "LWS_LEADER_ADDRESS", "LWS_GROUP_SIZE", "LWS_WORKER_INDEX")


def group_pods(lws: dict) -> list[dict]:
    """The pods the controller makes for `lws`, every group, leader first in each."""
    meta, spec = lws["metadata"], lws["spec"]
    template = spec["leaderWorkerTemplate"]
    size = int(template.get("size", 1))
    name, namespace = meta["name"], meta["namespace"]
    pods = []
    for group in range(int(spec.get("replicas", 1))):
        leader = f"{name}-{group}"
        # the group key: one hash per group (the real one hashes the leader pod's identity)
        key = hashlib.sha1(f"{namespace}/{leader}".encode()).hexdigest()
        for index in range(size):
            chosen = template.get("leaderTemplate") if index == 0 else None
            pods.append(_pod(lws, chosen or template["workerTemplate"], leader=leader,
                             group=group, index=index, size=size, key=key))
    return pods


def _pod(lws: dict, template: dict, *, leader: str, group: int, index: int, size: int,
         key: str) -> dict:
    meta = lws["metadata"]
    name, namespace = meta["name"], meta["namespace"]
    pod_meta = copy.deepcopy(template.get("metadata") or {})
    spec = copy.deepcopy(template["spec"])
    pod_name = leader if index == 0 else f"{leader}-{index}"
    pod_meta.update(name=pod_name, namespace=namespace)
    pod_meta["labels"] = {**(pod_meta.get("labels") or {}), NAME_LABEL: name,
                          GROUP_INDEX_LABEL: str(group), WORKER_INDEX_LABEL: str(index),
                          GROUP_KEY_LABEL: key}
    annotations = {**(pod_meta.get("annotations") or {}), SIZE_ANNOTATION: str(size)}
    if index:
        annotations[LEADER_NAME_ANNOTATION] = leader
    pod_meta["annotations"] = annotations
    pod_meta["ownerReferences"] = [owner_reference(lws)]
    spec["hostname"], spec["subdomain"] = pod_name, name
    injected = [{"name": LEADER_ADDRESS_ENV, "value": f"{leader}.{name}.{namespace}"},
                {"name": GROUP_SIZE_ENV, "value": str(size)},
                {"name": WORKER_INDEX_ENV, "value": str(index)}]
    for container in spec.get("containers", []) + spec.get("initContainers", []):
        own = [e for e in container.get("env") or [] if e["name"] not in
               {i["name"] for i in injected}]
        container["env"] = injected + own  # prepended, as the webhook's prependEnvVars does
    return {"apiVersion": "v1", "kind": "Pod", "metadata": pod_meta, "spec": spec}


def headless_service(lws: dict) -> dict:
    name, namespace = lws["metadata"]["name"], lws["metadata"]["namespace"]
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": name, "namespace": namespace, "labels": {NAME_LABEL: name},
                         "ownerReferences": [owner_reference(lws)]},
            "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                     "selector": {NAME_LABEL: name}}}


def owner_reference(lws: dict) -> dict:
    """The LWS as the controlling owner: its deletion garbage-collects what it owns."""
    meta = lws["metadata"]
    return {"apiVersion": API_VERSION, "kind": "LeaderWorkerSet", "name": meta["name"],
            "uid": meta["uid"], "controller": True, "blockOwnerDeletion": True}


class LwsControllerDouble:
    """Plays the LWS controller for every namespace of `plane` (see the module's docstring)."""

    def __init__(self, plane: KubePlane, poll: float = 0.2):
        if plane.api is None or plane.ca_file is None:
            raise RuntimeError("start the KubePlane (and register the LWS CRD) first")
        self.poll = poll
        self.created: list[str] = []  # "<namespace>/<Kind>/<name>" in the order made, for tests
        self.errors: list[str] = []   # API errors met by the loop, for tests
        self._api = Api(plane.server, plane.token, plane.ca_file)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> "LwsControllerDouble":
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="lws-controller-double",
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the loop (what it made stays: the garbage collector owns its deletion)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        self._api.close()

    def __enter__(self) -> "LwsControllerDouble":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.reconcile()
            except Exception as exc:  # noqa: BLE001 - kept for the test to see; the loop goes on
                self.errors.append(f"{type(exc).__name__}: {exc}")
                self._api.close()
            self._stop.wait(self.poll)

    def reconcile(self) -> None:
        """One pass over every LeaderWorkerSet: what is missing of each is created."""
        for lws in self._api.get(f"/apis/{GROUP}/{VERSION}/{PLURAL}")["items"]:
            if lws["metadata"].get("deletionTimestamp"):
                continue
            namespace = lws["metadata"]["namespace"]
            self._ensure(f"/api/v1/namespaces/{namespace}/services", headless_service(lws))
            for pod in group_pods(lws):
                self._ensure(f"/api/v1/namespaces/{namespace}/pods", pod)

    def _ensure(self, collection: str, obj: dict) -> None:
        name = obj["metadata"]["name"]
        status, _ = self._api.request("GET", f"{collection}/{name}", ok=(404,))
        if status != 404:
            return
        try:
            self._api.post(collection, obj)
        except ApiError as exc:
            if exc.status != 409:  # made meanwhile (or still being deleted): the next pass looks again
                raise
            return
        self.created.append(f"{obj['metadata']['namespace']}/{obj['kind']}/{name}")
