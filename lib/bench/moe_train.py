"""A short Megatron-core training run of a small MoE GPT whose experts are spread over the ranks.

Run one process per rank under torchrun::

    python -m torch.distributed.run --nproc-per-node=2 --master-addr 127.0.0.1 \
        --master-port 29660 -m lib.bench.moe_train --steps 5 --experts 8 --topk 2

Expert parallelism spans every rank (EP = world size; TP = PP = 1), so each MoE layer's
dispatcher sends every token routed to another rank's expert through the all-to-all and back.
The model is megatron-core's own `GPTModel` on its local layer spec (no Transformer Engine),
learned absolute positions (megatron-core's rotary path moves its frequencies to a CUDA device
unconditionally) and an explicit causal mask (its default mask is made on CUDA). CPU-only and
no-Transformer-Engine shims: lib.bench.megatron_shims.

Data: per rank and step, sequences of a fixed affine recurrence (next = (a * token + c) mod V)
from seeded random starts: learnable, so the loss falls within a few steps, and the same on
every run with the same seed. The dense parameters' gradients are averaged over the data
parallel ranks (all of them); expert parameters belong to one rank and are not reduced.

Evidence: every rank prints one JSON object per line after the prefix `LINE` (lib.measure.training
parses them): `start` (the dispatcher class it built, EP size, its experts, the shims applied),
`step` per step (loss averaged over ranks, global grad norm, tokens routed to other ranks' experts
as the router's map says, tokens the dispatcher sent to and received from other ranks as its
split sizes say, summed over the MoE layers' forward dispatches; step seconds), `efa` (the node's
RDMA write counters before and after, where the node has them) and `done`.
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import sys
import time
from pathlib import Path

LINE = "moe-train"  # every evidence line starts with this word
# moe_token_dispatcher_type's values (lib.engines.megatron.DISPATCHER_CLASSES names the class
# each builds; the rank logs the class it got, never assumes it)
DISPATCHERS = ("alltoall", "allgather", "flex")
# the EFA device's RDMA write counter (hw_counters of every port of every device of the node)
EFA_COUNTER_GLOB = "/sys/class/infiniband/*/ports/*/hw_counters/rdma_write_bytes"
RECURRENCE_A, RECURRENCE_C = 5, 3  # next = (5 * token + 3) mod vocab: a full cycle mod 2^k


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--ffn-hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--dispatcher", choices=DISPATCHERS, default="alltoall")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    return parser.parse_args(argv)


def say(kind: str, **fields) -> None:
    """One evidence line: `moe-train <kind> {json}` (flushed: a rank that dies keeps its lines)."""
    print(f"{LINE} {kind} {json.dumps(fields, sort_keys=True)}", flush=True)


def build_model(args: argparse.Namespace, device):
    import torch
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(
        num_layers=args.layers, hidden_size=args.hidden, ffn_hidden_size=args.ffn_hidden,
        num_attention_heads=args.heads, num_moe_experts=args.experts,
        moe_router_topk=args.topk, moe_token_dispatcher_type=args.dispatcher,
        moe_grouped_gemm=False, moe_aux_loss_coeff=0.0, add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
        params_dtype=torch.float32, bf16=False,
        **({"moe_flex_dispatcher_backend": "deepep"} if args.dispatcher == "flex" else {}))
    spec = get_gpt_layer_local_spec(num_experts=args.experts, moe_grouped_gemm=False)
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=args.vocab,
                     max_sequence_length=args.seq_len,
                     position_embedding_type="learned_absolute")
    return model.to(device)


def batch(args: argparse.Namespace, step: int, rank: int, device):
    """(tokens, labels, positions, causal mask) of one rank's step: the affine recurrence from
    seeded starts (seed, rank and step choose them)."""
    import torch

    generator = torch.Generator().manual_seed(args.seed * 1_000_003 + rank * 1009 + step)
    starts = torch.randint(0, args.vocab, (args.micro_batch,), generator=generator)
    seq = [starts]
    for _ in range(args.seq_len):
        seq.append((RECURRENCE_A * seq[-1] + RECURRENCE_C) % args.vocab)
    tokens = torch.stack(seq, dim=1).to(device)
    positions = torch.arange(args.seq_len, device=device).unsqueeze(0).expand(args.micro_batch, -1)
    mask = torch.triu(torch.ones(args.seq_len, args.seq_len, dtype=torch.bool, device=device),
                      diagonal=1)[None, None]
    return tokens[:, :-1], tokens[:, 1:], positions, mask


class CrossRankCounter:
    """Per step, what every MoE layer's dispatcher sent across ranks, read from the dispatcher
    itself: its routing map (the router's choice) and its all-to-all split sizes."""

    def __init__(self, model, ep_rank: int, ep_size: int):
        self.ep_rank, self.ep_size = ep_rank, ep_size
        self.dispatchers = [layer.mlp.token_dispatcher for layer in model.decoder.layers]
        self.reset()
        for dispatcher in self.dispatchers:
            self._watch(dispatcher)

    def reset(self) -> None:
        self.routed = self.sent = self.received = 0

    def _watch(self, dispatcher) -> None:
        dispatch = dispatcher.token_dispatch
        local = set(dispatcher.local_expert_indices)

        def counted(*args, **kwargs):
            routing = dispatcher.routing_map  # [tokens, experts], bool: the router's choice
            others = [e for e in range(routing.shape[1]) if e not in local]
            self.routed += int(routing[:, others].sum()) if others else 0
            if getattr(dispatcher, "input_splits", None) is not None:
                sent = [int(x) for x in dispatcher.input_splits]
                got = [int(x) for x in dispatcher.output_splits]
                self.sent += sum(sent) - sent[self.ep_rank]
                self.received += sum(got) - got[self.ep_rank]
            return dispatch(*args, **kwargs)

        dispatcher.token_dispatch = counted


def sync_grads_and_norm(model, world: int) -> float:
    """Average the dense gradients over every rank (data parallel = world here); the global
    gradient norm: dense once, every rank's expert gradients summed over the ranks."""
    import torch
    import torch.distributed as dist

    dense_sq = torch.zeros((), dtype=torch.float64)
    expert_sq = torch.zeros((), dtype=torch.float64)
    for param in model.parameters():
        if param.grad is None:
            continue
        if getattr(param, "allreduce", True):
            dist.all_reduce(param.grad)
            param.grad /= world
            dense_sq += param.grad.double().pow(2).sum().cpu()
        else:
            expert_sq += param.grad.double().pow(2).sum().cpu()
    device = next(model.parameters()).device
    expert_sq = expert_sq.to(device)
    dist.all_reduce(expert_sq)
    return math.sqrt(float(dense_sq) + float(expert_sq.cpu()))


def efa_write_bytes() -> int | None:
    """The node's RDMA write bytes over every EFA port (None where the node exposes none)."""
    paths = glob.glob(EFA_COUNTER_GLOB)
    return sum(int(Path(p).read_text().strip() or 0) for p in paths) if paths else None


def train(args: argparse.Namespace, rank: int, world: int, device) -> None:
    import torch
    import torch.distributed as dist

    model = build_model(args, device)
    counter = CrossRankCounter(model, ep_rank=rank, ep_size=world)
    say("start", rank=rank, world=world, ep_size=world, dispatcher_asked=args.dispatcher,
        dispatcher=type(counter.dispatchers[0]).__name__,
        dispatchers=sorted({type(d).__name__ for d in counter.dispatchers}),
        local_experts=list(counter.dispatchers[0].local_expert_indices),
        device=str(device), backend=args.backend, shims=args.shims)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    efa_before = efa_write_bytes()
    for step in range(args.steps):
        started = time.perf_counter()
        counter.reset()
        tokens, labels, positions, mask = batch(args, step, rank, device)
        loss = model(tokens, positions, mask, labels=labels).float().mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = sync_grads_and_norm(model, world)
        optimizer.step()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        say("step", rank=rank, step=step, loss=float(mean_loss) / world, grad_norm=grad_norm,
            routed_to_other_ranks=counter.routed, sent_to_other_ranks=counter.sent,
            received_from_other_ranks=counter.received,
            step_s=round(time.perf_counter() - started, 4))
    efa_after = efa_write_bytes()
    say("efa", rank=rank, write_bytes_before=efa_before, write_bytes_after=efa_after,
        counter=EFA_COUNTER_GLOB)
    say("done", rank=rank, steps=args.steps)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch
    import torch.distributed as dist

    from lib.bench import megatron_shims
    args.shims = megatron_shims.apply()
    from megatron.core import parallel_state

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if args.backend == "nccl":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    torch.manual_seed(args.seed)
    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=world)
    if args.backend == "nccl":
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
        model_parallel_cuda_manual_seed(args.seed)
    try:
        train(args, rank, world, device)
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
