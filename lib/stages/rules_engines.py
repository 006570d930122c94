"""The rules across parameters that the engines' facts decide, each written once, here: the
stage's parameter model (lib.stages.registry's `_check_together`) calls them, and nothing below
the stage checks these values again (lib.engines and lib.measure take what the model accepted).

- `check_ep_divides`: expert parallelism's divisibility, from the routed experts the guide knows
  of a cluster model (lib.engines.model_facts);
- `check_pin_set`: a transport contract's floor (lib.engines.transport.floor_problems) against
  the pin set chosen.

Each raises lib.core.errors.ParameterError naming the parameter a person would change and what
it allows, before any effect.
"""
from __future__ import annotations

from typing import Mapping, Sequence

from lib.core.errors import ParameterError
from lib.engines import transport
from lib.engines.model_facts import routed_experts

MAX_NODES_SAID = 16  # the node counts a refusal lists (the guide's model divides over 1..16)


def check_ep_divides(model: str, nodes: int, gpus_per_node: int) -> None:
    """Expert parallelism's divisibility rule, the one place it is written: the EP size (nodes x
    GPUs per node) must divide the model's routed experts, so that every rank holds the same
    number of experts. Refuses 'nodes', naming the node counts (1..16) that divide them; a model
    whose experts the guide does not know passes (lib.engines.model_facts.routed_experts)."""
    experts = routed_experts(model)
    world = nodes * gpus_per_node
    if experts is not None and experts % world:
        divisors = [n for n in range(1, MAX_NODES_SAID + 1) if experts % (n * gpus_per_node) == 0]
        raise ParameterError(
            "nodes", nodes,
            f"a node count whose EP size divides the model's routed experts (expert parallelism "
            f"divisibility): {model} has {experts} routed experts, and {nodes} nodes x "
            f"{gpus_per_node} GPUs = {world} ranks does not divide them; nodes in "
            + ", ".join(map(str, divisors)))


def check_pin_set(name: transport.Transport, pin_set: str, pins: Mapping[str, Mapping],
                  reaching: Sequence[str] = (), param: str = "transport") -> None:
    """Refuse contract `name` on pin set `pin_set` (its pins `pins`) below its floor, naming the
    sets that reach it (`reaching`) and the parameter that asked (`param`: `transport`, or
    `transport_ab` for an A/B with a GIN type 5 arm)."""
    problems = transport.floor_problems(name, pins)
    if not problems:
        return
    sets = (f" ({', '.join(f'-p pin_set {s}' for s in reaching)})" if reaching
            else " (no pin set reaches it today)")
    if param != "transport":  # an A/B with a GIN type 5 arm
        raise ParameterError(param, True, f"false, or a pin_set whose NCCL is >= 2.31 and "
                             f"EFA installer >= 1.50{sets}: the A/B's GIN type 5 arm needs "
                             f"what pin set {pin_set!r} lacks: {'; '.join(problems)}")
    raise ParameterError(param, name,
                         f"a transport pin set {pin_set!r} can carry: {'; '.join(problems)}; "
                         f"choose -p transport efa (GIN type 2) or a pin_set whose NCCL is "
                         f">= 2.31 and EFA installer >= 1.50{sets}")
