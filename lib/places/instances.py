"""What an instance type brings per node: the facts the cluster places plan with.

GPUs and EFA devices per node are the defaults of `gpus_per_node` and `efa_per_node` when a
cluster place names `instance_type` (a parameter given explicitly wins). Sources: the public
reproductions' manifests and ANCHORS.md ("p5en 16, p5 32" EFA devices, 8 GPUs each), AWS's
instance pages as cited there.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class InstanceType:
    name: str
    gpus: int
    efa: int  # vpc.amazonaws.com/efa devices the EFA device plugin advertises per node
    gpu_model: str


INSTANCE_TYPES = {t.name: t for t in (
    InstanceType("p5en.48xlarge", 8, 16, "H200"),
    InstanceType("p5.48xlarge", 8, 32, "H100"),
)}
DEFAULT_INSTANCE_TYPE = "p5en.48xlarge"
