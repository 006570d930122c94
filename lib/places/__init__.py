"""Where a stage's processes run: `for_stage(stage)` picks the place from its context.

    local  this machine (lib.places.local)
    plan   what kube or slurm would run, recorded, nothing run (lib.places.plan)
    kube   a Kubernetes cluster through kubectl (lib.places.kube)
    slurm  a Slurm cluster through sbatch/srun (lib.places.slurm)
"""
from __future__ import annotations

from typing import Any

from lib.places.base import (NodeNeeds, NodeRank, NodeRun, Place, RankJob,  # noqa: F401
                             ServeSpec, Unsupported)
from lib.places.kube import KubePlace
from lib.places.local import LocalPlace
from lib.places.plan import PlanPlace, plan_place
from lib.places.slurm import SlurmPlace

PLACES: dict[str, type[Place]] = {"local": LocalPlace, "plan": PlanPlace, "kube": KubePlace,
                                  "slurm": SlurmPlace}


def place_class(context: str) -> type[Place]:
    return PLACES[context]


def for_stage(stage) -> Place:
    """The stage's place, made once per stage."""
    place = getattr(stage, "_place", None)
    if place is None:
        context = stage.params["context"]
        place = stage._place = (plan_place(stage) if context == "plan"
                                else PLACES[context](stage))
    return place


def engine_default(resolved: dict[str, Any]) -> str:
    return PLACES[resolved["context"]].engine_default(resolved)


def check_engine(resolved: dict[str, Any]) -> None:
    PLACES[resolved["context"]].check_engine(resolved)


def plans(resolved: dict[str, Any]) -> bool:
    """Whether the place of these parameters only plans (its door records and runs nothing
    against a cluster or a server): the one place a context name decides it."""
    return place_class(resolved["context"]) is PlanPlace


def on_one_machine(resolved: dict[str, Any]) -> bool:
    """Whether the place of these parameters runs every rank on this one machine (one node, its
    GPUs the ranks): the parameter rules on nodes and ranks ask it."""
    return place_class(resolved["context"]).one_machine
