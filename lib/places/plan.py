"""The plan place: what a cluster place would run, rendered, checked and recorded, with nothing
run against a cluster or a server.

`plan_for` names the place planned for (kube by default, or slurm). The plan IS that place's
code with its effects turned into records: the same renderers make the same objects and
commands, but where the place would apply or submit, the plan writes the objects into the
stage's `manifests/` folder (kube) or its scripts into `scripts/` (slurm), runs the local
checkers on them (`kubernetes-validate --strict` at the Kubernetes version EKS runs, shellcheck
on every embedded script; gates), and records the command in the transcript (`door.plan`, the
door's plan mode refusing anything else). Where the place would then wait for pods or read
logs, the plan stops and says so in one SKIP reason.

    kube   lib.places.kube_plan.KubePlan    (lib.places.kube, planning)
    slurm  lib.places.slurm_plan.SlurmPlan  (lib.places.slurm, planning)

What both share (`plans_only`, the placeholders said once, the one reason) is
lib.places.planning. Values a plan cannot know are placeholders, said in its notes: the image
(the tag 02 gives the build of these pins) and, when not given, the model cache directory and
the nodes' names.
"""
from __future__ import annotations

from lib.places.base import Place
from lib.places.kube_plan import PLACEHOLDER_CACHE, KubePlan  # noqa: F401
from lib.places.planning import IMAGE_NAME, Planning, planned_image, tool  # noqa: F401
from lib.places.slurm_plan import SlurmPlan


def plan_class(plan_for: str | None) -> type[Place]:
    """The plan of the place `plan_for` names (kube when it names none)."""
    return KubePlan if (plan_for or "kube") == "kube" else SlurmPlan


def plan_place(stage, spec=None) -> Place:
    """The plan of the place `plan_for` names (`spec`: the stage's values, lib.places.base
    .PlaceSpec; default the stage's own)."""
    spec = stage.place_spec if spec is None else spec
    return plan_class(spec.plan_for)(stage, spec)
