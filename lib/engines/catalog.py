"""The engines a stage may name (`-p engine`), each answering lib.engines.base's protocol."""
from __future__ import annotations

from lib.engines.base import Engine
from lib.engines.sglang import SglangEngine
from lib.engines.transformers import TransformersEngine
from lib.engines.trtllm import TrtllmEngine
from lib.engines.vllm import VllmEngine

ENGINES: dict[str, Engine] = {e.name: e for e in (VllmEngine(), SglangEngine(), TrtllmEngine(),
                                                  TransformersEngine())}


def engine(name: str) -> Engine:
    """The engine by its name: one of ENGINES, as the `engine` parameter's model allows (it
    refuses any other before the stage opens) or a place resolves '' to."""
    return ENGINES[name]
