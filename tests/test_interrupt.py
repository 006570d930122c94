"""Interrupting the guide, for real: the runner as `make run` runs it (in a group of its own, as a
terminal's foreground job), papermill, the notebooks' kernels, `transformers serve` and AIPerf,
all real processes on 127.0.0.1; signals sent as a person or a scheduler sends them.

One run (00, 04 and 05 of the local context at the smallest sweep: one concurrency level, one
repeat, two requests) lives through the module, in order:

1. SIGINT to the runner's group (Ctrl-C) while 05's AIPerf cell runs: every process of the run
   stopped (by the ledger's PIDs and groups, read in /proc), its ports closed, 05 marked
   incomplete, valid JSON everywhere, the run sealed;
2. resumed, then SIGTERM to papermill alone while 05's AIPerf cell runs again: its kernel dies
   without its exit hook, and the reaper stops the server and AIPerf;
3. resumed again: it completes, sealed (the real `sha256sum -c` passes), both interrupted
   attempts kept as 05_sweep.attempt-1/ and .attempt-2/, and the replay of its 05 notebook
   passes.

Beside it, the FAIL paths (a changed sealed file, a stage still running: resume refused, nothing
moved) and the pieces alone (the reaper after a SIGKILLed owner, a reused PID left alone, an
interrupted door call, the transcript's attempts). Durations are printed (-s).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from lib.core import processes
from lib.core.door import Door, read_transcript
from lib.core.errors import EvidenceError
from lib.core.stage import retire_attempt
from lib.core.processes import children

REPO = Path(__file__).resolve().parents[1]
STAGES = "00_cluster,04_serve,05_sweep"
SMALL = ["-p", "concurrency", "1", "-p", "repeats", "1", "-p", "request_count", "2",
         "-p", "requests_per_slot", "0", "-p", "warmup_requests", "0",
         "-p", "output_tokens", "4", "-p", "prompt_corpus", "random"]
RUN_ID = "interrupted-1"
WAIT_FOR_CELL_S = 300


def runner_argv(results: Path, run_id: str = RUN_ID) -> list[str]:
    """What `make run RUN=<run_id>` runs, with the stages and the sweep made small."""
    return [sys.executable, "-m", "lib.runner", "run", "--context", "local", "--run-id", run_id,
            "--stages", STAGES, "--no-book", "-p", "results_dir", str(results), *SMALL]


def start_runner(results: Path, log: Path, run_id: str = RUN_ID) -> subprocess.Popen:
    out = open(log, "a", encoding="utf-8")
    try:  # its own group, like a terminal's foreground job: Ctrl-C is SIGINT to that group
        return subprocess.Popen(runner_argv(results, run_id), cwd=REPO, stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    finally:
        out.close()


def ledger_events(run: Path) -> list[dict]:
    return processes.Ledger(run).events()


def wait_for_aiperf(run: Path, runner: subprocess.Popen, log: Path, since: float) -> dict:
    """Poll the run's ledger until 05's AIPerf cell (coreutils timeout leading its group) runs,
    and AIPerf itself has started under it."""
    deadline = time.monotonic() + WAIT_FOR_CELL_S
    while time.monotonic() < deadline:
        assert runner.poll() is None, log.read_text()[-3000:]
        for e in ledger_events(run):
            if (e["event"] == "started" and e.get("stage") == "05_sweep" and e["t"] >= since
                    and e.get("argv0") == "timeout"
                    and len(processes.group_alive(e["pgid"])) >= 2):
                return e
        time.sleep(0.5)
    raise AssertionError(f"no AIPerf cell ran within {WAIT_FOR_CELL_S} s:\n"
                         + log.read_text()[-3000:])


def pids_of_run(run: Path) -> dict[int, str]:
    """Every PID the ledger names (kernels, reapers, group leaders), what it was."""
    found = {}
    for e in ledger_events(run):
        if e["event"] in ("owner", "reaper"):
            found[e["pid"]] = f"{e['event']} {e.get('stage', '')}"
        elif e["event"] == "started":
            found[e["pgid"]] = f"{e['kind']} {e['argv0']} ({e['stage']})"
    return found


def alive_of_run(run: Path) -> list[str]:
    """What of the run still lives: a ledger PID still bearing its process, a member of any
    group the ledger names, any process whose command line names the run (papermill, AIPerf)."""
    alive = []
    for e in ledger_events(run):
        pid = e.get("pgid") if e["event"] == "started" else e.get("pid")
        if e["event"] in ("owner", "reaper", "started") and processes.is_alive(pid, e.get("start")):
            alive.append(f"{pid} {e['event']} {e.get('argv0', e.get('stage', ''))}")
        if e["event"] == "started" and processes.group_alive(e["pgid"]):
            alive.append(f"group {e['pgid']} ({e['argv0']}): {processes.group_alive(e['pgid'])}")
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = Path(entry.path, "cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if str(run).encode() in cmdline and processes.start_ticks(int(entry.name)) is not None:
            alive.append(f"{entry.name}: {cmdline[:160].decode(errors='replace')}")
    return alive


def settle(run: Path, seconds: float = 10.0) -> list[str]:
    """What is alive of the run once reapers had a moment to exit (they end after their
    owner, a few milliseconds after the runner returns)."""
    deadline = time.monotonic() + seconds
    while (alive := alive_of_run(run)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return alive


def ports_of_run(run: Path) -> list[int]:
    return sorted({e["port"] for e in ledger_events(run) if e["event"] == "port"})


def connect_fails(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(2)
        return s.connect_ex(("127.0.0.1", port)) != 0


def invalid_json(root: Path) -> list[str]:
    """Every .json and .ipynb under root that does not parse, every .jsonl line that does not."""
    bad = []
    for path in sorted(root.rglob("*")):
        if not path.is_file():
            continue
        try:
            if path.suffix in (".json", ".ipynb"):
                json.loads(path.read_text(encoding="utf-8"))
            elif path.suffix == ".jsonl":
                for line in path.read_text(encoding="utf-8").splitlines():
                    json.loads(line)
        except ValueError as err:
            bad.append(f"{path.relative_to(root)}: {err}")
    return bad


def json_count(root: Path) -> int:
    return sum(1 for p in root.rglob("*") if p.suffix in (".json", ".ipynb", ".jsonl"))


def sha256sum_check(run: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["sha256sum", "-c", "--quiet", "SHA256SUMS"], cwd=run,
                          capture_output=True, text=True, timeout=120)


def tree_digest(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def gates(run: Path, stage: str) -> list[dict] | None:
    path = run / stage / "gates.json"
    return json.loads(path.read_text()) if path.exists() else None


def timed(label: str, started: float) -> None:
    print(f"\n[duration] {label}: {time.monotonic() - started:.1f} s", flush=True)


# ---- 1: SIGINT to the runner's group in the middle of 05 -----------------------------------------
@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return tmp_path_factory.mktemp("results")


@pytest.fixture(scope="module")
def interrupted(results):
    run, log = results / RUN_ID, results / "runner-1.log"
    began = time.monotonic()
    runner = start_runner(results, log)
    try:
        cell = wait_for_aiperf(run, runner, log, 0)
        timed("runner start to 05's AIPerf cell running", began)
        time.sleep(1.0)  # AIPerf in the middle of its cell
        seen = pids_of_run(run)
        signalled = time.monotonic()
        os.killpg(runner.pid, signal.SIGINT)  # what Ctrl-C sends: the foreground group
        rc = runner.wait(timeout=180)
        timed("SIGINT to the runner's exit", signalled)
    finally:
        if runner.poll() is None:
            os.killpg(runner.pid, signal.SIGKILL)
    alive = settle(run)
    copy = results.parent / "refusals" / RUN_ID  # the interrupted run as it was, for the FAILs
    shutil.copytree(run, copy)
    return {"run": run, "rc": rc, "cell": cell, "seen": seen, "alive": alive, "log": log,
            "copy": copy}


def test_sigint_mid_sweep_stops_every_process_the_guide_started(interrupted):
    run, log = interrupted["run"], interrupted["log"].read_text()
    assert interrupted["rc"] == 130, log[-3000:]
    assert "SIGINT: stopping the run" in log and "05_sweep/incomplete.json" in log
    seen = interrupted["seen"]
    # the ledger named the kernel, its reaper, the server and the AIPerf cell while it ran
    assert any(v.startswith("owner 05_sweep") for v in seen.values()), seen
    assert any(v.startswith("reaper") for v in seen.values()), seen
    assert any(v.startswith("start ") and v.endswith("(05_sweep)")
               for v in seen.values()), seen  # the server
    assert interrupted["cell"]["pgid"] in seen
    # none of them, no member of their groups, nothing naming the run is alive
    assert interrupted["alive"] == []
    for pid in seen:
        assert not processes.group_alive(pid), (pid, seen[pid])
    ports = ports_of_run(run)
    assert ports and all(connect_fails(p) for p in ports), ports


def test_sigint_mid_sweep_marks_05_incomplete_and_keeps_valid_json(interrupted):
    run = interrupted["run"]
    assert gates(run, "00_cluster") and gates(run, "04_serve")
    assert gates(run, "05_sweep") is None
    marker = json.loads((run / "05_sweep" / "incomplete.json").read_text())
    assert marker["stage"] == "05_sweep" and marker["attempt"] == 1
    assert marker["signal"] == "SIGINT" and marker["how"] == "the runner received SIGINT"
    assert marker["left_running"] == []
    assert marker["ports"] and not any(p["listening"] for p in marker["ports"])
    assert marker["kernel"]["asked_to_stop"] is True
    [server] = [g for g in marker["process_groups"] if g["kind"] == "start"]
    [cell] = [g for g in marker["process_groups"] if g["argv0"] == "timeout"]
    # the stage stopped its own server through the door, and its door the AIPerf cell
    assert server["ended"] == "ended through its stage (the door)" and server["left"] == []
    assert cell["ended"] == "stopped by the door" and "SIGTERM" in cell["signals"]
    assert cell["pgid"] == interrupted["cell"]["pgid"] and cell["left"] == []
    assert marker["notebook"] == {"path": "notebooks/05_sweep.ipynb", "exists": True,
                                  "valid_json": True}
    # the interrupted AIPerf call is in the transcript, said to be interrupted
    cut = [e for e in read_transcript(run / "transcript.jsonl")
           if e["stage"] == "05_sweep" and e.get("interrupted")]
    assert len(cut) == 1 and cut[0]["key"][0] == "timeout", cut
    assert cut[0]["interrupted"] == "StageInterrupted" and cut[0]["group_left"] == []
    notebook = json.loads((run / "notebooks" / "05_sweep.ipynb").read_text())
    errors = [o for c in notebook["cells"] for o in c.get("outputs", [])
              if o.get("output_type") == "error"]
    assert [o["ename"] for o in errors] == ["StageInterrupted"]
    assert json_count(run) >= 12 and invalid_json(run) == []
    done = sha256sum_check(run)  # sealed as it was left: the resume checks against it
    assert done.returncode == 0, done.stdout + done.stderr


# ---- FAIL paths of a resume: refused, nothing moved ----------------------------------------------
def refusal_copy(interrupted, tmp_path) -> Path:
    copy = tmp_path / RUN_ID
    shutil.copytree(interrupted["copy"], copy)
    return copy


def test_a_resume_is_refused_when_a_sealed_file_changed(interrupted, tmp_path):
    copy = refusal_copy(interrupted, tmp_path)
    (copy / "05_sweep" / "server.log").write_text("edited\n")
    before = tree_digest(copy)
    done = subprocess.run(runner_argv(copy.parent), cwd=REPO, capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "05_sweep/server.log: changed" in done.stdout and "resume refused" in done.stdout
    assert tree_digest(copy) == before  # no attempt moved, nothing written
    assert not (copy / "05_sweep.attempt-1").exists()


def test_a_resume_is_refused_while_a_stage_of_the_run_still_runs(interrupted, tmp_path):
    copy = refusal_copy(interrupted, tmp_path)
    assert sha256sum_check(copy).returncode == 0
    kernel = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        ledger = processes.Ledger(copy)
        ledger.append("owner", pid=kernel.pid, start=processes.start_ticks(kernel.pid),
                      stage="05_sweep")
        before = tree_digest(copy)
        done = subprocess.run(runner_argv(copy.parent), cwd=REPO, capture_output=True,
                              text=True, stdin=subprocess.DEVNULL, timeout=120)
        assert done.returncode == 2, done.stdout + done.stderr
        assert f"05_sweep (kernel pid {kernel.pid})" in done.stdout
        assert tree_digest(copy) == before
    finally:
        kernel.kill()
        kernel.wait()


# ---- 2: resumed, then SIGTERM to papermill alone ------------------------------------------------
@pytest.fixture(scope="module")
def papermill_killed(interrupted, results):
    run, log = interrupted["run"], results / "runner-2.log"
    since = time.time()
    began = time.monotonic()
    runner = start_runner(results, log)
    try:
        cell = wait_for_aiperf(run, runner, log, since)
        timed("resume to 05's AIPerf cell running again", began)
        papermill = [p for p in children(runner.pid)
                     if b"papermill" in Path(f"/proc/{p}/cmdline").read_bytes()]
        assert len(papermill) == 1, papermill
        kernels = [e for e in ledger_events(run) if e["event"] == "owner"
                   and e["stage"] == "05_sweep" and e["t"] >= since]
        signalled = time.monotonic()
        os.kill(papermill[0], signal.SIGTERM)  # papermill alone, not its group
        rc = runner.wait(timeout=180)
        timed("SIGTERM to papermill to the runner's exit", signalled)
    finally:
        if runner.poll() is None:
            os.killpg(runner.pid, signal.SIGKILL)
    return {"run": run, "rc": rc, "cell": cell, "kernels": kernels, "since": since,
            "alive": settle(run), "log": log}


def test_papermill_killed_its_kernel_dies_and_the_reaper_stops_server_and_aiperf(
        papermill_killed):
    run, log = papermill_killed["run"], papermill_killed["log"].read_text()
    assert papermill_killed["rc"] == 128 + signal.SIGTERM, log[-3000:]
    assert "[05_sweep] its attempt 1 ended without gates: kept as 05_sweep.attempt-1" in log
    [kernel] = papermill_killed["kernels"]
    since = papermill_killed["since"]
    events = [e for e in ledger_events(run) if e["t"] >= since]
    started = [e for e in events if e["event"] == "started"
               and e["stage"] == "05_sweep" and e["owner"] == kernel["pid"]]
    [server] = [e for e in started if e["kind"] == "start"]
    [cell] = [e for e in started if e["argv0"] == "timeout"]
    assert cell["pgid"] == papermill_killed["cell"]["pgid"]
    stopped = {e["pgid"]: e for e in events if e["event"] == "stopped"}
    for name, group in (("the server", server), ("the AIPerf cell", cell)):
        assert group["pgid"] in stopped, (name, stopped)
        assert stopped[group["pgid"]]["by"] == "reaper", stopped[group["pgid"]]
        assert stopped[group["pgid"]]["left"] == []
        assert not processes.group_alive(group["pgid"])
    # the kernel ran no exit hook: its transcript holds no stop of the server
    calls = [e for e in read_transcript(run / "transcript.jsonl")
             if e["stage"] == "05_sweep" and e.get("attempt") == 2]
    assert calls and not [e for e in calls if e["kind"] == "stop"]
    assert papermill_killed["alive"] == []
    assert all(connect_fails(p) for p in ports_of_run(run))
    marker = json.loads((run / "05_sweep" / "incomplete.json").read_text())
    assert marker["attempt"] == 2 and marker["signal"] == "SIGTERM"
    assert marker["how"] == "papermill was killed by SIGTERM"
    assert marker["papermill"]["exit_code"] == -signal.SIGTERM
    assert marker["left_running"] == [] and not any(p["listening"] for p in marker["ports"])
    assert (run / "05_sweep.attempt-1" / "incomplete.json").exists()
    assert invalid_json(run) == []
    assert sha256sum_check(run).returncode == 0


# ---- 3: resumed again, to the end ----------------------------------------------------------------
@pytest.fixture(scope="module")
def completed(papermill_killed, results):
    run, log = papermill_killed["run"], results / "runner-3.log"
    began = time.monotonic()
    runner = start_runner(results, log)
    try:
        rc = runner.wait(timeout=400)
    finally:
        if runner.poll() is None:
            os.killpg(runner.pid, signal.SIGKILL)
    timed("the second resume, to the sealed run", began)
    return {"run": run, "rc": rc, "log": log, "alive": settle(run)}


def test_the_resumed_run_completes_sealed_with_its_attempts_kept(completed):
    run, log = completed["run"], completed["log"].read_text()
    assert completed["rc"] == 0, log[-3000:]
    assert "[00_cluster] already recorded in this run, hashes match: kept as is" in log
    assert "[04_serve] already recorded in this run, hashes match: kept as is" in log
    assert "kept as 05_sweep.attempt-2" in log
    assert all(g["status"] != "FAIL" for g in gates(run, "05_sweep"))
    done = sha256sum_check(run)  # the real sha256sum
    assert done.returncode == 0, done.stdout + done.stderr
    listed = (run / "SHA256SUMS").read_text()
    for k in (1, 2):
        name = f"05_sweep.attempt-{k}"
        assert json.loads((run / name / "incomplete.json").read_text())["attempt"] == k
        assert (run / "calls" / name).is_dir() and (run / "notebooks" / f"{name}.ipynb").exists()
        assert (run / "notebooks" / f"{name}.papermill.log").exists()
        assert f"  {name}/incomplete.json\n" in listed
        assert f"  notebooks/{name}.ipynb\n" in listed
    assert not (run / "05_sweep" / "incomplete.json").exists()  # the completed attempt's own
    # the transcript: every attempt's calls, each retired attempt closed by its entry
    entries = read_transcript(run / "transcript.jsonl")
    retired = [e for e in entries if e["kind"] == "retired"]
    assert [(e["stage"], e["attempt"]) for e in retired] == [("05_sweep", 1), ("05_sweep", 2)]
    assert retired[0]["moved"]["calls/05_sweep"] == "calls/05_sweep.attempt-1"
    final = [e for e in entries if e["stage"] == "05_sweep" and e.get("attempt") == 3]
    assert final and [e["seq"] for e in final] == list(range(len(final)))
    assert {e.get("attempt", 1) for e in entries if e["stage"] != "05_sweep"} == {1}
    assert invalid_json(run) == [] and completed["alive"] == []


def test_the_replay_of_the_resumed_runs_05_follows_the_attempt_that_completed(completed,
                                                                               tmp_path):
    run = completed["run"]
    before = tree_digest(run)
    began = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbval",
         "--nbval-sanitize-with", str(REPO / "tests" / "nbval_sanitize.cfg"),
         str(run / "notebooks" / "05_sweep.ipynb")], capture_output=True, text=True,
        cwd=tmp_path, env={**os.environ, "REPRO_REPLAY": str(run)}, stdin=subprocess.DEVNULL,
        timeout=300)
    timed("replay of the resumed run's 05", began)
    assert done.returncode == 0, done.stdout[-3000:]
    assert " passed" in done.stdout and "failed" not in done.stdout
    assert tree_digest(run) == before


# ---- the pieces alone ----------------------------------------------------------------------------
OWNER = """
import sys, time
from pathlib import Path
from lib.core.door import Door
other = Door(Path(sys.argv[2]), "09_other")  # a second run: one reaper watches both
other.start(["sh", "-c", "sleep 300 & sleep 300; wait"], log_path=Path(sys.argv[2]) / "o.log")
door = Door(Path(sys.argv[1]), "09_owner")
door.start(["sh", "-c", "sleep 300 & sleep 300; wait"], log_path=Path(sys.argv[1]) / "s.log")
print("started", flush=True)
door.run(["sh", "-c", "sleep 300 & sleep 300"], timeout=600)
"""


def test_the_reaper_stops_what_a_sigkilled_owner_started(tmp_path):
    """A process holding doors of two runs (a test session; a kernel holds one) starts a
    server-like group in each and runs a command; it is killed with SIGKILL (no hook runs):
    its one reaper stops the three groups, by process group, each in its own run's ledger."""
    run, other = tmp_path / "run", tmp_path / "other"
    began = time.monotonic()
    owner = subprocess.Popen([sys.executable, "-c", OWNER, str(run), str(other)], cwd=REPO,
                             stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert owner.stdout.readline().strip() == "started"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            groups = [e for e in ledger_events(run) if e["event"] == "started"]
            groups += [e for e in ledger_events(other) if e["event"] == "started"]
            if len(groups) == 3 and all(len(processes.group_alive(g["pgid"])) >= 2
                                        for g in groups):
                break
            time.sleep(0.1)
        assert [g["kind"] for g in groups] == ["start", "run", "start"], groups
        watchers = {e["pid"]: e for r in (run, other) for e in ledger_events(r)
                    if e["event"] == "reaper"}
        [watcher] = watchers.values()  # one reaper for the owner, whatever its ledgers
        assert watcher["owner"] == owner.pid and processes.is_alive(watcher["pid"], watcher["start"])
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and (
                any(processes.group_alive(g["pgid"]) for g in groups)
                or processes.is_alive(watcher["pid"], watcher["start"])):
            time.sleep(0.1)
        for g in groups:
            assert processes.group_alive(g["pgid"]) == [], g
        stopped = [e for r in (run, other) for e in ledger_events(r) if e["event"] == "stopped"]
        assert sorted(e["pgid"] for e in stopped) == sorted(g["pgid"] for g in groups)
        assert all(e["by"] == "reaper" and e["signals"] == ["SIGTERM"] and e["left"] == []
                   for e in stopped), stopped
        assert not processes.is_alive(watcher["pid"], watcher["start"])  # its work done, it left
        timed("reaper after a SIGKILLed owner", began)
    finally:
        for g in [e for r in (run, other) for e in ledger_events(r) if e["event"] == "started"]:
            if processes.still_ours(g["pgid"], g["start"]):
                os.killpg(g["pgid"], signal.SIGKILL)


def test_a_group_that_ignores_sigterm_is_killed_and_said_so(tmp_path):
    """The FAIL path of a stop: a group whose processes ignore SIGTERM gets SIGKILL after the
    grace, and the ledger says both signals; a group already gone gets none."""
    ledger = processes.Ledger(tmp_path)
    stubborn = subprocess.Popen(
        [sys.executable, "-c", "import signal, subprocess, time; "
         "signal.signal(signal.SIGTERM, signal.SIG_IGN); "
         "subprocess.Popen(['sleep', '300']); print('up', flush=True); time.sleep(300)"],
        stdout=subprocess.PIPE, text=True, start_new_session=True)
    gone = subprocess.Popen(["true"], start_new_session=True)
    gone_start = processes.start_ticks(gone.pid)
    gone.wait()
    try:
        assert stubborn.stdout.readline().strip() == "up"
        groups = [{"pgid": stubborn.pid, "start": processes.start_ticks(stubborn.pid),
                   "argv0": "python", "stage": "s"},
                  {"pgid": gone.pid, "start": gone_start, "argv0": "true", "stage": "s"}]
        reports = processes.stop_groups(ledger, groups, by="test", grace_s=0.5)
        assert [r["signals"] for r in reports] == [["SIGTERM", "SIGKILL"], []]
        assert [r["left"] for r in reports] == [[], []]
        assert stubborn.wait(timeout=5) == -signal.SIGKILL
        assert processes.group_alive(stubborn.pid) == []
    finally:
        if stubborn.poll() is None:
            os.killpg(stubborn.pid, signal.SIGKILL)


def test_a_reused_pid_or_another_boot_is_never_signalled(tmp_path):
    """The ledger names a group by its leader's PID and start: a live process bearing that PID
    with another start (the PID reused) is left alone; so is a ledger of another boot."""
    bystander = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        ledger = processes.Ledger(tmp_path)
        true_start = processes.start_ticks(bystander.pid)
        wrong = {"pgid": bystander.pid, "start": true_start - 1, "argv0": "x", "stage": "s"}
        assert not processes.still_ours(bystander.pid, true_start - 1)
        assert not processes.still_ours(bystander.pid, None)
        assert processes.still_ours(bystander.pid, true_start)
        [report] = processes.stop_groups(ledger, [wrong], by="test", grace_s=1)
        assert report["signals"] == [] and bystander.poll() is None
        ledger.append("started", pgid=bystander.pid, start=true_start, argv0="sleep",
                      stage="s", kind="run", owner=1, owner_start=0)
        assert [g["pgid"] for g in ledger.open_groups()] == [bystander.pid]
        text = ledger.path.read_text().replace(processes.boot_id(), "another-boot")
        ledger.path.write_text(text + "{torn line\n")
        assert ledger.open_groups() == [] and bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()


def interrupt_once_started(run: Path, pid: int, marker: Path, within_s: float = 10.0) -> None:
    """SIGINT to `pid` as soon as the run's ledger records a started group and the command
    has said it began (`marker` exists: the ledger's line is written before the command runs
    its first word, so under load a SIGINT on the ledger alone came before its echo)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if (run / processes.LEDGER_NAME).exists() and marker.exists() and any(
                e["event"] == "started" for e in ledger_events(run)):
            break
        time.sleep(0.05)
    os.kill(pid, signal.SIGINT)


def test_an_interrupted_door_call_stops_its_group_and_is_recorded(tmp_path):
    """KeyboardInterrupt while door.run waits (what the stage's stop raises): the command's
    whole group (a child that ignores nothing, a grandchild) is stopped, the call recorded as
    interrupted with what it printed, and the interruption goes on."""
    run = tmp_path / "run"
    door = Door(run, "s")
    # SIGINT once the ledger holds the command's group: door.run waits on it then. A timer of
    # 1.5 s from here fired before that under a second worker's load once, and the call ran
    # its whole sleep (300 s then): the sleep is 60 s, the deadline 15.
    # Python's own SIGINT handler, as a kernel and `make run` have it: in a pytest-xdist worker
    # it was once found not to raise (two runs in three, the call ran its whole sleep), left
    # so by something an earlier test of that worker ran; what it was is in the message.
    found = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        marker = tmp_path / "begun"
        threading.Thread(target=interrupt_once_started, args=(run, os.getpid(), marker),
                         daemon=True).start()
        began = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            door.run(["sh", "-c", f"echo begun; touch {marker}; sleep 60 & sleep 60"],
                     timeout=600)
    finally:
        signal.signal(signal.SIGINT, found)
    assert time.monotonic() - began < 15, f"SIGINT's handler in this worker was {found!r}"
    [entry] = read_transcript(run / "transcript.jsonl")
    assert entry["interrupted"] == "KeyboardInterrupt" and entry["group_left"] == []
    assert (run / entry["stdout"]).read_text() == "begun\n"
    [group] = [e for e in ledger_events(run) if e["event"] == "started"]
    assert processes.group_alive(group["pgid"]) == []
    assert [e["by"] for e in ledger_events(run) if e["event"] == "stopped"] == ["door"]


def test_a_door_records_and_replays_the_attempt_after_the_last_retired(tmp_path):
    """After a retired attempt, a door's calls start again at seq 0 and carry attempt 2; a
    replay answers from attempt 2 only. Without a retired entry (every older transcript),
    nothing changes: attempt 1, no field."""
    run = tmp_path / "run"
    first = Door(run, "05_x")
    first.run(["echo", "one"], timeout=10)
    (run / "05_x").mkdir()
    retired = retire_attempt(run, "05_x")
    assert retired["attempt"] == 1 and retired["moved"]["calls/05_x"] == "calls/05_x.attempt-1"
    assert json.loads((run / "05_x.attempt-1" / "incomplete.json").read_text())["attempt"] == 1
    second = Door(run, "05_x")
    assert second.attempt == 2
    result = second.run(["echo", "two"], timeout=10)
    entries = read_transcript(run / "transcript.jsonl")
    assert "attempt" not in entries[0] and entries[-1]["attempt"] == 2 and result.seq == 0
    assert (run / "calls" / "05_x" / "0000.stdout").read_text() == "two\n"
    assert (run / "calls" / "05_x.attempt-1" / "0000.stdout").read_text() == "one\n"
    replay = Door(run, "05_x", replay=True)
    assert replay.run(["echo", "two"], timeout=10).stdout == "two\n"
    assert replay.remaining() == 0
    # a name already taken refuses the whole move
    (run / "05_x.attempt-2").mkdir()
    with pytest.raises(EvidenceError, match="exists already; nothing was moved"):
        retire_attempt(run, "05_x")
    assert (run / "calls" / "05_x").is_dir()


def test_the_runner_raises_a_signal_only_while_it_waits_and_notes_a_second(capsys):
    """The runner's signals: while it waits for papermill, the first SIGTERM (or SIGINT,
    SIGHUP) raises at once; outside a wait (moving an attempt, sealing, stopping) it waits for
    the next check, so no such step is cut short; a second one is only said; the handlers are
    restored after."""
    from lib import runner

    before = signal.getsignal(signal.SIGTERM)
    child = subprocess.Popen(["sleep", "30"])
    try:
        with runner.Signals() as signals:
            threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()
            with pytest.raises(runner.Interrupted) as stopped:
                signals.wait(child)
            assert stopped.value.signum == signal.SIGTERM
            os.kill(os.getpid(), signal.SIGINT)  # a second one, while stopping
            time.sleep(0.2)
            signals.check()  # noted, never raised
        assert "SIGINT again: still stopping" in capsys.readouterr().out
        with runner.Signals() as signals:
            os.kill(os.getpid(), signal.SIGHUP)  # outside a wait: deferred
            time.sleep(0.2)
            with pytest.raises(runner.Interrupted) as stopped:
                signals.check()
            assert stopped.value.signum == signal.SIGHUP
        assert signal.getsignal(signal.SIGTERM) is before
    finally:
        child.kill()
        child.wait()
