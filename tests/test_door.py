"""The door: record, replay, redaction, timeouts, background processes, on real processes."""
import json
import shutil
import socket
import sys
import time
from pathlib import Path

import pytest

from lib.core import door as door_module
from lib.core import processes
from lib.core.door import CommandError, Door, DoorError, ReplayMismatch, read_transcript

TOKEN = "hf_plantedSECRET0123456789"
AWS_KEY_ID = "AKIA" + "ABCDEFGHIJKLMNOP"  # built, so no key-shaped string sits in the repository


@pytest.fixture
def run_dir(tmp_path):
    return tmp_path / "run"


def replay_copy(run_dir, tmp_path, stage="s"):
    copy = tmp_path / "copy" / run_dir.name
    shutil.copytree(run_dir, copy)
    return Door(copy, stage, replay=True)


def test_run_records_argv_rc_streams_and_env_keys(run_dir):
    door = Door(run_dir, "s")
    result = door.run([sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"],
                      timeout=30, env={"GUIDE_X": "1"}, check=False)
    assert (result.rc, result.stdout, result.stderr) == (3, "out\n", "err\n")
    [entry] = read_transcript(run_dir / "transcript.jsonl")
    assert entry["kind"] == "run" and entry["rc"] == 3 and entry["env"] == {"GUIDE_X": "1"}
    assert entry["key"][0] == "{python}"  # the interpreter, whichever machine recorded it
    assert (run_dir / entry["stdout"]).read_text() == "out\n"
    assert (run_dir / entry["stderr"]).read_text() == "err\n"


def test_check_raises_with_ran_stdout_stderr(run_dir):
    door = Door(run_dir, "s")
    with pytest.raises(CommandError) as err:
        door.run(["sh", "-c", "echo boom >&2; exit 4"], timeout=10)
    assert "RAN: sh -c" in str(err.value) and "RC: 4" in str(err.value) and "boom" in str(err.value)


def test_every_call_needs_a_timeout_and_an_argv_list(run_dir):
    door = Door(run_dir, "s")
    with pytest.raises(DoorError, match="timeout"):
        door.run(["true"], timeout=0)
    with pytest.raises(DoorError, match="argv list"):
        door.run("echo hi", timeout=5)


def test_timeout_kills_and_is_recorded(run_dir):
    door = Door(run_dir, "s")
    result = door.run(["sleep", "30"], timeout=1, check=False)
    assert result.timed_out and result.rc == 124 and result.duration_s < 10
    assert read_transcript(run_dir / "transcript.jsonl")[0]["timed_out"] is True


def test_missing_program_is_rc_127_not_a_crash(run_dir):
    result = Door(run_dir, "s").run(["no-such-program-here"], timeout=5, check=False)
    assert result.rc == 127 and "command not found" in result.stderr


def test_secrets_are_redacted_before_writing(run_dir, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    door = Door(run_dir, "s")
    result = door.run(["sh", "-c", f'echo "$HF_TOKEN"; echo key {AWS_KEY_ID}', "--token", TOKEN],
                      timeout=10, env={"MY_SECRET": "s3cr3t-value-xyz"})
    assert TOKEN not in result.stdout and AWS_KEY_ID not in result.stdout
    for path in run_dir.rglob("*"):
        if path.is_file():
            text = path.read_text()
            assert TOKEN not in text and AWS_KEY_ID not in text
            assert "s3cr3t-value-xyz" not in text


def test_replay_answers_from_the_transcript_without_running(run_dir, tmp_path):
    door = Door(run_dir, "s")
    marker = tmp_path / "ran"
    door.run(["sh", "-c", f"touch {marker}; echo recorded"], timeout=10)
    port = door.free_port()
    now = door.now()
    marker.unlink()
    replay = replay_copy(run_dir, tmp_path)
    result = replay.run(["sh", "-c", f"touch {marker}; echo recorded"], timeout=10)
    assert result.stdout == "recorded\n" and not marker.exists()
    assert replay.free_port() == port and replay.now() == now
    assert replay.remaining() == 0


def test_replay_mismatch_names_the_call(run_dir, tmp_path):
    door = Door(run_dir, "s")
    door.run(["echo", "one"], timeout=5)
    door.run(["echo", "two"], timeout=5)
    replay = replay_copy(run_dir, tmp_path)
    replay.run(["echo", "one"], timeout=5)
    with pytest.raises(ReplayMismatch) as err:
        replay.run(["echo", "TWO"], timeout=5)
    assert "call #1" in str(err.value) and "'TWO'" in str(err.value) and "'two'" in str(err.value)


def _record_with_masked_value(run_dir):
    """A run recorded before redact_argv stopped masking `--num-tokens VALUE`."""
    Door(run_dir, "s").run(["echo", "--num-tokens", "128", "done"], timeout=5)
    transcript = run_dir / "transcript.jsonl"
    entry = json.loads(transcript.read_text())
    assert entry["key"] == ["echo", "--num-tokens", "128", "done"]  # recorded unmasked now
    entry["key"] = ["echo", "--num-tokens", "[REDACTED]", "done"]
    transcript.write_text(json.dumps(entry) + "\n")


def test_replay_accepts_a_masked_value_of_an_older_recording(run_dir, tmp_path):
    _record_with_masked_value(run_dir)
    replay = replay_copy(run_dir, tmp_path)
    result = replay.run(["echo", "--num-tokens", "128", "done"], timeout=5)
    assert result.stdout == "--num-tokens 128 done\n"
    assert replay.remaining() == 0


@pytest.mark.parametrize("argv", [
    ["echo", "--num-tokens", "128", "DIFFERENT"],    # an unmasked element differs
    ["echo", "--max-tokens", "128", "done"],         # the flag before the mask differs
    ["echo", "--num-tokens", "128", "done", "more"],  # a different length
])
def test_replay_with_a_masked_value_still_detects_real_differences(run_dir, tmp_path, argv):
    _record_with_masked_value(run_dir)
    with pytest.raises(ReplayMismatch, match="differs"):
        replay_copy(run_dir, tmp_path).run(argv, timeout=5)


def test_replay_detects_an_edited_transcript(run_dir, tmp_path):
    Door(run_dir, "s").run(["echo", "one"], timeout=5)
    transcript = run_dir / "transcript.jsonl"
    entry = json.loads(transcript.read_text())
    entry["key"] = ["echo", "edited"]
    transcript.write_text(json.dumps(entry) + "\n")
    with pytest.raises(ReplayMismatch, match="edited"):
        replay_copy(run_dir, tmp_path).run(["echo", "one"], timeout=5)


def test_replay_asking_for_more_calls_than_recorded(run_dir, tmp_path):
    Door(run_dir, "s").run(["echo", "one"], timeout=5)
    replay = replay_copy(run_dir, tmp_path)
    replay.run(["echo", "one"], timeout=5)
    with pytest.raises(ReplayMismatch, match="holds only 1 calls"):
        replay.run(["echo", "two"], timeout=5)


def test_paths_are_recorded_relative_to_run_and_repo(run_dir, tmp_path):
    door = Door(run_dir, "s")
    target = run_dir / "s" / "file.txt"
    target.parent.mkdir(parents=True)
    door.run(["touch", str(target)], timeout=5)
    assert read_transcript(run_dir / "transcript.jsonl")[0]["key"] == ["touch", "{run}/s/file.txt"]
    replay = replay_copy(run_dir, tmp_path)
    replay.run(["touch", str(replay.run_dir / "s" / "file.txt")], timeout=5)


def test_background_process_start_poll_stop_by_pid(run_dir):
    door = Door(run_dir, "s")
    port = door.free_port()
    server = door.start([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
                        log_path=run_dir / "s" / "server.log")
    for _ in range(100):
        if door.http("GET", f"http://127.0.0.1:{port}/", timeout=2).status == 200:
            break
        door.sleep(0.1)
    assert door.poll(server) is None
    assert door.port_listening(port)
    door.stop(server)
    assert door.poll(server) is not None
    assert not door.port_listening(port)
    with pytest.raises(ProcessLookupError):
        import os
        os.kill(server.pid, 0)


def _group_with_a_child(door, run_dir, child_on_term: str) -> tuple:
    """A leader shell that dies on SIGTERM, with a Python child that handles SIGTERM its own
    way (the shape of vLLM's resource tracker: a child that outlives the leader)."""
    ready = run_dir / "child.ready"
    child = ("import signal, sys, time, pathlib\n"
             f"{child_on_term}\n"
             f"pathlib.Path({str(ready)!r}).write_text('x')\n"
             "time.sleep(60)\n")
    proc = door.start(["sh", "-c", f'{sys.executable} -c "$0" & wait', child],
                      log_path=run_dir / "s" / "group.log")
    for _ in range(200):
        if ready.exists():
            break
        time.sleep(0.05)
    assert ready.exists(), (run_dir / "s" / "group.log").read_text()
    return proc


def _stop_record(run_dir) -> dict:
    lines = [json.loads(x) for x in (run_dir / "transcript.jsonl").read_text().splitlines()]
    return [e for e in lines if e["kind"] == "stop"][-1]


def test_stop_waits_for_a_child_that_outlives_the_leader(run_dir):
    """The child exits 1 s after SIGTERM, after the leader: stop returns only when the whole
    group is gone, without SIGKILL."""
    door = Door(run_dir, "s")
    proc = _group_with_a_child(door, run_dir, "signal.signal(signal.SIGTERM, "
                                              "lambda *a: (time.sleep(1), sys.exit(0)))")
    assert len(processes.group_alive(proc.pid)) == 2
    door.stop(proc, timeout=5)
    assert processes.group_alive(proc.pid) == []
    assert _stop_record(run_dir)["killed"] is False


def test_stop_kills_a_child_that_ignores_sigterm(run_dir):
    """The child ignores SIGTERM: after the grace, SIGKILL for the group; nothing is left."""
    door = Door(run_dir, "s")
    proc = _group_with_a_child(door, run_dir,
                               "signal.signal(signal.SIGTERM, signal.SIG_IGN)")
    door.stop(proc, timeout=1)
    assert door.poll(proc) is not None
    assert processes.group_alive(proc.pid) == []
    assert _stop_record(run_dir)["killed"] is True


def test_http_records_status_and_connection_errors(run_dir):
    door = Door(run_dir, "s")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed_port = s.getsockname()[1]
    result = door.http("GET", f"http://127.0.0.1:{closed_port}/", timeout=2)
    assert result.status is None and "Connection" in result.error


def test_a_started_process_reports_its_env_as_recorded_and_replays_it(run_dir, tmp_path,
                                                                        monkeypatch):
    """What a server was started with comes back from the door: paths of this checkout as
    {repo}, secrets masked; in replay the recorded values, whatever the replaying machine's
    environment holds (an artifact reporting them must re-compute equal)."""
    from lib.core.door import REPO_ROOT
    door = Door(run_dir, "s")
    env = {"PYTHONPATH": f"/opt/site:{REPO_ROOT}", "HF_TOKEN": TOKEN}
    proc = door.start([sys.executable, "-c", "pass"], log_path=run_dir / "s" / "p.log", env=env)
    assert proc.env == {"PYTHONPATH": "/opt/site:{repo}", "HF_TOKEN": "[REDACTED]"}
    door.stop(proc)
    assert TOKEN not in (run_dir / "transcript.jsonl").read_text()
    monkeypatch.setenv("PYTHONPATH", "/somewhere/else")
    replay = replay_copy(run_dir, tmp_path)
    again = replay.start([sys.executable, "-c", "pass"], log_path=run_dir / "s" / "p.log",
                         env={"PYTHONPATH": "/somewhere/else"})  # env is not part of the key
    assert again.env == proc.env


def test_a_transcript_without_env_replays_with_env_none(run_dir, tmp_path):
    door = Door(run_dir, "s")
    door.stop(door.start([sys.executable, "-c", "pass"], log_path=run_dir / "s" / "p.log"))
    lines = [json.loads(x) for x in (run_dir / "transcript.jsonl").read_text().splitlines()]
    for entry in lines:
        entry.pop("env", None)  # as transcripts recorded before the field
    (run_dir / "transcript.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines))
    assert replay_copy(run_dir, tmp_path).start([sys.executable, "-c", "pass"],
                                                log_path=run_dir / "s" / "p.log").env is None


def ephemeral_low() -> int:
    return int(Path(door_module.EPHEMERAL_RANGE_FILE).read_text().split()[0])


def test_free_port_is_below_the_ephemeral_range_so_no_running_process_takes_it(run_dir):
    # On two H200s a 06 server died with "Address already in use": its port, picked by binding
    # to 0, had been handed by the kernel to a socket of the vLLM server already running.
    port = Door(run_dir, "s").free_port()
    assert door_module._LOWEST_PICKED_PORT <= port < ephemeral_low()
    sockets = []
    try:
        for _ in range(300):  # what a running server does: many sockets bound to port 0
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        assert port not in {s.getsockname()[1] for s in sockets}
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", port))  # still free for the server we start
    finally:
        for s in sockets:
            s.close()


def test_free_port_skips_a_taken_port_and_falls_back_to_an_ephemeral_one(tmp_path):
    port = door_module._port_below_ephemeral_range()
    only_that_port = tmp_path / "ip_local_port_range"
    only_that_port.write_text(f"{port + 1}\t60999\n")
    assert door_module._port_below_ephemeral_range(only_that_port, lowest=port) == port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        fallback = door_module._port_below_ephemeral_range(only_that_port, lowest=port)
    assert fallback != port and fallback >= ephemeral_low()


def test_free_port_without_a_readable_range_assumes_linux_default(tmp_path):
    port = door_module._port_below_ephemeral_range(tmp_path / "absent")
    assert door_module._LOWEST_PICKED_PORT <= port < 32768


def test_read_text_keeps_carriage_returns_so_quoted_line_numbers_are_greps(run_dir, tmp_path):
    """A progress bar writes frames ended by a carriage return: read through the door, they stay
    what they are (not line breaks), in the recorded stream and in its replay."""
    log = tmp_path / "server.log"
    log.write_bytes(b"banner\r\n(Worker pid=7) \rLoading 0%\rLoading 100%\nfatal here\n")
    text = Door(run_dir, "s").read_text(log)
    assert text == log.read_bytes().decode()
    assert replay_copy(run_dir, tmp_path).read_text(log) == text


def test_a_read_recorded_with_carriage_returns_as_line_breaks_replays_as_recorded(run_dir,
                                                                                  tmp_path):
    """Transcripts recorded before carriage returns were kept hold each one as a line break:
    their replays give that text back unchanged, so their notebooks replay as recorded."""
    log = tmp_path / "server.log"
    log.write_text("a\rb\n")
    Door(run_dir, "s").read_text(log)
    [entry] = read_transcript(run_dir / "transcript.jsonl")
    (run_dir / entry["body"]).write_text("a\nb\n")  # as an older door wrote it
    assert replay_copy(run_dir, tmp_path).read_text(log) == "a\nb\n"
