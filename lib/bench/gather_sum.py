"""The combine's gather and sum as one Triton kernel.

The benchmark's combine lays the returned rows out token-major with ``index_select`` (one
kernel writing [T, m, H]) and reduces over the m destination ranks with ``torch.sum`` (a second
kernel reading it back). On 2x H200 at test_ep's shape that pair is most of the gap between
dispatch+combine and the bare all-to-all floor (issue #3: 54 us against 40 us). Here both are
one kernel: per token and block of columns, load the token's m rows by their cached positions,
add them in float32 in slot order, round once to the output dtype and store into the combine's
preallocated output. No atomics, no intermediate buffer, the same result on every run; for
m = 2 it is bitwise the result of ``index_select`` + ``torch.sum`` (0 + a + b in float32, one
rounding), and the benchmark's correctness check compares it with the reference anyway.

Triton runs it on CUDA; with ``TRITON_INTERPRET=1`` the same kernel runs on CPU tensors, which
is how the tests check it on a machine without a GPU. ``available()`` says why not when Triton
is missing, so the benchmark can fall back to ``index_select`` + ``torch.sum`` and record it.
"""
from __future__ import annotations

import os

import torch

try:  # Triton ships with CUDA builds of torch; the CPU venv installs it for the interpreter
    import triton
    import triton.language as tl
except ImportError as exc:  # pragma: no cover - depends on the machine
    triton, tl, _IMPORT_ERROR = None, None, f"triton not importable: {exc}"
else:
    _IMPORT_ERROR = None

BLOCK = 1024  # columns per program: hidden 7168 is 7 programs per token


def available(device: torch.device) -> str | None:
    """None when the kernel can run on `device`, else the reason it cannot."""
    if triton is None:
        return _IMPORT_ERROR
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return f"device {device.type}: Triton needs CUDA (or TRITON_INTERPRET=1 on CPU)"
    return None


if triton is not None:
    @triton.jit
    def _gather_sum_kernel(src_ptr, pos_ptr, out_ptr, hidden, M: tl.constexpr,
                           BLOCK_H: tl.constexpr):
        token = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        inside = cols < hidden
        acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        for j in tl.static_range(M):  # slot order, as torch.sum over the slots
            row = tl.load(pos_ptr + token * M + j).to(tl.int64)
            acc += tl.load(src_ptr + row * hidden + cols, mask=inside, other=0.0).to(tl.float32)
        out_row = token.to(tl.int64) * hidden
        tl.store(out_ptr + out_row + cols, acc.to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne"),
                 mask=inside)


def gather_sum(src: torch.Tensor, pos: torch.Tensor, m: int, out: torch.Tensor) -> torch.Tensor:
    """out[t] = sum_j src[pos[t * m + j]] for j < m, summed in float32 in slot order.

    src: [S, H] contiguous rows (a zero row where an empty slot points); pos: [T * m] int64
    row indices; out: [T, H] contiguous, src's dtype. Returns out."""
    tokens, hidden = out.shape
    if pos.numel() != tokens * m:
        raise ValueError(f"gather_sum: pos holds {pos.numel()} indices, not tokens x m = "
                         f"{tokens} x {m}")
    if src.shape[1] != hidden or src.dtype != out.dtype:
        raise ValueError(f"gather_sum: src {tuple(src.shape)} {src.dtype} does not match out "
                         f"{tuple(out.shape)} {out.dtype}")
    if not (src.is_contiguous() and out.is_contiguous() and pos.is_contiguous()):
        raise ValueError("gather_sum: src, pos and out must be contiguous")
    if tokens:
        grid = (tokens, triton.cdiv(hidden, BLOCK))
        _gather_sum_kernel[grid](src, pos, out, hidden, M=m, BLOCK_H=BLOCK)
    return out
