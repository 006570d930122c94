"""The one door to the world.

Every effect and every observation a stage makes goes through a Door: processes (argv lists only,
a timeout on every call), background servers, HTTP requests, free ports, clocks, host files.
Recording writes one JSON line per call into ``<run>/transcript.jsonl`` (argv, cwd, the env keys
it set, rc, duration, stdout/stderr kept whole as files under ``<run>/calls/<stage>/``), with
secrets redacted and cluster identities (private addresses, EC2 host names, AWS account ids)
pseudonymised before anything is written (lib/core/redact.py, lib/core/identities.py). The
values handed back to the caller are the redacted, pseudonymised, recorded ones, so a recorded
run and its replay see exactly the same data. What leaves for the world is revealed again: a
pseudonym the caller passes back (a node name it read from `kubectl get nodes`) reaches the
process, the URL or the file it names as the real value, and is recorded as the pseudonym.

Replay (``REPRO_REPLAY=<run dir>``) answers each call from the transcript, in order, per stage,
and raises ReplayMismatch naming the call when the code asks for something else.

Paths inside the run directory and the repository are recorded as ``{run}`` and ``{repo}`` so a
run recorded in one checkout replays in another.

Every process the door starts leads a process group of its own (a server: its own session) and
is written into the run's ledger (lib/core/processes.py), whose reaper stops it should the kernel
die without stopping it. A call interrupted (the stage's stop on SIGTERM, a KeyboardInterrupt)
stops its process's group before the interruption goes on, and is recorded as interrupted.

Attempts: a stage interrupted before its gates were written is kept, when the run is resumed, as
an attempt of its own (`NN_stage.attempt-K/`, lib.core.stage `retire_attempt`), and the
transcript gets a `retired` entry for it. Entries of a stage's attempt K > 1 carry
`"attempt": K`; entries without it are attempt 1 (every transcript recorded before attempts).
A door records and replays the attempt after the last retired one: a replay follows the attempt
that completed.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import weakref
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import sh

from lib.core import identities as naming
from lib.core import processes
from lib.core import redact as redaction
from lib.core.errors import CommandError, DoorError, PlanOnly, ReplayMismatch  # noqa: F401

REPO_ROOT = Path(__file__).resolve().parents[2]
ALL_EXIT_CODES = list(range(-64, 256))
KILL_GRACE_S = 10.0
# After SIGKILL, how long a process may take to vanish: a GPU process frees its device memory
# and contexts in the driver first (seconds), and the stop waits only while one remains.
KILLED_EXIT_S = 30.0
# free_port's range: [_LOWEST_PICKED_PORT, the ephemeral range's low bound read from here)
EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
_LOWEST_PICKED_PORT = 10000  # above the well-known and most registered service ports
# A file of the run an argv names is handed to the process as a revealed copy when its text holds
# a pseudonym (a manifest, a script: small); a larger one (a log, a model) is passed as it is.
REVEAL_MAX_BYTES = 16 * 2 ** 20
# The transcript entry that closes an attempt of a stage (lib.core.stage `retire_attempt`)
RETIRED = "retired"
# The signals a stage's stop is asked with; held back while the door stops a process
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# a program that could not be started (not on PATH): the shell's exit code and what stderr says
NOT_FOUND_RC, NOT_FOUND = 127, "command not found"


@dataclass
class CallResult:
    argv: list[str]
    rc: int
    stdout: str
    stderr: str
    duration_s: float
    timed_out: bool = False
    seq: int = -1

    @property
    def ok(self) -> bool:
        return self.rc == 0 and not self.timed_out

    @property
    def not_found(self) -> bool:
        """Whether its program could not be started: not on PATH (the shell's exit 127)."""
        return self.rc == NOT_FOUND_RC and self.stderr.startswith(NOT_FOUND)


@dataclass
class HttpResult:
    method: str
    url: str
    status: int | None
    body: str
    error: str | None
    duration_s: float
    seq: int = -1
    headers: dict[str, str] = field(default_factory=dict)

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class Background:
    """A long-running process started through the door (a server)."""

    argv: list[str]
    pid: int
    log_path: Path
    seq: int
    _running: Any = field(default=None, repr=False)
    # The variables set over the inherited environment, as the transcript holds them (paths
    # normalised, secrets masked): in replay, what the recorded process was started with, so an
    # artifact that reports it does not depend on the replaying machine's environment. None when
    # a transcript older than this field is replayed.
    env: dict[str, str] | None = None
    # After `Door.stop`: the processes of its group still alive when the stop gave up (empty
    # when it is wholly gone; children and grandchildren included, which /proc reads of the
    # leader's children miss). None before a stop, and when a transcript older than the field
    # is replayed.
    group_left: list[int] | None = None
    # its leader's start (clock ticks since boot): the ledger's name for its group (record only)
    _ticks: int | None = field(default=None, repr=False)


class Door:
    def __init__(self, run_dir: Path, stage: str, *, replay: bool = False, plan: bool = False):
        self.run_dir = Path(run_dir).resolve()
        self.stage = stage
        self.replay = replay
        # plan mode: nothing is run against a cluster or a server; commands are recorded as
        # planned (`plan`), local checkers still run (PLAN_CHECKERS), local files are still read
        self.planning = plan
        self.transcript_path = self.run_dir / "transcript.jsonl"
        self.calls_dir = self.run_dir / "calls" / stage
        self._seq = 0
        self._script: list[dict] = []
        # Recording: the run's table of pseudonyms (kept outside the run, lib/core/identities.py).
        # Replay: none; a live key's raw identities (a parameter's account id) match the
        # recorded pseudonyms by a consistent renaming, learned in _bindings.
        self.identities = None if replay else naming.Identities.for_run(self.run_dir)
        self._bindings = naming.Bindings()
        # Values this stage's calls named secret (their env, flags, URLs, headers), longest
        # first: masked in everything recorded after, though no variable of this process holds them.
        self._secrets: list[str] = []
        self._private: Path | None = None  # revealed copies of files an argv names (0700)
        self._held: dict[int, list[Path]] = {}  # a background process's copies, until its stop
        # the processes it starts, for the reaper and the runner (never in replay: none start)
        self.ledger = None if replay else processes.Ledger(self.run_dir)
        entries = read_transcript(self.transcript_path)
        self.attempt = attempt_of(entries, stage)
        mine = [e for e in entries if e["stage"] == stage and in_attempt(e, self.attempt)]
        if replay:
            self._script = mine
        else:
            self._seq = len(mine)

    # ---- path normalisation: recorded text names {run} and {repo}, never this checkout -------
    def norm(self, text: str) -> str:
        # The interpreter first: a run recorded with a GPU machine's python3 replays under .venv.
        text = text.replace(sys.executable, "{python}")
        text = text.replace(str(Path(sys.executable).parent) + "/", "{bin}/")  # its scripts
        text = text.replace(str(self.run_dir), "{run}")
        return text.replace(str(REPO_ROOT), "{repo}")

    def denorm(self, text: str) -> str:
        text = text.replace("{python}", sys.executable).replace("{run}", str(self.run_dir))
        text = text.replace("{bin}/", str(Path(sys.executable).parent) + "/")
        return text.replace("{repo}", str(REPO_ROOT))

    # ---- what is recorded and handed back: secrets masked, identities pseudonymised --------
    def _learn(self, values: list[str]) -> None:
        new = {v for v in values if len(v) >= redaction.MIN_SECRET_LEN} - set(self._secrets)
        if new:
            self._secrets = sorted({*self._secrets, *new}, key=len, reverse=True)

    def _pseudonymise(self, text: str) -> str:
        return self.identities.pseudonymise(text) if self.identities is not None else text

    def scrub(self, text: str) -> str:
        """A text as the door writes it, paths left as they are: secrets masked, identities
        pseudonymised (recording; a replay writes nothing)."""
        return self._pseudonymise(redaction.redact(text, self._secrets))

    def clean(self, text: str) -> str:
        """What the door records and hands back of a text: paths normalised ({run}, {repo}),
        secrets masked, identities pseudonymised."""
        return self.scrub(self.norm(text))

    _clean = clean

    def _clean_argv(self, argv: list[str]) -> list[str]:
        masked = redaction.redact_argv([self.norm(str(a)) for a in argv], self._secrets)
        return [self._pseudonymise(a) for a in masked]

    def _clean_env(self, env: dict[str, str] | None) -> dict[str, str]:
        masked = redaction.redact_env({k: self.norm(str(v)) for k, v in (env or {}).items()},
                                      self._secrets)
        return {k: self._pseudonymise(v) for k, v in masked.items()}

    def clean_file(self, path: Path) -> bool:
        """Rewrite a file the world wrote into the run (a server's log) as the door writes text;
        returns whether anything changed."""
        path = Path(path)
        try:
            with open(path, encoding="utf-8", newline="") as fh:
                text = fh.read()
        except (OSError, UnicodeDecodeError):
            return False
        clean = self.scrub(text)
        if clean != text:
            with open(path, "w", encoding="utf-8", newline="") as fh:
                fh.write(clean)
            return True
        return False

    # ---- what leaves for the world: pseudonyms revealed ---------------------------------------
    def _reveal(self, text):
        if self.identities is None or not isinstance(text, str):
            return text
        return self.identities.reveal(text)

    def _reveal_env(self, env: dict[str, str] | None) -> dict[str, str] | None:
        return None if env is None else {k: self._reveal(str(v)) for k, v in env.items()}

    def _reveal_argv(self, argv: list[str], cwd, copies: list[Path]) -> list[str]:
        """argv with pseudonyms revealed, and each element naming a file of the run whose text
        holds one (a manifest pinned to `node-0.ec2.internal`) replaced by a revealed private
        copy, so `kubectl apply -f` reaches the real node while the evidence keeps the name."""
        if self.identities is None:
            return argv
        return [self._reveal_file_arg(self._reveal(a), cwd, copies) for a in argv]

    def _reveal_file_arg(self, arg: str, cwd, copies: list[Path]) -> str:
        prefix, path = "", arg
        if arg.startswith("-") and "=" in arg:
            name, _, path = arg.partition("=")
            prefix = name + "="
        if not path or len(path) > 4096 or "\0" in path:
            return arg
        try:
            file = Path(path) if Path(path).is_absolute() else Path(cwd or os.getcwd()) / path
            file = file.resolve()
            if not (file.is_relative_to(self.run_dir) and file.is_file()
                    and file.stat().st_size <= REVEAL_MAX_BYTES):
                return arg
            with open(file, encoding="utf-8", newline="") as fh:
                text = fh.read()
        except (OSError, UnicodeDecodeError, ValueError):
            return arg
        revealed = self.identities.reveal(text)
        if revealed == text:
            return arg
        if self._private is None:
            self._private = Path(tempfile.mkdtemp(prefix="guide-revealed-"))  # mode 0700
            weakref.finalize(self, shutil.rmtree, str(self._private), True)
        copy = Path(tempfile.mkdtemp(dir=self._private)) / file.name
        with open(copy, "w", encoding="utf-8", newline="") as fh:
            fh.write(revealed)
        copies.append(copy)
        return prefix + str(copy)

    @staticmethod
    def _drop(copies: list[Path]) -> None:
        for copy in copies:
            shutil.rmtree(copy.parent, ignore_errors=True)

    # ---- transcript ---------------------------------------------------------------------------
    def _next(self, kind: str, key: Any) -> dict:
        """Replay: the next recorded call of this stage, which must be `kind` with `key`."""
        index = self._seq
        self._seq += 1
        if index >= len(self._script):
            raise ReplayMismatch(
                f"replay: stage {self.stage} call #{index}: the code asks for {kind} {key!r}, "
                f"but the transcript holds only {len(self._script)} calls for this stage"
            )
        entry = self._script[index]
        if entry["kind"] != kind or not _key_matches(entry["key"], key, self._bindings):
            raise ReplayMismatch(
                f"replay: stage {self.stage} call #{index} differs:\n"
                f"  the code asks for  {kind} {key!r}\n"
                f"  the transcript has {entry['kind']} {entry['key']!r}"
            )
        return entry

    def _record(self, kind: str, key: Any, **fields: Any) -> dict:
        entry = {"stage": self.stage, "seq": self._seq, "kind": kind, "key": key, **fields}
        if self.attempt > 1:
            entry["attempt"] = self.attempt
        self._seq += 1
        self.transcript_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.transcript_path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(entry, sort_keys=True) + "\n")
        return entry

    def _as_recorded(self, key: Any) -> Any:
        """Replay: a live key in the recorded pseudonyms of the identities it matched."""
        if not self._bindings:
            return key
        if isinstance(key, str):
            return naming.as_recorded(key, self._bindings)
        if isinstance(key, list):
            return [self._as_recorded(k) for k in key]
        if isinstance(key, dict):
            return {k: self._as_recorded(v) for k, v in key.items()}
        return key

    def same_as_recorded(self, recorded: str, live: str) -> bool:
        """Replay: does a recorded text (an artifact the stage wrote through `scrub`) say what
        the code re-computed, up to the consistent renaming of identities the replay of this
        stage has learned (a manifest naming the image by a parameter's raw account id)?"""
        return _key_matches(recorded, live, self._bindings)

    def remaining(self) -> int:
        """Replay: recorded calls of this stage the code has not asked for."""
        return max(0, len(self._script) - self._seq) if self.replay else 0

    def _write_stream(self, seq: int, name: str, text: str) -> str:
        self.calls_dir.mkdir(parents=True, exist_ok=True)
        path = self.calls_dir / f"{seq:04d}.{name}"
        path.write_text(text, encoding="utf-8")
        return str(path.relative_to(self.run_dir))

    def _read_stream(self, rel: str) -> str:
        # newline="": a carriage return stays one (see read_text).
        with open(self.run_dir / rel, encoding="utf-8", newline="") as f:
            return f.read()

    # ---- processes ----------------------------------------------------------------------------
    def run(
        self,
        argv: list[str],
        *,
        timeout: float,
        cwd: str | Path | None = None,
        env: dict[str, str] | None = None,
        input: str | None = None,
        check: bool = True,
        ok_codes: tuple[int, ...] = (0,),
    ) -> CallResult:
        """Run argv to completion. `env` holds only the keys to set over the current environment."""
        if isinstance(argv, str):
            raise DoorError("door.run takes an argv list, never a shell string")
        if not timeout or timeout <= 0:
            raise DoorError(f"door.run needs a positive timeout, got {timeout!r}")
        argv = [str(a) for a in argv]
        self._learn(redaction.secrets_in_env(env) + redaction.secrets_in_argv(argv))
        key = self._clean_argv(argv)
        if self.planning and not self.replay and not _is_plan_checker(argv):
            raise PlanOnly(f"context plan runs nothing but local checkers "
                           f"({', '.join(PLAN_CHECKERS)}); asked to run {' '.join(key)!r}: "
                           "record it with door.plan instead")
        if self.replay:
            entry = self._next("run", key)
            key = self._as_recorded(key)
            result = CallResult(
                argv=key, rc=entry["rc"], stdout=self._read_stream(entry["stdout"]),
                stderr=self._read_stream(entry["stderr"]), duration_s=entry["duration_s"],
                timed_out=entry["timed_out"], seq=entry["seq"],
            )
        else:
            copies: list[Path] = []
            running: dict[str, Any] = {}
            try:
                rc, out, err, duration, timed_out = _execute(
                    self._reveal_argv(argv, cwd, copies), timeout, self._reveal(cwd),
                    self._reveal_env(env), self._reveal(input), started=running,
                    ledger=self.ledger, stage=self.stage)
            except BaseException as stopped:  # interrupted: its group first, then the record
                if "proc" not in running:
                    raise
                with deferred_signals():
                    rc, out, err, duration, left = _abandon(running)
                    self._drop(copies)
                    self._record_run(key, cwd, env, timeout, rc, out, err, duration, False,
                                     interrupted=type(stopped).__name__, group_left=left)
                raise
            finally:
                self._drop(copies)
            seq, out, err = self._record_run(key, cwd, env, timeout, rc, out, err, duration,
                                             timed_out)
            result = CallResult(key, rc, out, err, round(duration, 6), timed_out, seq)
        if check and (result.rc not in ok_codes or result.timed_out):
            raise CommandError(result)
        return result

    def _record_run(self, key, cwd, env, timeout, rc, out, err, duration, timed_out,
                    **interruption) -> tuple[int, str, str]:
        """A finished or an interrupted `run` into the transcript, its streams cleaned of
        secrets and identities; returns its seq and the cleaned streams."""
        seq = self._seq
        out, err = self._clean(out), self._clean(err)
        self._record(
            "run", key, cwd=self._clean(str(cwd)) if cwd else None,
            env=self._clean_env(env), timeout_s=timeout, rc=rc,
            duration_s=round(duration, 6), timed_out=timed_out, **interruption,
            stdout=self._write_stream(seq, "stdout", out),
            stderr=self._write_stream(seq, "stderr", err),
        )
        return seq, out, err

    def start(
        self, argv: list[str], *, log_path: Path, env: dict[str, str] | None = None,
        cwd: str | Path | None = None,
    ) -> Background:
        """Start a long-running process in its own session, its output into log_path."""
        argv = [str(a) for a in argv]
        self._learn(redaction.secrets_in_env(env) + redaction.secrets_in_argv(argv))
        key = self._clean_argv(argv)
        log_path = Path(log_path)
        if self.planning and not self.replay:
            raise PlanOnly(f"context plan starts no process; asked to start {' '.join(key)!r}")
        if self.replay:
            entry = self._next("start", key)
            return Background(self._as_recorded(key), entry["pid"], log_path, entry["seq"],
                              env=entry.get("env"))
        log_path.parent.mkdir(parents=True, exist_ok=True)
        seq = self._seq
        copies: list[Path] = []
        started = self._reveal_argv(argv, cwd, copies)
        ticks = None
        try:
            processes.ensure_reaper(self.ledger)  # before the process: it is never unwatched
            running = sh.Command(started[0])(
                *started[1:], _bg=True, _bg_exc=False, _out=str(log_path), _err_to_out=True,
                _cwd=str(self._reveal(str(cwd))) if cwd else None,
                _env=_full_env(self._reveal_env(env)), _new_session=True,
                _ok_code=ALL_EXIT_CODES,
            )
            pid, error = running.pid, None
            ticks = self.ledger.started(pid, started, self.stage, "start")["start"]
            self._held[seq] = copies  # the process may read them while it runs: kept to its stop
        except sh.CommandNotFound as exc:
            self._drop(copies)
            running, pid, error = None, -1, self._clean(f"{NOT_FOUND}: {exc}")
        recorded_env = self._clean_env(env)
        self._record(
            "start", key, pid=pid, error=error, log=self._clean(str(log_path)), env=recorded_env,
            cwd=self._clean(str(cwd)) if cwd else None,
        )
        if error:
            raise DoorError(error)
        return Background(key, pid, log_path, seq, running, env=recorded_env, _ticks=ticks)

    def poll(self, proc: Background) -> int | None:
        """The exit code of a background process, or None while it runs."""
        key = {"pid_of": proc.seq}
        if self.replay:
            return self._next("poll", key)["rc"]
        rc = None
        if proc._running is not None and not proc._running.process.is_alive()[0]:
            rc = proc._running.process.exit_code
        self._record("poll", key, rc=rc)
        return rc

    def stop(self, proc: Background, *, timeout: float = KILL_GRACE_S) -> int | None:
        """Stop a background process by its PID (its whole session): TERM, then KILL."""
        key = {"pid_of": proc.seq}
        if self.replay:
            entry = self._next("stop", key)
            proc.group_left = entry.get("group_left")
            return entry["rc"]
        rc, killed, left = None, False, []
        with deferred_signals():  # a stop asked meanwhile waits until this one is recorded
            if proc._running is not None:
                rc, killed, left = _terminate(proc, timeout)
                if not left:
                    self.ledger.ended(proc.pid, proc._ticks)
            proc.group_left = left
            self._drop(self._held.pop(proc.seq, []))
            self.clean_file(proc.log_path)
            self._record("stop", key, rc=rc, killed=killed, group_left=left)
        return rc

    def plan(self, argv: list[str], *, note: str = "") -> None:
        """Record a command a plan would run, without running it (argv as given, secrets
        masked). A replay checks the code plans the same command at the same point."""
        argv = [str(a) for a in argv]
        self._learn(redaction.secrets_in_argv(argv))
        key = self._clean_argv(argv)
        if self.replay:
            self._next("plan", key)
            return
        self._record("plan", key, note=self._clean(note))

    # ---- observations -----------------------------------------------------------------------
    def http(
        self, method: str, url: str, *, timeout: float, json_body: Any = None,
        headers: dict[str, str] | None = None, secret_response: bool = False,
        public_response: bool = False,
    ) -> HttpResult:
        """One HTTP request. Request headers are sent but recorded by name only (they carry
        tokens); response headers are recorded redacted.

        `secret_response=True` declares that the answer carries a credential the caller must use
        (a registry's anonymous pull token): the caller gets the raw body, the transcript and
        a replay the redacted one. Such a body must never be displayed.

        `public_response=True` declares a public index's answer (PyPI, a registry, GitHub): its
        body holds no cluster's identity, and its dotted versions (tensorrt's 10.16.1.11) are
        kept as they are, not pseudonymised as addresses; secrets are masked all the same."""
        self._learn(redaction.secrets_in_headers(headers) + redaction.secrets_in_argv([url]))
        key = {"method": method, "url": self._clean(url)}
        if self.planning and not self.replay:
            raise PlanOnly(f"context plan sends no request; asked for {method} {key['url']}")
        if self.replay:
            e = self._next("http", key)
            return HttpResult(method, url, e["status"], self._read_stream(e["body"]), e["error"],
                              e["duration_s"], e["seq"], e.get("headers") or {})
        sent = json_body
        if json_body is not None and self.identities is not None:
            sent = json.loads(self._reveal(json.dumps(json_body)))
        status, body, error, duration, got = _http(
            method, self._reveal(url), timeout, sent,
            {k: self._reveal(str(v)) for k, v in (headers or {}).items()})
        seq = self._seq
        raw, body = body, (redaction.redact(self.norm(body), self._secrets) if public_response
                           else self._clean(body))
        error = self._clean(error) if error else error
        got = {k: self._clean(v) for k, v in got.items()}
        self._record("http", key, status=status, error=error, duration_s=round(duration, 6),
                     request=None if json_body is None else json.loads(self._clean(json.dumps(json_body))),
                     request_headers=sorted(headers or {}), headers=got,
                     body=self._write_stream(seq, "body", body))
        return HttpResult(method, url, status, raw if secret_response else body, error,
                          round(duration, 6), seq, got)

    def now(self) -> float:
        """Wall-clock seconds since the epoch, recorded (a clock used as a measurement)."""
        if self.replay:
            return self._next("clock", "now")["value"]
        value = time.time()
        self._record("clock", "now", value=value)
        return value

    def sleep(self, seconds: float) -> None:
        """Waiting observes nothing, so replay skips it."""
        if not self.replay:
            time.sleep(seconds)

    def free_port(self) -> int:
        """A loopback port free now, chosen below the kernel's ephemeral range.

        Why below: a port taken from the ephemeral range (bind to 0) is free only until some
        process's next outgoing or bind-to-0 socket, and a running vLLM server opens many (its
        ZMQ and NCCL sockets). On two H200s the second 06 server failed with "Address already
        in use" on a port picked that way while the first server was up. The kernel never
        hands out a port below ip_local_port_range on its own, so one chosen there stays free
        until the server we start binds it.
        """
        if self.replay:
            return self._next("port", "free")["value"]
        port = _port_below_ephemeral_range()
        self._record("port", "free", value=port)
        self.ledger.port(port, self.stage)  # checked closed should the stage be interrupted
        return port

    def port_listening(self, port: int) -> bool:
        key = {"port": port}
        if self.replay:
            return self._next("listening", key)["value"]
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.settimeout(1.0)
            value = s.connect_ex(("127.0.0.1", port)) == 0
        self._record("listening", key, value=value)
        return value

    def read_text(self, path: str | Path) -> str | None:
        """A host file's text (or None when absent/unreadable), recorded."""
        key = self._clean(str(path))
        if self.replay:
            e = self._next("read", key)
            return None if e["body"] is None else self._read_stream(e["body"])
        try:
            # newline="": keep a carriage return (a progress bar's frame) as it is, so that a line
            # number quoted from this text is the one `grep -n` and an editor show. Transcripts
            # recorded before this hold the text with each one turned into a line break, and
            # replay as recorded.
            with open(self._reveal(str(path)), encoding="utf-8", errors="replace",
                      newline="") as f:
                text = self._clean(f.read())
        except OSError:
            text = None
        seq = self._seq
        body = None if text is None else self._write_stream(seq, "read", text)
        self._record("read", key, body=body)
        return text

    def listdir(self, path: str | Path) -> list[str] | None:
        key = self._clean(str(path))
        if self.replay:
            return self._next("listdir", key)["value"]
        try:
            value = sorted(self._clean(name) for name in os.listdir(self._reveal(str(path))))
        except OSError:
            value = None
        self._record("listdir", key, value=value)
        return value

    def which(self, program: str) -> str | None:
        if self.replay:
            return self._next("which", program)["value"]
        found = shutil.which(program)
        value = self.norm(str(found)) if found else None
        self._record("which", program, value=value)
        return value


# ---- plan mode ----------------------------------------------------------------------------------
# What a plan still runs: checkers that read files and touch nothing else.
PLAN_CHECKERS = ("kubernetes-validate", "shellcheck", "hadolint", "git", "sha256sum")


def _is_plan_checker(argv: list[str]) -> bool:
    return bool(argv) and Path(argv[0]).name in PLAN_CHECKERS


# ---- replay -------------------------------------------------------------------------------------
def _key_matches(recorded: Any, live: Any, bindings: naming.Bindings | None = None) -> bool:
    """Does the transcript's key answer the key the code asks for now?

    Equal keys match. Besides, in an argv (a list of strings) of the same length, a recorded
    element that is exactly the redaction mask matches any live element: runs recorded before
    redact_argv stopped over-masking (`--num-tokens [REDACTED]`, now `--num-tokens 128`) hold
    the mask where the value was. The value was lost from the recording, so a masked position
    cannot be checked; this is no weaker than what the recording proves, and live secrets are
    masked the same way before comparing, so they match anyway.

    And a string of the live key that holds a cluster identity the code did not get from the
    door (an ECR image's account id, a kube context's ARN, given as parameters) matches the
    recorded string that says the same with a pseudonym there, when the renaming is consistent
    over the whole replay of the stage (`bindings`: one identity, one pseudonym, both ways). The
    recording hid the value, so this is all it can prove, as with the mask. Every other part
    must be equal.
    """
    if recorded == live:
        return True
    trial = bindings.copy() if bindings is not None else naming.Bindings()
    if not _matches(recorded, live, trial):
        return False
    if bindings is not None:
        bindings.to_k, bindings.to_key = trial.to_k, trial.to_key
    return True


def _matches(recorded: Any, live: Any, bindings: naming.Bindings) -> bool:
    if recorded == live:
        return True
    if isinstance(recorded, str) and isinstance(live, str):
        return naming.unify(recorded, live, bindings)
    if isinstance(recorded, list) and isinstance(live, list) and len(recorded) == len(live):
        strings = all(isinstance(x, str) for x in (*recorded, *live))
        return all((strings and r == redaction.MASK) or _matches(r, lv, bindings)
                   for r, lv in zip(recorded, live))
    if isinstance(recorded, dict) and isinstance(live, dict) and recorded.keys() == live.keys():
        return all(_matches(recorded[k], live[k], bindings) for k in recorded)
    return False


# ---- helpers that touch the world (record mode only) -------------------------------------------
def _full_env(env: dict[str, str] | None) -> dict[str, str]:
    full = dict(os.environ)
    full.update(env or {})
    return full


def _execute(argv, timeout, cwd, env, input, *, started: dict | None = None,
             ledger: processes.Ledger | None = None, stage: str = ""):
    """Run argv to its end, in a process group of its own (written into `ledger`, so that the
    reaper stops it should this process die meanwhile). `started` gets the running command
    ("proc"), its start ("t0") and its start ticks ("ticks"): an interruption stops it from there
    (`_abandon`)."""
    start = time.monotonic()
    started = {} if started is None else started
    try:
        command = sh.Command(argv[0])
        if ledger is not None:
            processes.ensure_reaper(ledger)
        running = command(
            *argv[1:], _cwd=str(cwd) if cwd else None, _env=_full_env(env), _timeout=timeout,
            _ok_code=ALL_EXIT_CODES, _in=input, _return_cmd=True, _tty_out=False,
            _bg=True, _bg_exc=False, _new_group=True,
        )
        ticks = processes.start_ticks(running.pid)
        started.update(proc=running, t0=start, ticks=ticks, ledger=ledger, stage=stage,
                       argv0=Path(str(argv[0])).name)
        if ledger is not None:
            ledger.started(running.pid, argv, stage, "run")
        try:
            running.wait()
        finally:  # ended, timed out or killed: its group is done (an interruption: _abandon)
            if (ledger is not None and not running.process.is_alive()[0]
                    and not processes.group_alive(running.pid)):
                ledger.ended(running.pid, ticks)
        rc, out, err, timed_out = running.exit_code, running.stdout, running.stderr, False
    except sh.TimeoutException as exc:
        rc, out, err, timed_out = 124, b"", f"timed out after {timeout} s: {exc}".encode(), True
    except sh.CommandNotFound:
        rc, out, err, timed_out = NOT_FOUND_RC, b"", f"{NOT_FOUND}: {argv[0]}".encode(), False
    except sh.SignalException as exc:  # killed by a signal: keep what it printed
        rc, out, err, timed_out = exc.exit_code, exc.stdout, exc.stderr, False
    return rc, _decode(out), _decode(err), time.monotonic() - start, timed_out


def _decode(b) -> str:
    return b.decode("utf-8", errors="replace") if isinstance(b, bytes) else (b or "")


def _abandon(started: dict) -> tuple[int | None, str, str, float, list[int]]:
    """An interrupted `run`: TERM its group, KILL what is left after the grace, reap it; its
    exit code, what it printed so far, how long it ran, and what of its group is left."""
    running, ledger = started["proc"], started.get("ledger")
    group = {"pgid": running.pid, "start": started.get("ticks"),
             "argv0": started.get("argv0", ""), "stage": started.get("stage", "")}
    if ledger is not None:
        left = processes.stop_groups(ledger, [group], by="door")[0]["left"]
    else:
        processes.stop_pid_group(running.pid, started.get("ticks"), grace_s=KILL_GRACE_S)
        left = processes.group_alive(running.pid)
    rc = None
    if not running.process.is_alive()[0]:
        try:
            rc = running.process.wait()
        except Exception:  # noqa: BLE001 - what it printed is kept whatever its end
            rc = running.process.exit_code
    out, err = running.process.stdout, running.process.stderr
    if ledger is not None and not left:
        ledger.ended(running.pid, started.get("ticks"))
    return rc, _decode(out), _decode(err), time.monotonic() - started["t0"], left


class deferred_signals:
    """Hold SIGINT, SIGTERM and SIGHUP back while a process is being stopped and its stop
    recorded, then act on the first that came as its handler would have (a stage's stop raises
    there). In the main thread only (where Python runs its handlers); elsewhere a no-op."""

    def __enter__(self):
        self._saved, self._got = {}, []
        if threading.current_thread() is not threading.main_thread():
            return self
        for sig in STOP_SIGNALS:
            try:
                self._saved[sig] = signal.signal(sig, lambda n, _f: self._got.append(n))
            except (ValueError, OSError):
                pass
        return self

    def __exit__(self, *exc):
        for sig, handler in self._saved.items():
            signal.signal(sig, handler)
        if self._got:
            sig = self._got[0]
            handler = self._saved.get(sig)
            if callable(handler):
                handler(sig, None)
            elif handler == signal.SIG_DFL:
                os.kill(os.getpid(), sig)
        return False


def attempt_of(entries: list[dict], stage: str) -> int:
    """The attempt of `stage` a door records or replays: the one after its last retired one."""
    retired = [e.get("attempt", 1) for e in entries
               if e.get("stage") == stage and e.get("kind") == RETIRED]
    return max(retired, default=0) + 1


def in_attempt(entry: dict, attempt: int) -> bool:
    """A call of that attempt (a transcript entry without `attempt` is attempt 1)."""
    return entry.get("kind") != RETIRED and entry.get("attempt", 1) == attempt


def record_retired(run_dir: Path, stage: str, attempt: int, moved: dict[str, str],
                   **fields: Any) -> dict:
    """Append the entry that closes `attempt` of `stage` to the run's transcript: where its
    files went (its entries name them where they were written: `moved` maps each old prefix to
    the new one)."""
    transcript = Path(run_dir) / "transcript.jsonl"
    calls = [e for e in read_transcript(transcript)
             if e.get("stage") == stage and in_attempt(e, attempt)]
    entry = {"stage": stage, "seq": len(calls), "kind": RETIRED, "attempt": attempt,
             "key": f"{stage}.attempt-{attempt}", "moved": moved, "calls": len(calls), **fields}
    with open(transcript, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(entry, sort_keys=True) + "\n")
    return entry


def _terminate(proc: Background, timeout: float) -> tuple[int | None, bool, list[int]]:
    """TERM the process's group (its own session), then KILL it, until the leader AND every
    process of its group are gone. Returns (exit code, whether KILL was sent, what is left).
    Waiting for the leader alone left vLLM's processes behind on 2x H200: a rank's worker
    (a grandchild) stuck in DeepEP's teardown barrier went on writing its log after the stage
    was sealed."""
    def gone() -> bool:
        return not proc._running.process.is_alive()[0] and not processes.group_alive(proc.pid)

    def wait(seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if gone():
                return True
            time.sleep(0.1)
        return gone()

    killed = False
    for sig, grace in ((signal.SIGTERM, timeout), (signal.SIGKILL, KILLED_EXIT_S)):
        if gone():
            break
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        killed = sig == signal.SIGKILL
        if wait(grace):
            break
    return proc._running.process.exit_code, killed, processes.group_alive(proc.pid)


def _http(method, url, timeout, json_body, extra_headers=None):
    data = None
    headers = dict(extra_headers or {})
    if json_body is not None:
        data = json.dumps(json_body).encode()
        headers["Content-Type"] = "application/json"
    request = urllib.request.Request(url, data=data, method=method, headers=headers)
    start = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            status, body, error = response.status, response.read().decode("utf-8", "replace"), None
            got = dict(response.headers.items())
    except urllib.error.HTTPError as exc:
        status, body, error = exc.code, exc.read().decode("utf-8", "replace"), None
        got = dict(exc.headers.items()) if exc.headers else {}
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        status, body, error, got = None, "", f"{type(reason).__name__}: {reason}", {}
    return status, body, error, time.monotonic() - start, got


def read_transcript(path: Path) -> list[dict]:
    if not Path(path).exists():
        return []
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def redact_file(path: Path, run_dir: Path | None = None) -> bool:
    """Rewrite a text file with secrets masked (and, given the run it belongs to, its cluster
    identities pseudonymised with that run's table); returns whether anything changed. A door
    at hand does more (`Door.clean_file`: the secrets its calls named too)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return False
    clean = redaction.redact(text)
    if run_dir is not None:
        clean = naming.Identities.for_run(Path(run_dir).resolve()).pseudonymise(clean)
    if clean != text:
        path.write_text(clean, encoding="utf-8")
        return True
    return False


def as_dict(obj) -> dict:
    data = asdict(obj)
    data.pop("_running", None)
    return data



def _port_below_ephemeral_range(range_file: str | Path = EPHEMERAL_RANGE_FILE,
                                lowest: int = _LOWEST_PICKED_PORT) -> int:
    """A port in [lowest, the ephemeral range's low bound) that binds on 127.0.0.1 now; an
    ephemeral one (bind to 0) only when every port tried there is taken."""
    try:
        low = int(Path(range_file).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768  # Linux's default low bound
    candidates = list(range(lowest, max(low, lowest + 1)))
    random.SystemRandom().shuffle(candidates)
    for port in candidates[:200]:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # all tried were taken
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
