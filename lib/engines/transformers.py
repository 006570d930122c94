"""The local server: the seeded MoE behind ``transformers serve``, started and stopped by the door.

``local_server(stage, model_dir, timeout_s=...)`` is the one way a stage gets a server on the local
context (the local place serves its ServeSpec through it, the timeout the spec's)::

    with local_server(stage, model_dir, timeout_s=spec.timeout_s) as server:
        if server.ready:
            ...  # requests to server.url

It starts ``transformers serve MODEL_DIR --host 127.0.0.1 --port P --device cpu
--continuous-batching --cb-num-blocks 128 --cb-max-batch-tokens 1024`` through ``door.start``
(its own session, its log an artifact in the stage folder), pinned to the first allowed core when
the machine has two or more (the client gets the others), with HF_HUB_OFFLINE=1 and HF_HOME in
the repository's .cache. It waits for readiness under a deadline, polling ``GET /v1/models`` and
the process (a crash ends the wait at once), and adds the gate ``server ready`` (a FAIL carries
the tail of the server's log). On exit, normal or not, it stops the server by its PID (the whole
process group: ``door.stop``) and adds the gate ``server stopped``: exited, no process of its
group left, the port no longer listening. ``stage.on_exit`` holds a backstop that stops it too.

Everything observed goes through the door, so a replay re-computes the same gates without
starting anything.
"""
from __future__ import annotations

import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from lib.core.door import REPO_ROOT
from lib.core.errors import DoorError
from lib.core.evidence import Gate, gate
from lib.engines.base import Engine, EngineSpec
from lib.engines.devices import cuda_device_count
from lib.engines.server import (HOST, Server, _json_or_none, listed_models, poll_until_ready,
                                stop_server)

CB_NUM_BLOCKS = 128  # bound the continuous-batching cache: by default it sizes itself from RAM
CB_MAX_BATCH_TOKENS = 1024
HF_HOME = REPO_ROOT / ".cache" / "hf"
MODEL_BUILD_TIMEOUT_S = 900


# ---- host facts ------------------------------------------------------------------------------
def parse_cpu_list(text: str) -> list[int]:
    """'0-3,6,8-9' -> [0, 1, 2, 3, 6, 8, 9]."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        low, _, high = part.partition("-")
        cpus.extend(range(int(low), int(high or low) + 1))
    return sorted(set(cpus))


def allowed_cpus(door) -> list[int]:
    """The cores this process (hence its children) may run on, read through the door."""
    status = door.read_text("/proc/self/status") or ""
    for line in status.splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return parse_cpu_list(line.split(":", 1)[1])
    return []


def cpu_split(cpus: list[int]) -> tuple[str | None, str | None]:
    """(server cores, client cores) for taskset -c; (None, None) below two cores."""
    if len(cpus) < 2:
        return None, None
    return str(cpus[0]), ",".join(str(c) for c in cpus[1:])


def pinned(argv: list[str], cores: str | None) -> list[str]:
    return ["taskset", "-c", cores, *argv] if cores else list(argv)


# ---- engines and the model ---------------------------------------------------------------------


def model_flavor(engine: str) -> str:
    """lib.models' flavor per engine: the tiny CPU model, or the default model's layer shape."""
    return "vllm" if engine == "vllm" else "tiny"


def build_model(stage, engine: str = "transformers", *, seed: int,
                layers: int) -> tuple[dict[str, Any] | None, Gate]:
    """`python -m lib.engines.models build` through the door (recorded; a replay never builds), the
    model drawn from `seed` with `layers` decoder layers (the stage's `seed` and `model_layers`,
    handed down by its place).

    Returns (its JSON with model_dir as a path on this machine, or None when it failed; the gate
    `model built from its seed`)."""
    name = "model built from its seed"
    argv = [sys.executable, "-m", "lib.engines.models", "build", "--seed", str(seed),
            "--layers", str(layers)]
    if model_flavor(engine) != "tiny":
        argv += ["--flavor", model_flavor(engine)]
    call = stage.door.run(argv, cwd=REPO_ROOT, timeout=MODEL_BUILD_TIMEOUT_S, check=False)
    streams = [f"calls/{stage.name}/{call.seq:04d}.stdout",
               f"calls/{stage.name}/{call.seq:04d}.stderr"]
    lines = call.stdout.strip().splitlines()
    info = _json_or_none(lines[-1]) if call.ok and lines else None
    if not isinstance(info, dict) or "model_dir" not in info:
        tail = "\n".join((call.stderr or call.stdout).strip().splitlines()[-15:])
        return None, gate(name, False, {"exit_code": call.rc, "timed_out": call.timed_out},
                          {"exit_code": 0}, f"python -m lib.engines.models build failed; its output "
                          f"ends:\n{tail}", streams)
    info["model_dir"] = stage.door.denorm(info["model_dir"])
    info["evidence"] = streams[:1]
    return info, gate(name, True,
                      {"config_hash": info["config_hash"], "seed": info["seed"],
                       "parameters": info["parameters"], "num_experts": info["num_experts"]},
                      {"seed": seed},
                      f"{'built' if info['built'] else 'found in the cache'}: "
                      f"{stage.door.norm(info['model_dir'])}", streams[:1])


# ---- the server ---------------------------------------------------------------------------------
def serve_argv(model_dir: str | Path, port: int, cores: str | None = None,
               device: str = "cpu", host: str = HOST,
               console_script: str | None = None) -> list[str]:
    """The one place transformers serve's flags are decided. `console_script`: the program as
    the nodes run it (None: this interpreter's)."""
    transformers_cli = console_script or str(Path(sys.executable).parent / "transformers")
    return pinned([
        transformers_cli, "serve", str(model_dir), "--host", host, "--port", str(port),
        "--device", device, "--continuous-batching", "--cb-num-blocks", str(CB_NUM_BLOCKS),
        "--cb-max-batch-tokens", str(CB_MAX_BATCH_TOKENS),
    ], cores)


def serve_env() -> dict[str, str]:
    return {"HF_HUB_OFFLINE": "1", "HF_HOME": str(HF_HOME), "PYTHONUNBUFFERED": "1"}


def wait_ready(stage, server: Server, timeout_s: float) -> Gate:
    """Poll the process and GET /v1/models until it answers 200, it exits, or time is up.

    Ready means the HTTP API answers. Whether it lists the model is a gate of its own: transformers
    5.17 lists only the Hugging Face cache there, never the served path (seen on the H200s)."""
    want = stage.door.norm(server.model_dir)
    print(f"waiting up to {timeout_s:.0f} s for transformers serve at {server.url} "
          f"(GET /v1/models answers 200; log {stage.rel(server.log_path)})", flush=True)
    return poll_until_ready(
        stage, server, timeout_s, path="/v1/models", who="the server", waiting_for="",
        ready_note=lambda body: f" ({'listing' if want in listed_models(body) else 'not listing'}"
                                " the model)")


@contextmanager
def local_server(stage, model_dir: str | Path, *, timeout_s: float, port: int | None = None,
                 log_name: str = "server.log") -> Iterator[Server]:
    """Serve model_dir for the duration of the block; gates `server ready` (within `timeout_s`,
    the stage's server_timeout_s) / `server stopped`.

    Yields the Server even when it is not ready (server.ready False, its FAIL gate added), so the
    caller gates what depends on it as SKIP with the reason. Never outlives the block.
    """
    door = stage.door
    timeout_s = float(timeout_s)
    server_cores, client_cores = cpu_split(allowed_cpus(door))
    device = "cuda" if cuda_device_count(door) else "cpu"
    port = port or door.free_port()
    log_path = stage.path(log_name)
    server = Server(str(model_dir), port, log_path, server_cores=server_cores,
                    client_cores=client_cores, device=device)

    def add(g: Gate | None) -> None:
        if g is not None:
            server.gates.append(g)
            stage.add(g)

    def backstop() -> None:
        if not server.stopped and server.proc is not None:
            add(stop_server(stage, server))

    if not stage.replay:
        # transformers 5.17 answers /v1/models with 500 unless the hub cache folder exists
        (HF_HOME / "hub").mkdir(parents=True, exist_ok=True)
    print(f"starting transformers serve {door.norm(str(model_dir))} on {HOST}:{port} ({device})"
          f"{f' pinned to core {server_cores}' if server_cores else ''}", flush=True)
    try:
        server.proc = door.start(serve_argv(model_dir, port, server_cores, device), log_path=log_path,
                                 env=serve_env())
    except DoorError as exc:
        add(gate("server ready", False, {"started": False}, "listening",
                 f"could not start the server: {exc}", []))
        yield server
        return
    stage.on_exit(backstop)
    try:
        add(wait_ready(stage, server, timeout_s))
        yield server
    finally:
        add(stop_server(stage, server))


# ---- the engine --------------------------------------------------------------------------------
class TransformersEngine(Engine):
    """`transformers serve` (lib.engines.base): one process on one node, the CPU default. Its
    logs prove no all-to-all backend (it has none: experts run in one process)."""

    name = "transformers"
    title = "transformers serve"
    ready_path = "/v1/models"

    def command(self, spec: EngineSpec) -> tuple[list[str], dict[str, str]]:
        return (serve_argv(spec.model, spec.port, spec.cores, spec.device, spec.host or HOST,
                           spec.console_script), serve_env())

    def process_words(self, spec: EngineSpec) -> list[str]:
        return ["transformers", "serve"]

    def wait_ready(self, stage, server, timeout_s: float):
        return wait_ready(stage, server, timeout_s)

    def first_fatal(self, text: str) -> str | None:
        """The last line of a Python traceback (its exception), or None."""
        lines = [line for line in text.replace("\r", "\n").splitlines() if line.strip()]
        if not any(line.startswith("Traceback (most recent call last)") for line in lines):
            return None
        return next((line for line in reversed(lines) if not line.startswith(" ")), None)

