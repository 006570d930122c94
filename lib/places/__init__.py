"""Where a stage's processes run: `for_stage(stage)` picks the place from its context.

    local  this machine (lib.places.local)
    plan   what kube or slurm would run, recorded, nothing run (`plan_for` picks
           lib.places.kube.plan.KubePlan or lib.places.slurm.plan.SlurmPlan: `plan_class`;
           what both plans share is lib.places.planning)
    kube   a Kubernetes cluster through kubectl (the package lib.places.kube; the place
           itself lib.places.kube.place.KubePlace)
    slurm  a Slurm cluster through sbatch/srun (the package lib.places.slurm; the place
           itself lib.places.slurm.place.SlurmPlace)

What kube and slurm share is lib.places.cluster; the protocol every place answers is
lib.places.base; the errors places raise are lib.core.errors'.
"""
from __future__ import annotations

from typing import Any, Mapping

from lib.core import stage as stage_mod
from lib.places.base import (NodeNeeds, NodeRank, NodeRun, Place, PlaceSpec,  # noqa: F401
                             RankJob, ServeSpec, Unsupported)
from lib.places.kube.place import KubePlace
from lib.places.kube.plan import KubePlan
from lib.places.local import LocalPlace
from lib.places.slurm.place import SlurmPlace
from lib.places.slurm.plan import SlurmPlan

# "plan": the plan of the place `plan_for` names (place_class, for_stage); KubePlan by default
PLACES: dict[str, type[Place]] = {"local": LocalPlace, "plan": KubePlan, "kube": KubePlace,
                                  "slurm": SlurmPlace}


def plan_class(plan_for: str | None) -> type[Place]:
    """The plan of the place `plan_for` names (kube when it names none)."""
    return KubePlan if (plan_for or "kube") == "kube" else SlurmPlan


def plan_place(stage, spec: PlaceSpec | None = None) -> Place:
    """The plan of the place `plan_for` names (`spec`: the stage's values, lib.places.base
    .PlaceSpec; default the stage's own)."""
    spec = stage.place_spec if spec is None else spec
    return plan_class(spec.plan_for)(stage, spec)


def place_class(context: str, plan_for: str | None = None) -> type[Place]:
    """The class of the place a context picks (for "plan", the plan `plan_for` names)."""
    return plan_class(plan_for) if context == "plan" else PLACES[context]


def for_stage(stage) -> Place:
    """The stage's place, made once per stage: handed the values the stage hands it
    (`stage.place_spec`, lib.places.base.PlaceSpec) and the stage, which records its evidence."""
    place = getattr(stage, "_place", None)
    if place is None:
        spec = stage.place_spec
        place = stage._place = (plan_place(stage, spec) if spec.context == "plan"
                                else PLACES[spec.context](stage, spec))
    return place


def _spec(spec: PlaceSpec | Mapping[str, Any]) -> PlaceSpec:
    """A PlaceSpec as given; values a caller has not yet made into one are made into one by the
    stage layer's builder (lib.stages.specs.place_spec, through lib.core.stage): nothing here
    reads a parameter by its name."""
    return spec if isinstance(spec, PlaceSpec) else stage_mod.build_place_spec(spec)


def _class_of(spec: PlaceSpec) -> type[Place]:
    return place_class(spec.context, spec.plan_for)


def engine_default(spec: PlaceSpec | Mapping[str, Any]) -> str:
    """The engine a stage serves with here when its `engine` is '' (the place's pick)."""
    spec = _spec(spec)
    return _class_of(spec).engine_default(spec)


def engine_refusal(spec: PlaceSpec | Mapping[str, Any]) -> str | None:
    """Why the place of `spec` cannot serve with the engine it names (None: it can); asked
    before a stage opens to record (lib.stages.rules_places.check_engine_here refuses it)."""
    spec = _spec(spec)
    return _class_of(spec).engine_refusal(spec)


def plans(spec: PlaceSpec | Mapping[str, Any]) -> bool:
    """Whether the place of `spec` only plans (its door records and runs nothing against a
    cluster or a server): its class's `plans_only`."""
    return _class_of(_spec(spec)).plans_only


def on_one_machine(spec: PlaceSpec | Mapping[str, Any]) -> bool:
    """Whether the place of `spec` runs every rank on this one machine (one node, its GPUs the
    ranks): the parameter rules on nodes and ranks ask it."""
    return _class_of(_spec(spec)).one_machine
