"""Processes, in one home: what a run's doors start, how each is grouped, stopped and reaped
when the stage cannot stop it itself, and what `make run` does with a stage's papermill when a
signal comes (the runner's side, at the end of this module).

Every process a Door starts leads a process group of its own: a server (`Door.start`) its own
session, a command (`Door.run`: AIPerf under coreutils timeout, torchrun, kubectl) its own group.
A notebook's kernel stops them itself, by PID and group, when a stage ends or raises (the door's
`stop`, the stage's exit hook). What this module covers is the rest: a kernel that dies without
running its hooks (killed, or papermill killed under it: ipykernel's parent poller leaves with
`os._exit`), and `make run` interrupted while a stage runs.

The **ledger**: `<run>/.processes.jsonl`, one JSON line per event, appended by whoever acts:

    owner    a process that holds doors of the run (a notebook's kernel): pid, start, stage
    reaper   the reaper watching an owner
    started  a group a door started: pgid (= its leader's pid), start, argv0, stage, owner
    ended    the door saw that group end (its call returned, its stop finished)
    port     a port a door handed out (`free_port`): checked closed after an interruption
    stopped  a group stopped by its door, the reaper or the runner: the signals, what was left

`start` is the process's start time in clock ticks since boot (/proc/PID/stat field 22) and
`boot` the kernel's boot id: a PID is acted on only while the process bearing it is the one the
ledger names (a PID reused since, or a ledger from another boot or machine, is left alone). A
group whose leader is gone is still the run's while any process remains in it: Linux never
hands out a PID that is still some group's id.

Why the ledger is in the run folder yet outside the seal (dot-named, as AIPerf's markers are;
lib.core.evidence): every party already knows the run folder (the door in the kernel, the reaper,
the runner, and a resume after the runner itself was killed), and the ledger goes where the run
goes, with no state elsewhere. It is not evidence: PIDs and start ticks are facts of one
machine at one moment that mean nothing to a reader or a replay, and it keeps growing after a
seal (the reaper and the runner append to it after the stage's end); results/.gitignore keeps
it out of committed runs. What an interruption stopped, and when, is evidence: the runner writes
it, sealed, into the stage's `incomplete.json` (lib.runner).

A door stopping a process also says so here: `stopped` by "door" (an interrupted `run`), or
`ended` (its stop through the stage). An interrupted `run` is recorded in the transcript too.

The **reaper** (`python -m lib.core.processes --owner PID --owner-start T`): one small process per
owner (a kernel; a test session), in a session of its own (no signal meant for the kernel's group
or the runner's reaches it), started before the first process a door of the owner starts, and
told each ledger the owner writes to through its stdin. It waits for its owner to exit (a pidfd:
no polling), then stops, by process group, every group that owner started and never saw end,
and exits. An owner that ended normally left none: the reaper exits at once.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

LEDGER_NAME = ".processes.jsonl"
TERM_GRACE_S = 10.0  # the door's KILL_GRACE_S: a server's own shutdown, then SIGKILL
KILLED_EXIT_S = 30.0  # after SIGKILL: a GPU process frees its device memory first (door.py)
POLL_S = 0.1
_REPO = Path(__file__).resolve().parents[2]
_BOOT_ID_FILE = "/proc/sys/kernel/random/boot_id"


# ---- /proc ------------------------------------------------------------------------------------
def _stat_fields(pid: int) -> list[str] | None:
    """Fields 3.. of /proc/PID/stat (state first), or None when the process is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read().decode("utf-8", errors="replace")
    except OSError:
        return None
    return stat.rsplit(")", 1)[-1].split()


def start_ticks(pid: int) -> int | None:
    """When the process started (clock ticks since boot), None when it is gone or a zombie."""
    fields = _stat_fields(pid)
    if not fields or fields[0] in ("Z", "X") or len(fields) < 20:
        return None
    return int(fields[19])


def boot_id() -> str:
    try:
        return Path(_BOOT_ID_FILE).read_text().strip()
    except OSError:
        return ""


def group_alive(pgid: int) -> list[int]:
    """Live (not zombie) processes of the process group `pgid`, read from /proc."""
    alive = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        fields = _stat_fields(int(entry.name))
        if fields and len(fields) > 2 and fields[2] == str(pgid) and fields[0] not in ("Z", "X"):
            alive.append(int(entry.name))
    return alive


def is_alive(pid: int, start: int | None) -> bool:
    """Is the process that bore `pid` at `start` still running (not a zombie)?"""
    now = start_ticks(pid)
    return now is not None and (start is None or now == start)


def still_ours(pgid: int, start: int | None) -> bool:
    """Does the group the ledger names still exist, and is it the one it names? Its leader
    alive with another start time (or with none recorded): the PID was reused, not ours. Its
    leader gone: the group is ours while any process remains in it."""
    leader = start_ticks(pgid)
    if leader is not None:  # no start recorded: the leader had exited when the door looked
        return start is not None and leader == start
    return bool(group_alive(pgid))


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        return s.connect_ex((host, port)) == 0


# ---- the ledger -------------------------------------------------------------------------------
class Ledger:
    """`<run>/.processes.jsonl`: appended by the doors, the reapers and the runner of one run."""

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LEDGER_NAME

    def append(self, event: str, **fields) -> dict:
        entry = {"event": event, "t": round(time.time(), 3), "boot": boot_id(), **fields}
        self.run_dir.mkdir(parents=True, exist_ok=True)
        line = json.dumps(entry, sort_keys=True) + "\n"
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:  # one write of one line, O_APPEND: writers of several processes never interleave
            os.write(fd, line.encode("utf-8"))
        finally:
            os.close(fd)
        return entry

    def events(self, *, this_boot: bool = True) -> list[dict]:
        """The ledger's events (of this boot unless told); a line a killed writer left
        unfinished is skipped (the ledger is not evidence: nothing is read from it but PIDs)."""
        try:
            text = self.path.read_text(encoding="utf-8")
        except OSError:
            return []
        found, boot = [], boot_id()
        for line in text.splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if isinstance(entry, dict) and (not this_boot or entry.get("boot") == boot):
                found.append(entry)
        return found

    # -- the events the doors write
    def owner(self, stage: str) -> dict:
        pid = os.getpid()
        return self.append("owner", pid=pid, start=start_ticks(pid), stage=stage)

    def started(self, pgid: int, argv: list[str], stage: str, kind: str) -> dict:
        owner = os.getpid()
        return self.append("started", pgid=pgid, start=start_ticks(pgid), stage=stage,
                           kind=kind, argv0=Path(str(argv[0])).name if argv else "",
                           owner=owner, owner_start=start_ticks(owner))

    def ended(self, pgid: int, start: int | None) -> dict:
        return self.append("ended", pgid=pgid, start=start)

    def port(self, port: int, stage: str) -> dict:
        return self.append("port", port=port, stage=stage, owner=os.getpid())

    # -- what is left
    def owners(self, stage: str | None = None, *, alive_only: bool = True) -> list[dict]:
        found = [e for e in self.events() if e["event"] == "owner"
                 and (stage is None or e.get("stage") == stage)]
        return [e for e in found if not alive_only or is_alive(e["pid"], e.get("start"))]

    def open_groups(self, *, owner: tuple[int, int | None] | None = None,
                    stage: str | None = None) -> list[dict]:
        """Groups started and not seen to end (nor stopped wholly), still the run's, of one
        owner or stage when given, in the order they started."""
        events = self.events()
        closed = {(e["pgid"], e.get("start")) for e in events
                  if e["event"] == "ended" or (e["event"] == "stopped" and not e.get("left"))}
        found = []
        for e in events:
            if e["event"] != "started" or (e["pgid"], e.get("start")) in closed:
                continue
            if owner is not None and (e.get("owner"), e.get("owner_start")) != owner:
                continue
            if stage is not None and e.get("stage") != stage:
                continue
            if still_ours(e["pgid"], e.get("start")):
                found.append(e)
        return found

    def ports(self, stage: str | None = None, owners: set[int] | None = None) -> list[int]:
        return sorted({e["port"] for e in self.events() if e["event"] == "port"
                       and (stage is None or e.get("stage") == stage)
                       and (owners is None or e.get("owner") in owners)})


# ---- stopping ---------------------------------------------------------------------------------
def stop_groups(ledger: Ledger, groups: list[dict], *, by: str, grace_s: float = TERM_GRACE_S,
                killed_exit_s: float = KILLED_EXIT_S) -> list[dict]:
    """SIGTERM every group, wait up to `grace_s` for all to be gone, SIGKILL what is left, wait
    up to `killed_exit_s`; each group acted on only while it is still the ledger's. Appends a
    `stopped` event per group; returns them (what was sent, what was left)."""
    sent: dict[tuple[int, int | None], list[str]] = {}
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, killed_exit_s)):
        targets = [g for g in groups if still_ours(g["pgid"], g.get("start"))]
        if not targets:
            break
        for g in targets:
            try:
                os.killpg(g["pgid"], sig)
            except (ProcessLookupError, PermissionError):
                continue
            sent.setdefault((g["pgid"], g.get("start")), []).append(sig.name)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and any(group_alive(g["pgid"]) for g in targets):
            time.sleep(POLL_S)
    reports = []
    for g in groups:
        key = (g["pgid"], g.get("start"))
        left = group_alive(g["pgid"]) if still_ours(*key) else []
        reports.append(ledger.append("stopped", pgid=g["pgid"], start=g.get("start"), by=by,
                                     argv0=g.get("argv0", ""), stage=g.get("stage"),
                                     signals=sent.get(key, []), left=left))
    return reports


def stop_pid_group(pid: int, start: int | None, *, grace_s: float,
                   killed_exit_s: float = KILLED_EXIT_S) -> list[str]:
    """SIGTERM then SIGKILL the process group led by `pid` (a papermill, a kernel: sessions of
    their own), while it is the one that started at `start`; the signals sent."""
    sent = []
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, killed_exit_s)):
        if not still_ours(pid, start):
            break
        try:
            os.killpg(pid, sig)
        except (ProcessLookupError, PermissionError):
            break
        sent.append(sig.name)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and group_alive(pid):
            time.sleep(POLL_S)
    return sent


# ---- the reaper -------------------------------------------------------------------------------
class _Reaper:
    """This process's reaper: started once, told each ledger this process writes to."""

    def __init__(self, proc: subprocess.Popen, owner: int, start: int | None):
        self.proc, self.owner, self.start = proc, owner, start
        self.proc_start = start_ticks(proc.pid)
        self.ledgers: set[str] = set()


_reaper: _Reaper | None = None
_reaper_lock = threading.Lock()


def ensure_reaper(ledger: Ledger) -> int | None:
    """This process's reaper, watching it for `ledger` from now on; its PID. One reaper per
    process whatever the ledgers (a test session writes hundreds), started on first use and
    again should it have died; told each new ledger through its stdin, before the process the
    ledger will name is started."""
    global _reaper
    me = os.getpid()
    path = str(ledger.path)
    with _reaper_lock:
        reaper = _reaper
        if reaper is not None and (reaper.proc.poll() is not None or reaper.owner != me):
            reaper = None  # it died, or this is a fork of the process that started it
        if reaper is None:
            start = start_ticks(me)
            try:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "lib.core.processes", "--owner", str(me),
                     "--owner-start", str(start)],
                    cwd=_REPO, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL, start_new_session=True, close_fds=True,
                    env=_reaper_env())
            except OSError:
                return None
            reaper = _reaper = _Reaper(proc, me, start)
            # never waited for by its owner, which it outlives by design: a thread reaps it
            # should it end first (no zombie under a long-lived owner)
            threading.Thread(target=proc.wait, daemon=True).start()
        if path not in reaper.ledgers:
            try:
                reaper.proc.stdin.write((path + "\n").encode("utf-8"))
                reaper.proc.stdin.flush()
            except (BrokenPipeError, OSError):
                _reaper = None
                return None
            reaper.ledgers.add(path)
            ledger.append("reaper", pid=reaper.proc.pid, start=reaper.proc_start, owner=me,
                          owner_start=reaper.start)
        return reaper.proc.pid


def _reaper_env() -> dict[str, str]:
    """What the reaper needs of the environment, nothing more: it holds no secret, and no
    marker a test finds its own processes by (tests/slurmlocal.py: LOCALSLURM_ID)."""
    env = {k: os.environ[k] for k in ("PATH", "LANG", "LC_ALL", "TMPDIR") if k in os.environ}
    env["PYTHONPATH"] = str(_REPO)
    return env


def wait_for_exit(pid: int, start: int | None, on_input=None) -> None:
    """Return when the process that bore `pid` at `start` has exited; meanwhile each chunk
    read from stdin goes to `on_input` (the ledgers the owner names)."""
    stdin = sys.stdin.fileno() if on_input is not None else None
    try:
        fd = os.pidfd_open(pid)
    except (OSError, AttributeError):
        fd = None
    try:
        if not is_alive(pid, start):  # gone (or the PID reused) before the pidfd opened
            return
        poller = select.poll()
        if fd is not None:
            poller.register(fd, select.POLLIN)
        if stdin is not None:
            poller.register(stdin, select.POLLIN | select.POLLHUP)
        while True:
            for ready, _mask in poller.poll(None if fd is not None else 500):
                if ready == fd:
                    return
                chunk = os.read(stdin, 65536)
                if chunk:
                    on_input(chunk)
                else:  # the owner's end closed: it is exiting; the pidfd (or /proc) says when
                    poller.unregister(stdin)
                    stdin = None
            if fd is None and not is_alive(pid, start):
                return
    finally:
        if fd is not None:
            os.close(fd)


def watch(owner: int, owner_start: int | None) -> list[dict]:
    """The reaper's life: wait for the owner to exit, then stop what it left in each ledger."""
    told = bytearray()
    wait_for_exit(owner, owner_start, told.extend)
    try:  # what the owner wrote just before it died
        os.set_blocking(sys.stdin.fileno(), False)
        while chunk := os.read(sys.stdin.fileno(), 65536):
            told.extend(chunk)
    except (BlockingIOError, OSError):
        pass
    stopped = []
    for path in sorted({p for p in told.decode("utf-8", "replace").splitlines() if p}):
        ledger = Ledger(Path(path).parent)
        left = ledger.open_groups(owner=(owner, owner_start))
        if left:
            stopped += stop_groups(ledger, left, by="reaper")
    return stopped


# ==== the runner's side: signals, a stage's attempt, what a run left ===========================
# `make run` (lib.runner) runs each stage's notebook with papermill; what starts that process,
# what a signal does meanwhile and how the attempt and its leftovers are stopped live here, with
# the ledger and the reaper they act through.

INTERRUPTS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# How long a stage's kernel has to stop what it started, once asked (its servers: SIGTERM, up
# to the door's 10 s, SIGKILL, up to 30 s), before it is killed; papermill then ends by itself.
KERNEL_GRACE_S = 60.0
PAPERMILL_GRACE_S = 5.0
# A papermill killed under its kernel: ipykernel's parent poller ends the kernel within ~1 s
ORPHAN_KERNEL_S = 10.0
# A reaper's stop of what its kernel left: SIGTERM, its grace, SIGKILL, the exits
REAPER_WAIT_S = TERM_GRACE_S + KILLED_EXIT_S + 5.0


try:  # Linux's prctl, for papermill's PR_SET_PDEATHSIG (loaded here: never after a fork)
    _LIBC = ctypes.CDLL(None, use_errno=True)
except OSError:
    _LIBC = None
_PR_SET_PDEATHSIG = 1


def _die_with_the_runner() -> None:
    """In papermill's process, before it runs: SIGTERM when the runner dies, by SIGKILL too
    (which the runner cannot handle), so papermill never outlives it; its kernel then ends
    (ipykernel's parent poller) and the kernel's reaper stops what the stage started."""
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def say(text: str) -> None:
    """A progress line; a terminal that went away (SIGHUP) does not stop a stop."""
    try:
        print(text, flush=True)
    except OSError:
        pass


class Interrupted(BaseException):
    """The runner received SIGINT, SIGTERM or SIGHUP."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(signal.Signals(signum).name)


class Signals:
    """SIGINT, SIGTERM and SIGHUP while the stages run. The first one raises Interrupted at once
    only while the runner waits for papermill; anywhere else (moving an attempt, sealing,
    stopping) it is raised at the next `check`, so no such step is cut short. A later one (a
    second Ctrl-C while stopping) is noted, never raised. The handlers are restored on exit
    (the runner may run inside pytest); outside the main thread, signals are left alone."""

    def __init__(self):
        self.got: list[int] = []
        self.raised = False
        self._waiting = False
        self._saved: dict = {}

    def __enter__(self) -> "Signals":
        if threading.current_thread() is threading.main_thread():
            self._saved = {sig: signal.signal(sig, self._handler) for sig in INTERRUPTS}
        return self

    def __exit__(self, *exc) -> bool:
        for sig, old in self._saved.items():
            signal.signal(sig, old)
        return False

    def _handler(self, signum, _frame) -> None:
        self.got.append(signum)
        if len(self.got) > 1:
            say(f"{signal.Signals(signum).name} again: still stopping what the stage started")
        elif self._waiting:
            self.raised = True
            raise Interrupted(signum)

    def check(self) -> None:
        if self.got and not self.raised:
            self.raised = True
            raise Interrupted(self.got[0])

    def wait(self, proc: subprocess.Popen) -> int:
        """proc.wait(), interruptible."""
        self._waiting = True
        try:
            self.check()
            return proc.wait()
        finally:
            self._waiting = False


def settle_leftovers(run_dir: Path) -> list[dict]:
    """Groups of the run's ledger still open whose owner is gone (its reaper died too, or the
    runner was killed before it could stop them): stopped now."""
    ledger = Ledger(run_dir)
    alive = {(o["pid"], o.get("start")) for o in ledger.owners()}
    left = [g for g in ledger.open_groups() if (g.get("owner"), g.get("owner_start")) not in alive]
    if not left:
        return []
    say(f"stopping {len(left)} process group(s) an earlier attempt left running: "
        + ", ".join(f"{g['argv0']} (pgid {g['pgid']}, {g['stage']})" for g in left))
    return stop_groups(ledger, left, by="runner")


class Attempt:
    """The stage papermill is running now (`start_attempt`), and what stops it: its kernel
    asked, then papermill, then what the ledger says the attempt left; what it all came to
    (`incomplete`, which the runner writes as the stage's incomplete.json)."""

    def __init__(self, run_dir: Path, stage: str, proc: subprocess.Popen, number: int):
        self.run_dir, self.stage, self.proc = run_dir, stage, proc
        self.since = time.time()
        self.number = number  # its attempt of the stage (the runner reads it from the transcript)
        self.ledger = Ledger(run_dir)

    def kernels(self, alive_only: bool = True) -> list[dict]:
        """This attempt's kernel(s): the ledger's owners of the stage, and papermill's children
        (a kernel stopped before its stage opened is in no ledger)."""
        found = [o for o in self.ledger.owners(self.stage, alive_only=alive_only)
                 if o["t"] >= self.since - 1]
        known = {o["pid"] for o in found}
        for pid in children(self.proc.pid):
            if pid not in known:
                found.append({"pid": pid, "start": start_ticks(pid), "stage": self.stage})
        return found

    def stop(self, ask_kernel: bool) -> dict:
        """Stop the stage: its kernel asked first (when `ask_kernel`), then killed; papermill;
        then what is left. A kernel not asked (its papermill was killed) ends by itself, and its
        reaper stops what it started."""
        kernels = self.kernels()
        asked = []
        for k in kernels:
            if ask_kernel and is_alive(k["pid"], k.get("start")):
                try:
                    os.kill(k["pid"], signal.SIGTERM)
                    asked.append(k["pid"])
                except ProcessLookupError:
                    pass
        if asked:
            say(f"[{self.stage}] asked its kernel (pid {', '.join(map(str, asked))}) to stop "
                f"what it started; waiting up to {KERNEL_GRACE_S:.0f} s")
        wait_for(lambda: self.proc.poll() is not None, KERNEL_GRACE_S if asked else 0)
        pm_signals = stop_pid_group(self.proc.pid, start_ticks(self.proc.pid),
                                           grace_s=PAPERMILL_GRACE_S) \
            if self.proc.poll() is None else []
        self.proc.wait()
        # a kernel whose papermill is gone ends by itself (ipykernel's parent poller): else now
        wait_for(lambda: not any(is_alive(k["pid"], k.get("start")) for k in kernels),
                 ORPHAN_KERNEL_S)
        kernel_signals = {k["pid"]: stop_pid_group(k["pid"], k.get("start"),
                                                          grace_s=PAPERMILL_GRACE_S)
                          for k in kernels}
        # a kernel that died without its exit hook: its reaper stops what it left; the runner
        # stops only what is left after (a reaper killed too, a group it could not stop)
        owners = {(k["pid"], k.get("start")) for k in self.kernels(alive_only=False)}
        reapers = [e for e in self.ledger.events() if e["event"] == "reaper"
                   and (e.get("owner"), e.get("owner_start")) in owners]
        if any(is_alive(r["pid"], r.get("start")) for r in reapers):
            say(f"[{self.stage}] its kernel is gone; its reaper is stopping what it left")
        wait_for(lambda: not any(is_alive(r["pid"], r.get("start")) for r in reapers),
                 REAPER_WAIT_S)
        left = [g for g in self.ledger.open_groups(stage=self.stage) if g["t"] >= self.since - 1]
        stopped = stop_groups(self.ledger, left, by="runner") if left else []
        return {"asked_kernel": asked, "papermill_signals": pm_signals,
                "kernel_signals": {str(k): v for k, v in kernel_signals.items() if v},
                "stopped_now": stopped}

    def incomplete(self, how: str, signum: int | None, stop: dict) -> dict:
        """What incomplete.json says: when, how, by which signal; each process group the
        attempt's doors started and how it ended (its stage's own stop through the door, the
        reaper, the runner), with what was left of it; its ports, each checked closed."""
        events = [e for e in self.ledger.events() if e.get("t", 0) >= self.since - 1
                  and e.get("stage") == self.stage]
        groups = []
        for e in (e for e in events if e["event"] == "started"):
            key = (e["pgid"], e.get("start"))
            ended = [x for x in self.ledger.events() if (x.get("pgid"), x.get("start")) == key
                     and x["event"] in ("ended", "stopped")]
            stopped = [x for x in ended if x["event"] == "stopped"]
            groups.append({
                "pgid": e["pgid"], "argv0": e.get("argv0"), "kind": e.get("kind"),
                "ended": (f"stopped by the {stopped[0]['by']}" if stopped else
                          "ended through its stage (the door)" if ended else "not seen to end"),
                "signals": [sig for x in stopped for sig in x.get("signals") or []],
                "left": group_alive(e["pgid"]) if group_still_ours(e) else []})
        ports = sorted({e["port"] for e in events if e["event"] == "port"})
        notebook = self.run_dir / "notebooks" / f"{self.stage}.ipynb"
        try:
            json.loads(notebook.read_text(encoding="utf-8"))
            notebook_ok = True
        except (OSError, ValueError):
            notebook_ok = False
        return {
            "stage": self.stage, "attempt": self.number,
            "stopped_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "how": how, "signal": signal.Signals(signum).name if signum else None,
            "papermill": {"exit_code": self.proc.returncode,
                          "signals": stop.get("papermill_signals", [])},
            "kernel": {"asked_to_stop": bool(stop.get("asked_kernel")),
                       "signals": sorted({s for v in stop.get("kernel_signals", {}).values()
                                          for s in v})},
            "process_groups": groups,
            "left_running": sorted({p for g in groups for p in g["left"]}),
            "ports": [{"port": p, "listening": port_open(p)} for p in ports],
            "notebook": {"path": f"notebooks/{self.stage}.ipynb", "exists": notebook.exists(),
                         "valid_json": notebook_ok},
        }


def group_still_ours(started: dict) -> bool:
    """Whether the group a ledger's `started` event names is still that group."""
    return still_ours(started["pgid"], started.get("start"))


def children(pid: int) -> list[int]:
    """A process's children (papermill's: its kernel), read from /proc."""
    found = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children", encoding="ascii") as fh:
                found += [int(p) for p in fh.read().split()]
        except (OSError, ValueError):
            continue
    return found


def found_in_ledger(run_dir: Path, stage: str) -> dict:
    """What the ledger says of a stage's last attempt that no runner saw end (for the
    incomplete.json written when it is kept): its process groups, how each ended, its ports."""
    ledger = Ledger(run_dir)
    events = ledger.events()
    opened = [e["t"] for e in events if e["event"] == "owner" and e.get("stage") == stage]
    if not opened:
        return {}
    mine = [e for e in events if e.get("t", 0) >= opened[-1] and e.get("stage") == stage]
    groups = []
    for e in (e for e in mine if e["event"] == "started"):
        ends = [x for x in events if (x.get("pgid"), x.get("start")) == (e["pgid"], e.get("start"))
                and x["event"] in ("ended", "stopped")]
        by = [x.get("by") for x in ends if x["event"] == "stopped"]
        groups.append({"pgid": e["pgid"], "argv0": e.get("argv0"), "kind": e.get("kind"),
                       "ended": (f"stopped by the {by[0]}" if by else "ended through its "
                                 "stage (the door)" if ends else "not seen to end"),
                       "left": group_alive(e["pgid"]) if group_still_ours(e) else []})
    ports = sorted({e["port"] for e in mine if e["event"] == "port"})
    return {"process_groups": groups,
            "ports": [{"port": p, "listening": port_open(p)} for p in ports]}


def wait_for(condition, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)
    return True


def start_attempt(argv: list[str], out) -> subprocess.Popen:
    """papermill running one stage, its output into `out`, in a session of its own (a
    terminal's Ctrl-C reaches the runner alone, which stops the stage in order; its kernel sits
    in a session of its own too: jupyter_client), ending should the runner die
    (`_die_with_the_runner`)."""
    return subprocess.Popen(argv, cwd=_REPO, stdin=subprocess.DEVNULL, stdout=out,
                            stderr=subprocess.STDOUT, start_new_session=True,
                            preexec_fn=_die_with_the_runner)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lib.core.processes")
    parser.add_argument("--owner", type=int, required=True)
    parser.add_argument("--owner-start", default="None")
    args = parser.parse_args(argv)
    for sig in (signal.SIGINT, signal.SIGHUP):  # a terminal's signals are not for it
        signal.signal(sig, signal.SIG_IGN)
    start = None if args.owner_start in ("", "None") else int(args.owner_start)
    watch(args.owner, start)
    return 0


if __name__ == "__main__":
    sys.exit(main())
