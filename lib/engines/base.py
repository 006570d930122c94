"""What a place asks of the engine a stage names: the one protocol every engine answers.

The flow is stage -> place -> engine: a stage names its engine (`-p engine`), a place renders
and launches whatever engine that is, and neither names an engine's flags (tests/test_layers.py
walks their syntax trees). For one serving process (`EngineSpec`: the model, DP/EP/TP over
nodes x GPUs, the backend, eager or graphs, ports, the role and start rank) an engine gives:

    command(spec)            -> (argv, env): the process and the variables it sets (the
                                transport contract of lib.engines.transport, reused)
    process_words(spec)      -> the words of its command line a process list shows (a probe
                                that looks for it must not match itself: lib.places.kube.manifests)
    ready_path               -> the GET that answers 200 once it serves
    endpoints, metrics_path  -> what it serves (OpenAI routes; Prometheus text, or None)
    log_gates(leader, logs, spec, ...) -> what its logs prove (the backend it built, the EP
                                split, every rank's NCCL init and EFA provider, no silent
                                fallback); None when its logs prove no backend
    first_fatal(text)        -> the first fatal line of a log, or None
    crashed_step(text)       -> the step a log died at (what it was running), or None
    wait_ready(stage, server, timeout_s) -> the gate 'server ready' (ready_path polled)
    settled(leader_log, api_servers)     -> whether every start-up line is written yet
    startup_seconds(leader_log)          -> its start-up time as its log says, or None

An engine a place cannot run is the place's SKIP (`Place.engines` lists what it runs); an engine
the chosen pin set does not pin is a parameter error (lib.stages.registry). `expert_parallel`,
`backends` and `level` say what a stage may ask of it and how far it has been verified.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Mapping, get_args

from lib.engines.transport import Transport

# A process's role in a serve: what the place that renders it decides (node 0 or a later node,
# one machine, an MPI task), never a parameter
Role = Literal["leader", "worker", "local", "task"]
ROLES: tuple[str, ...] = get_args(Role)


@dataclass(frozen=True)
class EngineSpec:
    """One serving process: what any engine needs to render it.

    `role`: 'leader' (node 0 of a multi-node serve: HTTP and the rendezvous), 'worker' (node
    k > 0, no HTTP, ranks from `start_rank`), 'local' (one machine, its GPUs the ranks), or
    'task' (one rank of an MPI world the cluster's scheduler launched: `launch` "mpi_world").
    DP = EP = nodes x gpus_per_node with TP 1 (the public reproduction's layout).

    Built by a place from the stage's serve spec and what the place decides (role, ranks,
    ports, the rendezvous): the values the stage's parameter model accepted, and nothing an
    engine checks again."""
    model: str
    role: Role = "local"
    nodes: int = 1
    gpus_per_node: int = 1
    start_rank: int = 0
    backend: str = "allgather_reducescatter"
    enforce_eager: bool = True
    expert_parallel: bool = True
    ep_num_comms: int = 1
    # DeepEP-V2's mode with backend deepep_v2 (lib.engines.deepep.MODES; None: the
    # engine's own pick, hybrid across nodes)
    deepep_v2_mode: str | None = None
    port: int = 8000
    rendezvous: str | None = None  # the leader's address (leader and workers)
    rpc_port: int | None = None
    revision: str | None = None  # weights and tokenizer at this commit (None: the default)
    transport: Transport = "efa"  # lib.engines.transport's contract for its GPU processes
    python: str | None = None  # the interpreter to run it with (None: its console script)
    plugin_path: str | None = None  # the aws-ofi-nccl plugin's folder (None: the default)
    num_experts: int | None = None  # the model's routed experts (the EP split checks them)
    max_model_len: int | None = None
    gpu_memory_utilization: float | None = None
    served_model_name: str | None = None
    device: str = "cuda"
    cores: str | None = None  # CPU cores to pin it to (this machine only)
    host: str | None = None  # the address it listens on (None: the engine's default)
    console_script: str | None = None  # its program as the nodes run it (None: this machine's)
    nccl_site: str | None = None  # a site folder whose NCCL it preloads (None: its own)
    extra_env: Mapping[str, str] = field(default_factory=dict)

    @property
    def dp_size(self) -> int:
        return self.nodes * self.gpus_per_node


class Engine:
    """An engine's defaults; each engine module subclasses it (lib.engines.catalog lists them)."""

    name = "?"
    title = "?"  # as a reader names it ("vLLM")
    ready_path = "/v1/models"
    endpoints = ("/v1/models", "/v1/chat/completions", "/v1/completions")
    metrics_path: str | None = None
    # whether its logs prove which all-to-all backend it built (log_gates gives gates)
    proves_backend = False
    # whether it serves with expert parallelism over every GPU (04's EP serve; 05's, 06's)
    expert_parallel = False
    # the guide's all-to-all backend names it takes (`all2all_backend`; vLLM's names)
    backends: tuple[str, ...] = ()
    # how far the guide has taken it (the book's coverage says it beside every row)
    level = "measured here"
    # the pin (pins.yaml) a pin set must hold to serve with it; None: pinned elsewhere
    pin: str | None = None
    # how a multi-node serve is launched: "per_node" (one process per node, roles leader and
    # worker) or "mpi_world" (one MPI rank per GPU; where the scheduler launches MPI worlds,
    # as Slurm's srun does, every rank is a 'task' of one step; elsewhere the leader's mpirun)
    launch = "per_node"

    def command(self, spec: EngineSpec) -> tuple[list[str], dict[str, str]]:
        raise NotImplementedError(f"engine {self.name} renders no command")

    def process_words(self, spec: EngineSpec) -> list[str]:
        """The words of its command line that name it (e.g. `vllm serve`)."""
        raise NotImplementedError(f"engine {self.name} names no process")

    def log_gates(self, leader: str, logs: Mapping[str, str], spec: EngineSpec, *,
                  log_name: str, evidence: list[str], api_servers: int) -> list[dict] | None:
        """What the logs prove: the leader's log (the backend is logged by rank 0 only) and
        every process's log by its evidence name. None: its logs prove no backend."""
        return None

    def settings_gates(self, logs: Mapping[str, str], spec: EngineSpec, *,
                       evidence: list[str]) -> list[dict]:
        """What every rank's log proves of a setting the serve asked beyond its backend. Not
        backend gates: a serve without it is still the backend asked for (its measurements
        kept), the gate FAILing beside them."""
        return []

    def first_fatal(self, text: str) -> str | None:
        return None

    # the server's whole output, in the stage folder (node 0's; node k's beside it)
    log_name = "server.log"

    def wait_ready(self, stage, server, timeout_s: float):
        """The gate 'server ready': poll `ready_path` until it answers 200, the process exits
        or time is up (lib.engines.server.poll_until_ready)."""
        from lib.engines.server import poll_until_ready

        print(f"waiting up to {timeout_s:.0f} s for {self.name} at {server.url} (GET "
              f"{self.ready_path} answers 200; log {stage.rel(server.log_path)})", flush=True)
        return poll_until_ready(stage, server, timeout_s, path=self.ready_path, who=self.name,
                                waiting_for=f" for {self.name}")

    # True for an engine whose log has no last start-up line to wait for: its leader's log is
    # settled once two looks a poll apart read the same text (Slurm's srun forwards a step's
    # output after its port opens: under load a TensorRT-LLM log was read short once)
    settles_when_quiet = False

    def settled(self, leader_log: str, api_servers: int) -> bool:
        """Whether the leader's log holds every start-up line its gates read (the API can answer
        a moment before the last line is written)."""
        return True

    def startup_seconds(self, leader_log: str) -> float | None:
        """Seconds from its log's first line to its last start-up line, where it says."""
        return None

    def crashed_step(self, text: str) -> dict | None:
        return None


def process_regex(words: list[str]) -> str:
    """A bash regex for a process whose command line holds `words`, that cannot match the
    probe's own command line: its first character in brackets (`[v]llm serve`: the probe's text
    holds `[v]llm`, never `vllm`; the public review's fix for `pgrep -af 'vllm serve'` matching
    itself)."""
    text = " ".join(words).replace(".", "\\.")
    return f"[{text[0]}]{text[1:]}"
