"""What every served engine shares once it serves: the Server a place hands a stage, its
readiness loop, its stop, and what a ready server must answer (its model listed, an MoE config,
a chat answer with usage), whatever the engine (lib.engines.base).

Every observed value goes through the door (HTTP, /proc, the log), so a replay re-computes the
same gates without starting anything. The local `transformers serve` is lib.engines.transformers;
vLLM's local server lib.engines.vllm_server.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lib.core.door import Background
from lib.core.evidence import Gate, gate, skip

HOST = "127.0.0.1"
POLL_INTERVAL_S = 0.5
PROBE_TIMEOUT_S = 5.0
CHAT_TIMEOUT_S = 120.0
PROGRESS_EVERY_S = 15.0
LOG_TAIL_LINES = 25


def resolve_engine(engine: str) -> str:
    """The engine a stage serves with, given its `engine` parameter: lib.stages.opening.open_stage
    already turned '' into the machine's pick ('vllm' with 2+ GPUs and vllm importable, else
    'transformers') and refused an explicit 'vllm' where it cannot run."""
    return engine or "transformers"


@dataclass
class Server:
    model_dir: str
    port: int
    log_path: Path
    proc: Background | None = None
    ready: bool = False
    ready_s: float | None = None
    client_cores: str | None = None
    server_cores: str | None = None
    device: str = "cpu"
    stopped: bool = False
    gates: list[Gate] = field(default_factory=list)
    # the hub revision AIPerf loads the served model's tokenizer at, from the cache the engine
    # filled (None: `model_dir` is a folder, or the place's AIPerf has no such cache)
    tokenizer_revision: str | None = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def request(self, door, method: str, path: str, *, timeout: float, json_body=None):
        """One HTTP request to the server, through the door. Here: from this machine; a place
        whose server is reachable only from inside its cluster answers it from there."""
        return door.http(method, self.url + path, timeout=timeout, json_body=json_body)

    def run_aiperf(self, stage, argv_for, *, timeout: float, out: Path, name: str,
                   env: dict[str, str]):
        """One AIPerf cell against this server, its files into `out`, a CallResult back.
        `argv_for(aiperf, artifact_dir, cores)` builds AIPerf's argv (lib.measure.sweep's one
        builder; aiperf None: the guide's own AIPerf venv). Here: on this machine, through the
        door, on the client cores; a cluster's server runs it where the server runs."""
        return stage.door.run(argv_for(None, out, self.client_cores), timeout=timeout, env=env,
                              check=False)


def log_tail(door, log_path: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last lines of a log, read through the door (so a replay sees the same text)."""
    text = door.read_text(log_path)
    if text is None:
        return "(no log)"
    text = text.replace("\r", "\n")
    kept = [line for line in text.splitlines() if line.strip()][-lines:]
    return "\n".join(kept) or "(empty log)"


def listed_models(body: str) -> list[str]:
    try:
        return [m.get("id") for m in json.loads(body).get("data") or []]
    except (ValueError, AttributeError):
        return []


def poll_until_ready(stage, server: Server, timeout_s: float, *, path: str, who: str,
                     waiting_for: str, ready_note=lambda body: "") -> Gate:
    """The readiness loop every engine shares: the process's exit code, then GET `path`, until
    200, an exit, or the deadline; a FAIL carries the log's tail. `who` names the process in
    the messages ("the server", "vLLM"), `waiting_for` the progress lines (" for vLLM")."""
    door, name = stage.door, "server ready"
    evidence = [stage.rel(server.log_path)]
    started = door.now()
    next_note = PROGRESS_EVERY_S
    while True:
        rc = door.poll(server.proc)
        elapsed = round(door.now() - started, 1)
        if rc is not None:
            return gate(name, False, {"exit_code": rc, "after_s": elapsed}, "listening",
                        f"{who} exited with code {rc} after {elapsed} s; log tail:\n"
                        + log_tail(door, server.log_path), evidence)
        answer = server.request(door, "GET", path, timeout=PROBE_TIMEOUT_S)
        if answer.status == 200:
            server.ready, server.ready_s = True, elapsed
            print(f"{'server' if who == 'the server' else who} ready after {elapsed} s",
                  flush=True)
            return gate(name, True, {"ready_after_s": elapsed, "port": server.port},
                        {"within_s": timeout_s}, f"GET {path} answered 200 after {elapsed} s"
                        + ready_note(answer.body), evidence)
        if elapsed >= timeout_s:
            seen = answer.error or f"HTTP {answer.status}"
            return gate(name, False, {"waited_s": elapsed, "last_probe": seen},
                        {"within_s": timeout_s},
                        f"not ready within {timeout_s:.0f} s (last probe: {seen}); log tail:\n"
                        + log_tail(door, server.log_path), evidence)
        if elapsed >= next_note:
            print(f"  still waiting{waiting_for}: {elapsed:.0f} s of {timeout_s:.0f} s", flush=True)
            next_note += PROGRESS_EVERY_S
        door.sleep(POLL_INTERVAL_S)


def process_ids(door, pid: int) -> list[int]:
    """The server's PID and its children's (transformers serve forks none today)."""
    children = door.read_text(f"/proc/{pid}/task/{pid}/children") or ""
    return [pid] + [int(p) for p in children.split() if p.isdigit()]


def pid_alive(door, pid: int) -> bool:
    stat = door.read_text(f"/proc/{pid}/stat")
    if stat is None:
        return False
    state = stat.rsplit(")", 1)[-1].split()[:1]
    return bool(state) and state[0] not in ("Z", "X")


def rss_bytes(door, pids: list[int]) -> int | None:
    """Resident memory (VmRSS) summed over live pids, read from /proc through the door."""
    total, seen = 0, False
    for pid in pids:
        status = door.read_text(f"/proc/{pid}/status") or ""
        for line in status.splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1]) * 1024
                seen = True
    return total if seen else None


def server_rss(door, server: Server) -> int | None:
    if server.proc is None:
        return None
    return rss_bytes(door, process_ids(door, server.proc.pid))


def stop_server(stage, server: Server) -> Gate | None:
    """Stop by PID (TERM, then KILL, the whole group) and gate that nothing is left."""
    if server.stopped or server.proc is None:
        return None
    door = stage.door
    pids = process_ids(door, server.proc.pid)
    rc = door.stop(server.proc)
    server.stopped = True
    exited = door.poll(server.proc)
    alive = [p for p in pids if pid_alive(door, p)]
    listening = door.port_listening(server.port)
    # the whole process group, as the door saw it when its stop returned (workers are
    # grandchildren of vLLM's leader); absent from runs recorded before the door reported it
    group_left = server.proc.group_left
    ok = exited is not None and not alive and not listening and not group_left
    observed = {"exit_code": rc, "pids_alive": alive, "port_listening": listening}
    if group_left is not None:
        observed["group_left"] = group_left
    print(f"server stopped (exit code {rc}); port {server.port} "
          f"{'still listening' if listening else 'closed'}", flush=True)
    return gate("server stopped", ok, observed,
                {"pids_alive": [], "port_listening": False,
                 **({"group_left": []} if group_left is not None else {})},
                f"stopped by PID {server.proc.pid} (its process group); port {server.port} "
                f"{'still listening' if listening else 'closed'}",
                [stage.rel(server.log_path)])


def models_gate(stage, server: Server) -> tuple[Gate, dict | None]:
    answer = server.request(stage.door, "GET", "/v1/models", timeout=PROBE_TIMEOUT_S)
    ids = listed_models(answer.body)
    want = stage.door.norm(server.model_dir)
    body = _json_or_none(answer.body)
    return gate("/v1/models lists the model", answer.status == 200 and want in ids,
                {"status": answer.status, "models": ids}, {"status": 200, "model": want},
                answer.error or "", []), body


def read_model_config(stage, model_dir: str | Path) -> tuple[dict | None, str | None]:
    """config.json through the door; saved as the stage artifact model_config.json."""
    text = stage.door.read_text(Path(model_dir) / "config.json")
    if text is None:
        return None, None
    saved = stage.write_text("model_config.json", text)
    return _json_or_none(text), saved


def moe_gate(config: dict | None, saved: str | None, model_dir: str) -> Gate:
    name = "model config is a Mixture of Experts"
    if config is None:
        return gate(name, False, None, {"num_experts": ">1"},
                    f"no readable config.json in {model_dir}", [])
    experts = config.get("num_experts", config.get("num_local_experts"))
    top_k = config.get("num_experts_per_tok")
    ok = isinstance(experts, int) and experts > 1 and isinstance(top_k, int) and 0 < top_k < experts
    return gate(name, ok, {"model_type": config.get("model_type"), "num_experts": experts,
                           "num_experts_per_tok": top_k},
                {"num_experts": ">1", "num_experts_per_tok": "1..num_experts-1"},
                f"{config.get('architectures')}: top-{top_k} of {experts} experts", [saved])


CHAT_PROMPT = "In one sentence: what does an expert-parallel all-to-all do?"


def chat_gate(stage, server: Server, max_tokens: int = 16) -> tuple[Gate, dict]:
    """A chat request must answer 200 with non-empty content and a usage block."""
    request = {"model": server.model_dir, "max_tokens": max_tokens,
               "messages": [{"role": "user", "content": CHAT_PROMPT}]}
    answer = server.request(stage.door, "POST", "/v1/chat/completions",
                            timeout=CHAT_TIMEOUT_S, json_body=request)
    body = _json_or_none(answer.body) or {}
    choices = body.get("choices") or [{}]
    content = ((choices[0] or {}).get("message") or {}).get("content") or ""
    usage = body.get("usage") or None
    has_usage = bool(usage) and (usage.get("completion_tokens") or 0) > 0
    ok = answer.status == 200 and bool(content.strip()) and has_usage
    problems = [p for p, bad in (
        (f"HTTP {answer.status}" + (f" ({answer.error})" if answer.error else ""),
         answer.status != 200),
        ("empty content", not content.strip()),
        ("no usage (or 0 completion tokens)", not has_usage)) if bad]
    reason = ("answered 200 with content and usage" if ok else
              "; ".join(problems) + f"; body: {answer.body[:300]}")
    data = {"status": answer.status, "content": content, "usage": usage,
            "duration_s": answer.duration_s, "body": body}
    return gate("chat request answers with content and usage", ok,
                {"status": answer.status, "content_chars": len(content), "usage": usage},
                {"status": 200, "content": "non-empty", "usage": "completion_tokens > 0"},
                reason, [f"calls/{stage.name}/{answer.seq:04d}.body"]), data


def skip_gates(names: list[str], reason: str) -> list[Gate]:
    return [skip(n, reason) for n in names]


def _json_or_none(text: str) -> Any:
    try:
        return json.loads(text)
    except (TypeError, ValueError):
        return None
