"""Megatron-core, the engine stage 07 trains with: the one place that knows its process's argv
and environment, the dispatchers it may build and what each needs.

A place launches `train_argv(config, ...)` once per node (torchrun, one rank per GPU, or the
local context's `ranks` on CPU over gloo), the rendezvous on node 0. The training itself is
lib.bench.moe_train, megatron-core's GPTModel with its MoE layers; what its logs prove is
lib.measure.training's.

Why megatron-core 0.16.1 (pins.yaml `megatron_core`): 0.17.0 and later require Python >= 3.12
(their METADATA), and the guide's venv, the one `make run` builds on this machine's CPU torch,
is Python 3.11; 0.16.1 is the newest release that installs there. Without Transformer Engine it
needs one name bound (lib.bench.megatron_shims), which 0.17 binds itself. The same release has
a wheel for Python 3.12 (the GPU image's), so one pin serves both.
"""
from __future__ import annotations

from dataclasses import dataclass

NAME = "megatron-core"
PIN = "megatron_core"  # pins.yaml
LEVEL = "run here on CPU (two ranks over gloo) and on one H200"
MODULE = "lib.bench.moe_train"
# moe_token_dispatcher_type -> the class megatron-core builds for it (the rank logs its class)
DISPATCHER_CLASSES = {"alltoall": "MoEAlltoAllTokenDispatcher",
                      "allgather": "MoEAllGatherTokenDispatcher",
                      "flex": "MoEFlexTokenDispatcher"}
DISPATCHERS = tuple(DISPATCHER_CLASSES)
# DeepEP-V2 (ElasticBuffer) behind the flex dispatcher: no megatron-core release up to 0.19.2
# has it (its flex/deepep backend is DeepEP's legacy Buffer); the public reproduction's seam
# is NVIDIA/Megatron-LM PR #4632, with #4793 merged into the dev branch and #5153 open.
ELASTIC_BUFFER_RELEASES: tuple[str, ...] = ()
THREADS_PER_RANK = 1  # OMP threads per CPU rank: two ranks share this machine's two cores


@dataclass(frozen=True)
class TrainConfig:
    """One training run's shape (the stage's train_* parameters)."""
    nproc: int  # ranks per node
    backend: str  # gloo (CPU) or nccl (GPUs)
    steps: int
    layers: int
    hidden: int
    ffn_hidden: int
    heads: int
    experts: int
    topk: int
    vocab: int
    seq_len: int
    micro_batch: int
    lr: float
    dispatcher: str
    seed: int


def train_argv(cfg: TrainConfig, *, nodes: int, node_rank: int, master_addr: str, port: int,
               python: str) -> list[str]:
    """torchrun of the training on one node; several nodes rendezvous on node 0's port."""
    spread = [] if nodes == 1 else [f"--nnodes={nodes}", f"--node-rank={node_rank}"]
    return [
        python, "-m", "torch.distributed.run", f"--nproc-per-node={cfg.nproc}", *spread,
        f"--master-addr={master_addr}", f"--master-port={port}", "-m", MODULE,
        "--steps", str(cfg.steps), "--layers", str(cfg.layers), "--hidden", str(cfg.hidden),
        "--ffn-hidden", str(cfg.ffn_hidden), "--heads", str(cfg.heads),
        "--experts", str(cfg.experts), "--topk", str(cfg.topk), "--vocab", str(cfg.vocab),
        "--seq-len", str(cfg.seq_len), "--micro-batch", str(cfg.micro_batch),
        "--lr", repr(cfg.lr), "--dispatcher", cfg.dispatcher, "--seed", str(cfg.seed),
        "--backend", cfg.backend,
    ]


def train_env(master_addr: str) -> dict[str, str]:
    """What the training process sets over the place's own environment."""
    return {"OMP_NUM_THREADS": str(THREADS_PER_RANK), "MASTER_ADDR": master_addr,
            # megatron-core warns at import that Transformer Engine and Apex are absent, once
            # per module; the rank logs are evidence, kept to what the run did
            "PYTHONWARNINGS": "ignore::UserWarning,ignore::FutureWarning"}


def pinned_version(pin_set: str) -> str:
    """The megatron-core release pin set `pin_set` pins."""
    from lib.roots import pins
    return pins.set_pins(pins.load(), pin_set)[PIN]["version"]


def flex_refusal(version: str) -> str | None:
    """Why the flex dispatcher with DeepEP-V2 cannot run on megatron-core `version` (None when
    it can)."""
    if version in ELASTIC_BUFFER_RELEASES:
        return None
    return (f"megatron-core {version} has no DeepEP-V2 (ElasticBuffer) path behind its flex "
            "dispatcher (its deepep backend is DeepEP's legacy Buffer, which the guide gates "
            "against); the seam is NVIDIA/Megatron-LM PR #4632 (#4793 merged into dev, #5153 "
            "open), in no release up to 0.19.2")
