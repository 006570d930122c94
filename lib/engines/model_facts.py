"""Facts of the cluster models the guide serves, kept here because the Hugging Face Hub is not
reachable everywhere the guide is planned (a plan, a replay): the first cell checks expert-parallel
divisibility from them before anything runs (lib.stages.rules_engines.check_ep_divides, the
parameter model's rule).

Where the Hub (or a local copy) is reachable, a cluster stage reads the model's config.json
and gates that it says the same (routed experts: `num_experts` in Qwen3-MoE's config).
"""
from __future__ import annotations

# Qwen/Qwen3-30B-A3B-FP8 at the revision pinned in pins.yaml (`model`): 128 routed experts,
# top-8 (its config.json: num_experts 128, num_experts_per_tok 8; ANCHORS.md 1.4 "[EP Rank 0/16]
# ... 8/128 experts").
ROUTED_EXPERTS = {"Qwen/Qwen3-30B-A3B-FP8": 128}


def routed_experts(model: str) -> int | None:
    """The model's routed experts when the guide knows them; None otherwise (then the stage
    reads them from the model's config where it can, and says so)."""
    return ROUTED_EXPERTS.get(model)

