"""Facts of the cluster models the guide serves, kept here because the Hugging Face Hub is not
reachable everywhere the guide is planned (a plan, a replay): the first cell checks expert-parallel
divisibility from them before anything runs.

Where the Hub (or a local copy) is reachable, a cluster stage reads the model's config.json
and gates that it says the same (routed experts: `num_experts` in Qwen3-MoE's config).
"""
from __future__ import annotations

from lib.core.errors import ParameterError

# Qwen/Qwen3-30B-A3B-FP8 at the revision pinned in pins.yaml (`model`): 128 routed experts,
# top-8 (its config.json: num_experts 128, num_experts_per_tok 8; ANCHORS.md 1.4 "[EP Rank 0/16]
# ... 8/128 experts").
ROUTED_EXPERTS = {"Qwen/Qwen3-30B-A3B-FP8": 128}


def routed_experts(model: str) -> int | None:
    """The model's routed experts when the guide knows them; None otherwise (then the stage
    reads them from the model's config where it can, and says so)."""
    return ROUTED_EXPERTS.get(model)


def check_ep_divides(model: str, nodes: int, gpus_per_node: int) -> None:
    """Expert parallelism's divisibility rule, the one place it is written: the EP size (nodes x
    GPUs per node) must divide the model's routed experts, so that every rank holds the same
    number of experts. Raises ParameterError naming 'nodes' and the node counts (1..16) that
    divide them; a model whose experts the guide does not know passes (see routed_experts)."""
    experts = routed_experts(model)
    world = nodes * gpus_per_node
    if experts is not None and experts % world:
        divisors = [n for n in range(1, 17) if experts % (n * gpus_per_node) == 0]
        raise ParameterError(
            "nodes", nodes,
            f"a node count whose EP size divides the model's routed experts (expert parallelism "
            f"divisibility): {model} has {experts} routed experts, and {nodes} nodes x "
            f"{gpus_per_node} GPUs = {world} ranks does not divide them; nodes in "
            + ", ".join(map(str, divisors)))
