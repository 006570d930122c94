"""What a stage asks of the place it runs on: the one protocol every place answers.

The flow is notebook -> stage -> place -> door -> world. A stage never asks which context it is
in; it asks its place (lib.places.for_stage). A place that cannot do something raises
Unsupported, whose message is the one SKIP reason the stage records.

The protocol (every place subclasses Place; what it leaves unimplemented is Unsupported):

    gpus()                      -> GPUs per node the stage's processes see
    host_facts()                -> per-node facts (CPU, memory, GPUs, EFA, gdrdrv, hugepages)
    node_needs()                -> what 00's gates require of a node here (NodeNeeds)
    run_ranks(job)              -> each node's exit code and whole output (torchrun, test_ep)
    model(engine, announce)     -> the model to serve and the gate of how it was had
    serve(spec)                 -> a context manager yielding a Server (url, ready, logs, stop)

Every Server answers `run_aiperf(stage, argv_for, *, timeout, out, name, env)`: one AIPerf cell
run where the server runs (here through the door; kube: a Job beside its pods; slurm: a step of
its allocation), its files into `out`, a CallResult back; lib.measure.sweep reaches AIPerf only
through it. `argv_for(aiperf, artifact_dir, cores)` is lib.measure.sweep's one builder of
AIPerf's argv.

A place whose door plans (context plan: `plans_only`, lib.places.planning) runs nothing: its
door records what the place would run, and the place's effects are records (its `planned`).

A place is handed typed values, never a parameter by its name: a PlaceSpec (every value of the
stage's parameters a place reads), built once by the stage layer from the stage's typed model
(lib.stages.specs.place_spec) and carried by the Stage (`stage.place_spec`); the Stage itself
is what records evidence (its door, its folder, its gates). Nothing here checks a parameter:
the stage's model refused what a place cannot take before the stage opened
(lib.stages.registry, lib.stages.rules_places).

`engine_default(spec)` and `engine_refusal(spec)` are asked before a stage opens (no door yet):
the engine a stage serves with when its `engine` parameter is '' comes from the place, and why
this place cannot serve with the engine named (the stage layer refuses it:
lib.stages.rules_places.check_engine_here).
"""
from __future__ import annotations

import json
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal

from lib.core.errors import Unsupported  # noqa: F401  (lib.places.Unsupported, as stages catch it)
from lib.engines.transformers import Server


# The contexts a stage runs in, and the cluster places a plan plans for (lib.stages.registry's
# CONTEXTS and CLUSTER_PLACES: the model refused anything else)
Context = Literal["local", "plan", "kube", "slurm"]
ClusterPlace = Literal["kube", "slurm"]


@dataclass(frozen=True)
class PlaceSpec:
    """Every value of a stage's parameters that a place reads, typed, as the stage's model
    accepted them (lib.stages.specs.place_spec builds it once, when the stage opens; in a
    replay, from the recorded parameters). None: the stage takes no such parameter (or, for
    gpus_per_node on the local context, it is detected at run time)."""
    context: Context = "local"
    plan_for: ClusterPlace | None = None  # context plan: the place planned for
    engine: str | None = None  # '' : the place's pick (settled before the stage opens)
    transport: str | None = None  # lib.engines.transport's contract (None: the place's)
    seed: int | None = None
    # the nodes
    nodes: int | None = None
    gpus_per_node: int | None = None
    efa_per_node: int | None = None
    instance_type: str | None = None
    # the software on them
    image: str | None = None  # '' : none given
    venv: str | None = None  # slurm: '' none
    deepep_dir: str | None = None  # '' none
    nccl_site: str | None = None  # '' none
    # slurm
    partition: str | None = None  # '' the cluster's default
    account: str | None = None  # '' none
    slurm_mpi: str | None = None
    time_limit_min: int | None = None
    # kube and slurm: waits, and what is left behind
    schedule_timeout_s: float | None = None
    job_timeout_s: float | None = None
    keep: bool | None = None
    # kube
    kube_context: str | None = None  # '' kubectl's current context
    namespace: str | None = None
    kube_workload: str | None = None  # statefulset or leaderworkerset
    hf_token_secret: str | None = None  # '' none
    # the served model
    model: str | None = None
    model_revision: str | None = None  # '' the Hub's current one
    model_cache_dir: str | None = None  # '' none
    model_layers: int | None = None  # the seeded model's decoder layers
    deepep_v2_mode: str | None = None  # hybrid or direct (backend deepep_v2)

    @property
    def leaderworkerset(self) -> bool:
        """Whether the kube place serves as one LeaderWorkerSet group (else a StatefulSet)."""
        return self.kube_workload == "leaderworkerset"


@dataclass
class ClusterServer(Server):
    """A server a cluster place runs (its pods or steps), with the fields 04-06 read of a vLLM
    serve (lib.engines.vllm_server.VllmServer's): the place that serves it, the backend asked,
    DP over every node, the leader's argv and env, and the gates its logs earned."""
    place: Any = None
    backend: str = ""
    gpus: int = 0  # vLLM: DP = nodes x GPUs per node
    argv: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    startup_s: float | None = None
    backend_gates: list[dict] | None = None  # None: no log proves a backend (transformers)

    @property
    def backend_ok(self) -> bool:
        return bool(self.backend_gates) and all(g["status"] == "PASS"
                                                for g in self.backend_gates)

    def run_aiperf(self, stage, argv_for, *, timeout: float, out: Path, name: str,
                   env: dict[str, str]):
        """One AIPerf cell where this server runs, its files into `out` (a CallResult): its
        place's `aiperf_beside` (kube: a Job beside the pods, lib.places.kube.manifests.aiperf_job,
        its files back through its log; slurm: a step of the allocation on node 0, writing on
        the shared file system). The AIPerf env is the place's, not this machine's `env`."""
        return self.place.aiperf_beside(self, argv_for, timeout=timeout, out=out, name=name)


def saved_model_config(stage, call) -> tuple[dict | None, str | None]:
    """A served model's config.json as a cluster place read it (a command's output): kept as
    the stage's model_config.json; (its dict or None, the file or None)."""
    if not call.ok:
        return None, None
    saved = stage.write_text("model_config.json", call.stdout)
    try:
        return json.loads(call.stdout), saved
    except ValueError:
        return None, saved


@dataclass(frozen=True)
class NodeRank:
    """Where one node's process of a multi-node job stands: its rank, how many nodes, and the
    rendezvous every node reaches (node 0's address and port)."""
    rank: int
    nodes: int
    master_addr: str
    port: int


@dataclass
class RankJob:
    """One process per node, each spawning its ranks (torchrun, or test_ep's own spawner).
    `argv` and `env` are asked per node; `env` holds only what is set over the place's own.

    `modules`: the guide's files its processes import (paths relative to the repository root,
    packages' __init__.py included), for a place whose nodes do not hold the checkout: the kube
    place mounts them into every pod (lib.places.kube.files) and puts them on PYTHONPATH. The
    local place runs in the checkout and the slurm place's steps start in it (a shared file
    system; pyxis mounts it as the working directory), so both import the guide from there and
    ignore the field."""
    name: str
    argv: Callable[[NodeRank], list[str]]
    env: Callable[[NodeRank], dict[str, str]]
    timeout_s: float
    nodes: int = 1
    cwd: Path | None = None
    modules: tuple[str, ...] = ()
    # the contract its processes run over: its own (an A/B arm's, lib.stages.transport_ab) or,
    # None, the place's; `env` already carries its variables, a place renders the rest (EFA
    # devices, the kube pods' env)
    transport: str | None = None


@dataclass
class NodeRun:
    """What one node's process of a RankJob did: its exit code (None when it never ran), its
    whole output, and the evidence files that hold it."""
    rank: int
    rc: int | None
    stdout: str
    stderr: str
    timed_out: bool
    streams: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class NodeNeeds:
    """What 00's gates require of each node here. None: not required on this place; the text
    beside it is the SKIP reason when the node lacks it."""
    gpus: int | None
    efa: int | None
    gdrdrv: bool
    hugepages: bool
    hugepages_bytes: int | None = None  # 2 MiB pages each of the later stages' pods asks for
    no_gpus: str = ""
    no_efa: str = ""
    no_gdrdrv: str = ""
    no_hugepages: str = ""
    no_cluster_access: str = ""  # {kubectl}: the kubectl client's version, or 'absent'


@dataclass
class ServeSpec:
    """What a stage asks to have served; the place decides how (a process, a StatefulSet, an
    allocation's steps), with whichever engine it names (lib.engines.base: its argv and env)."""
    engine: str
    model: dict[str, Any]
    backend: str = "allgather_reducescatter"
    enforce_eager: bool = True
    expert_parallel: bool = True
    num_comms: int = 1
    timeout_s: float = 1800.0
    gate_prefix: str = ""
    log_name: str | None = None
    gpus: int | None = None  # GPUs per node, when the stage asked already (else the place asks)
    nodes: int = 1  # the nodes it spans (DP = EP = nodes x GPUs per node); 1 on one machine
    # its transport contract (lib.engines.transport; None: the place's, Place.transport):
    # 06's GIN lever serves one arm over type 5 and one over type 2 in one stage
    transport: str | None = None


class Place:
    """A place's defaults: every capability Unsupported, named for the person reading the SKIP."""

    kind = "?"
    what = "this place"
    # while its door plans (context plan, lib.places.planning): what the place does instead of
    # acting on a cluster, its effects as records (the kube and slurm places make theirs)
    planned = None

    @property
    def plans_only(self) -> bool:
        """Whether this place only plans: its door records what would run, nothing is run."""
        return self.planned is not None
    # whether DeepEP's GIN runs here (an RDMA NIC: EFA): the EP_NUM_COMMS lever needs it
    gin = True
    # the transport contract of lib.engines.transport its GPU processes get: the stage's
    # `transport` (lib.stages.registry: efa on a cluster by default, gin_type5 where the pin
    # set reaches its floor; efa for a run recorded before it was a parameter); the local place
    # has one of its own (intranode_nvlink)
    @property
    def transport(self) -> str:
        return self.spec.transport or "efa"

    def transport_of(self, spec: ServeSpec) -> str:
        """The contract a serve's processes get: its own (an A/B arm's) or the place's."""
        return spec.transport or self.transport
    # the interpreter a rank's or a server's process runs (the image's on a cluster)
    python = "python3"
    # whether a file a rank writes lands where this machine reads it (the stage's folder):
    # the torch benchmark writes its result JSON that way
    shares_files = False
    # whether every rank runs on this one machine (one node; the ranks are its GPUs) rather
    # than one node per rank group of a cluster
    one_machine = False
    # the engines (lib.engines.catalog) it serves with; another is its SKIP
    engines: tuple[str, ...] = ()

    def __init__(self, stage, spec: PlaceSpec | None = None):
        """`stage`: what records the place's evidence (its door, its folder, its gates);
        `spec`: the values the stage hands it (default: the stage's own, `stage.place_spec`)."""
        self.stage = stage
        self.door = stage.door
        self.spec: PlaceSpec = stage.place_spec if spec is None else spec

    # ---- asked before a stage opens -----------------------------------------------------------
    @classmethod
    def engine_default(cls, spec: PlaceSpec) -> str:
        """The engine a stage serves with when `engine` is ''. Cluster places serve with vLLM."""
        return "vllm"

    @classmethod
    def engine_refusal(cls, spec: PlaceSpec) -> str | None:
        """Why this place cannot serve with the engine `spec` names (what the engine parameter
        may be here instead, and what was found), or None; the stage layer refuses it before
        any effect (lib.stages.rules_places.check_engine_here)."""
        return None

    # ---- capabilities -------------------------------------------------------------------------
    def _cannot(self, what: str) -> Unsupported:
        return Unsupported(f"{self.what} does not {what}")

    def gpus(self) -> int:
        raise self._cannot("know its GPUs")

    def host_facts(self) -> list[dict[str, Any]]:
        raise self._cannot("probe its nodes")

    def node_needs(self) -> NodeNeeds:
        raise self._cannot("probe its nodes")

    def run_ranks(self, job: RankJob) -> list[NodeRun]:
        raise self._cannot(f"run {job.name} on its nodes")

    def model(self, engine: str, announce: bool = False):
        """(the model to serve, or None when it could not be had; the gate of how it was had).
        `announce`: say what is being done first."""
        raise self._cannot("serve a model")

    def serve(self, spec: ServeSpec) -> AbstractContextManager:
        raise self._cannot("serve a model")

    def read_model_config(self, server, model: dict[str, Any]):
        """(the served model's config.json as a dict, or None; its file in the stage folder)."""
        raise self._cannot("read the served model's config")

    def deepep_dir(self) -> str | None:
        """Where DeepEP (built, with its tests/elastic/test_ep.py) is on the nodes, or None."""
        return None

    def nccl_site(self) -> str | None:
        """A site folder holding the NCCL DeepEP was built for, to preload (None: the image's)."""
        return None

    def build_image(self, *, dockerfile: Path, context: Path, tag: str, repo: Path) -> dict:
        raise self._cannot("build or check the image")

    def server_rss(self, server) -> int | None:
        """Resident memory of a server's processes, where the place can read it (else None)."""
        return None
