"""The plan place: what a cluster place would run, rendered, checked and recorded, with nothing
run against a cluster or a server; here, what its two plans share.

`plan_for` names the place planned for (kube by default, or slurm; lib.places.place_class picks
it), opened with its door in plan mode. The plan IS that place, its effects turned into records
while its door plans: the same renderers make the same objects and commands, but where the
place would apply or submit, it writes the objects into the stage's `manifests/` folder (kube)
or its scripts into `scripts/` (slurm), runs the local checkers on them (`kubernetes-validate
--strict` at the Kubernetes version EKS runs, shellcheck on every embedded script; gates), and
records the command in the transcript (`door.plan`, the door's plan mode refusing anything
else). Where the place would then wait for pods or read logs, the plan stops and says so in one
SKIP reason.

    kube   lib.places.kube.plan.KubePlanned    (a KubePlace's effects, as records)
    slurm  lib.places.slurm.plan.SlurmPlanned  (a SlurmPlace's effects, as records)

What both share is here: `Planning`, what each place's planned effects are made of, which says
the plan's placeholders once and gives its one reason; the image it plans (`planned_image`);
the local checkers (`tool`). Values a plan cannot know are placeholders, said in its notes: the
image (the tag 02 gives the build of these pins) and, when not given, the model cache directory
and the nodes' names.
"""
from __future__ import annotations

import sys
from pathlib import Path

from lib.core import evidence
from lib.core.errors import Unsupported
from lib.roots import pins as pins_mod

IMAGE_NAME = "deepep-v2-efa"  # as 02 tags its build (lib.stages.image)


def planned_image(stage) -> str:
    """The tag 02 gives the image it builds from the run's pins (pins-<digest>): the digest its
    run.json recorded (lib.stages.opening), so a replayed plan names the image it planned even
    after pins.yaml has moved on; the pins file's own digest before run.json exists."""
    record = stage.run_dir / "run.json"
    run = evidence.read_json(record) if record.is_file() else None
    digest = run.get("pins_digest") if isinstance(run, dict) else None
    return f"{IMAGE_NAME}:pins-{(digest or pins_mod.digest())[:12]}"


def tool(name: str) -> str:
    """A checker installed beside this interpreter (the guide's venv), by its path: a notebook
    kernel's PATH need not hold the venv's bin/ (the door records it as {bin}/)."""
    return str(Path(sys.executable).with_name(name))


class Planning:
    """What a plan says as it plans, held by each plan (its `planning`): a placeholder said once
    in the transcript (`note`), and the one reason it stops where the place it plans for would
    wait (`not_run`). `target` names that place; `verb` and `past` what it does to a cluster
    (applies / applied); `kept` where the plan's records are."""

    def __init__(self, door, *, target: str, verb: str, past: str, kept: str):
        self.door = door
        self.target, self.verb, self.past, self.kept = target, verb, past, kept
        self.what = f"a plan for the {target} place (nothing is {past} to a cluster)"
        self.notes: list[str] = []

    def not_run(self, what: str) -> Unsupported:
        return Unsupported(f"plan for {self.target}: {what} is planned, not run (context plan "
                           f"{self.verb} nothing to a cluster); {self.kept}")

    def note(self, text: str) -> None:
        """A placeholder of the plan, said once in the transcript (`# ...`)."""
        if text not in self.notes:
            self.notes.append(text)
            self.door.plan(["#", text], note="a placeholder of the plan")
