"""MoE dispatch/combine all-to-all benchmark on torch.distributed (gloo on CPU, NCCL on GPUs).

Run one process per rank under torchrun::

    torchrun --nproc-per-node=2 -m lib.bench.moe_a2a --num-tokens 128 --out bench.json
    python -m torch.distributed.run --nproc-per-node=2 --master-addr 127.0.0.1 \
        --master-port 29650 -m lib.bench.moe_a2a --num-tokens 32 --hidden 64 --out x.json

(without torchrun it runs as a single rank, world size 1). The parameters mean what they mean in
DeepEP's tests/elastic/test_ep.py: ``--num-tokens`` per rank, ``--hidden``, ``--num-topk`` experts
per token out of ``--num-experts`` (spread evenly over the ranks).

What one rank does
------------------
* Routing, generated once from ``--seed`` and the rank (deterministic, different per rank):
  top-k of random scores, the routing weights the softmax over the k top scores.
* Layout exchange: every token goes to each rank that holds one of its experts, ONCE per rank
  (a token routed to two experts of one rank is sent one copy). Per-destination row counts travel
  by ``all_to_all_single``, then each row's routing metadata (its local expert ids, -1 where the
  expert lives elsewhere, and its k weights). The result is a cached layout, like DeepEP's handle.
* Dispatch: the token rows (bf16 on GPU, float32 on CPU) gathered with one ``index_select`` into a
  preallocated send buffer and moved with ``all_to_all_single`` using the cached split sizes.
* Expert: expert ``e`` multiplies its input by ``(e + 1) / num_experts``. The expert rank returns,
  per received row, the routing-weighted sum of its local experts' outputs: one row per token per
  rank, computed as ``x * gate`` with ``gate = sum_j w_j * (e_j + 1) / E`` over the token's local
  slots, added in slot order.
* Combine: the rows go back to their source rank (``all_to_all_single`` with the splits reversed)
  and are reduced there with one ``index_add_`` (the sum over destination ranks, in rank order).
* Correctness (never skipped): the combined output must equal a reference computed on the source
  rank without communication (the same gate function and the same reduction order): bitwise on
  CPU in float32, within bf16 tolerance otherwise. It is checked before timing and again on the
  last timed combine's output.
* ``--num-comms K`` stripes every all-to-all over K process groups (``dist.new_group`` K times
  over all ranks): tokens are cut into K contiguous chunks, each chunk's all-to-all runs on its
  own group (on GPU each issued from its own CUDA stream). The local analogue of DeepEP's
  EP_NUM_COMMS. The result is the same for every K.

Timing (the method of every number is recorded in the JSON)
-----------------------------------------------------------
Phases: ``layout`` (uncached layout exchange), ``dispatch`` and ``combine`` (cached layout),
``dispatch_combine`` (cached), ``dispatch_combine_uncached`` (layout + dispatch + combine) and
``floor``: two bare ``all_to_all_single`` on the world group moving exactly the bytes of dispatch
and combine with the same per-destination split sizes, timed in the same run the same way.

* CPU: ``time.perf_counter`` around each call, after a ``dist.barrier()`` (``perf_counter_per_call``).
* GPU: ``cuda_events_back_to_back`` - each sample is ``--b2b-calls`` back-to-back calls between one
  CUDA-event pair, divided by the count (after a barrier); this is what ``phases_us`` holds. The
  per-call figure (barrier, then one event pair around one call, which adds the ranks' skew) is
  kept beside it as ``phases_us_per_call``.

Output
------
Rank 0 prints one progress line per phase, writes ``--out`` (JSON, schema in ``result.py``'s
docstring and below) and ends with one line
``RESULT dc_p50_us=... floor_p50_us=... ratio=... gbps_per_rank=...``.
Exit codes: 0 ok; 2 bad arguments (refused before any process group starts); 4 this rank's
correctness check failed (after the JSON is written); 3 the ``--crash-rank`` test path.

Test-only fault injection
-------------------------
``--crash-rank R``: rank R exits with code 3 just before the timed loop (after the process group
and the correctness pass), so tests can show that torchrun exits non-zero and names that rank.
``--corrupt-rank R``: rank R adds 1 to its expert output, so every rank that routed tokens to R
fails its correctness check (tests the correct=false path).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

SCHEMA = "moe_a2a/1"
EXIT_OK = 0
EXIT_BAD_ARGS = 2
EXIT_CRASH_TEST = 3
EXIT_INCORRECT = 4

# DeepEP test_ep's published kernel-test shape (tests/elastic/test_ep.py).
GPU_DEFAULT_HIDDEN = 7168
CPU_DEFAULT_HIDDEN = 256
DEFAULT_TOKENS = 128
DEFAULT_TOPK = 8
DEFAULT_EXPERTS = 256

PHASES = ("layout", "dispatch", "combine", "dispatch_combine", "dispatch_combine_uncached", "floor")
METHOD_CPU = "perf_counter_per_call"
METHOD_GPU_B2B = "cuda_events_back_to_back"
METHOD_GPU_PER_CALL = "cuda_events_per_call"
# bf16 tolerance for torch.testing.assert_close (torch's own bf16 rtol, an atol for |x| ~ 1).
BF16_RTOL, BF16_ATOL = 1.6e-2, 1e-2
F32_RTOL, F32_ATOL = 1.3e-6, 1e-5


def log(msg: str, *, rank: int = 0, only_rank0: bool = True) -> None:
    if not only_rank0 or rank == 0:
        print(f"[moe_a2a] {msg}", flush=True)


# ----------------------------------------------------------------------------- arguments
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lib.bench.moe_a2a",
        description="MoE dispatch/combine all-to-all benchmark (torch.distributed; run under "
        "torchrun, one process per rank). Parameters as in DeepEP tests/elastic/test_ep.py.",
    )
    p.add_argument("--num-tokens", type=int, default=DEFAULT_TOKENS, help="tokens per rank (default 128)")
    p.add_argument("--hidden", type=int, default=None,
                   help=f"hidden size (default {GPU_DEFAULT_HIDDEN} on GPU, {CPU_DEFAULT_HIDDEN} on CPU)")
    p.add_argument("--num-topk", type=int, default=DEFAULT_TOPK, help="experts per token (default 8)")
    p.add_argument("--num-experts", type=int, default=DEFAULT_EXPERTS,
                   help="experts in all, divisible by the world size (default 256)")
    p.add_argument("--num-comms", type=int, default=1,
                   help="K process groups to stripe each all-to-all over (EP_NUM_COMMS analogue, default 1)")
    p.add_argument("--warmup", type=int, default=5, help="untimed calls per phase (default 5)")
    p.add_argument("--iters", type=int, default=20, help="timed samples per phase (default 20)")
    p.add_argument("--b2b-calls", type=int, default=10,
                   help="GPU only: back-to-back calls per CUDA-event sample (default 10)")
    p.add_argument("--seed", type=int, default=0, help="routing/data seed; rank r uses seed and r (default 0)")
    p.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto",
                   help="auto: nccl when CUDA is available, else gloo")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                   help="token dtype; auto: bfloat16 on GPU (nccl), float32 on CPU (gloo)")
    p.add_argument("--out", default=None, help="result JSON path, written by rank 0")
    p.add_argument("--crash-rank", type=int, default=None,
                   help="TEST ONLY: this rank exits with code 3 just before the timed loop")
    p.add_argument("--corrupt-rank", type=int, default=None,
                   help="TEST ONLY: this rank corrupts its expert output (correctness must fail)")
    return p


@dataclass(frozen=True)
class Config:
    num_tokens: int
    hidden: int
    num_topk: int
    num_experts: int
    num_comms: int
    world_size: int
    backend: str
    dtype: str
    device: str
    seed: int
    warmup: int
    iters: int
    b2b_calls: int
    timing_method: str
    crash_rank: int | None
    corrupt_rank: int | None
    out: str | None

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.world_size

    def public(self) -> dict:
        keys = ("num_tokens", "hidden", "num_topk", "num_experts", "num_comms", "world_size",
                "backend", "dtype", "device", "seed", "warmup", "iters", "timing_method")
        d = {k: getattr(self, k) for k in keys}
        d["b2b_calls"] = self.b2b_calls if self.device == "cuda" else None
        d["experts_per_rank"] = self.experts_per_rank
        d["layout"] = "cached (dispatch/combine/dispatch_combine); dispatch_combine_uncached includes it"
        d["floor"] = "two bare all_to_all_single on the world group, same per-destination bytes"
        d["expert"] = "expert e: y = x * (e+1)/num_experts; weighted sum over local experts on the expert rank"
        return d


def resolve_config(args: argparse.Namespace, world_size: int, cuda_available: bool) -> tuple[Config | None, list[str]]:
    """Validate the arguments (all errors at once, each naming its parameter) and fill defaults."""
    errors: list[str] = []

    def need(ok: bool, msg: str) -> None:
        if not ok:
            errors.append(msg)

    backend = args.backend
    if backend == "auto":
        backend = "nccl" if cuda_available else "gloo"
    need(not (backend == "nccl" and not cuda_available),
         "--backend nccl needs CUDA GPUs (torch.cuda.is_available() is False); allowed here: gloo, auto")
    device = "cuda" if backend == "nccl" else "cpu"
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if device == "cuda" else "float32")
    need(not (backend == "gloo" and dtype != "float32"),
         f"--dtype {dtype} is not supported with --backend gloo; allowed: float32, auto")
    hidden = args.hidden if args.hidden is not None else (GPU_DEFAULT_HIDDEN if device == "cuda" else CPU_DEFAULT_HIDDEN)

    need(args.num_tokens >= 1, f"--num-tokens must be >= 1 (tokens per rank), got {args.num_tokens}")
    need(hidden >= 1, f"--hidden must be >= 1, got {hidden}")
    need(args.num_experts >= 1, f"--num-experts must be >= 1, got {args.num_experts}")
    need(1 <= args.num_topk <= max(args.num_experts, 1),
         f"--num-topk must be between 1 and --num-experts ({args.num_experts}), got {args.num_topk}")
    need(world_size >= 1, f"world size must be >= 1 (WORLD_SIZE), got {world_size}")
    if args.num_experts >= 1 and world_size >= 1:
        need(args.num_experts % world_size == 0,
             f"--num-experts ({args.num_experts}) must be divisible by the world size ({world_size}); "
             f"allowed: multiples of {world_size}")
    need(args.num_comms >= 1, f"--num-comms must be >= 1, got {args.num_comms}")
    need(args.iters >= 1, f"--iters must be >= 1, got {args.iters}")
    need(args.warmup >= 0, f"--warmup must be >= 0, got {args.warmup}")
    need(args.b2b_calls >= 1, f"--b2b-calls must be >= 1, got {args.b2b_calls}")
    for flag, val in (("--crash-rank", args.crash_rank), ("--corrupt-rank", args.corrupt_rank)):
        if val is not None:
            need(0 <= val < max(world_size, 1),
                 f"{flag} must be a rank between 0 and {world_size - 1} (world size {world_size}), got {val}")
    if errors:
        return None, errors
    return Config(
        num_tokens=args.num_tokens, hidden=hidden, num_topk=args.num_topk, num_experts=args.num_experts,
        num_comms=args.num_comms, world_size=world_size, backend=backend, dtype=dtype, device=device,
        seed=args.seed, warmup=args.warmup, iters=args.iters, b2b_calls=args.b2b_calls,
        timing_method=METHOD_GPU_B2B if device == "cuda" else METHOD_CPU,
        crash_rank=args.crash_rank, corrupt_rank=args.corrupt_rank, out=args.out,
    ), []


# ----------------------------------------------------------------------------- routing and math
def rank_seed(seed: int, rank: int) -> int:
    """The generator seed of one rank: deterministic, different per rank."""
    return (seed * 1_000_003 + rank * 7919 + 17) % (2**63 - 1)


def make_routing(seed: int, rank: int, num_tokens: int, hidden: int, num_topk: int, num_experts: int):
    """Seeded tokens and top-k routing of one rank, on the CPU: (x float32 [T,H], topk_idx int64
    [T,k], weights float32 [T,k] = softmax over the k top scores)."""
    g = torch.Generator(device="cpu").manual_seed(rank_seed(seed, rank))
    x = torch.randn(num_tokens, hidden, generator=g, dtype=torch.float32)
    scores = torch.randn(num_tokens, num_experts, generator=g, dtype=torch.float32)
    top_scores, topk_idx = scores.topk(num_topk, dim=1)
    weights = torch.softmax(top_scores, dim=1)
    return x, topk_idx, weights


def expert_scale(expert_ids_f32: torch.Tensor, num_experts: int) -> torch.Tensor:
    """The scalar of expert e: (e + 1) / num_experts, from float32 expert ids."""
    return (expert_ids_f32 + 1.0) / float(num_experts)


def local_gate(weights: torch.Tensor, scale: torch.Tensor, is_local: torch.Tensor) -> torch.Tensor:
    """sum_j w_j * s_j over the local slots, added in slot order (bitwise reproducible: the same
    elementwise float32 ops in the same order wherever it runs)."""
    gate = torch.zeros(weights.shape[0], dtype=torch.float32, device=weights.device)
    for j in range(weights.shape[1]):
        gate = gate + torch.where(is_local[:, j], weights[:, j] * scale[:, j], 0.0)
    return gate


def apply_gate(x: torch.Tensor, gate: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """y = x * gate (per row), computed in float32 and rounded to x's dtype."""
    if x.dtype == torch.float32:
        return torch.mul(x, gate[:, None], out=out) if out is not None else x * gate[:, None]
    y = (x.float() * gate[:, None]).to(x.dtype)
    if out is not None:
        out.copy_(y)
        return out
    return y


def reference_output(x: torch.Tensor, topk_idx: torch.Tensor, weights: torch.Tensor,
                     num_experts: int, world_size: int) -> torch.Tensor:
    """The combined output computed on the source rank with no communication: for each
    destination rank in order, its weighted local-expert sum, added into a zero output."""
    e_local = num_experts // world_size
    dst = topk_idx // e_local
    scale = expert_scale(topk_idx.float(), num_experts)
    out = torch.zeros_like(x)
    for r in range(world_size):
        is_local = dst == r
        sel = is_local.any(dim=1).nonzero().squeeze(1)
        if sel.numel() == 0:
            continue
        gate = local_gate(weights[sel], scale[sel], is_local[sel])
        out.index_add_(0, sel, apply_gate(x[sel], gate))
    return out


def expected_rows_per_destination(topk_idx: torch.Tensor, num_experts: int, world_size: int) -> list[int]:
    """Rows this rank sends to each rank: one per (token, distinct destination rank)."""
    e_local = num_experts // world_size
    mask = torch.zeros(topk_idx.shape[0], world_size, dtype=torch.bool)
    mask.scatter_(1, (topk_idx // e_local).cpu(), True)
    return mask.sum(dim=0).tolist()


# ----------------------------------------------------------------------------- communication
@dataclass
class Layout:
    send_idx: torch.Tensor            # [S] token index of each send row (chunk, destination, token order)
    send_splits: list[list[int]]      # per chunk, rows to each destination
    recv_splits: list[list[int]]      # per chunk, rows from each source
    send_offs: list[int]              # row offsets of the chunks in the send buffer (K+1)
    recv_offs: list[int]              # row offsets of the chunks in the receive buffer (K+1)
    recv_meta: torch.Tensor           # [R, 2k] float32: local expert id (-1 elsewhere), weight
    layout_bytes_sent: int

    @property
    def rows_sent(self) -> int:
        return self.send_offs[-1]

    @property
    def rows_recv(self) -> int:
        return self.recv_offs[-1]

    def per_rank_totals(self, world_size: int) -> tuple[list[int], list[int]]:
        send = [sum(s[r] for s in self.send_splits) for r in range(world_size)]
        recv = [sum(s[r] for s in self.recv_splits) for r in range(world_size)]
        return send, recv


def _offsets(rows: list[int]) -> list[int]:
    offs = [0]
    for n in rows:
        offs.append(offs[-1] + n)
    return offs


class Comm:
    """K process groups over all ranks (and a CUDA stream each on GPU); one striped all-to-all."""

    def __init__(self, cfg: Config, device: torch.device):
        self.cfg = cfg
        self.device = device
        self.groups = [dist.new_group(list(range(cfg.world_size))) for _ in range(cfg.num_comms)]
        self.streams = ([torch.cuda.Stream(device=device) for _ in range(cfg.num_comms)]
                        if device.type == "cuda" and cfg.num_comms > 1 else None)

    def a2a(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[list[int]],
            in_splits: list[list[int]], out_offs: list[int], in_offs: list[int]) -> None:
        """Chunk c of ``inp`` (rows in_offs[c]:in_offs[c+1], split per rank by in_splits[c]) goes
        over group c into the same chunk of ``out``."""
        k = self.cfg.num_comms
        if k == 1:
            dist.all_to_all_single(out, inp, out_splits[0], in_splits[0], group=self.groups[0])
            return
        works = []
        cur = torch.cuda.current_stream(self.device) if self.streams else None
        for c in range(k):
            o = out[out_offs[c]:out_offs[c + 1]]
            i = inp[in_offs[c]:in_offs[c + 1]]
            if self.streams:
                s = self.streams[c]
                s.wait_stream(cur)
                with torch.cuda.stream(s):
                    works.append(dist.all_to_all_single(o, i, out_splits[c], in_splits[c],
                                                        group=self.groups[c], async_op=True))
            else:
                works.append(dist.all_to_all_single(o, i, out_splits[c], in_splits[c],
                                                    group=self.groups[c], async_op=True))
        for w in works:
            w.wait()  # on GPU: the current stream waits for each group's NCCL stream


class MoEA2A:
    """Layout, dispatch, expert and combine of one rank, with preallocated buffers."""

    def __init__(self, cfg: Config, rank: int, device: torch.device, comm: Comm,
                 x: torch.Tensor, topk_idx: torch.Tensor, weights: torch.Tensor):
        self.cfg, self.rank, self.device, self.comm = cfg, rank, device, comm
        self.x, self.topk_idx, self.weights = x, topk_idx, weights
        w, k = cfg.world_size, cfg.num_comms
        self.e_local = cfg.experts_per_rank
        bounds = torch.tensor_split(torch.arange(cfg.num_tokens), k)
        chunk_of = torch.empty(cfg.num_tokens, dtype=torch.long)
        for c, b in enumerate(bounds):
            chunk_of[b] = c
        self.chunk_of_token = chunk_of.to(device)
        self.dst = topk_idx // self.e_local                   # [T, k] destination rank per slot
        self.layout = self.build_layout()
        s, r = self.layout.rows_sent, self.layout.rows_recv
        h = cfg.hidden
        self.send_buf = torch.empty(s, h, dtype=x.dtype, device=device)
        self.recv_buf = torch.empty(r, h, dtype=x.dtype, device=device)
        self.y_buf = torch.empty(r, h, dtype=x.dtype, device=device)
        self.back_buf = torch.empty(s, h, dtype=x.dtype, device=device)
        self.out = torch.empty_like(x)
        # floor: the same per-destination bytes on the world group, one all-to-all each way
        send_tot, recv_tot = self.layout.per_rank_totals(w)
        self.floor_send_splits, self.floor_recv_splits = [send_tot], [recv_tot]
        self.floor_send = torch.ones(s, h, dtype=x.dtype, device=device)
        self.floor_recv = torch.empty(r, h, dtype=x.dtype, device=device)
        self.floor_back = torch.empty(s, h, dtype=x.dtype, device=device)

    # --- layout (uncached): routing -> send order, split sizes, metadata on the expert ranks
    def build_layout(self) -> Layout:
        cfg, dev = self.cfg, self.device
        w, kc, topk = cfg.world_size, cfg.num_comms, cfg.num_topk
        mask = torch.zeros(cfg.num_tokens, w, dtype=torch.bool, device=dev)
        mask.scatter_(1, self.dst, True)                       # one copy per destination rank
        tok, rk = mask.nonzero(as_tuple=True)                  # sorted by token, then rank
        key = self.chunk_of_token[tok] * w + rk
        order = torch.argsort(key, stable=True)                # (chunk, destination, token)
        send_tok, send_rk = tok[order], rk[order]
        counts = torch.bincount(key, minlength=kc * w)         # [K*W], index c*W + dst
        cnt_send = counts.view(kc, w).t().contiguous()         # [W, K]: what each destination gets
        cnt_recv = torch.empty_like(cnt_send)
        dist.all_to_all_single(cnt_recv, cnt_send)             # [W, K]: what each source sends
        splits = torch.cat([counts, cnt_recv.t().reshape(-1)]).tolist()   # the one host sync
        send_splits = [splits[c * w:(c + 1) * w] for c in range(kc)]
        recv_splits = [splits[kc * w + c * w: kc * w + (c + 1) * w] for c in range(kc)]
        send_offs = _offsets([sum(s) for s in send_splits])
        recv_offs = _offsets([sum(s) for s in recv_splits])
        # routing metadata per send row: local expert id on that destination (-1: elsewhere), weight
        is_local = self.dst[send_tok] == send_rk[:, None]
        local_id = torch.where(is_local, self.topk_idx[send_tok] - send_rk[:, None] * self.e_local, -1)
        meta = torch.cat([local_id.float(), self.weights[send_tok]], dim=1).contiguous()
        recv_meta = torch.empty(recv_offs[-1], 2 * topk, dtype=torch.float32, device=dev)
        self.comm.a2a(recv_meta, meta, recv_splits, send_splits, recv_offs, send_offs)
        return Layout(send_idx=send_tok, send_splits=send_splits, recv_splits=recv_splits,
                      send_offs=send_offs, recv_offs=recv_offs, recv_meta=recv_meta,
                      layout_bytes_sent=cnt_send.numel() * 8 + meta.numel() * 4)

    def dispatch(self) -> torch.Tensor:
        lay = self.layout
        torch.index_select(self.x, 0, lay.send_idx, out=self.send_buf)
        self.comm.a2a(self.recv_buf, self.send_buf, lay.recv_splits, lay.send_splits,
                      lay.recv_offs, lay.send_offs)
        return self.recv_buf

    def expert(self) -> torch.Tensor:
        """Each received row times its gate: the weighted sum of this rank's local experts."""
        topk = self.cfg.num_topk
        meta = self.layout.recv_meta
        local_id, w = meta[:, :topk], meta[:, topk:]
        scale = expert_scale(local_id + float(self.rank * self.e_local), self.cfg.num_experts)
        gate = local_gate(w, scale, local_id >= 0)
        apply_gate(self.recv_buf, gate, out=self.y_buf)
        if self.cfg.corrupt_rank == self.rank:
            self.y_buf.add_(1.0)
        return self.y_buf

    def combine(self) -> torch.Tensor:
        lay = self.layout
        self.comm.a2a(self.back_buf, self.y_buf, lay.send_splits, lay.recv_splits,
                      lay.send_offs, lay.recv_offs)
        self.out.zero_()
        self.out.index_add_(0, lay.send_idx, self.back_buf)   # the sum over ranks, one op
        return self.out

    def dispatch_combine(self) -> torch.Tensor:
        self.dispatch()
        return self.combine()

    def dispatch_combine_uncached(self) -> torch.Tensor:
        self.layout = self.build_layout()
        return self.dispatch_combine()

    def relayout(self) -> None:
        self.layout = self.build_layout()

    def floor(self) -> None:
        s, r = self.floor_send_splits, self.floor_recv_splits
        dist.all_to_all_single(self.floor_recv, self.floor_send, r[0], s[0])
        dist.all_to_all_single(self.floor_back, self.floor_recv, s[0], r[0])


# ----------------------------------------------------------------------------- timing and stats
def stats(samples: list[float], method: str) -> dict:
    a = np.asarray(samples, dtype=np.float64)
    if a.size == 0:
        return {"p50": None, "p99": None, "mean": None, "min": None, "max": None, "n": 0, "method": method}
    return {"p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99)),
            "mean": float(a.mean()), "min": float(a.min()), "max": float(a.max()),
            "n": int(a.size), "method": method}


class Timer:
    def __init__(self, cfg: Config, device: torch.device):
        self.cfg, self.device = cfg, device
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def barrier(self) -> None:
        if self.cuda:
            dist.barrier(device_ids=[self.device.index])
        else:
            dist.barrier()
        self.sync()

    def run(self, fn) -> tuple[list[float], list[float] | None]:
        """(primary samples in us, per-call samples in us on GPU else None)."""
        for _ in range(self.cfg.warmup):
            fn()
        self.sync()
        per_call: list[float] = []
        for _ in range(self.cfg.iters):
            self.barrier()
            if self.cuda:
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                fn()
                e1.record()
                e1.synchronize()
                per_call.append(e0.elapsed_time(e1) * 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                per_call.append((time.perf_counter() - t0) * 1e6)
        if not self.cuda:
            return per_call, None
        b2b: list[float] = []
        n = self.cfg.b2b_calls
        for _ in range(self.cfg.iters):
            self.barrier()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            for _ in range(n):
                fn()
            e1.record()
            e1.synchronize()
            b2b.append(e0.elapsed_time(e1) * 1e3 / n)
        return b2b, per_call


# ----------------------------------------------------------------------------- correctness
def check_output(out: torch.Tensor, ref: torch.Tensor, exact: bool) -> tuple[bool, float, str]:
    err = float((out.float() - ref.float()).abs().max().item()) if out.numel() else 0.0
    if exact:
        return bool(torch.equal(out, ref)), err, "exact (torch.equal)"
    rtol, atol = (BF16_RTOL, BF16_ATOL) if out.dtype == torch.bfloat16 else (F32_RTOL, F32_ATOL)
    how = f"torch.testing.assert_close(rtol={rtol}, atol={atol})"
    try:
        torch.testing.assert_close(out, ref, rtol=rtol, atol=atol)
        return True, err, how
    except AssertionError:
        return False, err, how


# ----------------------------------------------------------------------------- aggregation
def aggregate(cfg: Config, ranks: list[dict]) -> dict:
    """The rank-0 summary from every rank's result (pure)."""
    def pooled(key: str, phase: str, method: str) -> dict:
        samples = [s for r in ranks for s in (r.get(key) or {}).get(phase, [])]
        return stats(samples, method)

    phases = {p: pooled("samples_us", p, cfg.timing_method) for p in PHASES if p != "floor"}
    floor = pooled("samples_us", "floor", cfg.timing_method)
    res: dict = {"phases_us": phases, "floor_us": floor}
    if cfg.device == "cuda":
        res["phases_us_per_call"] = {p: pooled("samples_per_call_us", p, METHOD_GPU_PER_CALL) for p in PHASES}
    moved = [r["bytes"]["dispatch_sent"] + r["bytes"]["combine_sent"] for r in ranks]
    dc = phases["dispatch_combine"]["p50"]
    res["bytes_per_rank_mean"] = float(np.mean(moved)) if moved else 0.0
    res["gbps_per_rank"] = (res["bytes_per_rank_mean"] / (dc * 1e-6) / 1e9) if dc else None
    res["dc_over_floor"] = (dc / floor["p50"]) if dc and floor["p50"] else None
    res["correct"] = bool(ranks) and all(r["correct"] for r in ranks)
    return res


def write_json(path: str, obj: dict) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")
    os.replace(tmp, p)


# ----------------------------------------------------------------------------- main
def init_distributed(cfg: Config, rank: int, local_rank: int) -> torch.device:
    device = torch.device("cuda", local_rank) if cfg.device == "cuda" else torch.device("cpu")
    if cfg.device == "cuda":
        torch.cuda.set_device(device)
    if "MASTER_ADDR" in os.environ and "RANK" in os.environ:
        kw = {"device_id": device} if cfg.device == "cuda" else {}
        dist.init_process_group(cfg.backend, **kw)
    else:  # plain `python -m lib.bench.moe_a2a`: one rank, in-process store
        dist.init_process_group(cfg.backend, store=dist.HashStore(), rank=0, world_size=1)
    return device


def run_rank(cfg: Config, rank: int, device: torch.device) -> tuple[dict, int]:
    dtype = getattr(torch, cfg.dtype)
    x32, topk_idx, weights = make_routing(cfg.seed, rank, cfg.num_tokens, cfg.hidden, cfg.num_topk, cfg.num_experts)
    x = x32.to(dtype).to(device)
    topk_idx, weights = topk_idx.to(device), weights.to(device)
    exact = cfg.device == "cpu" and dtype == torch.float32
    ref = reference_output(x, topk_idx, weights, cfg.num_experts, cfg.world_size)

    comm = Comm(cfg, device)
    moe = MoEA2A(cfg, rank, device, comm, x, topk_idx, weights)
    log(f"layout: rank 0 sends {moe.layout.rows_sent} rows, receives {moe.layout.rows_recv} "
        f"(world {cfg.world_size}, {cfg.num_comms} comm(s), {cfg.backend}, {cfg.dtype})", rank=rank)

    # correctness pass (never skipped): dispatch -> expert -> combine vs the local reference
    moe.dispatch()
    moe.expert()
    out = moe.combine()
    ok1, err1, how = check_output(out, ref, exact)
    recv_snapshot = moe.recv_buf.clone()
    log(f"correctness (before timing): {'ok' if ok1 else 'FAILED'} on rank 0, max_abs_err={err1:.3g}, {how}",
        rank=rank)

    if cfg.crash_rank == rank:
        print(f"[moe_a2a] rank {rank}: --crash-rank {rank}: exiting with code {EXIT_CRASH_TEST} "
              "before the timed loop (test fault path)", file=sys.stderr, flush=True)
        os._exit(EXIT_CRASH_TEST)

    timer = Timer(cfg, device)
    fns = {"layout": moe.relayout, "dispatch": moe.dispatch, "combine": moe.combine,
           "dispatch_combine": moe.dispatch_combine,
           "dispatch_combine_uncached": moe.dispatch_combine_uncached, "floor": moe.floor}
    samples, per_call = {}, {}
    for phase in PHASES:
        samples[phase], pc = timer.run(fns[phase])
        if pc is not None:
            per_call[phase] = pc
        st = stats(samples[phase], cfg.timing_method)
        log(f"phase {phase}: p50 {st['p50']:.1f} us  p99 {st['p99']:.1f} us  (rank 0, n={st['n']}, "
            f"{cfg.timing_method})", rank=rank)

    # correctness again, on what the timed loop left (last combine; last dispatch)
    timer.sync()
    ok2, err2, _ = check_output(moe.out, ref, exact)
    ok3 = bool(torch.equal(moe.recv_buf, recv_snapshot))
    correct = ok1 and ok2 and ok3
    lay = moe.layout
    elt = torch.empty((), dtype=dtype).element_size()
    send_tot, recv_tot = lay.per_rank_totals(cfg.world_size)
    result = {
        "rank": rank,
        "phases_us": {p: stats(samples[p], cfg.timing_method) for p in PHASES if p != "floor"},
        "floor_us": stats(samples["floor"], cfg.timing_method),
        "bytes": {
            "dispatch_sent": lay.rows_sent * cfg.hidden * elt,
            "combine_sent": lay.rows_recv * cfg.hidden * elt,
            "layout_sent": lay.layout_bytes_sent,
            "dispatch_rows_sent": lay.rows_sent,
            "dispatch_rows_per_destination": send_tot,
            "dispatch_rows_per_source": recv_tot,
        },
        "correct": correct,
        "max_abs_err": max(err1, err2),
        "check": {"method": how, "before_timing": ok1, "after_timing": ok2, "dispatch_stable": ok3},
        "samples_us": samples,
    }
    if per_call:
        result["phases_us_per_call"] = {p: stats(per_call[p], METHOD_GPU_PER_CALL) for p in PHASES}
        result["samples_per_call_us"] = per_call
    return result, (EXIT_OK if correct else EXIT_INCORRECT)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cfg, errors = resolve_config(args, world_size, torch.cuda.is_available())
    if errors:  # refused before any process group starts
        for e in errors:
            print(f"lib.bench.moe_a2a: error: {e}", file=sys.stderr, flush=True)
        return EXIT_BAD_ARGS
    device = init_distributed(cfg, rank, local_rank)
    try:
        result, rc = run_rank(cfg, rank, device)
        gathered: list = [None] * cfg.world_size
        dist.all_gather_object(gathered, result)
        if rank == 0:
            summary = {"schema": SCHEMA, "config": cfg.public()}
            summary["ranks"] = [{k: v for k, v in r.items() if k not in ("samples_us", "samples_per_call_us")}
                                for r in gathered]
            summary.update(aggregate(cfg, gathered))
            summary["samples_us"] = {str(r["rank"]): r["samples_us"] for r in gathered}
            if cfg.out:
                write_json(cfg.out, summary)
                log(f"wrote {cfg.out}")
            bad = [r["rank"] for r in gathered if not r["correct"]]
            log(f"correctness: {'ok on all ranks' if not bad else f'FAILED on rank(s) {bad}'}")
            dc, fl = summary["phases_us"]["dispatch_combine"]["p50"], summary["floor_us"]["p50"]
            print(f"RESULT dc_p50_us={dc:.2f} floor_p50_us={fl:.2f} ratio={summary['dc_over_floor']:.3f} "
                  f"gbps_per_rank={summary['gbps_per_rank']:.3f}", flush=True)
        dist.barrier()  # the JSON is on disk before any rank exits (a failing exit ends the job)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if rc == EXIT_INCORRECT:
        print(f"[moe_a2a] rank {rank}: correctness check FAILED (exit {EXIT_INCORRECT})", file=sys.stderr, flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
