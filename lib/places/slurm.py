"""The slurm place: a Slurm cluster through sbatch/srun/scancel (`partition`, `account`, an image
through pyxis or a venv).

Not built yet: every capability says so (issue #20 adds it here, in this one file).
"""
from __future__ import annotations

from lib.places.base import Place


class SlurmPlace(Place):
    kind = "slurm"
    what = "the slurm place (Slurm through sbatch/srun), not built yet,"
