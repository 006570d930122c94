"""AIPerf as a Job beside a kube serve (lib.places.kube.place's half that measures): one Job per cell
against the leader's Service, on the leader's node with its model cache mounted read-only, so a
hub model's tokenizer is read from the files the engine downloaded there (a cluster's pods
cannot reach the hub: AIPerf runs cache-only at the pinned revision, lib.measure.sweep); what
the Job wrote comes back through its log (lib.places.stream), since a finished Job's pod cannot
be copied from."""
from __future__ import annotations

from pathlib import Path

import lib.places.kube.manifests as manifests  # the renderers themselves, not lib.places (no cycle through it)
import lib.places.stream as stream
from lib.core.door import CallResult
from lib.core.errors import StreamError
from lib.places.cluster import AIPERF_ENV, AIPERF_IN_IMAGE, wait_until
from lib.places.kube.pods import (POLL_S, KubeServer, exit_code, is_finished, object_name,
                                  unschedulable)


class KubeAiperf:
    """The kube place's AIPerf Jobs (a mixin of lib.places.kube.KubePlace: its stage, door,
    namespace, apply, delete, pod_log, _json and _image)."""

    def aiperf_beside(self, server: KubeServer, argv_for, *, timeout: float, out: Path,
                      name: str) -> CallResult:
        """One AIPerf cell as a Job in the cluster against the leader's Service; what it wrote
        comes back through its log into `out`, read by the same AIPerf reader as on the local
        place. A served hub model (server.tokenizer_revision) puts the Job on the leader's
        node with the model cache that holds its tokenizer."""
        job_name = object_name(name)
        folder = f"{manifests.ARTIFACT_ROOT}/cell"
        argv = argv_for(AIPERF_IN_IMAGE, folder, None)
        serve_name = server.name
        cache = self.spec.model_cache_dir if server.tokenizer_revision else None
        leader = manifests.leader_selector(self.stage.run_id, serve_name,
                                           self.spec.leaderworkerset)
        job = manifests.aiperf_job(
            run_id=self.stage.run_id, image=self._image(), argv=argv, artifact_dir=folder,
            block=job_name, name=job_name, stage=self.stage.name, namespace=self.namespace,
            serve_name=serve_name, timeout_s=timeout, env=AIPERF_ENV,
            leader_cache=manifests.LeaderCache(cache, leader) if cache else None)
        started = self.door.now()
        self.apply([job], job_name)
        try:
            pod = self.wait_job(job_name, timeout_s=timeout + self.spec.schedule_timeout_s)
            name_of = (pod or {}).get("metadata", {}).get("name")
            text = self.pod_log(name_of, pod) if name_of else ""
            try:
                stream.unpack(text, job_name, out)
                note = ""
            except StreamError as why:
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
        def look(elapsed) -> tuple[bool, dict | None]:
            got = self._json("get", "pods", "-l", f"job-name={name}")
            pods = (got or {}).get("items", [])
            pod = pods[0] if pods else None
            waited = elapsed()
            if pod and is_finished(pod):
                return True, pod
            reason = unschedulable(pod) if pod else None
            return bool(reason and waited >= self.spec.schedule_timeout_s), pod

        return wait_until(self.door, look, timeout_s, f"the job {name}", poll_s=POLL_S)
