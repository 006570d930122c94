"""The combine's one-kernel gather + sum (lib/bench/gather_sum.py): the same Triton kernel that
runs on CUDA, executed here by Triton's interpreter (TRITON_INTERPRET=1) on CPU tensors, and
compared with what it replaces (index_select + torch.sum)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from lib.bench import moe_a2a

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _interpreted(code: str) -> subprocess.CompletedProcess:
    """Triton reads TRITON_INTERPRET when it is imported: a fresh interpreter per check."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=REPO)
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)


CHECK = """
import torch
from lib.bench.gather_sum import gather_sum
from lib.bench.moe_a2a import reduce_slots
worst = {}
for dtype in (torch.float32, torch.bfloat16):
    for m in (1, 2, 3):
        for hidden in (300, 1024, 2100):  # below, at and across the kernel's column block
            g = torch.Generator().manual_seed(m * 7 + hidden)
            rows, tokens = 40, 16
            src = torch.randn(rows + 1, hidden, generator=g).to(dtype)
            src[rows] = 0  # the zero row empty slots point to
            pos = torch.randint(0, rows + 1, (tokens * m,), generator=g)
            pos[:m] = rows  # token 0: every slot empty
            out = torch.full((tokens, hidden), 7.0, dtype=dtype)
            assert gather_sum(src, pos, m, out) is out
            ref = reduce_slots(torch.index_select(src, 0, pos).view(tokens, m, hidden))
            assert torch.equal(out[0], torch.zeros(hidden, dtype=dtype))
            key = (str(dtype), m, hidden)
            worst[key] = (torch.equal(out, ref), float((out.float() - ref.float()).abs().max()),
                          float(ref.float().abs().max()))
print(repr(worst))
"""


def test_gather_sum_equals_index_select_and_sum():
    proc = _interpreted(CHECK)
    assert proc.returncode == 0, proc.stderr[-3000:]
    worst = eval(proc.stdout.strip().splitlines()[-1])  # noqa: S307 - our own repr above
    assert len(worst) == 18
    for (dtype, m, hidden), (equal, err, scale) in worst.items():
        if dtype == "torch.float32":
            assert equal, (dtype, m, hidden, err)  # bitwise: float32 adds in slot order
        else:
            # Triton's interpreter casts float32 -> bfloat16 by truncation (numpy emulation),
            # CUDA rounds to nearest even: within one bf16 step here, bitwise on the GPU
            # (test_gather_sum_bitwise_on_cuda)
            assert err <= scale * 2 ** -7, (dtype, m, hidden, err)


def test_gather_sum_refuses_mismatched_buffers():
    proc = _interpreted("""
import torch
from lib.bench.gather_sum import gather_sum
src, out = torch.zeros(5, 8), torch.zeros(2, 8)
for pos, s, o in ((torch.zeros(3, dtype=torch.long), src, out),
                  (torch.zeros(4, dtype=torch.long), torch.zeros(5, 9), out),
                  (torch.zeros(4, dtype=torch.long), src, torch.zeros(2, 8, dtype=torch.bfloat16))):
    try:
        gather_sum(s, pos, 2, o)
    except ValueError as e:
        print("refused:", e)
""")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("refused:")]
    assert len(lines) == 3
    assert "pos holds 3 indices, not tokens x m = 2 x 2" in lines[0]
    assert "does not match out" in lines[1] and "does not match out" in lines[2]


def test_auto_picks_gather_sum_only_where_triton_runs(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    from lib.bench import gather_sum as kernel
    cpu = torch.device("cpu")
    assert "Triton needs CUDA" in kernel.available(cpu)
    assert moe_a2a.choose_combine("auto", cpu) == "index_select_sum"
    assert moe_a2a.choose_combine("index_select_sum", cpu) == "index_select_sum"
    cfg, errors = moe_a2a.resolve_config(
        moe_a2a.build_parser().parse_args(["--combine", "gather_sum"]), 2, False)
    assert cfg is None and errors[0].startswith("--combine gather_sum cannot run here")
    assert "allowed: auto, index_select_sum" in errors[0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: "
                    f"torch.cuda.is_available()={torch.cuda.is_available()}")
def test_gather_sum_bitwise_on_cuda():
    from lib.bench.gather_sum import gather_sum
    g = torch.Generator().manual_seed(0)
    tokens, m, hidden, rows = 128, 2, 7168, 250
    src = torch.randn(rows + 1, hidden, generator=g).to(torch.bfloat16).cuda()
    src[rows] = 0
    pos = torch.randint(0, rows + 1, (tokens * m,), generator=g).cuda()
    out = torch.empty(tokens, hidden, dtype=torch.bfloat16, device="cuda")
    gather_sum(src, pos, m, out)
    ref = moe_a2a.reduce_slots(torch.index_select(src, 0, pos).view(tokens, m, hidden))
    assert torch.equal(out, ref)
