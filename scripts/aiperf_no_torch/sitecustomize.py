"""Hide torch from AIPerf's processes on a GPU machine whose python3 holds a CUDA torch.

AIPerf loads its tokenizer with transformers, and transformers imports torch whenever torch is
installed: on the H200 image each AIPerf cell spent 11.8 s + 9.7 s loading a 2048-token
tokenizer (results/gpu-2xh200-vllm-20261130/05_sweep/aiperf/*/*/logs/aiperf.log), against 1.0 s
where no torch is installed. AIPerf itself needs no torch. scripts/gpu-run.sh puts this folder
first on the PYTHONPATH of its AIPerf wrapper only (python imports sitecustomize at start, in
every process AIPerf spawns too); nothing else sees it.

transformers asks ``importlib.util.find_spec("torch")``: the path finder below answers None for
torch and its submodules, so transformers runs as on a machine without torch.
"""
import sys
from importlib.machinery import PathFinder

HIDDEN = "torch"


class _PathFinderWithoutTorch(PathFinder):
    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        if fullname == HIDDEN or fullname.startswith(HIDDEN + "."):
            return None
        return super().find_spec(fullname, path, target)


sys.meta_path[:] = [_PathFinderWithoutTorch if finder is PathFinder else finder
                    for finder in sys.meta_path]
