"""What the two plans share (lib.places.kube.plan.KubePlan, lib.places.slurm.plan.SlurmPlan; the
plan place is lib.places.plan): a place that only plans (`plans_only`), its placeholders said
once in the transcript, the one reason it gives where it would wait, and the image it plans.
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
    """A cluster place's own code, planning (mixed in before the place it plans for): what it
    would do to a cluster is recorded, nothing is run. `target` names that place; `verb` and
    `past` what it does to a cluster (applies / applied); `kept` where the plan's records are."""

    kind = "plan"
    plans_only = True
    target = verb = past = kept = "?"

    def __init__(self, stage, spec=None):
        super().__init__(stage, spec)
        self.what = f"a plan for the {self.target} place (nothing is {self.past} to a cluster)"
        self.notes: list[str] = []

    def _not_run(self, what: str) -> Unsupported:
        return Unsupported(f"plan for {self.target}: {what} is planned, not run (context plan "
                           f"{self.verb} nothing to a cluster); {self.kept}")

    def _note(self, text: str) -> None:
        """A placeholder of the plan, said once in the transcript (`# ...`)."""
        if text not in self.notes:
            self.notes.append(text)
            self.door.plan(["#", text], note="a placeholder of the plan")
