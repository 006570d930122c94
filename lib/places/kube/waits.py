"""The kube place's waits: until a stage's pods are Ready or finished, or a Job's pod has
finished, each a look through the place's kubectl (`pod_status`, `_json`) polled by the one
deadline loop (lib.places.cluster.wait_until, on the door's clock).

A wait stops early, in the cluster's own words, where waiting longer cannot help: a pod the
scheduler leaves Pending past `schedule_timeout_s` (NotScheduled), a container stuck on its
image or config (PodStuck, at once), a StatefulSet whose controller made no pod within
CREATE_GRACE_S (PodsNotCreated, with its FailedCreate events). Functions of the place
(lib.places.kube.place.KubePlace; a plan records its wait instead: lib.places.kube.plan).
"""
from __future__ import annotations

from lib.core.errors import NotScheduled
from lib.places.cluster import wait_until
from lib.places.kube.pods import (POLL_S, PodsNotCreated, PodStuck, exit_code,
                                  failed_creations, is_finished, is_ready, nodes_said, restarted,
                                  stuck_reason, unschedulable, where_pod)

# A StatefulSet's controller makes its pods within a second of the apply (Parallel); pods still
# absent after this long are looked for in its FailedCreate events (an admission's refusal).
CREATE_GRACE_S = 10.0


def wait_pods(place, names: list[str], *, done: bool, timeout_s: float,
              made_by: str | None = None, peers: bool = False) -> dict[str, dict]:
    """Until every pod is Ready (done=False) or finished (done=True), or time is up. A pod
    Pending past schedule_timeout_s raises NotScheduled with the scheduler's reason; a pod
    stuck on its image or config raises PodStuck at once; pods of the StatefulSet `made_by`
    still absent after CREATE_GRACE_S raise PodsNotCreated where its controller said why.
    `peers`: the pods are one job's ranks, each waiting on the others (torchrun's rendezvous,
    NCCL's init): the first that exits non-zero ends the wait, since its peers would wait on it
    until the timeout."""
    schedule_by = place.spec.schedule_timeout_s

    def look(elapsed) -> tuple[bool, dict[str, dict]]:
        pods = place.pod_status(names)
        waited = elapsed()
        if made_by and waited >= CREATE_GRACE_S and not all(pods.values()):
            said = not_created(place, made_by)
            if said:
                raise PodsNotCreated(f"the StatefulSet controller: {said}")
        pending = {n: unschedulable(p) for n, p in pods.items() if p and
                   p["status"].get("phase") == "Pending"}
        reasons = {n: r for n, r in pending.items() if r}
        stuck = {n: stuck_reason(p) for n, p in pods.items() if p and stuck_reason(p)}
        if stuck:  # the kubelet will not get past it: said now, not at the timeout
            raise PodStuck("; ".join(f"{where_pod(n, pods[n])}: {r}"
                                     for n, r in stuck.items()))
        if reasons and waited >= schedule_by:
            nodes = (place._json("get", "nodes") or {}).get("items", [])
            raise NotScheduled("; ".join(
                f"{n}: {r} (the scheduler); the nodes: {nodes_said(pods[n], nodes)}"
                for n, r in reasons.items()))
        if all(p and (is_finished(p) if done else is_ready(p)) for p in pods.values()):
            return True, pods
        if peers and any(p and is_finished(p) and exit_code(p) != 0 for p in pods.values()):
            return True, pods
        # a serve pod that exited, or that its restartPolicy restarted (CrashLoopBackOff next:
        # its engine's group lost a rank), will never be ready: the caller says why at once,
        # from the pod's status, instead of at server_timeout_s
        return not done and any(p and (is_finished(p) or restarted(p))
                                for p in pods.values()), pods

    return wait_until(place.door, look, timeout_s, f"{len(names)} pod(s) "
                      f"{'finished' if done else 'ready'}: {', '.join(names)}", poll_s=POLL_S)


def not_created(place, statefulset: str) -> str | None:
    """Why the StatefulSet `statefulset` (of this stage: its uid read now, so an older
    object's events of the same name are not its) made no pod: its FailedCreate events."""
    got = place._json("get", "statefulset", statefulset)
    uid = ((got or {}).get("metadata") or {}).get("uid")
    if not uid:
        return None
    return failed_creations(place._json("get", "events", "--field-selector",
                                        f"involvedObject.uid={uid},reason=FailedCreate"))


def wait_job(place, name: str, *, timeout_s: float) -> dict | None:
    """The pod of Job `name` once it finished (None when none appeared in time)."""
    def look(elapsed) -> tuple[bool, dict | None]:
        got = place._json("get", "pods", "-l", f"job-name={name}")
        pods = (got or {}).get("items", [])
        pod = pods[0] if pods else None
        waited = elapsed()
        if pod and is_finished(pod):
            return True, pod
        reason = unschedulable(pod) if pod else None
        return bool(reason and waited >= place.spec.schedule_timeout_s), pod

    return wait_until(place.door, look, timeout_s, f"the job {name}", poll_s=POLL_S)
