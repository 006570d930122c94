"""The slurm place's serving (SlurmServing, held by lib.places.slurm.place.SlurmPlace as its
`serving`): the server as steps of an allocation, the allocation an A/B's arms share.

Serving (`model`, `serve`; stages 04, 05 and 06):

- `model(engine)`: for 'transformers' the seeded model, built here as the local place builds it
  (lib.engines.transformers.build_model through the door) into the checkout's `.cache/`, which
  is on the shared file system, so the nodes read the very files built here; for 'vllm' the
  cluster model named by its pin (pins.yaml's model and revision, as the kube place: nothing
  built here; the nodes download it, into `model_cache_dir` when given, else their own HF
  cache).
- `serve(spec)`: one allocation (the same holder) sized for the serve (the stage's `nodes` for
  vLLM, one node for transformers serve), then the server as steps inside it, each started
  through `door.start` (its srun is the door's handle; its whole output the stage's log):
  `srun --jobid J --overlap -N1 -n1 --nodelist <node>` (lib.places.slurm.sbatch.task_argv)
  running `transformers serve` (lib.engines.transformers.serve_argv) on node 0, or vLLM's leader on
  node 0 and a headless worker on every other node (lib.engines.vllm, the engine's roles
  leader/worker, DP = nodes x GPUs per node, one step per node). Ready by the local place's
  readiness loop (lib.engines.transformers.poll_until_ready through wait_ready: the leader's
  srun polled, `GET /v1/models` or `/health` at node 0's address); vLLM's logs then gated as
  the kube place gates its pods' (the backend, the EP split, NCCL's EFA provider on every rank).
  The server is reached from this machine on the cluster's network (`request` through
  door.http). `run_aiperf` runs AIPerf as one more step of the allocation on node 0
  (lib.places.slurm.aiperf). On exit, normal or not: every step's srun stopped (door.stop),
  the allocation cancelled (scancel, then squeue until it is gone), and the gate `server
  stopped` (no step of it left in `squeue -s`, its port no longer answering).
- the arms of an A/B (lib.measure.serving: a serve whose gates carry the arm's name) share one
  allocation for the stage: side by side, or one after the other, interleaved with repeats,
  without giving the nodes back between blocks; each arm's steps are stopped when its block
  ends, the allocation is cancelled when the stage closes (stage.on_exit) or at once when an
  exception leaves a block. A lone serve (04, 05's sweep) cancels its allocation when its block
  ends. Arms side by side take `gpu_memory_utilization` 0.25 each (as on the local place) and
  the next ports.
- the server's processes are on a node: their resident memory is not read from here
  (`server_rss` None; 05's memory gate SKIPs) and the Server's `proc` is None once it is ready
  (its srun handle is `step`). `keep` is read by nothing here: a server never outlives its
  stage, and no allocation either.

SlurmServing asks its place (`place`) for its allocation (`_allocate`, `_nodes_of`,
`release`), its steps (`_start_step`, `_run_step`) and its parameters (`_image`, `_python`,
`_program`, `_venv`, `_in_image`), and to wait for a server (`_wait_ready`, which comes back
to `wait_ready` here): lib.places.slurm.place's, or a plan's (lib.places.slurm.plan), whose
effects are records. What is left of a stopped server's steps is lib.places.slurm.waits'.
"""
from __future__ import annotations

import ipaddress
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from lib.core.door import REPO_ROOT, Background
from lib.core.errors import DoorError, NotAllocated, Unsupported
from lib.core.evidence import Gate, gate
from lib.engines import (catalog, nccl_logs, server as served, transformers, vllm_logs,
                         vllm_server)
from lib.engines.transport import unset_vars
from lib.engines.base import EngineSpec
import lib.places.slurm.sbatch as sbatch  # the module itself, not lib.places (no cycle through it)
from lib.places.slurm import waits
from lib.places.base import ClusterServer, ServeSpec, saved_model_config
from lib.places.cluster import (CONFIG_SCRIPT, first_rank_gate,
                                gate_adder, pinned_model, serve_gates, settings_gates,
                                wait_until)

CONFIG_TIMEOUT_S = 300.0  # a step that reads the served model's config on node 0
ANSWER_TIMEOUT_S = 5.0  # is a stopped server's port still answering?
NODE_LOGS_SETTLE_S = 30.0  # the longest the other nodes' logs are awaited once the leader is ready
# Arms side by side in one allocation share the GPUs (as on the local place: three at 0.25)
ARM_GPU_MEMORY_UTILIZATION = vllm_server.GPU_MEMORY_UTILIZATION


@dataclass
class SlurmServer(ClusterServer):
    """A server as steps of an allocation: `url` is node 0's address and the port. For vLLM
    (`backend` set) the fields of lib.engines.vllm_server.VllmServer; for transformers serve
    `backend_gates` stays None (no log to prove a backend)."""
    jobid: str = ""
    host: str = ""  # node 0's address
    nodes: list[str] = field(default_factory=list)  # the nodes its steps run on, node 0 first
    step: Background | None = None  # the leader's srun (the door's handle of the server)
    steps: list[Background] = field(default_factory=list)  # every step's srun, node 0 first
    step_names: list[str] = field(default_factory=list)  # as `squeue -s` names them
    logs: list[Path] = field(default_factory=list)  # every step's output, node 0 first
    ready_path: str = "/v1/models"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


@dataclass
class _Held:
    """The allocation a stage's serves run in: its job id, nodes in node-rank order, each
    one's scontrol facts, and how many serve blocks are open in it."""
    jobid: str
    nodes: int
    names: list[str]
    info: dict[str, dict[str, Any]]
    open: list[int] = field(default_factory=list)  # the port slots of the open serves


def node_address(info: dict[str, dict[str, Any]], name: str) -> str:
    """A node's address as scontrol says it (NodeAddr, else NodeHostName, else its name)."""
    first = info.get(name, {})
    return first.get("node_addr") or first.get("node_hostname") or name


def this_host(addr: str) -> bool:
    """Whether node 0's address is this machine's loopback (the one-host test cluster)."""
    if addr == "localhost":
        return True
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return False


class SlurmServing:
    """The slurm place's serving: `model`, `serve` and what a server's steps need (see the
    module's docstring). Held by its place (lib.places.slurm.place.SlurmPlace, as its
    `serving`), whose allocation and steps it runs in, and which it asks through `place`; it
    keeps the allocation the stage's serves share (`held`)."""

    def __init__(self, place):
        self.place = place
        self.held: _Held | None = None

    def model(self, engine: str, announce: bool = False):
        """(the model to serve, the gate of how it was had). transformers: the seeded model,
        built here through the door as the local place builds it, into the checkout's `.cache/`
        on the shared file system (the nodes read the files built here); vllm: the cluster
        model named by its pin, as the kube place (nothing built). Unsupported before any call
        when the nodes have nothing to serve with (neither `image` nor `venv`)."""
        place = self.place
        place._python()
        if engine not in place.engines:
            raise Unsupported(f"{place.what} serves with {', '.join(place.engines)}, not engine "
                              f"{engine!r}")
        if not catalog.engine(engine).expert_parallel:
            if announce:
                print(f"building (or finding cached) the seeded MoE model for {engine}, seed "
                      f"{place.spec.seed}, {place.spec.model_layers} layers, in the "
                      "checkout's .cache/ on the shared file system", flush=True)
            return transformers.build_model(place.stage, engine, seed=place.spec.seed,
                                            layers=place.spec.model_layers)
        cache = place.spec.model_cache_dir
        return pinned_model(place.spec.model, place.spec.model_revision, announce,
                            "the nodes download it at this revision"
                            + (f" into {cache}" if cache else " into their own HF cache"))

    def _serving_allocation(self, nodes: int, gpus: int) -> _Held:
        """The stage's serving allocation of `nodes` nodes: the one held, else a new one."""
        place = self.place
        held = self.held
        if held and held.jobid not in place._released and held.nodes == nodes:
            return held
        if held and not held.open:
            place.release(held.jobid)  # another size: its nodes back first
        jobid = place._allocate("serve", nodes, gpus)
        try:
            names, info = place._nodes_of(jobid)
        except BaseException:
            place.release(jobid)
            raise
        self.held = _Held(jobid, nodes, names, info)
        return self.held

    @contextmanager
    def serve(self, spec: ServeSpec) -> Iterator[SlurmServer]:
        """The server as steps of an allocation (see the module's docstring); yields it even
        when it is not ready (`ready` False, its FAIL gate added)."""
        place = self.place
        stage, door = place.stage, place.door
        engine = catalog.engine(spec.engine)
        ep = engine.expert_parallel  # one process per node over its GPUs; else one on node 0
        python = place._python()
        gpus = (spec.gpus if spec.gpus is not None else place.gpus()) if ep else 0
        nodes = spec.nodes if ep else 1
        lone = not spec.gate_prefix
        log_name = spec.log_name or engine.log_name
        server = SlurmServer(str(spec.model["model_dir"]), 0, stage.path(log_name),
                             device="cuda" if ep else "slurm", place=place,
                             backend=spec.backend if ep else "",
                             gpus=nodes * gpus if ep else 0, ready_path=engine.ready_path)
        add = gate_adder(stage, server, spec.gate_prefix)
        try:
            held = self._serving_allocation(nodes, gpus)
        except NotAllocated as why:
            add(gate("server ready", False, {"allocated": False}, "listening",
                     f"the nodes of the serve were not allocated: {why}", []))
            yield server
            return
        slot = next(k for k in range(len(held.open) + 1) if k not in held.open)
        held.open.append(slot)
        server.jobid, server.nodes = held.jobid, held.names[:nodes]
        if ep:  # a hub model the nodes downloaded: AIPerf's tokenizer at its pinned revision
            server.tokenizer_revision = spec.model.get("revision") or None
        server.host = node_address(held.info, held.names[0])
        here = this_host(server.host)
        server.port = door.free_port() if here else sbatch.SERVE_PORT + slot
        failed = False

        def backstop() -> None:
            if not server.stopped:
                self._stop_server(server, release=True)

        try:
            if not ep:
                steps = self._transformers_steps(server, here)
            elif engine.launch == "mpi_world":
                steps = self._world_step(spec, server, python, gpus)
            else:
                steps = self._node_steps(spec, server, python, gpus, slot, here, lone)
            if not place.plans_only:
                stage.on_exit(backstop)
            started = door.now()
            unstarted = self._start_steps(server, steps, spec.gate_prefix)
            if unstarted:
                add(gate("server ready", False, {"started": False}, "listening", unstarted, []))
            else:
                place._wait_ready(server, spec, add, started)
            yield server
        except BaseException:
            failed = True
            raise
        finally:
            held.open.remove(slot)
            release = (lone or failed) and not held.open
            if not place.plans_only:
                add(self._stop_server(server, release=release))
            elif release:
                place.release(held.jobid)
            if release and self.held is held:
                self.held = None

    def _start_steps(self, server: SlurmServer, steps: list[tuple],
                     gate_prefix: str) -> str | None:
        """Each step started (its srun the door's handle), node 0 first: None, or why one could
        not be started (srun itself could not be run here); the later ones are then not."""
        place = self.place
        door, prefix = place.door, f"{gate_prefix}: " if gate_prefix else ""
        for node, argv, log_path in steps:
            command = argv[next(i for i, a in enumerate(argv) if i and a[:2] != "--"):]
            print(f"{'planning' if place.plans_only else 'starting'} a step on {node} of "
                  f"allocation {server.jobid}: {door.norm(' '.join(command))[:400]}", flush=True)
            try:
                handle = place._start_step(argv, log_path=log_path,
                                          label=f"{prefix}the server on {node}")
            except DoorError as exc:  # srun could not be started here at all
                server.step = server.steps[0] if server.steps else None
                return f"could not start the step on {node}: {exc}"
            server.logs.append(log_path)
            if handle is not None:
                server.steps.append(handle)
        server.step = server.steps[0] if server.steps else None
        return None

    def _transformers_steps(self, server: SlurmServer, here: bool) -> list[tuple]:
        """transformers serve on node 0 (its engine's command, lib.engines.base: the nodes'
        console script, listening on every address unless node 0 is this host)."""
        place = self.place
        # reached from this machine and the AIPerf step over the network unless node 0 is here
        argv, env = catalog.engine("transformers").command(EngineSpec(
            model=server.model_dir, port=server.port, device="cpu",
            host=None if here else "0.0.0.0", console_script=place._program("transformers")))
        if not place.stage.replay and not place.plans_only:
            # transformers 5.17 answers /v1/models with 500 unless the hub cache folder exists
            (transformers.HF_HOME / "hub").mkdir(parents=True, exist_ok=True)
        name = f"guide-{place.stage.name}-{sbatch.slug(server.log_path.stem)}"
        server.step_names = [name]
        return [(server.nodes[0], sbatch.task_argv(
            jobid=server.jobid, node=server.nodes[0], name=name,
            time_min=place.spec.time_limit_min, chdir=str(REPO_ROOT), argv=argv,
            env=env, **place._in_image()), server.log_path)]

    def _node_steps(self, spec: ServeSpec, server: SlurmServer, python: str, gpus: int,
                    slot: int, here: bool, lone: bool) -> list[tuple]:
        """An expert-parallel engine's leader on node 0 and a worker on every other node, one
        step each, argv and env from the engine (lib.engines.base: vLLM's headless workers,
        SGLang's node ranks)."""
        place = self.place
        cache = place.spec.model_cache_dir
        nodes = len(server.nodes)
        rpc = place.door.free_port() if here else sbatch.DP_RPC_PORT + slot
        stem = server.log_path.stem
        steps = []
        for ordinal, node in enumerate(server.nodes):
            argv, env = catalog.engine(spec.engine).command(self._engine_spec(
                spec, server, python, gpus, role="leader" if ordinal == 0 else "worker",
                start_rank=ordinal * gpus, rpc_port=rpc,
                gpu_memory_utilization=None if lone else ARM_GPU_MEMORY_UTILIZATION))
            if cache:
                env["HF_HOME"] = cache
            if ordinal == 0:
                server.argv, server.env = list(argv), dict(env)
            name = f"guide-{place.stage.name}-{sbatch.slug(stem)}-node{ordinal}"
            server.step_names.append(name)
            log_path = server.log_path if ordinal == 0 else server.log_path.with_name(
                f"{stem}-node{ordinal}.log")
            steps.append((node, sbatch.task_argv(
                jobid=server.jobid, node=node, name=name,
                time_min=place.spec.time_limit_min, chdir=str(REPO_ROOT), argv=argv,
                env=env, unset=unset_vars(place.transport_of(spec)), gpus_per_node=gpus,
                **place._in_image()), log_path))
        return steps

    def _engine_spec(self, spec: ServeSpec, server: SlurmServer, python: str, gpus: int,
                     **role) -> EngineSpec:
        """The engine's process as this allocation runs it (`role`: its role and ranks)."""
        place = self.place
        return EngineSpec(
            model=server.model_dir, nodes=len(server.nodes), gpus_per_node=gpus,
            backend=spec.backend, enforce_eager=spec.enforce_eager,
            expert_parallel=spec.expert_parallel, ep_num_comms=spec.num_comms,
            port=server.port, rendezvous=server.host, revision=place.spec.model_revision or None,
            transport=place.transport_of(spec), python=python, num_experts=spec.model.get("num_experts"),
            nccl_site=place.nccl_site(), deepep_v2_mode=place.spec.deepep_v2_mode, **role)

    def _world_step(self, spec: ServeSpec, server: SlurmServer, python: str,
                    gpus: int) -> list[tuple]:
        """An engine launched as one MPI world (lib.engines.base `launch`: TensorRT-LLM): one
        step over every node, a task per GPU (lib.places.slurm.sbatch.world_argv, Slurm's
        `slurm_mpi` plugin its wiring), every task the engine's 'task' command; task 0 serves HTTP on node
        0 (trtllm-llmapi-launch makes rank 0 the server), every task's output in the one log,
        labelled with its rank."""
        place = self.place
        argv, env = catalog.engine(spec.engine).command(
            self._engine_spec(spec, server, python, gpus, role="task"))
        if place.spec.model_cache_dir:
            env["HF_HOME"] = place.spec.model_cache_dir
        server.argv, server.env = list(argv), dict(env)
        name = f"guide-{place.stage.name}-{sbatch.slug(server.log_path.stem)}-world"
        server.step_names.append(name)
        return [(",".join(server.nodes), sbatch.world_argv(
            jobid=server.jobid, nodes=server.nodes, name=name,
            time_min=place.spec.time_limit_min, chdir=str(REPO_ROOT), argv=argv, env=env,
            unset=unset_vars(place.transport_of(spec)), tasks_per_node=gpus,
            mpi=place.spec.slurm_mpi, **place._in_image()), server.log_path)]

    def wait_ready(self, server: SlurmServer, spec: ServeSpec, add, started: float) -> None:
        """The local place's readiness loop on the leader's srun and node 0's port; for an
        expert-parallel engine then its logs gated (every node's), as the kube place gates its
        pods'."""
        place = self.place
        stage, engine = place.stage, catalog.engine(spec.engine)
        server.proc = server.step  # polled while it comes up: a step that ends ends the wait
        try:
            add(engine.wait_ready(stage, server, spec.timeout_s))
        finally:
            server.proc = None  # its processes are on a node: none of them is read here
        gpus_per_node = server.gpus // max(len(server.nodes), 1)
        if engine.expert_parallel and not server.ready:
            logs = {stage.rel(path): place.door.read_text(path) or "" for path in server.logs}
            if any(logs.values()):
                add(first_rank_gate(logs, gpus_per_node, list(logs)))
        if not engine.expert_parallel or not server.ready:
            return
        leader = self._settled_log(server, engine, gpus_per_node, started, spec.timeout_s)
        logs = {stage.rel(server.log_path): leader}
        logs.update({stage.rel(path): text for path, text in self._settled_node_logs(
            server.logs[1:], gpus_per_node).items()})
        server.startup_s = engine.startup_seconds(leader)
        evidence = list(logs)
        server.backend_gates = serve_gates(
            spec.engine, leader, logs, backend=spec.backend, nodes=len(server.nodes),
            gpus_per_node=gpus_per_node, num_experts=spec.model.get("num_experts"),
            enforce_eager=spec.enforce_eager, api_servers=gpus_per_node, log_name=evidence[0],
            evidence=evidence, transport=place.transport_of(spec),
            deepep_v2_mode=place.spec.deepep_v2_mode)
        for g in (server.backend_gates or []) + settings_gates(
                spec.engine, logs, backend=spec.backend, nodes=len(server.nodes),
                gpus_per_node=gpus_per_node, evidence=evidence,
                deepep_v2_mode=place.spec.deepep_v2_mode):
            add(g)

    def _settled_log(self, server: SlurmServer, engine, api_servers: int, started: float,
                     timeout_s: float) -> str:
        """The leader's log once the engine says every start-up line is in it (vLLM: one per
        API server, one per local DP rank), or as it is at the deadline. An engine that
        settles when quiet (lib.engines.base): once two looks read the same text."""
        place = self.place
        before: list[str] = []

        def look(elapsed) -> tuple[bool, str]:
            text = place.door.read_text(server.log_path) or ""
            quiet = not engine.settles_when_quiet or bool(text) and before[-1:] == [text]
            before[:] = [text]
            return engine.settled(text, api_servers) and quiet, text

        return wait_until(place.door, look, timeout_s, poll_s=served.POLL_INTERVAL_S,
                          started=started)

    def _settled_node_logs(self, paths: list[Path], gpus_per_node: int) -> dict[Path, str]:
        """The other nodes' logs (node k's at paths[k - 1]) once each holds NCCL's Init COMPLETE
        of every rank of its node and two looks a poll apart read it the same, or as they are
        after NODE_LOGS_SETTLE_S: the leader answers once every rank is up, but a step's output
        reaches the shared file system through srun late under load (node 2's log was read
        without its ranks once, which then 'never completed NCCL init'); a node whose ranks
        never come up costs at most that bound before its gates FAIL."""
        place = self.place
        before: dict[Path, str] = {}
        world = gpus_per_node * (len(paths) + 1)

        def up(node: int, text: str) -> bool:
            done = {c["rank"] for c in nccl_logs.nccl_comm_lines(text)
                    if c["nranks"] == world and c["state"] == "COMPLETE"}
            return set(range(node * gpus_per_node, (node + 1) * gpus_per_node)) <= done

        def look(elapsed) -> tuple[bool, dict[Path, str]]:
            texts = {path: place.door.read_text(path) or "" for path in paths}
            settled = all(up(k, text) and before.get(path) == text
                          for k, (path, text) in enumerate(texts.items(), 1))
            before.update(texts)
            return settled, texts

        return wait_until(place.door, look, NODE_LOGS_SETTLE_S,
                          poll_s=served.POLL_INTERVAL_S) if paths else {}

    def _stop_server(self, server: SlurmServer, *, release: bool) -> Gate | None:
        """Every step's srun stopped (door.stop: TERM, then KILL; srun ends its step), the
        allocation cancelled when `release`, then what is left: the server's steps in `squeue
        -s`, its port answering from here."""
        place = self.place
        if server.stopped:
            return None
        server.stopped = True
        door = place.door
        codes = [door.stop(h) for h in server.steps]
        exited = all(door.poll(h) is not None for h in server.steps)
        gone = place.release(server.jobid) if release else None
        left = waits.steps_gone(place.door, server.jobid, server.step_names)
        answer = door.http("GET", server.url + server.ready_path, timeout=ANSWER_TIMEOUT_S)
        answering = answer.status is not None
        ok = exited and left == [] and not answering and gone is not False
        observed = {"exit_codes": codes, "steps_left": left, "port_answering": answering}
        if release:
            observed["allocation_gone"] = gone
        print(f"server stopped (srun exit {', '.join(map(str, codes)) or 'none'}); "
              f"{'allocation ' + server.jobid + ' cancelled; ' if release else ''}port "
              f"{server.port} on {server.nodes[0] if server.nodes else '?'} "
              f"{'still answering' if answering else 'closed'}", flush=True)
        return gate("server stopped", ok, observed,
                    {"steps_left": [], "port_answering": False,
                     **({"allocation_gone": True} if release else {})},
                    f"{len(codes)} step(s) of job {server.jobid} stopped by their srun"
                    + (", the allocation cancelled (scancel) and gone from squeue" if release
                       else "; the allocation stays for the stage's other arms")
                    + f"; no step of the server in squeue -s: {left == []}; port "
                    f"{server.port} {'still answering' if answering else 'closed'}",
                    [place.stage.rel(p) for p in server.logs] or [])

    def read_model_config(self, server, model: dict[str, Any]):
        """The served model's config.json: transformers, the seeded model's file here (the
        shared file system); vLLM, read on node 0 where it downloaded it (a step, offline),
        kept as the stage's model_config.json."""
        place = self.place
        if not getattr(server, "backend", ""):
            return served.read_model_config(place.stage, model["model_dir"])
        cache = place.spec.model_cache_dir
        env = {"HF_HUB_OFFLINE": "1", **({"HF_HOME": cache} if cache else {})}
        call = place._run_step(sbatch.task_argv(
            jobid=server.jobid, node=server.nodes[0],
            name=f"guide-{place.stage.name}-model-config",
            time_min=place.spec.time_limit_min, chdir=str(REPO_ROOT),
            argv=[place.python, "-c", CONFIG_SCRIPT, model["model_dir"],
                  place.spec.model_revision or "main"], env=env, **place._in_image()),
            timeout=CONFIG_TIMEOUT_S, label="the served model's config.json")
        return saved_model_config(place.stage, call)
