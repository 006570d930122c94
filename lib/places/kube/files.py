"""The guide's own files a rank job's pods import (lib.places.base.RankJob.modules), read from the
checkout for the kube place: the image (docker/Dockerfile, built from docker/) holds no `lib/`,
so a pod running `python3 -m lib.bench.moe_train` would die with "No module named 'lib'".
lib.places.kube.manifests.rank_objects renders them into the job's ConfigMap, mounted read-only at
manifests.GUIDE_MOUNT with the package layout kept and put first on PYTHONPATH.

What is read is the guide's source at this checkout (the run records its git SHA), not a value
of the world: it is read here, not through the door, and the rendered ConfigMap (in the stage's
manifests/) is its evidence.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable

from lib.core.door import REPO_ROOT


def guide_files(paths: Iterable[str], root: Path = REPO_ROOT) -> dict[str, str]:
    """{path relative to the repository root: its text}, in the order given. The paths are a
    RankJob's `modules`, the guide's own (lib.engines.deepep.TEST_EP_MODULES,
    lib.stages.train.TRAIN_MODULES): relative POSIX paths of .py files of the checkout, every
    package's __init__.py named beside its modules (Python imports lib.bench.x only through
    lib/__init__.py and lib/bench/__init__.py; tests/test_guide_modules.py checks each list)."""
    return {path: (root / path).read_text(encoding="utf-8") for path in paths}
