"""The cluster places' one poll loop (lib.places.cluster.wait_until) and their kubectl retry
(lib.places.kube.retry.run_retrying), both tenacity's loop on the door's clock and sleep: what
they read of the clock and how long they wait between looks, recorded through a real door and
replayed from its transcript; the retry against a real kubectl that reaches no API server."""
from __future__ import annotations

import shutil
import socket

import pytest

from lib.core.door import Door, read_transcript
from lib.places.cluster import wait_until
from lib.places.kube.retry import run_retrying


def clock_reads(run_dir) -> int:
    return sum(1 for e in read_transcript(run_dir / "transcript.jsonl") if e["kind"] == "clock")


def sleeps_of(door: Door) -> list[float]:
    """The seconds the door is asked to sleep, each still slept (record) or skipped (replay)."""
    asked, sleep = [], door.sleep

    def spy(seconds: float) -> None:
        asked.append(seconds)
        sleep(seconds)

    door.sleep = spy
    return asked


def looks_until(done_at: int):
    """A look that is done at its `done_at`-th call (never, for 0), answering its call count;
    it reads no clock itself."""
    calls = []

    def look(elapsed):
        calls.append(1)
        return (len(calls) == done_at, len(calls))

    return look, calls


def test_a_wait_doubles_its_delay_up_to_the_cap_and_reads_the_clock_only_when_not_done(tmp_path):
    door = Door(tmp_path / "run", "00_cluster")
    slept = sleeps_of(door)
    look, calls = looks_until(6)
    assert wait_until(door, look, 60.0, poll_s=0.01, max_poll_s=0.04) == 6
    assert slept == [0.01, 0.02, 0.04, 0.04, 0.04]
    # the start, then one reading after each of the five looks not done; none after the sixth
    assert clock_reads(tmp_path / "run") == 1 + 5
    replay = Door(tmp_path / "run", "00_cluster", replay=True)
    look, _ = looks_until(6)
    assert wait_until(replay, look, 60.0, poll_s=0.01, max_poll_s=0.04) == 6
    assert replay.remaining() == 0


def test_a_wait_past_its_timeout_answers_the_last_look_at_a_fixed_poll(tmp_path):
    door = Door(tmp_path / "run", "00_cluster")
    slept = sleeps_of(door)
    look, calls = looks_until(0)
    assert wait_until(door, look, 0.05, poll_s=0.02, started=door.now()) == len(calls)
    assert len(calls) >= 2 and set(slept) == {0.02} and len(slept) == len(calls) - 1
    assert clock_reads(tmp_path / "run") == 1 + len(calls)  # `started`, then one per look


def test_a_look_that_reads_the_clock_itself_is_not_read_for_again(tmp_path):
    door = Door(tmp_path / "run", "00_cluster")
    seen = []

    def look(elapsed):
        seen.append(elapsed())
        return (len(seen) == 3, elapsed())

    wait_until(door, look, 60.0, poll_s=0.001)
    assert clock_reads(tmp_path / "run") == 1 + 3


def test_an_exception_in_a_look_is_raised_as_it_is(tmp_path):
    door = Door(tmp_path / "run", "00_cluster")

    def look(elapsed):
        raise LookupError("the pod is gone")

    with pytest.raises(LookupError, match="the pod is gone"):
        wait_until(door, look, 60.0, poll_s=0.001)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed once the socket is: a connection is refused


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_kubectl_that_reaches_no_api_server_is_tried_again_until_its_budget(tmp_path):
    door = Door(tmp_path / "run", "04_serve")
    slept, said = sleeps_of(door), []
    # global flags as name=value (verb_of takes a bare --flag's next word as its value); a
    # token, or kubectl asks for a user name
    argv = ["kubectl", f"--server=https://127.0.0.1:{closed_port()}",
            "--insecure-skip-tls-verify=true", "--token=none", "get", "pods"]
    call = run_retrying(door, argv, timeout=30, budget_s=2.5, say=said.append)
    assert not call.ok and "refused" in call.stderr
    tries = [e for e in read_transcript(tmp_path / "run" / "transcript.jsonl")
             if e["kind"] == "run"]
    assert len(tries) == len(slept) + 1 >= 3 and slept[:2] == [1.0, 2.0]
    assert said[0].startswith("kubectl get: the API server did not answer (")
    assert said[0].endswith("; try 2 in 1 s") and said[1].endswith("; try 3 in 2 s")
    # a budget of none: the one try, no clock but the two readings that end it
    again = Door(tmp_path / "again", "04_serve")
    assert not run_retrying(again, argv, timeout=30, budget_s=0.0, say=said.append).ok
    assert clock_reads(tmp_path / "again") == 2
    with pytest.raises(ValueError, match="'apply' is not retried blindly"):
        run_retrying(door, ["kubectl", "apply", "-f", "x.yaml"], timeout=30)
