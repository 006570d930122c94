"""The guide's own files a rank job's pods import (lib.places.base.RankJob.modules), read from the
checkout for the kube place: the image (docker/Dockerfile, built from docker/) holds no `lib/`,
so a pod running `python3 -m lib.bench.moe_train` would die with "No module named 'lib'".
lib.places.manifests.rank_objects renders them into the job's ConfigMap, mounted read-only at
manifests.GUIDE_MOUNT with the package layout kept and put first on PYTHONPATH.

What is read is the guide's source at this checkout (the run records its git SHA), not a value
of the world: it is read here, not through the door, and the rendered ConfigMap (in the stage's
manifests/) is its evidence.
"""
from __future__ import annotations

from pathlib import Path, PurePosixPath
from typing import Iterable

from lib.core.door import REPO_ROOT
from lib.core.errors import ParameterError


def guide_files(paths: Iterable[str], root: Path = REPO_ROOT) -> dict[str, str]:
    """{path relative to the repository root: its text}, in the order given. Each must be a
    relative POSIX path to a .py file of the checkout, inside it; a package's module needs its
    __init__.py named too (Python imports lib.bench.x only through lib/__init__.py and
    lib/bench/__init__.py)."""
    paths = list(paths)
    files: dict[str, str] = {}
    for path in paths:
        rel = PurePosixPath(str(path))
        if rel.is_absolute() or ".." in rel.parts or rel.suffix != ".py" or str(rel) != path:
            raise ParameterError("modules", path, "relative paths of the guide's .py files "
                                 "under the repository root (e.g. lib/bench/moe_train.py)")
        file = root / rel
        if not file.is_file():
            raise ParameterError("modules", path, f"files of the checkout ({root}); "
                                 f"{path} is not one")
        files[path] = file.read_text(encoding="utf-8")
    for path in paths:
        for package in PurePosixPath(path).parents:
            if str(package) != "." and f"{package}/__init__.py" not in files:
                raise ParameterError("modules", paths, f"every package's __init__.py beside its "
                                     f"modules: {path} needs {package}/__init__.py")
    return files
