"""Where a stage's processes run: `for_stage(stage)` picks the place from its context.

    local  this machine (lib.places.local)
    plan   what kube or slurm would run, recorded, nothing run (lib.places.plan: `plan_for`
           picks lib.places.kube_plan.KubePlan or lib.places.slurm_plan.SlurmPlan)
    kube   a Kubernetes cluster through kubectl (lib.places.kube; its pods read by kube_pods)
    slurm  a Slurm cluster through sbatch/srun (lib.places.slurm; its serving slurm_serve)

What kube and slurm share is lib.places.cluster; the protocol every place answers is
lib.places.base; the errors places raise are lib.core.errors'.
"""
from __future__ import annotations

from typing import Any

from lib.places.base import (NodeNeeds, NodeRank, NodeRun, Place, RankJob,  # noqa: F401
                             ServeSpec, Unsupported)
from lib.places.kube import KubePlace
from lib.places.local import LocalPlace
from lib.places.plan import KubePlan, plan_class, plan_place
from lib.places.slurm import SlurmPlace

# "plan": the plan of the place `plan_for` names (place_class, for_stage); KubePlan by default
PLACES: dict[str, type[Place]] = {"local": LocalPlace, "plan": KubePlan, "kube": KubePlace,
                                  "slurm": SlurmPlace}


def place_class(context: str, plan_for: str | None = None) -> type[Place]:
    """The class of the place a context picks (for "plan", the plan `plan_for` names)."""
    return plan_class(plan_for) if context == "plan" else PLACES[context]


def for_stage(stage) -> Place:
    """The stage's place, made once per stage."""
    place = getattr(stage, "_place", None)
    if place is None:
        context = stage.params["context"]
        place = stage._place = (plan_place(stage) if context == "plan"
                                else PLACES[context](stage))
    return place


def _class_of(resolved: dict[str, Any]) -> type[Place]:
    return place_class(resolved["context"], resolved.get("plan_for"))


def engine_default(resolved: dict[str, Any]) -> str:
    return _class_of(resolved).engine_default(resolved)


def check_engine(resolved: dict[str, Any]) -> None:
    _class_of(resolved).check_engine(resolved)


def plans(resolved: dict[str, Any]) -> bool:
    """Whether the place of these parameters only plans (its door records and runs nothing
    against a cluster or a server): its class's `plans_only`."""
    return _class_of(resolved).plans_only


def on_one_machine(resolved: dict[str, Any]) -> bool:
    """Whether the place of these parameters runs every rank on this one machine (one node, its
    GPUs the ranks): the parameter rules on nodes and ranks ask it."""
    return _class_of(resolved).one_machine
