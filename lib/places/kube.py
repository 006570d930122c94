"""The kube place: a Kubernetes cluster through kubectl (`kube_context`, `namespace`).

Not built yet: every capability says so (issue #19 adds it here, in this one file: nodes from
`kubectl get nodes`, probe pods, test_ep as one pod per node, vLLM as a StatefulSet with a
leader-only Service, AIPerf as a Job).
"""
from __future__ import annotations

from lib.places.base import Place


class KubePlace(Place):
    kind = "kube"
    what = "the kube place (Kubernetes through kubectl), not built yet,"
