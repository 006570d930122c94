"""Where a stage's processes run: `for_stage(stage)` picks the place from its context.

    local  this machine (lib.places.local)
    plan   what kube or slurm would run, recorded, nothing run: the place `plan_for` names
           (kube by default) with its door in plan mode, its effects then records
           (lib.places.kube.plan, lib.places.slurm.plan; what both share: lib.places.planning)
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
from lib.places.local import LocalPlace
from lib.places.slurm.place import SlurmPlace

PLACES: dict[str, type[Place]] = {"local": LocalPlace, "kube": KubePlace, "slurm": SlurmPlace}


def place_class(context: str, plan_for: str | None = None) -> type[Place]:
    """The class of the place a context picks (for "plan", the place `plan_for` names, kube
    when it names none: its door then plans)."""
    return PLACES[(plan_for or "kube") if context == "plan" else context]


def for_stage(stage) -> Place:
    """The stage's place, made once per stage: handed the values the stage hands it
    (`stage.place_spec`, lib.places.base.PlaceSpec) and the stage, which records its evidence.
    Context plan: the place `plan_for` names, whose door (the stage's, opened in plan mode:
    lib.stages.opening) records its effects instead of running them."""
    place = getattr(stage, "_place", None)
    if place is None:
        spec = stage.place_spec
        if spec.context == "plan" and not stage.door.planning:
            raise ValueError(f"context plan needs the stage's door in plan mode ({stage.name})")
        place = stage._place = place_class(spec.context, spec.plan_for)(stage, spec)
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
    cluster or a server): context plan."""
    return _spec(spec).context == "plan"


def on_one_machine(spec: PlaceSpec | Mapping[str, Any]) -> bool:
    """Whether the place of `spec` runs every rank on this one machine (one node, its GPUs the
    ranks): the parameter rules on nodes and ranks ask it."""
    return _class_of(_spec(spec)).one_machine
