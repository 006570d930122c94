"""The rules on parameters that a place's facts decide, each written once, here: the stage's
parameter model (lib.stages.registry's `_check_together`) calls `check_places`, the opener
(lib.stages.opening) calls `check_engine_here`, and nothing below the stage checks these values
again (lib.places takes what the model accepted, as a lib.places.base.PlaceSpec).

- `check_places`: a serve on the kube place asks each pod for its node's GPUs, so it needs
  `gpus_per_node` >= 1 (the model's own bound, 0..8, allows a node without GPUs, which the
  kube place serves nothing on);
- `check_engine_here`: the engine named against this machine (the local place: vLLM needs two
  or more GPUs and vllm importable). Asked only when a stage opens to record: it reads this
  machine, and a replay's recorded run already proves what its machine could do.

Each raises lib.core.errors.ParameterError naming the parameter a person would change and what
it allows, before any effect.
"""
from __future__ import annotations

from typing import Any, Mapping

from lib import places
from lib.core.errors import ParameterError
from lib.places.base import PlaceSpec
from lib.stages.specs import place_spec_of

# lib.stages.lever: 06 serves (its serving A/B) with engine vllm alone; 04 and 05 always serve
_SERVES_ONLY_WITH = ("arm_a_comms", "vllm")


def check_places(values: Mapping[str, Any]) -> None:
    """The rules across parameters that the place of `values` decides."""
    _check_kube_serve_gpus(values)


def _serves(values: Mapping[str, Any]) -> bool:
    """Whether a stage of these values serves a model: one that takes `model_cache_dir` (04, 05,
    06), 06 only with engine vllm."""
    lever, engine = _SERVES_ONLY_WITH
    return "model_cache_dir" in values and (lever not in values or values.get("engine") == engine)


def _check_kube_serve_gpus(values: Mapping[str, Any]) -> None:
    """A serve on the kube place (or a plan of one): every pod asks for its node's GPUs, and
    the engine's data parallelism is nodes x GPUs per node."""
    if "context" not in values or not _serves(values):
        return
    spec = place_spec_of(values)
    kube = spec.context == "kube" or spec.context == "plan" and (spec.plan_for or "kube") == "kube"
    if kube and spec.gpus_per_node is not None and spec.gpus_per_node < 1:
        raise ParameterError("gpus_per_node", spec.gpus_per_node,
                             "an integer >= 1 to serve on the kube place (each serve pod asks "
                             "for its node's GPUs; DP = nodes x GPUs per node)")


def check_engine_here(spec: PlaceSpec) -> None:
    """The engine `spec` names, against the machine its place would serve it on (the local
    place: this one); refused with the place's reason, naming what `engine` may be instead."""
    why = places.engine_refusal(spec)
    if why:
        raise ParameterError("engine", spec.engine, why)
