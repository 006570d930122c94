"""The local vLLM server: one machine, 2+ GPUs, TP1 x DP = EP, started and stopped by the door.

``vllm_server(stage, model_dir, gpus=2, backend=..., num_experts=64, nccl_site=SITE)`` is the
engine='vllm' counterpart of ``lib.serve.local_server``::

    with vllm_server(stage, model_dir, gpus=2, backend="deepep_v2", num_experts=64,
                     nccl_site=site) as server:
        if server.ready and server.backend_ok:
            ...  # requests to server.url (model name: the model_dir, as vLLM lists it)

argv and env come only from ``lib.vllm_args.vllm_serve(role='local', dp_size=gpus,
dp_size_local=gpus, transport='intranode_nvlink', ...)``: this module adds no flag of its own
(the model is served under its path, so lib.serve's models_gate and chat_gate work unchanged).
What it is asked is what the stage's parameter model accepted (a removed backend such as 'naive'
is refused there, before anything starts) and what the local place decided (its 2+ GPUs: the
place refuses engine 'vllm' on fewer), handed down: nothing is checked again here.

The process starts through ``door.start`` (its own session; its whole output is the artifact
``<stage>/vllm.log``). Readiness: ``GET /health`` answers 200 within ``timeout_s``, the process
polled each round (a crash ends the wait at once, its log tail in the FAIL). Then the backend
gates of ``lib.vllm_logs.assert_backend`` on the log read through ``door.read_text`` (a replay
reads the recorded log): the manager vLLM actually built, the EP split, the prepare/finalize
class, one "Application startup complete." per API server, no fallback / legacy buffer. When
the server never got ready they are SKIP with that reason. On exit, normal or not, it is stopped
by PID (its process group) with the gate ``server stopped`` (lib.engines.server.stop_server: exited, no
process left, port closed); ``stage.on_exit`` holds a backstop.
"""
from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterator

from lib.engines import vllm_logs
from lib.core.errors import DoorError
from lib.core.evidence import Gate, gate, read_json, skip
from lib.engines.server import POLL_INTERVAL_S, Server, poll_until_ready, stop_server
from lib.engines.vllm_args import HYBRID_MODE_VAR, vllm_serve
from lib.engines.deepep import DEFAULT_MODE

LOG_NAME = "vllm.log"
# The interpreter that runs vLLM's CLI module (a test points it at a double of vLLM).
PYTHON = sys.executable
# Each server takes this share of each GPU's memory: small enough that the A/B arms of
# 06_multicomm can be served side by side (3 x 0.25), ample for the seeded model's KV cache.
GPU_MEMORY_UTILIZATION = 0.25
MAX_MODEL_LEN = 2048
TRANSPORT = "intranode_nvlink"  # one machine: NVLink, GIN off (lib.transport)
READY_PATH = "/health"  # vLLM 0.24.0's route (its log lists "Route: /health, Methods: GET")
STARTUP_LINE = "Application startup complete."
BACKEND_GATES = ("vllm_all2all_manager", "vllm_ep_split", "vllm_prepare_finalize",
                 "vllm_api_servers_ready", "vllm_no_fallback_no_legacy_buffer")
EP_OFF_GATES = ("vllm_expert_parallel_off", "vllm_api_servers_ready")


@dataclass
class VllmServer(Server):
    backend: str = ""
    gpus: int = 0
    argv: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    startup_s: float | None = None  # lib.vllm_logs.startup_seconds: first log line to ready
    backend_gates: list[dict] = field(default_factory=list)

    @property
    def backend_ok(self) -> bool:
        """Every backend gate passed: only then is a measurement one of `backend`."""
        return bool(self.backend_gates) and all(g["status"] == "PASS"
                                                for g in self.backend_gates)


def mode_gates_of(text: str, *, backend: str, gpus: int, num_experts: int | None,
                  expert_parallel: bool, enforce_eager: bool, log_name: str) -> list[dict]:
    """What vLLM's log proves about the serve asked for: the all-to-all backend and EP split (or
    their absence without EP), every API server, and eager vs CUDA graphs."""
    if expert_parallel:
        gates = vllm_logs.assert_backend(text, backend, dp_size=gpus, num_experts=num_experts,
                                         log_name=log_name)
    else:
        gates = [vllm_logs.expert_parallel_off_gate(text, dp_size=gpus, log_name=log_name),
                 vllm_logs.api_servers_gate(text, gpus, log_name=log_name)]
    return gates + [vllm_logs.compile_mode_gate(text, enforce_eager, log_name=log_name)]


def _startup_lines(text: str | None) -> int:
    return (text or "").count(STARTUP_LINE)


def wait_ready(stage, server: VllmServer, timeout_s: float) -> Gate:
    """Poll the process and GET /health until it answers 200, the process exits, or time is up."""
    print(f"waiting up to {timeout_s:.0f} s for vLLM (DP={server.gpus}, all2all backend "
          f"{server.backend}) at {server.url} (GET {READY_PATH} answers 200; log "
          f"{stage.rel(server.log_path)})", flush=True)
    return poll_until_ready(stage, server, timeout_s, path=READY_PATH, who="vLLM",
                            waiting_for=" for vLLM")


def read_settled_log(stage, server: VllmServer, started: float, timeout_s: float) -> str:
    """The log once every API server logged its startup (one per GPU: vLLM defaults
    api_server_count to DP), or as it is when the deadline comes. /health can answer from
    ApiServer_0 a moment before ApiServer_1 writes its line."""
    door = stage.door
    while True:
        text = door.read_text(server.log_path) or ""
        if _startup_lines(text) >= server.gpus or door.now() - started >= timeout_s:
            return text
        door.sleep(POLL_INTERVAL_S)


def skip_mode_gates(add: Callable[[Gate], None], expert_parallel: bool, reason: str) -> None:
    """Every gate of the serve asked for as SKIP: there is no log of a running server to read."""
    for name in ((BACKEND_GATES if expert_parallel else EP_OFF_GATES)
                 + ("vllm_compile_mode", "nccl_init_per_rank")):
        add(skip(name, reason))


def gate_adder(stage, server: VllmServer,
               gate_prefix: str) -> Callable[[Gate | dict | None], None]:
    """How the server's gates are recorded: on the server and the stage, named with
    ``gate_prefix`` when it is one server among several."""
    def add(g: Gate | dict | None) -> None:
        if g is not None:
            g = g if isinstance(g, Gate) else Gate(**g)
            if gate_prefix:
                g = replace(g, gate=f"{gate_prefix}: {g.gate}")
            server.gates.append(g)
            stage.add(g)
    return add


def start_process(door, server: VllmServer, add: Callable[[Gate | dict | None], None],
                  expert_parallel: bool) -> bool:
    """Start the server's process through the door; whether it started. When the door cannot
    start it: `server ready` FAILs with the door's reason and every mode gate is SKIP."""
    try:
        server.proc = door.start(server.argv, log_path=server.log_path, env=server.env)
        if server.proc.env is not None:  # as recorded: {repo} for this checkout, secrets masked
            server.env = server.proc.env
    except DoorError as exc:
        add(gate("server ready", False, {"started": False}, "listening",
                 f"could not start vLLM: {exc}", []))
        skip_mode_gates(add, expert_parallel,
                        "vLLM could not be started (see the gate 'server ready')")
        return False
    return True


def run_site_patches(stage) -> list[dict] | None:
    """The vLLM site patches the run recorded (run.json `site_patches`, lib.stages.opening)."""
    record = stage.run_dir / "run.json"
    run = read_json(record) if record.is_file() else None
    return run.get("site_patches") if isinstance(run, dict) else None


def assert_serve(stage, server: VllmServer, add: Callable[[Gate | dict | None], None],
                 started: float, timeout_s: float, *, num_experts: int | None,
                 expert_parallel: bool, enforce_eager: bool, gate_prefix: str) -> None:
    """A ready server's gates from its settled log: the mode gates (backend, EP split, eager or
    graphs) and NCCL's per-rank init; one line says whether it is the serve asked for."""
    text = read_settled_log(stage, server, started, timeout_s)
    server.startup_s = vllm_logs.startup_seconds(text)
    log_name = stage.rel(server.log_path)
    server.backend_gates = mode_gates_of(text, backend=server.backend, gpus=server.gpus,
                                         num_experts=num_experts,
                                         expert_parallel=expert_parallel,
                                         enforce_eager=enforce_eager, log_name=log_name)
    for g in server.backend_gates:
        add(g)
    add(vllm_logs.per_rank_nccl(text, server.gpus, log_name=log_name))
    if expert_parallel and server.backend == "deepep_v2":  # patch 0002's line, where applied
        given = "hybrid" if server.env.get(HYBRID_MODE_VAR) == "1" else "direct"
        for g in vllm_logs.patch_0002_gates(text, server.gpus, mode=given,
                                            site_patches=run_site_patches(stage),
                                            log_name=log_name):
            add(g)
    failed = [g["gate"] for g in server.backend_gates if g["status"] != "PASS"]
    asked = (f"backend {server.backend}" if expert_parallel else "no expert parallelism")
    print(f"{gate_prefix + ': ' if gate_prefix else ''}{asked}, "
          f"{'eager' if enforce_eager else 'CUDA graphs'}: "
          + (f"NOT as requested ({', '.join(failed)})" if failed
             else "as requested (all gates PASS)"), flush=True)


@contextmanager
def vllm_server(stage, model_dir: str | Path, *, gpus: int,
                backend: str = "allgather_reducescatter", num_experts: int | None,
                enforce_eager: bool = True, timeout_s: float,
                port: int | None = None, python: str | None = None,
                nccl_site: str | Path | None = None, max_model_len: int | None = MAX_MODEL_LEN,
                gpu_memory_utilization: float | None = GPU_MEMORY_UTILIZATION,
                ep_num_comms: int = 1,
                expert_parallel: bool = True, gate_prefix: str = "",
                log_name: str = LOG_NAME,
                deepep_dir: str | Path | None = None,
                deepep_v2_mode: str = DEFAULT_MODE) -> Iterator[VllmServer]:
    """Serve model_dir with vLLM on this machine's `gpus` GPUs (2 or more) for the duration of
    the block, waiting up to `timeout_s` for it to be ready (the stage's server_timeout_s).

    Gates: `server ready`, the five backend gates of lib.vllm_logs.assert_backend (with
    ``expert_parallel=False`` instead: no EP split, and at DP > 1 vLLM's
    AllGather+ReduceScatter fallback and no other manager) and the
    compile-mode gate (eager or CUDA graphs, as asked), all SKIP when not ready; NCCL's per-rank
    init (a per-rank source beside the rank-0-only lines); `server stopped`. ``gate_prefix``
    names the gates of one server among several ("graphs+EP: server ready"). Yields the server
    even when it is not ready (server.ready False). ``nccl_site``: the site-packages holding NCCL
    2.30.4 (the intranode transport preloads it for DeepEP); ``deepep_dir``: DeepEP built in
    place here, put on the server's PYTHONPATH with the site (``lib.transport.deepep_pythonpath``).
    """
    door = stage.door
    timeout_s = float(timeout_s)
    port = port or door.free_port()
    # The one builder of its argv and env
    argv, env = vllm_serve("local", model=str(model_dir), backend=backend, dp_size=gpus,
                           dp_size_local=gpus, port=port, enforce_eager=enforce_eager,
                           max_model_len=max_model_len,
                           gpu_memory_utilization=gpu_memory_utilization,
                           ep_num_comms=ep_num_comms, transport=TRANSPORT, nccl_site=nccl_site,
                           python=python or PYTHON,
                           expert_parallel=expert_parallel, deepep_dir=deepep_dir,
                           inherited_pythonpath=os.environ.get("PYTHONPATH"),
                           deepep_v2_mode=deepep_v2_mode)
    log_path = stage.path(log_name)
    server = VllmServer(str(model_dir), port, log_path, device="cuda", backend=backend,
                        gpus=gpus, argv=argv, env=env)
    add = gate_adder(stage, server, gate_prefix)

    def backstop() -> None:
        if not server.stopped and server.proc is not None:
            add(stop_server(stage, server))

    print(f"starting vLLM {door.norm(str(model_dir))} on port {port}: DP={gpus} x TP1 = EP"
          f"{gpus}, all2all backend {backend}", flush=True)
    started = door.now()
    if not start_process(door, server, add, expert_parallel):
        yield server
        return
    stage.on_exit(backstop)
    try:
        add(wait_ready(stage, server, timeout_s))
        if server.ready:
            assert_serve(stage, server, add, started, timeout_s, num_experts=num_experts,
                         expert_parallel=expert_parallel, enforce_eager=enforce_eager,
                         gate_prefix=gate_prefix)
        else:
            skip_mode_gates(add, expert_parallel, "vLLM never became ready (see the gate "
                            "'server ready' and its log tail): no backend to assert")
        yield server
    finally:
        add(stop_server(stage, server))
