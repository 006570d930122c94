"""A cluster profile: the parameters a person with a cluster gives once, so that the guide's
headline command runs there as typed.

    python -m lib.runner profile --context kube -p kube_context my-eks -p namespace deepep \
        -p image REGISTRY/IMAGE:TAG -p model_cache_dir /opt/dlami/nvme/models
    python -m lib.runner profile show
    papermill notebooks/04_serve.ipynb out.ipynb -p nodes 2     # now on that cluster

The profile is one YAML file the repository ignores (`.guide-profile.yaml` at its root, or the
path in REPRO_PROFILE). Every notebook and `make run` take their defaults from it: a value the
notebook was not given (None in its parameters cell, papermill's `-p` and `-f` not naming it)
is the profile's, and an explicit `-p` still wins. It is checked when written by the same rules
as a stage's parameters (each value by its rule, and every stage's parameters together), so a
profile that would make a stage refuse is never written; a run records in run.json the profile
it read (its path and values, secrets redacted). A replay never reads it: a recorded run's
parameters are what its notebooks were given.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from lib.core import evidence
from lib.core.door import REPO_ROOT
from lib.core.errors import ParameterError
from lib.core.redact import redact
from lib.stages import registry

PROFILE_ENV = "REPRO_PROFILE"
DEFAULT_PATH = REPO_ROOT / ".guide-profile.yaml"
# what a profile may set: where the cluster is and how to reach it, never a run's identity
NOT_IN_A_PROFILE = ("run_id", "results_dir")
HOW_TO_WRITE = registry.PROFILE_HOW


def path() -> Path:
    return Path(os.environ.get(PROFILE_ENV) or DEFAULT_PATH)


def load() -> dict[str, Any]:
    """The profile's values ({} when there is none). A file that is not a profile is refused,
    naming the file."""
    where = path()
    if not where.is_file():
        return {}
    try:
        values = yaml.safe_load(where.read_text()) or {}
    except yaml.YAMLError as err:
        raise ParameterError("profile", str(where), f"a YAML mapping of parameters ({err})") \
            from None
    if not isinstance(values, dict):
        raise ParameterError("profile", str(where), "a YAML mapping of parameter names to values")
    return check(values)


def check(values: dict[str, Any]) -> dict[str, Any]:
    """The profile's values, each checked by its parameter's rule and every stage's parameters
    checked together with them; a ParameterError naming the first that is refused."""
    for name in values:
        if name not in registry.PARAMS or name in NOT_IN_A_PROFILE:
            allowed = sorted(set(registry.PARAMS) - set(NOT_IN_A_PROFILE))
            raise ParameterError(name, values[name], "a parameter a profile may set: "
                                 + ", ".join(allowed))
    checked = {name: registry.checked(registry.PARAMS[name], value)
               for name, value in values.items()}
    for stage, names in registry.STAGE_PARAMS.items():
        registry.resolve(stage, {k: v for k, v in checked.items() if k in names})
    return checked


def write(values: dict[str, Any]) -> Path:
    """Check `values` and write them as the profile (replacing the one there)."""
    checked = check(values)
    where = path()
    where.parent.mkdir(parents=True, exist_ok=True)
    text = ("# the guide's cluster profile (python -m lib.runner profile ...): every notebook's "
            "defaults; an explicit -p wins\n" + yaml.safe_dump(checked, sort_keys=True))
    evidence.replace_atomically(where, text)
    return where


def fill(declared: tuple[str, ...], given: dict[str, Any]) -> tuple[dict[str, Any], dict]:
    """`given` with the profile's value for each declared parameter it leaves None (or does not
    name), and what the profile supplied ({} without a profile)."""
    profile = load()
    supplied = {k: v for k, v in profile.items()
                if k in declared and given.get(k) is None}
    return {**given, **supplied}, supplied


def recorded(supplied: dict[str, Any]) -> dict[str, Any] | None:
    """What run.json keeps of the profile a run read (None: it read none)."""
    if not supplied:
        return None
    return {"path": str(path()), "values": {k: redact(str(v)) if isinstance(v, str) else v
                                            for k, v in supplied.items()}}


def shown() -> str:
    where = path()
    if not where.is_file():
        return f"no profile at {where}: the notebooks run on the local context. Write one " \
               f"with: {HOW_TO_WRITE}"
    return f"{where}:\n" + yaml.safe_dump(load(), sort_keys=True)
