"""The typed, frozen parameter model of a stage, made from its parameters' rules (pydantic v2).

A stage's model has one field per parameter it takes: the field's Python type (what papermill's
`--help-notebook` and the notebook's parameters cell show), its help and its defaults per
context (the field's description and schema), and its rule (lib.core.params) as the field's
validator, so the bounds and the hostile values generated from them stay one thing. The rules
across parameters (EP divisibility, top-k within experts, engine against place, transport
against the pin set's floor, the training shape) are the model's one `after` validator, given by
the stage registry, which knows the engines and places they name.

Built once when a stage opens (lib.stages.registry.resolve); frozen after. A value its rule or
a cross rule refuses raises lib.core.errors.ParameterError naming the parameter and what it
allows, before any effect: pydantic's own error is never shown to a person.

Why pydantic: it is the field's standard for typed, validated configuration (InferenceX
validates its configs and run matrix with it), it is already in this environment (transformers'
serving extra needs it), and its models give frozen instances, per-field help and a schema a
generator reads; attrs with validators would have needed the schema and the help by hand.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, model_validator
from pydantic.functional_validators import BeforeValidator
from typing_extensions import Annotated

from lib.core.errors import ParameterError
from lib.core.params import (ChoiceList, Flag, Folder, Integer, IntList, Number, OneOf, OrEmpty,
                             Param, Rule, Text)

# A rule's Python type: what a value is once its rule accepted it
_TYPES: dict[type, type] = {Integer: int, Number: float, OneOf: str, Flag: bool, Text: str,
                            Folder: str, IntList: list[int], ChoiceList: list[str]}


def python_type(rule: Rule) -> type:
    """The type a rule's accepted (normalised) value has: int, float, str, bool or a list."""
    while isinstance(rule, OrEmpty):
        rule = rule.rule
    for kind, python in _TYPES.items():
        if isinstance(rule, kind):
            return python
    raise TypeError(f"no Python type for the rule {type(rule).__name__}")


def type_said(rule: Rule) -> str:
    """The type as a parameters cell writes it (`list[int]`, `int`)."""
    python = python_type(rule)
    return getattr(python, "__name__", None) if python in (int, float, str, bool) else str(python)


def _checker(param: Param) -> Callable[[Any], Any]:
    """The field's validator: None passes (a default said at run time), else the rule's
    normalised value, or ParameterError naming the parameter and what it allows (a ValueError:
    pydantic carries it out in its ValidationError, `build` raises it again)."""
    def check(value: Any) -> Any:
        if value is None:
            return None
        try:
            return param.rule(value)
        except (ValueError, TypeError, OverflowError):
            raise ParameterError(param.name, value, param.allowed) from None
    return check


class StageParameters(BaseModel):
    """A stage's resolved parameters: typed, frozen, read as attributes (`p.nodes`). The stage
    layer also reads them by name (`p["nodes"]`, `p.get("engine")`) where the name is data
    (the registry's tables, params.json)."""

    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=False,
                              arbitrary_types_allowed=False)

    # ---- read by name ------------------------------------------------------------------------
    def __getitem__(self, name: str) -> Any:
        if name not in type(self).model_fields:
            raise KeyError(name)
        return getattr(self, name)

    def get(self, name: str, default: Any = None) -> Any:
        return getattr(self, name) if name in type(self).model_fields else default

    def __contains__(self, name: object) -> bool:
        return name in type(self).model_fields

    def keys(self) -> list[str]:
        return list(type(self).model_fields)

    def items(self) -> list[tuple[str, Any]]:
        return [(name, getattr(self, name)) for name in type(self).model_fields]

    def values(self) -> list[Any]:
        return [getattr(self, name) for name in type(self).model_fields]

    def __iter__(self) -> Iterator[str]:  # type: ignore[override]  (a mapping's: its names)
        return iter(type(self).model_fields)

    def __len__(self) -> int:
        return len(type(self).model_fields)

    def as_dict(self) -> dict[str, Any]:
        """A new, writable dict of the values (params.json, a copy to change one)."""
        return {name: getattr(self, name) for name in type(self).model_fields}


def model_for(stage: str, params: tuple[Param, ...],
              together: Callable[[dict[str, Any]], None]) -> type[StageParameters]:
    """The model of `stage`: a field per parameter (its type, help and defaults per context),
    each checked by its rule, then `together` (the rules across parameters) on the whole, which
    raises ParameterError itself."""
    fields: dict[str, Any] = {}
    for param in params:
        python = python_type(param.rule)
        fields[param.name] = (
            Annotated[python | None, BeforeValidator(_checker(param))],
            Field(default=None, description=param.help,
                  json_schema_extra={"allowed": param.allowed, "defaults": {
                      k: v for k, v in param.defaults.items()}}))

    def across(model: StageParameters) -> StageParameters:
        together(model.as_dict())
        return model

    validators = {"rules_across_parameters": model_validator(mode="after")(across)}
    name = "Parameters" + "".join(part.title() for part in stage.split("_")[1:])
    model = create_model(name, __base__=StageParameters, __validators__=validators,
                         __module__=__name__, **fields)
    globals()[name] = model  # importable by its name, so an instance pickles and deep-copies
    return model


def build(model: type[StageParameters], values: dict[str, Any]) -> StageParameters:
    """The model of these values, or ParameterError (the first refusal, as a person reads it)."""
    try:
        return model(**values)
    except ValidationError as err:
        for error in err.errors():
            cause = (error.get("ctx") or {}).get("error")
            if isinstance(cause, ParameterError):
                raise cause from None
        first = err.errors()[0]
        name = str(first["loc"][0]) if first.get("loc") else "parameters"
        raise ParameterError(name, first.get("input"), first.get("msg", "")) from None
