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
* Combine: the rows go back to their source rank (``all_to_all_single`` with the splits reversed);
  there one cached ``index_select`` lays them out token-major ([T, min(k, W), H] in rank order,
  empty slots naming a zero row) and one ``sum`` reduces over the destination ranks: no atomics,
  fp32 accumulation for bf16, the same result on every run. ``--combine gather_sum`` (auto's
  pick where Triton runs, i.e. CUDA) does both in one Triton kernel straight into the output,
  float32 adds in slot order (``lib/bench/gather_sum.py``); the result names the one used.
* Correctness (never skipped): the combined output must equal a reference computed on the source
  rank without communication (the same gate function and the same reduction): checked bitwise
  (torch.equal) on CPU in float32, with torch.testing.assert_close at bf16 tolerance on GPU
  (measured exact there too). It is checked before timing and again after every timed phase that
  leaves an output behind (graph replays included); dispatch's received rows must not change.
* ``--num-comms K`` stripes every all-to-all over K process groups (``dist.new_group`` K times
  over all ranks): tokens are cut into K contiguous chunks, each chunk's all-to-all runs on its
  own group (on GPU each issued from its own CUDA stream). The local analogue of DeepEP's
  EP_NUM_COMMS. The result is the same for every K.

Timing (the method of every number is recorded in the JSON)
-----------------------------------------------------------
Phases: ``layout`` (uncached layout exchange), ``dispatch`` and ``combine`` (cached layout),
``dispatch_combine`` (cached), ``dispatch_combine_uncached`` (layout + dispatch + combine) and
``floor``: two bare ``all_to_all_single`` on one communicator (the first of the K groups) moving
exactly the bytes of dispatch and combine with the same per-destination split sizes, timed in the
same run the same way.

* CPU: ``time.perf_counter`` around each call, after a ``dist.barrier()`` (``perf_counter_per_call``).
* GPU: ``cuda_events_back_to_back`` - each sample is ``--b2b-calls`` back-to-back calls between one
  CUDA-event pair, divided by the count (after a barrier); this is what ``phases_us`` holds. The
  per-call figure (barrier, then one event pair around one call, which adds the ranks' skew) is
  kept beside it as ``phases_us_per_call``. With ``--cuda-graphs`` (default on GPU) the phases
  without a host sync (dispatch, combine, dispatch_combine, floor) are captured once into a CUDA
  graph and each call is a replay (methods ``cuda_graph_back_to_back`` / ``cuda_graph_per_call``);
  the floor is timed the same way, so the ratio compares like with like. A failed capture is
  recorded (``methods[phase].graph_error``) and the phase is timed eagerly.

Measured on 2x H200 (torch 2.11, NCCL 2.28.9), graphs on, K=1, back to back: test_ep's shape
(128 tokens) D+C 54.2 us vs floor 41.6 us (1.30x); 4096 tokens 691.7 vs 446.9 us (1.55x, the
combine's gather + sum is the gap). Eager (--cuda-graphs off) 128 tokens: 154.9 vs 86.8 us (1.78x,
launch-bound). K=8: 122.1 vs 55.0 us at 128 tokens, 654.8 vs 445.4 us at 4096.

Output
------
Rank 0 prints one progress line per phase, writes ``--out`` (JSON, schema in ``result.py``'s
docstring and below) and ends with one line
``RESULT dc_p50_us=... floor_p50_us=... ratio=... gbps_per_rank=... combine=...``.

Which NCCL moved the bytes: ``torch.cuda.nccl.version()`` reports only the NCCL torch was built
against, while a site folder first on PYTHONPATH or an LD_PRELOAD of another ``libnccl.so.2`` can
put a different library under the same collectives. So each rank reads ``/proc/self/maps`` after
the process group is initialised and its first collectives have run (NCCL is loaded by then) and
records ``ranks[i].nccl_loaded = {libraries, torch_build_version}``: ``libraries`` the sorted
paths of the mapped files whose basename starts with ``libnccl`` (the library and any plugin,
``libnccl-net.so`` included), ``None`` where the maps cannot be read (not Linux);
``torch_build_version`` the build-time version as a string (``"2.28.9"``) when CUDA is available,
else ``None``. The top level holds ``nccl_loaded = {libraries (the union over ranks),
torch_build_version (rank 0's), same_on_every_rank, source}``. On CPU with gloo and a CPU-only
torch the list is empty: gloo loads no NCCL. (A CUDA torch wheel normally links ``libnccl.so.2``
dynamically, so there it is listed even under gloo; an empty list on a NCCL run means NCCL came
linked into another library, as in a torch built with static NCCL.)
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
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from lib.bench import gather_sum as gather_sum_kernel

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

COMBINE_CHOICES = ("auto", "gather_sum", "index_select_sum")
PHASES = ("layout", "dispatch", "combine", "dispatch_combine", "dispatch_combine_uncached", "floor")
METHOD_CPU = "perf_counter_per_call"
METHOD_GPU_B2B = "cuda_events_back_to_back"
METHOD_GPU_PER_CALL = "cuda_events_per_call"
METHOD_GRAPH_B2B = "cuda_graph_back_to_back"
METHOD_GRAPH_PER_CALL = "cuda_graph_per_call"
# phases without a host sync: captured into a CUDA graph on GPU (unless --cuda-graphs off)
CAPTURABLE = ("dispatch", "combine", "dispatch_combine", "floor")
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
    p.add_argument("--cuda-graphs", choices=("auto", "on", "off"), default="auto",
                   help="GPU: time dispatch, combine, dispatch+combine and the floor as CUDA-graph "
                   "replays (launch overhead out of the figure); auto: on with nccl")
    p.add_argument("--combine", choices=COMBINE_CHOICES, default="auto",
                   help="the combine's gather + sum: gather_sum (one Triton kernel, "
                   "lib/bench/gather_sum.py) or index_select_sum (two torch kernels); auto: "
                   "gather_sum where Triton runs (CUDA), else index_select_sum, and "
                   "index_select_sum if the kernel fails (recorded)")
    p.add_argument("--out", default=None, help="result JSON path, written by rank 0")
    p.add_argument("--crash-rank", type=int, default=None,
                   help="TEST ONLY: this rank exits with code 3 just before the timed loop")
    p.add_argument("--corrupt-rank", type=int, default=None,
                   help="TEST ONLY: this rank corrupts its expert output (correctness must fail)")
    p.add_argument("--fail-gather-sum-rank", type=int, default=None,
                   help="TEST ONLY: on this rank the first gather_sum combine fails after its "
                   "all-to-all (with --combine auto it falls back alone, no collective repeated)")
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
    cuda_graphs: bool
    timing_method: str
    combine: str  # as asked: auto, gather_sum or index_select_sum
    crash_rank: int | None
    corrupt_rank: int | None
    fail_gather_sum_rank: int | None
    out: str | None

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.world_size

    def public(self) -> dict:
        keys = ("num_tokens", "hidden", "num_topk", "num_experts", "num_comms", "world_size",
                "backend", "dtype", "device", "seed", "warmup", "iters", "timing_method")
        d = {k: getattr(self, k) for k in keys}
        d["b2b_calls"] = self.b2b_calls if self.device == "cuda" else None
        d["cuda_graphs"] = self.cuda_graphs
        d["combine_asked"] = self.combine
        d["experts_per_rank"] = self.experts_per_rank
        d["layout"] = "cached (dispatch/combine/dispatch_combine); dispatch_combine_uncached includes it"
        d["floor"] = "two bare all_to_all_single on one group, same per-destination bytes"
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
    need(not (args.cuda_graphs == "on" and device != "cuda"),
         "--cuda-graphs on needs --backend nccl (CUDA); allowed with gloo: off, auto")
    for flag, val in (("--crash-rank", args.crash_rank), ("--corrupt-rank", args.corrupt_rank),
                      ("--fail-gather-sum-rank", args.fail_gather_sum_rank)):
        if val is not None:
            need(0 <= val < max(world_size, 1),
                 f"{flag} must be a rank between 0 and {world_size - 1} (world size {world_size}), got {val}")
    if args.combine == "gather_sum":
        why_not = gather_sum_kernel.available(torch.device(device))
        need(why_not is None, f"--combine gather_sum cannot run here ({why_not}); allowed: auto, "
                              "index_select_sum")
    if errors:
        return None, errors
    return Config(
        num_tokens=args.num_tokens, hidden=hidden, num_topk=args.num_topk, num_experts=args.num_experts,
        num_comms=args.num_comms, world_size=world_size, backend=backend, dtype=dtype, device=device,
        seed=args.seed, warmup=args.warmup, iters=args.iters, b2b_calls=args.b2b_calls,
        cuda_graphs=device == "cuda" and args.cuda_graphs != "off",
        timing_method=METHOD_GPU_B2B if device == "cuda" else METHOD_CPU,
        combine=args.combine, crash_rank=args.crash_rank, corrupt_rank=args.corrupt_rank,
        fail_gather_sum_rank=args.fail_gather_sum_rank, out=args.out,
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


def destination_mask(dst: torch.Tensor, world_size: int) -> torch.Tensor:
    """[T, W] bool: token t has at least one expert on rank r (it is sent there once)."""
    mask = torch.zeros(dst.shape[0], world_size, dtype=torch.bool, device=dst.device)
    return mask.scatter_(1, dst, True)


def destination_slots(mask: torch.Tensor) -> torch.Tensor:
    """[T, W]: the slot of (token, rank) among the token's destination ranks, in rank order."""
    return torch.cumsum(mask.long(), dim=1) - 1


def num_slots(num_topk: int, world_size: int) -> int:
    """Most destination ranks one token can have."""
    return min(num_topk, world_size)


def reduce_slots(slots: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """[T, m, H] per-destination contributions (rank order, zero-padded) -> [T, H]: the sum over
    destination ranks in one reduction (no atomics; fp32 accumulation for bf16). The combine and
    the reference both call it on identically laid-out tensors, so float32 results agree bitwise.
    (A fused embedding_bag gather-and-sum measured slower on H200 at hidden 7168: 660 vs 413 us
    for the combine at 4096 tokens.)"""
    return torch.sum(slots, dim=1, out=out) if out is not None else torch.sum(slots, dim=1)


def reference_output(x: torch.Tensor, topk_idx: torch.Tensor, weights: torch.Tensor,
                     num_experts: int, world_size: int) -> torch.Tensor:
    """The combined output computed on the source rank with no communication: each destination
    rank's weighted local-expert sum in its slot, then the same reduction as the combine."""
    e_local = num_experts // world_size
    dst = topk_idx // e_local
    scale = expert_scale(topk_idx.float(), num_experts)
    mask = destination_mask(dst, world_size)
    slot = destination_slots(mask)
    contrib = torch.zeros(x.shape[0], num_slots(topk_idx.shape[1], world_size), x.shape[1],
                          dtype=x.dtype, device=x.device)
    for r in range(world_size):
        sel = mask[:, r].nonzero().squeeze(1)
        if sel.numel() == 0:
            continue
        gate = local_gate(weights[sel], scale[sel], dst[sel] == r)
        contrib[sel, slot[sel, r]] = apply_gate(x[sel], gate)
    return reduce_slots(contrib)


# ----------------------------------------------------------------------------- communication
@dataclass
class Layout:
    send_idx: torch.Tensor            # [S] token index of each send row (chunk, destination, token order)
    send_splits: list[list[int]]      # per chunk, rows to each destination
    recv_splits: list[list[int]]      # per chunk, rows from each source
    send_offs: list[int]              # row offsets of the chunks in the send buffer (K+1)
    recv_offs: list[int]              # row offsets of the chunks in the receive buffer (K+1)
    recv_meta: torch.Tensor           # [R, 2k] float32: local expert id (-1 elsewhere), weight
    combine_pos: torch.Tensor         # [T*m] row of each (token, destination slot) in the
                                      # returned buffer; S (a zero row) where the slot is empty
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
        if self.streams:
            for s in self.streams:  # join the side streams (required under CUDA-graph capture)
                cur.wait_stream(s)


def choose_combine(asked: str, device: torch.device) -> str:
    """The combine implementation for `asked` (auto, gather_sum, index_select_sum) here."""
    if asked == "auto":
        return "gather_sum" if gather_sum_kernel.available(device) is None else "index_select_sum"
    return asked


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
        # the returned rows, plus one zero row (index S) that empty destination slots name
        self.back_ext = torch.zeros(s + 1, h, dtype=x.dtype, device=device)
        self.back_buf = self.back_ext[:s]
        self.m = num_slots(cfg.num_topk, w)
        self.slots_buf = torch.empty(cfg.num_tokens * self.m, h, dtype=x.dtype, device=device)
        self.out = torch.empty_like(x)
        self.combine_impl = choose_combine(cfg.combine, device)
        # floor: the same per-destination bytes on one communicator, one all-to-all each way
        send_tot, recv_tot = self.layout.per_rank_totals(w)
        self.floor_send_splits, self.floor_recv_splits = [send_tot], [recv_tot]
        self.floor_send = torch.ones(s, h, dtype=x.dtype, device=device)
        self.floor_recv = torch.empty(r, h, dtype=x.dtype, device=device)
        self.floor_back = torch.empty(s, h, dtype=x.dtype, device=device)

    # --- layout (uncached): routing -> send order, split sizes, metadata on the expert ranks
    def build_layout(self) -> Layout:
        cfg, dev = self.cfg, self.device
        w, kc, topk = cfg.world_size, cfg.num_comms, cfg.num_topk
        mask = destination_mask(self.dst, w)                   # one copy per destination rank
        tok, rk = mask.nonzero(as_tuple=True)                  # sorted by token, then rank
        key = self.chunk_of_token[tok] * w + rk
        order = torch.argsort(key, stable=True)                # (chunk, destination, token)
        send_tok, send_rk = tok[order], rk[order]
        send_slot = destination_slots(mask)[send_tok, send_rk]
        combine_pos = torch.full((cfg.num_tokens, num_slots(topk, w)), send_tok.numel(),
                                 dtype=torch.long, device=dev)
        combine_pos[send_tok, send_slot] = torch.arange(send_tok.numel(), device=dev)
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
                      combine_pos=combine_pos.view(-1),
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
        return self.combine_reduce()

    def combine_reduce(self) -> torch.Tensor:
        """The returned rows, token-major and summed over the destination ranks (no
        communication: a fallback can redo it without a rank-unmatched collective)."""
        lay = self.layout
        if self.combine_impl == "gather_sum":  # both steps in one kernel, straight into out
            return gather_sum_kernel.gather_sum(self.back_ext, lay.combine_pos, self.m, self.out)
        # token-major slots of the returned rows (one cached gather), then the sum over ranks
        torch.index_select(self.back_ext, 0, lay.combine_pos, out=self.slots_buf)
        return reduce_slots(self.slots_buf.view(self.cfg.num_tokens, self.m, self.cfg.hidden), out=self.out)

    def dispatch_combine(self) -> torch.Tensor:
        self.dispatch()
        return self.combine()

    def dispatch_combine_uncached(self) -> torch.Tensor:
        self.layout = self.build_layout()
        return self.dispatch_combine()

    def relayout(self) -> None:
        self.layout = self.build_layout()

    def floor(self) -> None:
        """Two bare all-to-alls on the first group (the communicator dispatch uses at K=1)."""
        s, r, g = self.floor_send_splits, self.floor_recv_splits, self.comm.groups[0]
        dist.all_to_all_single(self.floor_recv, self.floor_send, r[0], s[0], group=g)
        dist.all_to_all_single(self.floor_back, self.floor_recv, s[0], r[0], group=g)


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

    def _events_us(self, fn, calls: int) -> float:
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(calls):
            fn()
        e1.record()
        e1.synchronize()
        return e0.elapsed_time(e1) * 1e3 / calls

    def capture(self, fn):
        """fn captured into a CUDA graph (after its eager warmup); returns the replay callable."""
        self.sync()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            fn()
        self.sync()
        return graph

    def run(self, fn, capturable: bool) -> dict:
        """Warm up, then time fn. CPU: perf_counter per call after a barrier. GPU: per call and
        back to back between CUDA events, as graph replays when capturable and enabled.
        Returns {samples, per_call, method, per_call_method, graph_error}."""
        for _ in range(self.cfg.warmup):
            fn()
        self.sync()
        if not self.cuda:
            per_call = []
            for _ in range(self.cfg.iters):
                self.barrier()
                t0 = time.perf_counter()
                fn()
                per_call.append((time.perf_counter() - t0) * 1e6)
            return {"samples": per_call, "per_call": None, "method": METHOD_CPU,
                    "per_call_method": None, "graph_error": None}
        call, graph, graph_error = fn, None, None
        if capturable and self.cfg.cuda_graphs:
            try:
                graph = self.capture(fn)
                call = graph.replay
            except Exception as e:  # noqa: BLE001 - recorded, then timed eagerly
                graph_error = f"{type(e).__name__}: {e}"[:500]
                self.sync()
        per_call = []
        for _ in range(self.cfg.iters):
            self.barrier()
            per_call.append(self._events_us(call, 1))
        b2b = []
        for _ in range(self.cfg.iters):
            self.barrier()
            b2b.append(self._events_us(call, self.cfg.b2b_calls))
        del graph
        return {"samples": b2b, "per_call": per_call,
                "method": METHOD_GRAPH_B2B if call is not fn else METHOD_GPU_B2B,
                "per_call_method": METHOD_GRAPH_PER_CALL if call is not fn else METHOD_GPU_PER_CALL,
                "graph_error": graph_error}


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


# ----------------------------------------------------------------------------- NCCL evidence
PROC_MAPS = "/proc/self/maps"
NCCL_PREFIX = "libnccl"
_DELETED = " (deleted)"


def nccl_libraries_from_maps(text: str) -> list[str]:
    """The sorted, distinct paths of the mapped files in ``/proc/<pid>/maps`` text whose basename
    starts with ``libnccl``: the NCCL library itself (``libnccl.so.2``, ``libnccl.so.2.28.9``) and
    its plugins (``libnccl-net.so``, ``libnccl-tuner.so``...), so a net plugin shows too. Lines
    without a path (anonymous mappings) and pseudo-paths (``[heap]``, ``[vdso]``) are skipped; a
    path is kept as written (a `` (deleted)`` suffix, file replaced on disk, stays visible)."""
    found: set[str] = set()
    for line in (text or "").splitlines():
        # address perms offset dev inode [path]; the path may itself contain spaces
        parts = line.split(None, 5)
        if len(parts) < 6:
            continue
        path = parts[5].strip()
        if not path.startswith("/"):
            continue
        name = path[:-len(_DELETED)] if path.endswith(_DELETED) else path
        if os.path.basename(name).startswith(NCCL_PREFIX):
            found.add(path)
    return sorted(found)


def torch_nccl_build_version() -> str | None:
    """``torch.cuda.nccl.version()`` as ``"2.28.9"`` when CUDA is available, else None. This is
    the NCCL torch was BUILT against, not necessarily the one loaded (see ``nccl_loaded``)."""
    try:
        if not torch.cuda.is_available():
            return None
        v = torch.cuda.nccl.version()
    except Exception:  # noqa: BLE001 - a torch without NCCL support: unknown, never a crash
        return None
    return ".".join(str(x) for x in v) if isinstance(v, (tuple, list)) else str(v)


def nccl_loaded(maps_path: str = PROC_MAPS) -> dict:
    """This process's NCCL evidence: {libraries: the libnccl* files mapped now (None where
    ``maps_path`` cannot be read, e.g. not Linux), torch_build_version}. Call it after the
    process group is initialised and a collective has run, so that NCCL is loaded."""
    try:
        libraries = nccl_libraries_from_maps(Path(maps_path).read_text(errors="replace"))
    except OSError:
        libraries = None
    return {"libraries": libraries, "torch_build_version": torch_nccl_build_version()}


def aggregate_nccl_loaded(per_rank: list[dict | None]) -> dict:
    """Every rank's ``nccl_loaded`` -> {libraries: sorted union over the ranks that could read
    their maps (None when none could), torch_build_version: rank 0's, same_on_every_rank: every
    rank reported the same libraries and build version}."""
    entries = [e or {"libraries": None, "torch_build_version": None} for e in per_rank]
    readable = [e["libraries"] for e in entries if e.get("libraries") is not None]
    libraries = sorted({p for libs in readable for p in libs}) if readable else None
    keys = {(None if e.get("libraries") is None else tuple(e["libraries"]), e.get("torch_build_version"))
            for e in entries}
    return {"libraries": libraries,
            "torch_build_version": entries[0].get("torch_build_version") if entries else None,
            "same_on_every_rank": len(keys) <= 1,
            "source": f"{PROC_MAPS} of each rank after init_process_group and the first collectives"}


# ----------------------------------------------------------------------------- aggregation
def aggregate(cfg: Config, ranks: list[dict]) -> dict:
    """The rank-0 summary from every rank's result (pure)."""
    def pooled(key: str, phase: str, method_key: str) -> dict:
        samples = [s for r in ranks for s in (r.get(key) or {}).get(phase, [])]
        methods = sorted({(r.get("methods") or {}).get(phase, {}).get(method_key) for r in ranks} - {None})
        return stats(samples, "+".join(methods) or cfg.timing_method)

    phases = {p: pooled("samples_us", p, "method") for p in PHASES if p != "floor"}
    floor = pooled("samples_us", "floor", "method")
    res: dict = {"phases_us": phases, "floor_us": floor}
    if cfg.device == "cuda":
        res["phases_us_per_call"] = {p: pooled("samples_per_call_us", p, "per_call_method") for p in PHASES}
    moved = [r["bytes"]["dispatch_sent"] + r["bytes"]["combine_sent"] for r in ranks]
    dc = phases["dispatch_combine"]["p50"]
    res["bytes_per_rank_mean"] = float(np.mean(moved)) if moved else 0.0
    res["gbps_per_rank"] = (res["bytes_per_rank_mean"] / (dc * 1e-6) / 1e9) if dc else None
    res["dc_over_floor"] = (dc / floor["p50"]) if dc and floor["p50"] else None
    res["correct"] = bool(ranks) and all(r["correct"] for r in ranks)
    res["nccl_loaded"] = aggregate_nccl_loaded([r.get("nccl_loaded") for r in ranks])
    # which combine produced the timed figures (a rank that fell back says why)
    impls = sorted({(r.get("combine") or {}).get("impl") or "index_select_sum" for r in ranks})
    res["combine_impl"] = impls[0] if len(impls) == 1 else "mixed: " + ", ".join(impls)
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


def correctness_combine(cfg: Config, rank: int, moe: MoEA2A) -> tuple[torch.Tensor, str | None]:
    """The first combine, checked before timing: (its output, why gather_sum fell back or None).
    Under ``--combine auto`` a failing gather_sum falls back to index_select_sum and the result
    says so; asked for by name, its failure is the run's."""
    combine_fallback = None
    try:
        out = moe.combine()
        if cfg.fail_gather_sum_rank == rank and moe.combine_impl == "gather_sum":
            raise RuntimeError(f"--fail-gather-sum-rank {rank} (test fault path)")
    except Exception as e:  # noqa: BLE001 - auto falls back, and the result says so
        if not (cfg.combine == "auto" and moe.combine_impl == "gather_sum"):
            raise
        combine_fallback = f"gather_sum failed, index_select_sum used: {type(e).__name__}: {e}"[:500]
        moe.combine_impl = "index_select_sum"
        out = moe.combine_reduce()  # the rows are back already: no second all-to-all
    log(f"combine: {moe.combine_impl}" + (f" ({combine_fallback})" if combine_fallback else ""),
        rank=rank)
    return out, combine_fallback


def time_phases(cfg: Config, rank: int, device: torch.device, moe: MoEA2A, ref: torch.Tensor,
                exact: bool, recv_snapshot: torch.Tensor, checks: dict,
                errs: list[float]) -> tuple[dict, dict, dict]:
    """Time every phase; after each, check what its loop left behind (into ``checks`` and
    ``errs``). Returns (samples, per_call samples, methods), by phase."""
    timer = Timer(cfg, device)
    fns = {"layout": moe.relayout, "dispatch": moe.dispatch, "combine": moe.combine,
           "dispatch_combine": moe.dispatch_combine,
           "dispatch_combine_uncached": moe.dispatch_combine_uncached, "floor": moe.floor}
    samples, per_call, methods = {}, {}, {}
    for phase in PHASES:
        r = timer.run(fns[phase], capturable=phase in CAPTURABLE)
        samples[phase] = r["samples"]
        methods[phase] = {"method": r["method"], "per_call_method": r["per_call_method"]}
        if r["graph_error"]:
            methods[phase]["graph_error"] = r["graph_error"]
            log(f"phase {phase}: CUDA-graph capture failed ({r['graph_error'][:120]}); timed eagerly", rank=rank)
        if r["per_call"] is not None:
            per_call[phase] = r["per_call"]
        st = stats(samples[phase], r["method"])
        log(f"phase {phase}: p50 {st['p50']:.1f} us  p99 {st['p99']:.1f} us  (rank 0, n={st['n']}, "
            f"{r['method']})", rank=rank)
        # correctness again on what each timed loop (graph replays included) left behind
        timer.sync()
        if phase in ("combine", "dispatch_combine", "dispatch_combine_uncached"):
            ok, err, _ = check_output(moe.out, ref, exact)
            checks[f"after_{phase}"] = ok
            errs.append(err)
        if phase in ("dispatch", "dispatch_combine", "dispatch_combine_uncached"):
            checks[f"recv_after_{phase}"] = bool(torch.equal(moe.recv_buf, recv_snapshot))
    return samples, per_call, methods


def bytes_moved(cfg: Config, lay: Layout) -> dict:
    """What this rank's layout sends: bytes of each exchange, rows per destination and source."""
    elt = torch.empty((), dtype=getattr(torch, cfg.dtype)).element_size()
    send_tot, recv_tot = lay.per_rank_totals(cfg.world_size)
    return {
        "dispatch_sent": lay.rows_sent * cfg.hidden * elt,
        "combine_sent": lay.rows_recv * cfg.hidden * elt,
        "layout_sent": lay.layout_bytes_sent,
        "dispatch_rows_sent": lay.rows_sent,
        "dispatch_rows_per_destination": send_tot,
        "dispatch_rows_per_source": recv_tot,
    }


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
    out, combine_fallback = correctness_combine(cfg, rank, moe)
    ok1, err1, how = check_output(out, ref, exact)
    recv_snapshot = moe.recv_buf.clone()
    # which NCCL actually moves the bytes: read now, after the process group's first collectives
    # (layout, dispatch and combine on every one of the K groups) have loaded it
    loaded = nccl_loaded()
    log(f"correctness (before timing): {'ok' if ok1 else 'FAILED'} on rank 0, max_abs_err={err1:.3g}, {how}",
        rank=rank)

    if cfg.crash_rank == rank:
        print(f"[moe_a2a] rank {rank}: --crash-rank {rank}: exiting with code {EXIT_CRASH_TEST} "
              "before the timed loop (test fault path)", file=sys.stderr, flush=True)
        os._exit(EXIT_CRASH_TEST)

    checks, errs = {"before_timing": ok1}, [err1]
    samples, per_call, methods = time_phases(cfg, rank, device, moe, ref, exact, recv_snapshot,
                                             checks, errs)
    correct = all(checks.values())
    result = {
        "rank": rank,
        "bytes": bytes_moved(cfg, moe.layout),
        "correct": correct,
        "max_abs_err": max(errs),
        "check": {"method": how, **checks},
        "methods": methods,
        "samples_us": samples,
        "nccl_loaded": loaded,
        "combine": {"impl": moe.combine_impl, "fallback": combine_fallback},
    }
    result["phases_us"] = {p: stats(samples[p], methods[p]["method"]) for p in PHASES if p != "floor"}
    result["floor_us"] = stats(samples["floor"], methods["floor"]["method"])
    if per_call:
        result["phases_us_per_call"] = {p: stats(per_call[p], methods[p]["per_call_method"]) for p in PHASES}
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
                  f"gbps_per_rank={summary['gbps_per_rank']:.3f} combine={summary['combine_impl']}",
                  flush=True)
        dist.barrier()  # the JSON is on disk before any rank exits (a failing exit ends the job)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if rc == EXIT_INCORRECT:
        print(f"[moe_a2a] rank {rank}: correctness check FAILED (exit {EXIT_INCORRECT})", file=sys.stderr, flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
