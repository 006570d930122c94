"""The rules a parameter's value must follow, and how a value is checked (the machinery).

The table of every parameter of every stage, with its rule and its defaults per context, is
lib.stages.registry's (it names facts of the engines and places: vLLM's backends, instance
types). A refused value raises lib.core.errors.ParameterError naming the parameter and its
allowed values, before any effect.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from lib.core.errors import ParameterError

RUN_ID_RULE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
# Kubernetes names (RFC 1123 labels: namespaces, Services, label values we make)
DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
# kubectl context names: what `kubectl config get-contexts` shows for EKS (ARNs included), no
# shell or YAML metacharacters
KUBE_CONTEXT_RULE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@-]{0,252}$")
# an image by digest (repo@sha256:...) or by a tag that is not `latest`
IMAGE_RULE = re.compile(r"^[a-z0-9]+([._/-][a-z0-9]+)*(:[0-9]+)?(/[a-z0-9]+([._-][a-z0-9]+)*)*"
                        r"(:(?!latest$)[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(@sha256:[0-9a-f]{64})?$")
MODEL_ID_RULE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95}$")
SLURM_NAME_RULE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")

NO_LEGACY = object()  # a parameter whose default is what runs recorded before it did


@dataclass(frozen=True)
class Param:
    name: str
    allowed: str  # said to a person when the value is refused
    check: Callable[[Any], Any]  # returns the normalised value or raises ValueError
    defaults: dict[str, Any]  # per context; key "*" for every context
    help: str
    # What a run recorded before the parameter existed did, when that is not the default:
    # its replay takes this value (lib.core.stage.open_replay), so a better default for new runs
    # never makes an older recording disagree with itself.
    legacy: Any = NO_LEGACY

    def default(self, context: str, engine: str = "") -> Any:
        """The default for `context`; a key "<context>:<engine>" wins for that engine (the vLLM
        serve on two GPUs sweeps the cluster's concurrency levels, not the CPU's)."""
        if engine and f"{context}:{engine}" in self.defaults:
            return self.defaults[f"{context}:{engine}"]
        return self.defaults.get(context, self.defaults.get("*"))


def checked(param: Param, value: Any) -> Any:
    """The normalised value, or ParameterError naming the parameter and what it allows."""
    try:
        return param.check(value)
    except (ValueError, TypeError):
        raise ParameterError(param.name, value, param.allowed) from None


# ---- rules -----------------------------------------------------------------------------------
def int_at_least(low: int):
    def check(v):
        if isinstance(v, bool) or not isinstance(v, (int, str)) or not str(v).strip().lstrip("-").isdigit():
            raise ValueError
        n = int(v)
        if n < low:
            raise ValueError
        return n
    return check


def int_range(low: int, high: int):
    at_least = int_at_least(low)

    def check(v):
        n = at_least(v)
        if n > high:
            raise ValueError
        return n
    return check


def float_above(low: float):
    def check(v):
        f = float(v)
        if not f > low:
            raise ValueError
        return f
    return check


def one_of(options: Iterable[Any]):
    options = tuple(options)

    def check(v):
        if v not in options:
            raise ValueError
        return v
    return check


def matching(rule: re.Pattern, empty_ok: bool = False):
    """A string that the pattern matches whole ('' too when empty_ok)."""
    def check(v):
        if not isinstance(v, str):
            raise ValueError
        if v == "" and empty_ok:
            return v
        if not rule.match(v):
            raise ValueError
        return v
    return check


def run_id(v):
    if not isinstance(v, str) or (v and (not RUN_ID_RULE.match(v) or ".." in v)):
        raise ValueError
    return v


def text(v):
    if not isinstance(v, str):
        raise ValueError
    return v


def results_dir(v):
    if not isinstance(v, str) or not v or "\x00" in v:
        raise ValueError
    return v


def boolean(v):
    if isinstance(v, bool):
        return v
    value = str(v).strip().lower()
    if value in ("true", "1", "yes"):
        return True
    if value in ("false", "0", "no"):
        return False
    raise ValueError


def int_list(v):
    """'1,2,4' or [1, 2, 4] -> [1, 2, 4]: positive, unique, ascending."""
    items = v if isinstance(v, (list, tuple)) else str(v).replace(" ", "").split(",")
    values = [int_at_least(1)(x) for x in items if str(x) != ""]
    if not values or len(set(values)) != len(values):
        raise ValueError
    return sorted(values)


def choice_list(options: Iterable[str], at_least: int = 2):
    """'' -> []; 'a,b' or [a, b] -> [a, b]: `at_least` or more distinct options, order kept."""
    options = tuple(options)

    def check(v):
        items = v if isinstance(v, (list, tuple)) else [
            x for x in str(v).replace(" ", "").split(",") if x]
        if not items:
            return []
        if len(items) < at_least or len(set(items)) != len(items) or any(
                x not in options for x in items):
            raise ValueError
        return list(items)
    return check


def optional(rule: Callable[[Any], Any]):
    """'' (not given) or what `rule` accepts."""
    def check(v):
        return "" if v == "" else rule(v)
    return check
