"""On one GPU, outside the guide (#7): what vLLM 0.24.0's TRITON experts do with the expert ids
deepep_v2's no-expand layout hands them, and whether a valid non-local id in place of -1 gives
the right MoE output.

The no-expand layout (vLLM picks it whenever --enforce-eager is absent) returns the received
tokens in a worst-case buffer of N rows; `_globalize_recv_topk_idx` in
`fused_moe/prepare_finalize/deepep_v2.py` turns each slot into a global expert id when the expert
is local and the row is a received token, and into -1 otherwise. `TritonExperts.apply` then
aligns the ids with `moe_align_block_size(topk_ids, BLOCK_SIZE_M, global_num_experts,
expert_map)` (ignore_invalid_experts left False). This probe builds such ids for EP rank 0 of 2
(128 experts, 64 local, top-8) and runs, each case in its own process (a fault ends a CUDA
context):

  align-<ids>     vLLM's moe_align_block_size alone, checked against what the TRITON kernel
                  needs: every local slot exactly once, in a block whose mapped expert is its
                  own; every block of a non-local expert mapped to -1 (the kernel writes zeros)
  experts-<ids>   TritonExperts.apply as the modular kernel calls it, its output against an
                  fp32 torch reference over the local experts only (padding rows: zero)
  sanitizer       align-minus1 under compute-sanitizer memcheck (if the machine has it)

<ids>: `minus1` (as vLLM 0.24.0 makes them), `patched` (-1 replaced by
(rank_expert_offset + num_experts // 2) % num_experts, a valid expert of the other rank, as the
one-line change to `_globalize_recv_topk_idx_kernel` would), `expanded` (no -1 at all: the
reference shape the expand layout gives, each local slot its own row).
Usage: python3 probe.py OUT_DIR   (vLLM importable); writes OUT_DIR/probe.json and probe.out.
"""
import json
import os
import shutil
import subprocess
import sys
import time

NUM_EXPERTS, LOCAL, TOPK = 128, 64, 8
RANK_OFFSET = 0  # EP rank 0 of 2: experts 0..63
ROWS, RECEIVED = 512, 135  # worst-case buffer rows; rows dispatch wrote (run d's fatal step: 135)
HIDDEN, INTER = 512, 256
SEEDS = (0, 1, 2, 3)


def make_ids(kind, seed, torch):
    """Global topk ids [ROWS, TOPK] as the no-expand layout leaves them for rank 0."""
    g = torch.Generator().manual_seed(seed)
    # each received row routes to TOPK distinct experts out of 128; about half are local
    ids = torch.stack([torch.randperm(NUM_EXPERTS, generator=g)[:TOPK] for _ in range(ROWS)])
    local = (ids >= RANK_OFFSET) & (ids < RANK_OFFSET + LOCAL)
    ids = torch.where(local, ids, torch.full_like(ids, -1))
    ids[RECEIVED:] = -1  # rows past what dispatch wrote
    if kind == "minus1":
        return ids
    if kind == "patched":
        fill = (RANK_OFFSET + NUM_EXPERTS // 2) % NUM_EXPERTS
        return torch.where(ids >= 0, ids, torch.full_like(ids, fill))
    if kind == "expanded":
        return ids[ids >= 0].reshape(-1, 1)
    raise ValueError(kind)


def expert_map(torch):
    m = torch.full((NUM_EXPERTS,), -1, dtype=torch.int32)
    m[RANK_OFFSET:RANK_OFFSET + LOCAL] = torch.arange(LOCAL, dtype=torch.int32)
    return m


def check_alignment(ids, sorted_ids, block_experts, post_pad, block, emap):
    """Problems with (sorted_ids, mapped block experts, num_tokens_post_pad), as a list."""
    flat = ids.flatten().long()
    numel = flat.numel()
    local_of = torch_where_local(flat, emap)
    problems = []
    n = int(post_pad)
    if n % block or n > sorted_ids.numel() or n < 0:
        return [f"num_tokens_post_pad {n} (block {block}, buffer {sorted_ids.numel()})"]
    seen = {}
    for b in range(n // block):
        e = int(block_experts[b])
        entries = [int(t) for t in sorted_ids[b * block:(b + 1) * block]]
        for t in entries:
            if t < 0 or t > numel:
                problems.append(f"block {b}: slot index {t} outside 0..{numel}")
            elif t < numel and e >= 0:
                if int(local_of[t]) != e:
                    problems.append(f"block {b} (local expert {e}): slot {t} is expert "
                                    f"{int(flat[t])} (local {int(local_of[t])})")
                seen[t] = seen.get(t, 0) + 1
    want = {t for t in range(numel) if int(local_of[t]) >= 0}
    missing = sorted(want - set(seen))
    twice = sorted(t for t, c in seen.items() if c > 1)
    if missing:
        problems.append(f"{len(missing)} of {len(want)} local slots in no block of their "
                        f"expert (first {missing[:5]})")
    if twice:
        problems.append(f"{len(twice)} local slots in more than one block")
    return problems[:20]


def torch_where_local(flat, emap):
    import torch
    safe = flat.clamp(0, NUM_EXPERTS - 1)
    return torch.where((flat >= 0) & (flat < NUM_EXPERTS), emap[safe].long(),
                       torch.full_like(flat, -1))


def case_align(kind):
    import torch
    from vllm.model_executor.layers.fused_moe.moe_align_block_size import moe_align_block_size
    emap = expert_map(torch)
    result = {"case": f"align-{kind}", "seeds": []}
    for seed in SEEDS:
        for block in (16, 64):
            ids = make_ids(kind, seed, torch)
            s, e, p = moe_align_block_size(ids.cuda(), block, NUM_EXPERTS, emap.cuda())
            torch.cuda.synchronize()
            problems = check_alignment(ids, s.cpu(), e.cpu(), p.cpu()[0], block, emap)
            result["seeds"].append({"seed": seed, "block": block, "post_pad": int(p.cpu()[0]),
                                    "problems": problems})
    result["ok"] = all(not r["problems"] for r in result["seeds"])
    return result


def reference_moe(x, w1, w2, ids, weights):
    """fp32: out[r] = sum over local slots k of weights[r,k] * W2 (silu(g) * u), [g; u] = W1 x."""
    import torch
    out = torch.zeros(x.shape[0], HIDDEN, dtype=torch.float32)
    xf, w1f, w2f = x.float().cpu(), w1.float().cpu(), w2.float().cpu()
    for r in range(ids.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[r, k]) - RANK_OFFSET
            if 0 <= e < LOCAL:
                h = w1f[e] @ xf[r]
                a = torch.nn.functional.silu(h[:INTER]) * h[INTER:]
                out[r] += float(weights[r, k]) * (w2f[e] @ a)
    return out


def case_experts(kind):
    import torch
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.config import (
        FUSED_MOE_UNQUANTIZED_CONFIG, FusedMoEConfig, FusedMoEParallelConfig, RoutingMethodType)
    from vllm.model_executor.layers.fused_moe.experts.triton_moe import TritonExperts

    parallel = FusedMoEParallelConfig(
        tp_size=1, pcp_size=1, dp_size=2, ep_size=2, tp_rank=0, pcp_rank=0, dp_rank=0,
        ep_rank=0, sp_size=1, use_ep=True, all2all_backend="deepep_v2", enable_eplb=False)
    moe = FusedMoEConfig(
        num_experts=NUM_EXPERTS, experts_per_token=TOPK, hidden_dim=HIDDEN,
        intermediate_size=INTER, num_local_experts=LOCAL, num_logical_experts=NUM_EXPERTS,
        activation=MoEActivation.SILU, device="cuda",
        routing_method=RoutingMethodType.Renormalize, moe_parallel_config=parallel,
        in_dtype=torch.bfloat16)
    experts = TritonExperts(moe, FUSED_MOE_UNQUANTIZED_CONFIG)
    emap = expert_map(torch).cuda()
    result = {"case": f"experts-{kind}", "seeds": []}
    for seed in SEEDS:
        torch.manual_seed(100 + seed)
        ids = make_ids(kind, seed, torch)
        rows = ids.shape[0]
        x = (torch.randn(rows, HIDDEN) / 4).to(torch.bfloat16).cuda()
        w1 = (torch.randn(LOCAL, 2 * INTER, HIDDEN) / HIDDEN ** 0.5).to(torch.bfloat16).cuda()
        w2 = (torch.randn(LOCAL, HIDDEN, INTER) / INTER ** 0.5).to(torch.bfloat16).cuda()
        weights = torch.rand(rows, ids.shape[1]).cuda()
        ws1, ws2, out_shape = experts.workspace_shapes(
            rows, 2 * INTER, HIDDEN, ids.shape[1], NUM_EXPERTS, LOCAL, None, MoEActivation.SILU)
        # filled with NaN: a row the kernels leave unwritten shows as NaN, not as a stale value
        ws13 = torch.full(ws1, float("nan"), dtype=torch.bfloat16, device="cuda")
        ws2t = torch.full(ws2, float("nan"), dtype=torch.bfloat16, device="cuda")
        out = torch.full(out_shape, float("nan"), dtype=torch.bfloat16, device="cuda")
        experts.apply(out, x, w1, w2, weights, ids.cuda(), MoEActivation.SILU, NUM_EXPERTS,
                      emap, None, None, ws13, ws2t, None, False)
        torch.cuda.synchronize()
        want = reference_moe(x, w1, w2, ids, weights.cpu())
        got = out.float().cpu()
        nan_rows = int(torch.isnan(got).any(dim=1).sum())
        err = (got - want).abs()
        scale = want.abs().max().item()
        worst = float(torch.nan_to_num(err, nan=float("inf")).max())
        result["seeds"].append({
            "seed": seed, "rows": rows, "nan_rows": nan_rows, "max_abs_err": worst,
            "max_abs_ref": scale, "padding_rows_max_abs": float(
                got[RECEIVED:].abs().max()) if ids.shape[1] > 1 else None})
    # bf16 operands and output: within 2 % of the reference's largest value, and no NaN row
    result["ok"] = all(r["nan_rows"] == 0 and r["max_abs_err"] <= 0.02 * r["max_abs_ref"]
                       for r in result["seeds"])
    return result


def _text(data):
    return data.decode(errors="replace") if isinstance(data, bytes) else (data or "")


def run_case(name, out_dir, env=None, wrapper=(), timeout=400, suffix=""):
    t0 = time.time()
    cmd = [*wrapper, sys.executable, os.path.abspath(__file__), "--case", name]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, **(env or {})})
    except subprocess.TimeoutExpired as exc:
        proc = subprocess.CompletedProcess(cmd, None, _text(exc.stdout), _text(exc.stderr))
    log = f"$ {' '.join(cmd)}\n" + (proc.stdout or "") + (proc.stderr or "")
    with open(os.path.join(out_dir, f"{name}{suffix}.log"), "w") as f:
        f.write(log)
    lines = [ln for ln in (proc.stdout or "").splitlines() if ln.startswith("RESULT ")]
    record = json.loads(lines[-1][7:]) if lines else {"case": name, "ok": None}
    record.update(rc=proc.returncode, seconds=round(time.time() - t0, 1),
                  tail=[ln for ln in log.splitlines()
                        if "error" in ln.lower() or "Invalid" in ln][:12])
    return record


def main(out_dir):
    os.makedirs(out_dir, exist_ok=True)
    records = []
    blocking = {"CUDA_LAUNCH_BLOCKING": "1"}
    for name in ("align-expanded", "align-patched", "align-minus1",
                 "experts-expanded", "experts-patched", "experts-minus1"):
        records.append(run_case(name, out_dir, blocking))
        print(json.dumps(records[-1]), flush=True)
    sanitizer = shutil.which("compute-sanitizer") or next(
        (p for p in ("/usr/local/cuda/bin/compute-sanitizer",) if os.path.exists(p)), None)
    if sanitizer:
        for name in ("align-minus1", "align-patched"):
            rec = run_case(name, out_dir, None, (sanitizer, "--tool", "memcheck",
                                                 "--print-limit", "8"), 300, "-sanitizer")
            rec["case"] = f"sanitizer-{name}"
            records.append(rec)
            print(json.dumps(rec), flush=True)
    else:
        records.append({"case": "sanitizer", "ok": None, "why": "no compute-sanitizer found"})
    with open(os.path.join(out_dir, "probe.json"), "w") as f:
        json.dump(records, f, indent=1)


if __name__ == "__main__":
    if sys.argv[1] == "--case":
        kind, ids = sys.argv[2].split("-", 1)
        res = (case_align if kind == "align" else case_experts)(ids)
        print("RESULT " + json.dumps(res), flush=True)
    else:
        main(sys.argv[1])
