"""lib.serve and stage 04 for real: the seeded model behind a real transformers serve.

Every server here is a real process on a free 127.0.0.1 port; the fault paths (port taken,
model dir missing, a crash on a corrupted config) are real failures of the real server.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import time
from pathlib import Path

import pytest

from lib.engines import models
from lib.stages import registry as params
from lib.engines import transformers as serve
from lib.engines import server as served
from lib.core.door import Door, read_transcript
from lib.core.processes import group_alive
from lib.core.evidence import read_gates
from lib.core.stage import Stage
from lib.stages import serve as serve_stage

FAULT_TIMEOUT_S = 120.0  # a fault must end the wait well before this


def make_stage(run_dir: Path, name: str = "04_serve", given: dict | None = None) -> Stage:
    p = params.resolve(name, given or {})  # context plan: its door plans, as the opener's
    return Stage(name, p, run_dir, Door(run_dir, name, plan=p["context"] == "plan"), None)


def by_name(gates) -> dict:
    return {g.gate if hasattr(g, "gate") else g["gate"]: g for g in gates}


def listening(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        return s.connect_ex(("127.0.0.1", port)) == 0


def pid_running(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] not in ("Z", "X")


@pytest.fixture(scope="module")
def model_dir() -> str:
    return models.build(0)["model_dir"]  # the repository's cache, as the stage uses it


def test_stage_04_serves_answers_stops_and_replays(tmp_path):
    run_dir = tmp_path / "run"
    stage = make_stage(run_dir)
    data = serve_stage.run(stage)
    serve_stage.show(stage, data)
    stage.finish()
    gates = read_gates(stage.dir)
    assert [g["status"] for g in gates] == ["PASS"] * len(gates), gates
    assert set(by_name(gates)) == {
        "model built from its seed", "server ready", "/v1/models lists the model",
        "model config is a Mixture of Experts", "chat request answers with content and usage",
        "server stopped"}
    assert data["chat"]["content"].strip() and data["chat"]["usage"]["completion_tokens"] > 0
    assert data["config"]["num_local_experts"] == 8
    assert data["rss_bytes"] and data["rss_bytes"] < 1.5 * 2 ** 30
    # nothing left: the pid is gone and nothing listens on the port
    start = next(e for e in read_transcript(run_dir / "transcript.jsonl") if e["kind"] == "start")
    assert not pid_running(start["pid"])
    assert not listening(data["port"])
    for artifact in ("server.log", "model.json", "model_config.json", "chat_response.json",
                     "models_response.json", "gates.json"):
        assert (stage.dir / artifact).is_file(), artifact
    assert "Uvicorn running" in (stage.dir / "server.log").read_text()

    # replay a copy: the same gates, re-computed with no process started
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    transcript = (copy / "transcript.jsonl").read_bytes()
    log = (copy / "04_serve" / "server.log").read_bytes()
    replay = Stage("04_serve", stage.params, copy, Door(copy, "04_serve", replay=True), run_dir)
    started = time.monotonic()
    again = serve_stage.run(replay)
    serve_stage.show(replay, again)
    replay.finish()  # raises ReplayMismatch when the gates differ or calls are left unasked
    assert time.monotonic() - started < 5.0  # a real server takes longer than this to start
    assert [g.as_dict() for g in replay.gates] == gates
    assert (copy / "transcript.jsonl").read_bytes() == transcript  # nothing recorded
    assert (copy / "04_serve" / "server.log").read_bytes() == log  # no server wrote its log
    assert again["chat"] == data["chat"] and again["port"] == data["port"]


def _fault(stage: Stage, model: str | Path, port: int | None = None) -> tuple[dict, float]:
    started = time.monotonic()
    with serve.local_server(stage, model, timeout_s=FAULT_TIMEOUT_S, port=port) as server:
        assert not server.ready
    took = time.monotonic() - started
    gates = by_name(stage.gates)
    assert gates["server ready"].status == "FAIL"
    assert gates["server stopped"].status == "PASS", gates["server stopped"]
    assert not server.proc or not pid_running(server.proc.pid)
    assert took < FAULT_TIMEOUT_S
    return gates, took


def test_port_taken_fails_with_log_tail(tmp_path, model_dir):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))  # bound, so the server cannot bind it
        port = taken.getsockname()[1]
        gates, _ = _fault(make_stage(tmp_path / "run"), model_dir, port=port)
    ready = gates["server ready"]
    assert "address already in use" in ready.reason
    assert "exited with code" in ready.reason


def test_missing_model_dir_fails_with_log_tail(tmp_path):
    gates, _ = _fault(make_stage(tmp_path / "run"), tmp_path / "no-such-model")
    assert "no-such-model" in gates["server ready"].reason
    assert "exited with code" in gates["server ready"].reason


def test_crash_on_corrupted_config_fails_with_log_tail(tmp_path, model_dir):
    broken = tmp_path / "broken-model"
    shutil.copytree(model_dir, broken)
    (broken / "config.json").write_text('{"model_type": "qwen3_moe", "hidden_size": ')
    gates, _ = _fault(make_stage(tmp_path / "run"), broken)
    assert "not a valid JSON" in gates["server ready"].reason


def test_deadline_ends_the_wait_and_stops_the_server(tmp_path, model_dir):
    stage = make_stage(tmp_path / "run")
    started = time.monotonic()
    with serve.local_server(stage, model_dir, timeout_s=1.0) as server:
        assert not server.ready
    assert time.monotonic() - started < 30
    gates = by_name(stage.gates)
    assert gates["server ready"].status == "FAIL"
    assert "not ready within 1 s" in gates["server ready"].reason
    assert gates["server stopped"].status == "PASS"
    assert not pid_running(server.proc.pid)


def test_backstop_stops_a_server_left_running(tmp_path, model_dir):
    """An exception inside the block still stops the server (the context manager's finally)."""
    stage = make_stage(tmp_path / "run")
    with pytest.raises(RuntimeError, match="boom"):
        with serve.local_server(stage, model_dir,
                                timeout_s=stage["server_timeout_s"]) as server:
            assert server.ready
            pid = server.proc.pid
            raise RuntimeError("boom")
    assert not pid_running(pid) and not listening(server.port)
    assert by_name(stage.gates)["server stopped"].status == "PASS"
    stage.close_resources()  # the on_exit backstop: a no-op once stopped
    assert len([g for g in stage.gates if g.gate == "server stopped"]) == 1


@pytest.mark.parametrize("context, said", [
    ("plan", "planned, not run"),          # rendered and checked, not applied
])
def test_a_place_that_cannot_serve_skips_with_its_reason(tmp_path, context, said):
    """A plan cannot serve: a SKIP. A cluster that does not answer is a FAIL, not a SKIP
    (tests/test_refusals.py); the slurm place without an image or a venv is a SKIP once its
    cluster answered (tests/test_slurm_place.py)."""
    # engine '' resolves to the place's pick when a notebook opens the stage: vLLM on a cluster
    stage = make_stage(tmp_path / "run", given={"context": context, "engine": "vllm"})
    data = serve_stage.run(stage)
    assert data["skipped"]
    skipped = [g for g in stage.gates if g.status == "SKIP"]
    assert [g.gate for g in skipped] == serve_stage.CLUSTER_GATES
    assert all(said in g.reason for g in skipped), [g.reason for g in skipped]
    assert not [g for g in stage.gates if g.status == "FAIL"]


def test_engine_picked_by_hardware_here(tmp_path):
    """The local place says why this machine cannot serve with vLLM; the stage layer refuses
    the parameter with it (lib.stages.rules_places), before any effect."""
    from lib.core.params import ParameterError
    from lib.places import PlaceSpec
    from lib.places.local import engine_for_this_machine, engine_refusal_here
    from lib.stages.rules_places import check_engine_here

    assert engine_for_this_machine() == "transformers"  # no vllm (and no GPU) here
    assert "needs 2 or more GPUs" in engine_refusal_here("vllm")
    assert engine_refusal_here("transformers") is None
    with pytest.raises(ParameterError, match="'engine' = 'vllm'.*needs 2 or more GPUs"):
        check_engine_here(PlaceSpec(context="local", engine="vllm"))
    check_engine_here(PlaceSpec(context="kube", engine="vllm"))  # a cluster's nodes serve it


def test_helpers():
    assert serve.parse_cpu_list("0-3,6,8-9") == [0, 1, 2, 3, 6, 8, 9]
    assert serve.cpu_split([0, 1]) == ("0", "1")
    assert serve.cpu_split([2, 3, 5]) == ("2", "3,5")
    assert serve.cpu_split([0]) == (None, None)
    argv = serve.serve_argv("/m", 1234, "0")
    assert argv[:3] == ["taskset", "-c", "0"]
    assert argv[4:] == ["serve", "/m", "--host", "127.0.0.1", "--port", "1234", "--device", "cpu",
                        "--continuous-batching", "--cb-num-blocks", "128",
                        "--cb-max-batch-tokens", "1024"]
    assert serve.serve_argv("/m", 1)[1] == "serve"
    assert serve.serve_env()["HF_HUB_OFFLINE"] == "1"
    assert Path(serve.serve_env()["HF_HOME"]).parent.name == ".cache"
    assert os.path.basename(serve.serve_argv("/m", 1)[0]) == "transformers"


def _stop_a_server_with_a_grandchild(run_dir: Path) -> tuple[Stage, served.Server, dict]:
    """A real process group shaped like vLLM's: leader -> child -> grandchild (the worker),
    the grandchild slow to exit on SIGTERM. Stopped through lib.served.stop_server."""
    stage = make_stage(run_dir)
    ready = run_dir / "worker.ready"
    worker = ("import pathlib, signal, sys, time\n"
              "signal.signal(signal.SIGTERM, lambda *a: (time.sleep(1), sys.exit(0)))\n"
              f"pathlib.Path({str(ready)!r}).write_text('x')\n"
              "time.sleep(60)\n")
    child = f'{sys.executable} -c "$0" & wait'
    log = run_dir / "04_serve" / "group.log"
    proc = stage.door.start(["sh", "-c", f"sh -c '{child}' \"$0\" & wait", worker], log_path=log)
    for _ in range(200):
        if ready.exists():
            break
        time.sleep(0.05)
    assert ready.exists(), log.read_text()
    server = served.Server(model_dir="-", port=stage.door.free_port(), log_path=log, proc=proc)
    stopped = served.stop_server(stage, server)
    stage.add(stopped)
    return stage, server, stopped.as_dict()


def test_stop_gate_sees_the_whole_group_and_replays(tmp_path):
    run_dir = tmp_path / "run"
    stage, server, stopped = _stop_a_server_with_a_grandchild(run_dir)
    assert stopped["status"] == "PASS", stopped
    assert stopped["observed"]["group_left"] == []  # the grandchild waited for, not left
    assert group_alive(server.proc.pid) == []
    stage.finish()
    replay = Stage("04_serve", stage.params, run_dir, Door(run_dir, "04_serve", replay=True),
                   run_dir)
    proc = replay.door.start(server.proc.argv, log_path=server.log_path)
    again = served.stop_server(replay, served.Server(model_dir="-", port=replay.door.free_port(),
                                                   log_path=server.log_path, proc=proc))
    assert again.as_dict()["observed"] == stopped["observed"]


def test_stop_gate_fails_on_a_group_left_behind(tmp_path):
    """The FAIL path, from the transcript's own format: the stop of a real run whose record
    says one process of the group outlived the stop (a worker stuck in the kernel, which no
    signal ends at once) replays as FAIL naming it; a record older than the field PASSes on
    what it holds."""
    run_dir = tmp_path / "run"
    stage, server, _ = _stop_a_server_with_a_grandchild(run_dir)
    stage.finish()
    transcript = run_dir / "transcript.jsonl"
    entries = [json.loads(l) for l in transcript.read_text().splitlines()]
    stop = next(e for e in entries if e["kind"] == "stop")

    def replayed(group_left) -> dict:
        if group_left is None:
            stop.pop("group_left", None)
        else:
            stop["group_left"] = group_left
        transcript.write_text("".join(json.dumps(e) + "\n" for e in entries))
        replay = Stage("04_serve", stage.params, run_dir,
                       Door(run_dir, "04_serve", replay=True), run_dir)
        proc = replay.door.start(server.proc.argv, log_path=server.log_path)
        return served.stop_server(replay, served.Server(
            model_dir="-", port=replay.door.free_port(), log_path=server.log_path,
            proc=proc)).as_dict()

    left = replayed([4705])
    assert left["status"] == "FAIL" and left["observed"]["group_left"] == [4705]
    old = replayed(None)
    assert old["status"] == "PASS" and "group_left" not in old["observed"]
