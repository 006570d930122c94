"""Each stage's typed parameter model (lib.core.param_model, built by lib.stages.registry) and
what a person sees of it: papermill's own `--help-notebook` on every notebook, the parameters
cell it reads, the refusals the model raises.
"""
from __future__ import annotations

import pickle
import subprocess
import sys

import pytest
from pydantic import ValidationError

from lib.core.door import REPO_ROOT
from lib.core.errors import ParameterError
from lib.core.param_model import StageParameters, python_type
from lib.stages import registry


@pytest.mark.parametrize("stage", registry.STAGES)
def test_papermill_help_shows_each_parameter_s_type_and_help(stage):
    done = subprocess.run([sys.executable, "-m", "papermill", "--help-notebook",
                           str(REPO_ROOT / "notebooks" / f"{stage}.ipynb")],
                          capture_output=True, text=True, timeout=120, check=True)
    assert "Unknown type" not in done.stdout
    shown = " ".join(done.stdout.split())
    for name in registry.STAGE_PARAMS[stage]:
        rule = registry.PARAMS[name].rule
        typed = f"{name}: {getattr(python_type(rule), '__name__', str(python_type(rule)))} " \
            if python_type(rule) in (int, float, str, bool) else f"{name}: {python_type(rule)} "
        assert typed in shown, (stage, name)
        help_words = " ".join(registry.PARAMS[name].help.split())[:40].replace(
            " = ", ": ").replace("=", " ")
        assert help_words in shown, (stage, name)
        assert "default:" in shown


def test_each_stage_has_one_frozen_model_with_every_parameter_it_takes():
    for stage, names in registry.STAGE_PARAMS.items():
        model = registry.MODELS[stage]
        assert issubclass(model, StageParameters)
        assert tuple(model.model_fields) == names
        for name in names:
            field = model.model_fields[name]
            assert field.description == registry.PARAMS[name].help
            assert field.json_schema_extra["allowed"] == registry.PARAMS[name].allowed
    p = registry.resolve("04_serve", {"context": "plan", "nodes": 2})
    assert isinstance(p, registry.MODELS["04_serve"]) and p.nodes == 2 and p["nodes"] == 2
    assert p.gpus_per_node == 8 and p.efa_per_node == 16  # derived from the instance type
    with pytest.raises(ValidationError):
        p.nodes = 3  # frozen
    assert pickle.loads(pickle.dumps(p)) == p
    assert dict(p)["nodes"] == 2 and {**p}["context"] == "plan" and p.as_dict()["nodes"] == 2


def test_a_refusal_names_the_parameter_and_its_allowed_values_field_or_across():
    with pytest.raises(ParameterError, match=r"parameter 'num_topk' = 'abc' is not allowed; "
                                             r"allowed: an integer >= 1"):
        registry.resolve("03_kernel_test", {"num_topk": "abc"})
    with pytest.raises(ParameterError, match=r"parameter 'num_topk' = 16 .* num_experts \(8\)"):
        registry.resolve("03_kernel_test", {"num_topk": 16, "num_experts": 8})  # across
    with pytest.raises(ParameterError, match=r"parameter 'nodes' = 3 .* 1 on the local context"):
        registry.resolve("04_serve", {"nodes": 3})
    with pytest.raises(ParameterError, match="the parameters of 04_serve"):
        registry.resolve("04_serve", {"no_such": 1})
