"""The engines a stage may name (`-p engine`), each answering lib.engines.base's protocol."""
from __future__ import annotations

from lib.engines.base import Engine
from lib.engines.sglang import MODE_FLAG, SglangEngine
from lib.engines.transformers import TransformersEngine
from lib.engines.trtllm import TrtllmEngine
from lib.engines.vllm import VllmEngine
from lib.engines.vllm_args import HYBRID_MODE_VAR

ENGINES: dict[str, Engine] = {e.name: e for e in (VllmEngine(), SglangEngine(), TrtllmEngine(),
                                                  TransformersEngine())}


def deepep_v2_mode_given(argv: list[str], env: dict[str, str]) -> str | None:
    """How a serve's processes were given DeepEP-V2's mode, as its recorded argv and env say
    it: vLLM's variable (lib.engines.vllm_args.HYBRID_MODE_VAR), SGLang's flag; None where
    neither is there."""
    if HYBRID_MODE_VAR in env:
        return f"{HYBRID_MODE_VAR}={env[HYBRID_MODE_VAR]}"
    if MODE_FLAG in argv[:-1]:
        return f"{MODE_FLAG} {argv[argv.index(MODE_FLAG) + 1]}"
    return None


def engine(name: str) -> Engine:
    """The engine by its name: one of ENGINES, as the `engine` parameter's model allows (it
    refuses any other before the stage opens) or a place resolves '' to."""
    return ENGINES[name]
