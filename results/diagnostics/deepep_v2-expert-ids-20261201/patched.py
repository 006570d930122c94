"""Second step of this diagnostic, on one GPU: the project's pinned vLLM patch itself
(patches/0001-vllm-deepep-v2-no-expand-valid-expert-ids.patch), applied to a copy of the vLLM
site by lib.site_patches as scripts/vllm-site.sh applies it, then:

  globalize  the patched `_globalize_recv_topk_idx` (Triton, compiled here) on local ids as
             DeepEP's dispatch leaves them (local id or -1 in received rows, stale values in the
             rows past them), for EP rank 0 and rank 1 of 2: its output against the ids
             probe.py's `patched` kind assumed
  experts    TritonExperts.apply on that output (rank 0) against probe.py's fp32 reference

Usage: PYTHONPATH=<patched site>:<repo> python3 patched.py OUT_DIR; writes OUT_DIR/patched.json.
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import probe as P  # noqa: E402  (this folder's probe.py: sizes, ids, reference, TritonExperts)


def dispatched_local_ids(seed, offset, torch):
    """[ROWS, TOPK] int64 as DeepEP's no-expand dispatch leaves them for the rank at `offset`:
    a received row holds its local expert ids or -1; rows past RECEIVED hold stale values."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(P.NUM_EXPERTS, generator=g)[:P.TOPK]
                       for _ in range(P.ROWS)])
    local = (ids >= offset) & (ids < offset + P.LOCAL)
    out = torch.where(local, ids - offset, torch.full_like(ids, -1))
    stale = torch.randint(-1, P.LOCAL, (P.ROWS - P.RECEIVED, P.TOPK), generator=g)
    out[P.RECEIVED:] = stale  # uninitialised in vLLM: anything, valid-looking ids included
    return out


def main(out_dir):
    import types

    import torch
    try:
        import deep_ep  # noqa: F401
        stubbed = False
    except ImportError:  # not built on this machine; the kernel under test never calls it
        stub = types.ModuleType("deep_ep")
        def attribute(name):
            if name.startswith("__"):
                raise AttributeError(name)
            return type(name, (), {})
        stub.__getattr__ = attribute
        sys.modules["deep_ep"] = stub
        stubbed = True
    from vllm.model_executor.layers.fused_moe.prepare_finalize import deepep_v2

    os.makedirs(out_dir, exist_ok=True)
    site = deepep_v2.__file__.split("/vllm/model_executor/")[0]
    record_path = os.path.join(site, ".guide-patches.json")
    result = {"site": site, "record": json.load(open(record_path))
              if os.path.exists(record_path) else None, "deep_ep_stubbed": stubbed,
              "globalize": [], "experts": None}
    for offset in (0, P.LOCAL):
        for seed in P.SEEDS:
            local = dispatched_local_ids(seed, offset, torch)
            psum = torch.tensor([P.RECEIVED // 2, P.RECEIVED], dtype=torch.int32).cuda()
            got = deepep_v2._globalize_recv_topk_idx(local.clone().cuda(), psum, offset,
                                                     P.NUM_EXPERTS).cpu()
            rows = torch.arange(P.ROWS)[:, None].expand(-1, P.TOPK)
            valid = (local >= 0) & (local + offset < P.NUM_EXPERTS) & (rows < P.RECEIVED)
            fill = (offset + P.NUM_EXPERTS // 2) % P.NUM_EXPERTS
            want = torch.where(valid, local + offset, torch.full_like(local, fill))
            result["globalize"].append({"offset": offset, "seed": seed,
                                        "equal": bool(torch.equal(got, want)),
                                        "fill": fill, "values": sorted(set(got.unique().tolist())
                                                                       - set(range(offset, offset + P.LOCAL)))})
            if offset == 0 and seed == P.SEEDS[0]:
                rank0_ids = got
    # the experts on rank 0's patched ids: P.case_experts builds its ids with make_ids; feed
    # it the kernel's own output instead
    original = P.make_ids
    P.make_ids = lambda kind, seed, torch_: rank0_ids if kind == "kernel" else original(
        kind, seed, torch_)
    P.SEEDS = (P.SEEDS[0],)
    result["experts"] = P.case_experts("kernel")
    result["ok"] = all(r["equal"] for r in result["globalize"]) and result["experts"]["ok"]
    with open(os.path.join(out_dir, "patched.json"), "w") as f:
        json.dump(result, f, indent=1)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
