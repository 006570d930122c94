"""The kube place: a Kubernetes cluster through kubectl, every call through the door.

    place     KubePlace: its kubectl calls (retried where safe), the nodes and their probe
              pods, rank jobs (one pod per node), the image's check, deleting what it applied
    serve     a serve as a StatefulSet or a LeaderWorkerSet group: its pods waited for, their
              logs kept and gated; KubeServer, its handle, asks it from inside the cluster
    waits     until pods are Ready or finished, or a Job's pod has finished, or the cluster
              says why they will not be
    aiperf    AIPerf as a Job beside a serve, its files back through its log
    pods      reading what kubectl prints of pods and nodes (pure), the objects' names
    retry     which kubectl calls are tried again while the API server restarts, and how
    files     the guide's own files a rank job's pods import (its ConfigMap)
    manifests the objects themselves, as data (the package lib.places.kube.manifests)
    plan      KubePlanned: what the place does instead of acting while its door plans
              (context plan): its effects turned into records

serve, waits and aiperf are functions the place hands itself to, so while its door plans they
run through the place's planned effects, as records too.
"""
