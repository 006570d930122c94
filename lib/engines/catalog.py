"""The engines a stage may name (`-p engine`), each answering lib.engines.base's protocol."""
from __future__ import annotations

from lib.core.errors import ParameterError
from lib.engines.base import Engine
from lib.engines.sglang import SglangEngine
from lib.engines.transformers import TransformersEngine
from lib.engines.trtllm import TrtllmEngine
from lib.engines.vllm import VllmEngine

ENGINES: dict[str, Engine] = {e.name: e for e in (VllmEngine(), SglangEngine(), TrtllmEngine(),
                                                  TransformersEngine())}


def engine(name: str) -> Engine:
    """The engine by its name; a ParameterError naming the known ones otherwise."""
    if name not in ENGINES:
        raise ParameterError("engine", name, ", ".join(ENGINES))
    return ENGINES[name]
