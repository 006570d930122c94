"""What the two cluster places (the packages lib.places.kube, lib.places.slurm) share: the
image's paths, the model named by its pin, the gates a vLLM serve's logs earn, the gate-adding
of a serve, and the one deadline loop their waits poll through.

Pure but for `wait_until`, which reads the door's clock and sleeps through it.
"""
from __future__ import annotations

from typing import Any, Callable

from tenacity import Retrying, retry_if_result, wait_exponential, wait_fixed

from lib.core.evidence import Gate, gate
from lib.engines import catalog
from lib.engines.base import EngineSpec
from lib.engines.model_facts import routed_experts

DEEPEP_IN_IMAGE = "/opt/DeepEP"  # docker/Dockerfile stages and builds DeepEP there
# AIPerf in the image: `pip install --target /opt/aiperf` (docker/Dockerfile, layer 8), its
# console script run with its packages on PYTHONPATH; flags checked against 0.10.0's wheel
AIPERF_IN_IMAGE = "/opt/aiperf/bin/aiperf"
AIPERF_ENV = {"PYTHONPATH": "/opt/aiperf", "HF_ENDPOINT": "http://127.0.0.1:9"}
# What reads the served model's config.json where vLLM downloaded it (on a node: offline):
# python3 -c CONFIG_SCRIPT <model> <revision> prints it.
CONFIG_SCRIPT = ("import sys\nfrom huggingface_hub import hf_hub_download\n"
                 "print(open(hf_hub_download(sys.argv[1], 'config.json', revision=sys.argv[2]))"
                 ".read())\n")


def pinned_model(model: str | None, revision: str | None, announce: bool, download: str):
    """The cluster model named by its pin (pins.yaml's model and revision, the stage's `model`
    and `model_revision`; nothing built here): (the model to serve, the gate 'model named by
    its pin'). `download` says where the nodes download it (the gate's reason)."""
    experts = routed_experts(model)
    info = {"model_dir": model, "revision": revision, "num_experts": experts,
            "config_hash": revision, "parameters": None, "seed": None, "built": False}
    if announce:
        print(f"serving {model} at revision {revision} (pins.yaml)", flush=True)
    return info, gate("model named by its pin", bool(model and revision),
                      {"model": model, "revision": revision, "routed_experts": experts},
                      {"revision": "40 hex"}, download, [])


def gate_adder(stage, server, gate_prefix: str) -> Callable[[Gate | dict | None], None]:
    """What a serve adds its gates with: each one (a dict or a Gate; None is none) named with
    the serve's `gate_prefix` (an arm's name), kept on the server and added to the stage."""
    prefix = f"{gate_prefix}: " if gate_prefix else ""

    def add(g: Gate | dict | None) -> None:
        if g is None:
            return
        g = g if isinstance(g, Gate) else Gate(**g)
        if prefix:
            g = Gate(prefix + g.gate, g.status, g.observed, g.expected, g.reason, g.evidence)
        server.gates.append(g)
        stage.add(g)

    return add


def serve_gates(engine: str, leader: str, logs: dict[str, str], *, backend: str, nodes: int,
                gpus_per_node: int, num_experts: int | None, enforce_eager: bool,
                api_servers: int, log_name: str, evidence: list[str],
                transport: str = "efa", deepep_v2_mode: str | None = None) -> list[dict] | None:
    """What the serve's logs prove (every pod's, every node's step's), as the engine reads them
    (lib.engines.base: the leader's log for what rank 0 alone logs, every log for every rank's
    NCCL init and EFA provider, and the settings the serve's `transport` contract has every
    rank read); None when the engine's logs prove no backend."""
    spec = EngineSpec(model="", nodes=nodes, gpus_per_node=gpus_per_node, backend=backend,
                      enforce_eager=enforce_eager, num_experts=num_experts, transport=transport,
                      deepep_v2_mode=deepep_v2_mode)
    return catalog.engine(engine).log_gates(leader, logs, spec, log_name=log_name,
                                            evidence=evidence, api_servers=api_servers)


def settings_gates(engine: str, logs: dict[str, str], *, backend: str, nodes: int,
                   gpus_per_node: int, evidence: list[str],
                   deepep_v2_mode: str | None = None) -> list[dict]:
    """What every pod's (node's) log proves of the settings the serve asked beyond its backend
    (lib.engines.base.Engine.settings_gates), gated beside the backend gates, not among them."""
    spec = EngineSpec(model="", nodes=nodes, gpus_per_node=gpus_per_node, backend=backend,
                      deepep_v2_mode=deepep_v2_mode)
    return catalog.engine(engine).settings_gates(logs, spec, evidence=evidence)


def first_rank_gate(logs: dict[str, str], gpus_per_node: int, evidence: list[str]) -> dict:
    """A serve that never came up, triaged (lib.measure.triage): the rank whose own error came
    first, every peer's barrier or collective timeout its symptom (each rank waits for the dead
    one in its next all-to-all), PASS when no log holds an error line."""
    from lib.measure import triage  # lib.measure: not imported when a place is loaded

    return triage.triage_gate(logs, ranks_per_node=gpus_per_node or None, evidence=evidence)


def ranks_apart_gate(job: str, placed: dict[int, str | None],
                     spans: dict[int, tuple[str | None, str | None]] | None,
                     evidence: list[str], how: str = "") -> Gate:
    """A rank job's node ranks ran on distinct nodes (`placed`: rank -> the node it ran on)
    and, where `spans` (rank -> its start and end, RFC 3339, as the cluster recorded them) are
    known, at the same time: every rank started before the first one finished. Ranks on one
    node measure that node's own links, not the network between nodes; a rank that finished
    before another started never met it. `how`: where the placements come from."""
    nodes = [placed[r] for r in sorted(placed)]
    shared = sorted({n for n in nodes if n and nodes.count(n) > 1})
    unknown = [r for r in sorted(placed) if not placed[r]]
    problems = ([f"ranks {', '.join(str(r) for r in sorted(placed) if placed[r] == n)} all "
                 f"ran on node {n}" for n in shared]
                + ([f"no node recorded for rank(s) {', '.join(map(str, unknown))}"]
                   if unknown else []))
    if spans:
        starts = [s for s, _ in spans.values() if s]
        ends = [e for _, e in spans.values() if e]
        if starts and ends and max(starts) > min(ends):
            first = min(spans, key=lambda r: spans[r][1] or "~")
            late = max(spans, key=lambda r: spans[r][0] or "")
            problems.append(f"rank {late} started at {spans[late][0]}, after rank {first} had "
                            f"finished at {spans[first][1]}")
    said = ", ".join(f"rank {r} on {placed[r]}" for r in sorted(placed))
    return gate(f"{job}: node ranks on distinct nodes, together", not problems,
                {str(r): placed[r] for r in sorted(placed)}, "a node each, all started before "
                "the first finished", ("; ".join(problems) + f" ({said})") if problems else
                f"{said}{how}", evidence)


def wait_until(door, look: Callable[[Callable[[], float]], tuple[bool, Any]], timeout_s: float,
               what: str = "", *, poll_s: float, max_poll_s: float | None = None,
               started: float | None = None) -> Any:
    """Look until a look says done, or `timeout_s` has passed: the value of the last look.

    `look(elapsed)` answers (done, value); `elapsed()` is the seconds since `started` (the
    door's clock when the wait begins, unless given), read from the door's clock (recorded) at
    most once per look and only when asked: by the look itself, when it decides by the time
    (a pod Pending past schedule_timeout_s), else by the wait once the look said not done. So
    a look that finds what it waits for reads no clock. `what`: said first ("waiting up to
    N s for <what>"). Between two looks `door.sleep(poll_s)`, the delay doubling up to
    `max_poll_s` when given."""
    start = door.now() if started is None else started
    if what:
        print(f"waiting up to {timeout_s:.0f} s for {what}", flush=True)
    reading: list[float] = []  # this look's one clock reading, when one was asked for

    def elapsed() -> float:
        if not reading:
            reading.append(door.now() - start)
        return reading[0]

    def one_look() -> tuple[bool, Any]:
        reading.clear()
        return look(elapsed)

    # tenacity's loop, on the door's clock and sleep (recorded, replayed): a look not done is
    # looked again after the wait, unless its elapsed() says the time is up
    looking = Retrying(
        retry=retry_if_result(lambda got: not got[0]),
        stop=lambda state: elapsed() >= timeout_s,
        wait=(wait_exponential(multiplier=poll_s, max=max_poll_s) if max_poll_s is not None
              else wait_fixed(poll_s)),
        sleep=door.sleep,
        retry_error_callback=lambda state: state.outcome.result())
    return looking(one_look)[1]
