"""AIPerf as a Job beside a kube serve (what KubePlace.aiperf_beside runs): one Job per cell
against the leader's Service, on the leader's node with its model cache mounted read-only, so a
hub model's tokenizer is read from the files the engine downloaded there (a cluster's pods
cannot reach the hub: AIPerf runs cache-only at the pinned revision, lib.measure.sweep); what
the Job wrote comes back through its log (lib.places.stream), since a finished Job's pod cannot
be copied from.

A function of the place (lib.places.kube.place.KubePlace, or its plan): it uses the place's
stage, door, spec and namespace, and its apply, delete, pod_log, _json and _image, so a plan's
effects stay records here too.
"""
from __future__ import annotations

from pathlib import Path

import lib.places.kube.manifests as manifests  # the renderers themselves, not lib.places (no cycle through it)
import lib.places.stream as stream
from lib.core.door import CallResult
from lib.core.errors import StreamError
from lib.places.cluster import AIPERF_ENV, AIPERF_IN_IMAGE
from lib.places.kube import waits
from lib.places.kube.pods import exit_code, is_finished, object_name
from lib.places.kube.serve import KubeServer


def aiperf_beside(place, server: KubeServer, argv_for, *, timeout: float, out: Path,
                  name: str) -> CallResult:
    """One AIPerf cell as a Job in the cluster against the leader's Service; what it wrote
    comes back through its log into `out`, read by the same AIPerf reader as on the local
    place. A served hub model (server.tokenizer_revision) puts the Job on the leader's
    node with the model cache that holds its tokenizer."""
    job_name = object_name(name)
    folder = f"{manifests.ARTIFACT_ROOT}/cell"
    argv = argv_for(AIPERF_IN_IMAGE, folder, None)
    serve_name = server.name
    cache = place.spec.model_cache_dir if server.tokenizer_revision else None
    leader = manifests.leader_selector(place.stage.run_id, serve_name,
                                       place.spec.leaderworkerset)
    job = manifests.aiperf_job(
        run_id=place.stage.run_id, image=place._image(), argv=argv, artifact_dir=folder,
        block=job_name, name=job_name, stage=place.stage.name, namespace=place.namespace,
        serve_name=serve_name, timeout_s=timeout, env=AIPERF_ENV,
        leader_cache=manifests.LeaderCache(cache, leader) if cache else None)
    started = place.door.now()
    place.apply([job], job_name)
    try:
        pod = waits.wait_job(place, job_name, timeout_s=timeout + place.spec.schedule_timeout_s)
        name_of = (pod or {}).get("metadata", {}).get("name")
        text = place.pod_log(name_of, pod) if name_of else ""
        try:
            stream.unpack(text, job_name, out)
            note = ""
        except StreamError as why:
            note = f"\nthe job's files did not come back: {why}"
        rc = exit_code(pod)
        result = CallResult(argv, -1 if rc is None else rc, text, note,
                            round(place.door.now() - started, 3), not is_finished(pod))
        result.streams = ([place.stage.rel(place.stage.path("pods", f"{name_of}.log"))]
                          if name_of else [])
        return result
    finally:
        place.delete(job_name)
