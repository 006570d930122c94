"""The typed values a stage hands down, built from its typed parameters: here, what its place is
handed (lib.places.base.PlaceSpec).

The stage layer is where a parameter is read by its name (the registry's table, params.json);
below it, a place reads the attributes of the PlaceSpec it was handed and nothing else of the
parameters. `place_spec(params)` builds it once from the stage's model (lib.stages.opening
attaches it when the stage opens; in a replay, from the recorded parameters, the same way);
`place_spec_of(values)` from the values the parameter rules see (lib.stages.registry, before the
model exists). A value the stage does not take is None.

lib.core.stage's Stage builds its spec through this module (`register_place_spec` below: core
imports nothing above it), so a Stage made without lib.stages.opening (a test's) hands its place
the same values.
"""
from __future__ import annotations

from dataclasses import fields
from typing import Any, Mapping

from lib.core import stage as stage_mod
from lib.core.param_model import StageParameters
from lib.places.base import PlaceSpec

PLACE_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(PlaceSpec))


def place_spec(params: StageParameters | Mapping[str, Any]) -> PlaceSpec:
    """What the stage's place is handed: its model's attributes, or (a replay's recorded
    parameters, a dict) its values by name."""
    if isinstance(params, StageParameters):
        taken = type(params).model_fields
        return PlaceSpec(**{name: getattr(params, name) for name in PLACE_FIELDS
                            if name in taken})
    return place_spec_of(params)


def place_spec_of(values: Mapping[str, Any]) -> PlaceSpec:
    """What a place is handed, from parameter values by name (the registry's rules across
    parameters, a recorded run's params.json); a name absent is None."""
    return PlaceSpec(**{name: values[name] for name in PLACE_FIELDS if name in values})


stage_mod.register_place_spec(place_spec)
