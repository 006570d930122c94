"""First-dead-rank triage: which rank of a multi-node job failed first, from the logs it left.

A multi-node job's logs come back one per pod (or per node): ``{source name: whole log text}``.
When one rank dies, every other rank waits for it in its next collective and then times out
("Gin barrier timeout tag:N is a symptom: find the first rank that died", ANCHORS.md section 4).
`triage` finds every error line, attributes it to a global rank where the log says which,
orders the lines, sets timeouts and dead-peer errors apart as SYMPTOMS, and returns the first
real error; `triage_gate` turns that into the project's gate shape.

Lines are numbered as ``grep -n`` numbers them: split at line feeds only (a carriage return
inside a line, a progress bar's frame, is dropped from the quoted text, never counted). Read a
log file with `read_log` (no universal-newline translation) so the numbers match ``grep -n``.

What is read, and where each format comes from:

- vLLM 0.24.0 (recorded on 2x H200: ../shared/fixtures/vllm-0.24.0-2xh200/ and the crash logs
  under results/): the process prefix ``(EngineCore_DP3 pid=N)`` / ``(Worker_DP3_EP3 pid=N)``
  (the DP rank; in the guide's TP1 x DP = EP layout it is the global rank), ``(Worker pid=N)``
  before the rename (tied to its rank by ``world_size=W rank=R ... backend=nccl``, ``rank R in
  world size W is assigned as DP rank D`` or a later prefix with the same pid), ``(ApiServer_N
  pid=N)`` (an API server: no rank); the level and time ``ERROR 11-30 23:01:26 [file.py:N]``
  (month-day, whole seconds); ``Worker proc VllmWorker-0 died unexpectedly``, ``EngineCore
  encountered a fatal error.``, ``WorkerProc hit an exception.``, ``EngineCore failed to
  start.`` each followed by a traceback; ``EngineDeadError: ... See stack trace (above) for the
  root cause.`` (an API server seeing a dead engine: downstream, not a cause); ``[shutdown]``.
- PyTorch: ``[rank11]: Traceback ...`` (the prefix torch puts on a distributed process's output;
  recorded: ``[rank1]:[W1130 23:01:26.985277033 CUDAGuardImpl.h:126] Warning: ...``), glog
  ``E0628 20:25:08.343000 <tid> torch/distributed/elastic/multiprocessing/api.py:826] failed
  (exitcode: 1) local_rank: 0 (pid: N) of binary: ...`` and the ChildFailedError summary
  (``rank      : 6 (local_rank: 6)`` / ``exitcode  : 1 (pid: N)``) as public torchrun output
  prints them (bytedance/flux issue #11); torch.multiprocessing.spawn's ``process 3 terminated
  with exit code 1`` and ``-- Process 3 terminated with the following error:``; ProcessGroupNCCL's
  watchdog ``[PG ID 0 PG GUID 0(default_pg) Rank 3] Watchdog caught collective operation
  timeout: ... ran for 600012 milliseconds before timing out.``
- NCCL (NVIDIA/nccl src/debug.cc): ``host:pid:tid [cudaDev] NCCL INFO|WARN ...``, no timestamp;
  a WARN line is an error, an INFO line never is. Its rank comes from the same process's
  ``comm 0x.. rank R nranks N ... Init COMPLETE`` line (lib.engines.vllm_logs.nccl_comm_lines),
  or from vLLM's pid, or from ``first_rank`` + cudaDev.
- DeepEP V2 (deepseek-ai/DeepEP deep_ep/include/deep_ep/common/comm.cuh, a device printf before
  the kernel traps): ``DeepEP Gin barrier timeout, tag: 8, scaleout: 1, scaleup: 3, thread: 0,
  signal: 1, target: 2`` (the printing rank = scaleout x ranks-per-node + scaleup) and ``DeepEP
  NVLink barrier timeout, tag: %d, nvl: %d, ...``; the anchors' shorthand ``Gin barrier timeout
  tag:8`` is matched too. test_ep's ``> Ranks: 2 x 8`` (scaleout x scaleup) gives the
  ranks per node when it is not passed.
- Device-side assertions (``IndexKernel.cu:111: ... Assertion `...` failed.``) and C++
  ``terminate called after throwing ...`` carry no rank: such a line takes the rank of the next
  error line in the same log that names one (else the previous), within 200 lines, and says so
  (``rank_from``).

Ordering: inside one log, by position; across logs, by the logs' own timestamps (vLLM's, glog's,
ISO dates, torchrun's ``time : ...``); a line without one carries the last one seen above it in
its log. When two logs' candidates cannot be ordered (no timestamp, or the same second), the
result says so (``ambiguous``).

Each rank (or, for lines with no rank, each process) is judged by its FIRST error line: a rank
whose first error is a timeout timed out waiting (a symptom), whatever it logged after (the
trap that follows a DeepEP barrier timeout, its exit code); a rank whose first error is anything
else failed. The first real error is the earliest first error of a failed rank. Errors logged
after a log's own shutdown began (vLLM's ``[shutdown]``, a SIGTERM), with no error before it in
that log, are the shutdown's and are reported apart, not counted.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from lib.core.evidence import gate
from lib.engines.vllm_logs import nccl_comm_lines

GATE_FIRST_RANK = "first rank to fail"
CONTEXT_LINES = 3
INFER_WINDOW = 200  # lines: how far an unattributed error looks for the rank it belongs to
_MAX_QUOTE = 300

# --- line prefixes -------------------------------------------------------------------------------
_VLLM_PROC_RE = re.compile(r"^\((\w+) pid=(\d+)\)\s?")
_VLLM_PROC_MID_RE = re.compile(r"\(\w+ pid=\d+\) (?=DEBUG |INFO |WARNING |ERROR |CRITICAL )")
_TORCH_RANK_RE = re.compile(r"^\[rank(\d+)\]:\s?")
_TEE_RE = re.compile(r"^\[default(\d+)\]:\s?")  # torchrun --tee: [<role><local rank>]:
_VLLM_LEVEL_RE = re.compile(
    r"^(DEBUG|INFO|WARNING|ERROR|CRITICAL) (\d\d)-(\d\d) (\d\d):(\d\d):(\d\d) \[[^\]]*\]\s?")
_UVICORN_RE = re.compile(r"^(DEBUG|INFO|WARNING|ERROR|CRITICAL):\s+")
_GLOG_RE = re.compile(r"^\[?([IWEF])(\d\d)(\d\d) (\d\d):(\d\d):(\d\d)(?:\.(\d+))?"
                      r"(?: +\d+)? +[^\]\s]*\]\s?")
_ISO_RE = re.compile(r"^\[?(\d{4})-(\d\d)-(\d\d)[ T_](\d\d):(\d\d):(\d\d)(?:[.,](\d+))?"
                     r"(?:Z|[+-]\d\d:?\d\d)?\]?"
                     r"(?:\s*-\s*[\w.]+\s*-\s*(DEBUG|INFO|WARNING|ERROR|CRITICAL)\s*-)?\s*")
_NCCL_RE = re.compile(r"([^\s:]+):(\d+):(\d+) \[(\d+)\] (?:\S+ )?NCCL (INFO|WARN|TRACE|ABORT)\b")
_ELASTIC_TIME_RE = re.compile(r"^\s*time\s*:\s*(\d{4})-(\d\d)-(\d\d)_(\d\d):(\d\d):(\d\d)")
_ELASTIC_RANK_RE = re.compile(r"^\s*rank\s*:\s*(\d+) \(local_rank: (\d+)\)")
_ELASTIC_EXIT_RE = re.compile(r"^\s*exitcode\s*:\s*(-?\d+) \(pid: (\d+)\)")

# --- ranks named in a line's own text ------------------------------------------------------------
_DP_NAME_RE = re.compile(r"^(?:EngineCore|Worker)_DP(\d+)(?:_|$)")
_WORLD_RANK_RE = re.compile(r"\bworld_size=(\d+) rank=(\d+) local_rank=(\d+)\b.*backend=")
_ASSIGNED_RE = re.compile(r"\brank (\d+) in world size (\d+) is assigned as DP rank (\d+)")
_PG_RANK_RE = re.compile(r"\[(?:PG ID \d+ PG GUID [^\]]*? )?Rank (\d+)\]")
_GIN_RE = re.compile(r"Gin barrier timeout, tag: (\d+), scaleout: (\d+), scaleup: (\d+)")
_NVL_RE = re.compile(r"NVLink barrier timeout, tag: (\d+), nvl: (\d+)")
_TORCHRUN_FAILED_RE = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+) \(pid: (\d+)\)")
_SPAWN_EXIT_RE = re.compile(r"\b[Pp]rocess (\d+) terminated with (?:exit code|signal)")
_SPAWN_RAISED_RE = re.compile(r"^-- Process (\d+) terminated with the following error:")
_TEST_EP_RANKS_RE = re.compile(r"> Ranks:\s*(\d+)\s*x\s*(\d+)")
_DP_LOCAL_ARG_RE = re.compile(r"'data_parallel_size_local': (\d+)")

# --- what a line says ----------------------------------------------------------------------------
_TRACEBACK_RE = re.compile(r"^Traceback \(most recent call last\):")
_CHAIN_RE = re.compile(r"^(During handling of the above exception|The above exception was the "
                       r"direct cause)")
_EXCEPTION_RE = re.compile(r"^(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt|"
                           r"Failure)\b(?::|$)")
# Lines that lead into a traceback (the message a logger prints before exc_info).
_LEAD_RE = re.compile(r"^(Exception in thread .*:|Process [\w-]+:$|.*encountered a fatal error|"
                      r".*failed to start|.*hit an exception|.*output_handler failed)")
_LEAD_ONLY_RE = re.compile(r"^(Exception in thread .*:|Process [\w-]+:)$")
_SPECIFIC_RE = re.compile(
    r"Assertion .* failed|CUDA error: |terminate called after throwing|Segmentation fault|"
    r"Fatal Python error|core dumped|\bFATAL\b|\bNCCL error\b|nccl(?:Internal|System|Unhandled"
    r"Cuda|InvalidUsage|InvalidArgument)Error|died unexpectedly|died with exit code|"
    r"barrier timeout|Watchdog caught collective operation timeout|\bKilled\b|"
    r"[Oo]ut of memory")
_EXIT_RE = re.compile(r"died unexpectedly|terminated with (?:exit code|signal)|"
                      r"failed \(exitcode: -?\d+\)|^\s*exitcode\s*:")
# Timeouts and a dead peer: what every rank still alive reports when one rank has died.
_SYMPTOM_RE = re.compile(
    r"barrier timeout|Watchdog caught collective operation timeout|\btimed out\b|timing out|"
    r"TimeoutError|\bTimeout\b|[Dd]eadline ?[Ee]xceeded|Connection reset by peer|"
    r"Connection closed by|[Bb]roken pipe|remote process exited|ncclRemoteError|"
    r"Connection refused|peer (?:closed|disconnected|died|exited)", re.IGNORECASE)
# What a front end prints when the engine behind it died: vLLM itself points above.
_DOWNSTREAM_RE = re.compile(
    r"EngineDeadError|ChildFailedError|ProcessRaisedException|"
    r"See (?:the )?(?:root cause|stack trace) \(?above\)?|output_handler failed|"
    r"Error in chat completion stream generator|Exception occurred while running API servers|"
    r"died with exit code")
# A rank its launcher stopped because another one failed (torchrun/mp.spawn send SIGTERM).
# torch elastic's agent, itself sent SIGTERM (srun ending the step): "SignalException: Process N
# got signal: 15".
_STOPPED_RE = re.compile(r"exitcode\s*:\s*-15\b|failed \(exitcode: -15\)|signal SIGTERM\b|"
                         r"Signal 15 \(SIGTERM\)|got signal: 15\b")
_SHUTDOWN_RE = re.compile(r"\[shutdown\]|received signal=SIG(?:TERM|INT)|"
                          r"Waiting up to \d+ seconds for processes to exit")

SYMPTOM_KINDS = ("symptom", "downstream")
CAUSE_KINDS = ("error", "exit")


def read_log(path: str | Path) -> str:
    """A log file's text with its line feeds as written (no universal-newline translation), so
    line numbers are `grep -n`'s."""
    return Path(path).read_bytes().decode("utf-8", errors="replace")


def log_lines(text: str) -> list[str]:
    """The log's lines, split at line feeds only; a trailing line feed opens no line."""
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return lines


def _clean(line: str) -> str:
    return line.replace("\r", "").rstrip()


def _quote(source: str, lineno: int, line: str) -> str:
    line = _clean(line)
    if len(line) > _MAX_QUOTE:
        line = line[:_MAX_QUOTE] + " ..."
    return f"{source}:{lineno}: {line}"


@dataclass
class _Parsed:
    payload: str
    level: str | None = None      # "info" (never an error), "error", or None (unlevelled)
    ts: tuple | None = None       # (month, day, hour, minute, second, microsecond)
    proc: str | None = None       # vLLM process name ("Worker_DP1_EP1"), torch "[rank3]"
    pid: int | None = None
    rank: int | None = None       # a rank the prefix states
    local_rank: int | None = None
    nccl: tuple | None = None     # (host, pid, cuda_dev)


@dataclass
class Event:
    source: str
    lineno: int
    line: str
    kind: str                       # error | exit | symptom | downstream
    key: str                        # the process that wrote it, as far as the log says
    ts: tuple | None = None
    rank: int | None = None
    local_rank: int | None = None
    role: str | None = None
    rank_from: str | None = None
    exception: tuple[int, str] | None = None  # (line number, text) of the traceback's last line
    generic: bool = False
    lead_only: bool = False
    after_shutdown: bool = False
    extra: dict = field(default_factory=dict)

    def quote(self) -> str:
        return _quote(self.source, self.lineno, self.line)

    def error_quote(self) -> str:
        """The error line: a traceback's last line when there is one."""
        return _quote(self.source, *self.exception) if self.exception else self.quote()


def _ts(month, day, hour, minute, second, micro=None) -> tuple:
    micro = int((micro or "0")[:6].ljust(6, "0"))
    return (int(month), int(day), int(hour), int(minute), int(second), micro)


def _parse(line: str) -> _Parsed:
    text = _clean(line)
    p = _Parsed(payload=text)
    # process prefixes, possibly several (interleaved writers: the text is the last one's)
    while True:
        if m := _VLLM_PROC_RE.match(text):
            p.proc, p.pid = m.group(1), int(m.group(2))
            text = text[m.end():]
        elif m := _TORCH_RANK_RE.match(text):
            p.rank = int(m.group(1))
            p.proc = p.proc or f"[rank{m.group(1)}]"
            text = text[m.end():]
        elif m := _TEE_RE.match(text):
            p.local_rank = int(m.group(1))
            text = text[m.end():]
        else:
            break
    # a line another process's output was glued onto (a progress bar without its line feed,
    # then "(Worker_DP1_EP1 pid=7077) ERROR ..."): the text after the last prefix is that one's
    glued = None
    for glued in _VLLM_PROC_MID_RE.finditer(text):
        pass
    if glued is not None and glued.start() > 0:
        return _parse(text[glued.start():])
    if m := _VLLM_LEVEL_RE.match(text):
        p.level = "error" if m.group(1) in ("ERROR", "CRITICAL") else "info"
        p.ts = _ts(*m.groups()[1:6])
        text = text[m.end():]
    elif m := _GLOG_RE.match(text):
        p.level = "error" if m.group(1) in ("E", "F") else "info"
        p.ts = _ts(*m.groups()[1:7])
        text = text[m.end():]
    elif m := _ISO_RE.match(text):
        p.ts = _ts(*m.groups()[1:7])
        if m.group(8):
            p.level = "error" if m.group(8) in ("ERROR", "CRITICAL") else "info"
        text = text[m.end():]
    elif m := _UVICORN_RE.match(text):
        p.level = "error" if m.group(1) in ("ERROR", "CRITICAL") else "info"
        text = text[m.end():]
    if m := _NCCL_RE.search(text):
        p.nccl = (m.group(1), int(m.group(2)), int(m.group(4)))
        p.level = "error" if m.group(5) in ("WARN", "ABORT") else "info"
        text = text[m.end():].lstrip()
    p.payload = text
    return p


def _classify(text: str) -> str:
    if _DOWNSTREAM_RE.search(text) or _STOPPED_RE.search(text):
        return "downstream"
    if _SYMPTOM_RE.search(text):
        return "symptom"
    if _EXIT_RE.search(text):
        return "exit"
    return "error"


# --- per-log facts: which pid is which rank, how many ranks per node ----------------------------
@dataclass
class _LogFacts:
    pid_rank: dict = field(default_factory=dict)        # pid -> global rank
    host_pid_rank: dict = field(default_factory=dict)   # (host, pid) -> global rank
    local_rank: dict = field(default_factory=dict)      # local rank -> global rank (torchrun)
    ranks_per_node: int | None = None


def _facts(lines: list[str], text: str) -> _LogFacts:
    f = _LogFacts()
    last_elastic_rank = None
    for line in lines:
        line = _clean(line)
        for m in re.finditer(r"\((\w+) pid=(\d+)\)", line):
            if dp := _DP_NAME_RE.match(m.group(1)):
                f.pid_rank.setdefault(int(m.group(2)), int(dp.group(1)))
        if (m := _WORLD_RANK_RE.search(line)) or (m := _ASSIGNED_RE.search(line)):
            rank = int(m.group(2) if m.re is _WORLD_RANK_RE else m.group(1))
            pids = re.findall(r"\(\w+ pid=(\d+)\)", line)
            if pids:
                f.pid_rank.setdefault(int(pids[-1]), rank)
        if m := _ELASTIC_RANK_RE.match(line):
            last_elastic_rank = (int(m.group(1)), int(m.group(2)))
            f.local_rank.setdefault(last_elastic_rank[1], last_elastic_rank[0])
        elif (m := _ELASTIC_EXIT_RE.match(line)) and last_elastic_rank:
            f.pid_rank.setdefault(int(m.group(2)), last_elastic_rank[0])
        if f.ranks_per_node is None:
            if m := _TEST_EP_RANKS_RE.search(line):
                f.ranks_per_node = int(m.group(2))
            elif m := _DP_LOCAL_ARG_RE.search(line):
                f.ranks_per_node = int(m.group(1))
    worlds: dict[tuple, tuple[int, int]] = {}
    for c in nccl_comm_lines(text):
        if c["host"] is None:
            continue
        proc = (c["host"], c["pid"])
        if proc not in worlds or c["nranks"] > worlds[proc][0]:
            worlds[proc] = (c["nranks"], c["rank"])
    f.host_pid_rank = {proc: rank for proc, (_, rank) in worlds.items()}
    return f


# A line's writer as far as the log says: (rank, local rank, role, where the rank came from).
_Who = tuple[int | None, int | None, str | None, str | None]


@dataclass
class _LogScan:
    """One log read line by line: its facts, and what a line leaves for the lines after it."""
    source: str
    lines: list[str]
    facts: _LogFacts
    rpn: int | None                   # ranks per node, for DeepEP's barrier lines
    first_rank: int | None
    events: list[Event] = field(default_factory=list)
    open_tb: dict[str, dict] = field(default_factory=dict)  # process key -> {"lead", "start", ...}
    last_event: dict[str, Event] = field(default_factory=dict)
    pending_spawn: int | None = None
    ts_now: tuple | None = None
    elastic_rank: tuple[int, int] | None = None

    def global_of(self, local: int | None) -> tuple[int | None, str | None]:
        if local is None:
            return None, None
        if local in self.facts.local_rank:
            return self.facts.local_rank[local], "torchrun's failure summary"
        if self.first_rank is not None:
            return (self.first_rank + local,
                    f"local rank {local} + this log's first rank {self.first_rank}")
        return None, None

    def add(self, ev: Event) -> None:
        self.events.append(ev)
        self.last_event[ev.key] = ev

    def who(self, p: _Parsed) -> _Who:
        """Where a line's rank comes from, most direct first."""
        facts, payload = self.facts, p.payload
        rank, local, role, rank_from = p.rank, p.local_rank, None, None
        if rank is not None:
            rank_from = f"the line's prefix [rank{rank}]"
        if p.proc and not p.proc.startswith("[rank"):
            role = p.proc
            if dp := _DP_NAME_RE.match(p.proc):
                rank, rank_from = int(dp.group(1)), f"vLLM's process name {p.proc} (DP rank)"
            elif p.pid in facts.pid_rank:
                rank = facts.pid_rank[p.pid]
                rank_from = f"vLLM's pid {p.pid}, rank {rank} by its own lines"
        if rank is None and p.nccl:
            host, pid, dev = p.nccl
            if (host, pid) in facts.host_pid_rank:
                rank = facts.host_pid_rank[(host, pid)]
                rank_from = f"NCCL's init line of {host}:{pid}"
            elif pid in facts.pid_rank:
                rank, rank_from = facts.pid_rank[pid], f"vLLM's pid {pid}"
            else:
                local = dev
        if rank is None and (m := _PG_RANK_RE.search(payload)):
            rank, rank_from = int(m.group(1)), "ProcessGroupNCCL's [Rank N]"
        if rank is None and (m := _GIN_RE.search(payload)):
            scaleout, scaleup = int(m.group(2)), int(m.group(3))
            if self.rpn:
                rank = scaleout * self.rpn + scaleup
                rank_from = f"DeepEP's scaleout {scaleout} x {self.rpn} + scaleup {scaleup}"
            else:
                role = f"scaleout {scaleout} scaleup {scaleup}"
        if rank is None and (m := _NVL_RE.search(payload)):
            local = int(m.group(2))
        if rank is None and (m := _TORCHRUN_FAILED_RE.search(payload)):
            pid = int(m.group(3))
            if pid in facts.pid_rank:
                rank, rank_from = facts.pid_rank[pid], "torchrun's failure summary (pid)"
            else:
                local = int(m.group(2))
        if rank is None and (m := _SPAWN_EXIT_RE.search(payload)):
            local = int(m.group(1))
        if rank is None and local is not None:
            rank, rank_from = self.global_of(local)
        return rank, local, role, rank_from

    def line(self, lineno: int, raw: str) -> None:
        """One line: a traceback's header, a line inside an open traceback, or one on its own."""
        p = _parse(raw)
        clean = _clean(raw)
        if p.ts is not None:
            self.ts_now = p.ts
        elif m := _ELASTIC_TIME_RE.match(clean):
            self.ts_now = _ts(*m.groups()[1:6])
        if m := _ELASTIC_RANK_RE.match(clean):
            self.elastic_rank = (int(m.group(1)), int(m.group(2)))
        key = p.proc or (f"{p.nccl[0]}:{p.nccl[1]}" if p.nccl else "-")
        payload = p.payload
        rank, local, role, rank_from = who = self.who(p)

        # tracebacks: the header opens one, the first unindented line after it closes it
        if _SPAWN_RAISED_RE.match(payload):
            self.pending_spawn = int(_SPAWN_RAISED_RE.match(payload).group(1))
            return
        tb = self.open_tb.get(key)
        if _TRACEBACK_RE.match(payload):
            prev = self.last_event.get(key)
            lead = prev if (prev and prev.generic and prev.exception is None
                            and lineno - prev.lineno <= 3) else None
            self.open_tb[key] = {"lead": lead, "start": lineno, "ts": self.ts_now, "rank": rank,
                                 "local": local, "role": role, "rank_from": rank_from}
            return
        if tb is not None:
            self.traceback_line(tb, key, lineno, clean, payload, who)
        else:
            self.error_line(p, lineno, raw, clean, key, who)

    def traceback_line(self, tb: dict, key: str, lineno: int, clean: str, payload: str,
                       who: _Who) -> None:
        """A line inside the traceback `key` opened: the first unindented one closes it, as its
        lead line's exception or as an event of its own."""
        rank, local, role, rank_from = who
        if not payload or payload[0].isspace() or _CHAIN_RE.match(payload):
            return
        del self.open_tb[key]
        kind = _classify(payload)
        lead: Event | None = tb["lead"]
        if lead is not None:
            # the message vLLM logged before the traceback, judged by what was raised
            lead.exception = (lineno, clean)
            # torchrun's "failed (exitcode: 3) local_rank: ..." stays the exit it reports (a
            # rank that died without a word), not the ChildFailedError its agent raises after it
            if kind != "error" and not (lead.kind == "exit"
                                        and _TORCHRUN_FAILED_RE.search(lead.line)):
                lead.kind = kind
            lead.generic = lead.lead_only = False
            return
        ev = Event(self.source, tb["start"], self.lines[tb["start"] - 1], kind, key, tb["ts"],
                   tb["rank"] if tb["rank"] is not None else rank,
                   tb["local"] if tb["local"] is not None else local,
                   tb["role"] or role, tb["rank_from"] or rank_from,
                   exception=(lineno, clean))
        if ev.rank is None and ev.local_rank is None and self.pending_spawn is not None:
            ev.local_rank = self.pending_spawn
            ev.rank, ev.rank_from = self.global_of(self.pending_spawn)
            if ev.rank is None:
                ev.role = ev.role or f"spawned process {self.pending_spawn}"
            self.pending_spawn = None
        self.add(ev)

    def error_line(self, p: _Parsed, lineno: int, raw: str, clean: str, key: str,
                   who: _Who) -> None:
        """A line outside a traceback: an event when it reads as an error."""
        rank, local, role, rank_from = who
        payload = p.payload
        if p.level == "info":
            return
        if payload[:1].isspace() and p.level != "error" and not _ELASTIC_EXIT_RE.match(clean):
            return  # a continuation ("  what():  CUDA error: ..."), said by the line above it
        specific = bool(_SPECIFIC_RE.search(payload) or _EXCEPTION_RE.match(payload)
                        or (p.nccl and p.level == "error"))
        elastic_exit = _ELASTIC_EXIT_RE.match(clean)
        if elastic_exit:
            if int(elastic_exit.group(1)) == 0:
                return
            if self.elastic_rank is not None:
                rank, rank_from = self.elastic_rank[0], "torchrun's failure summary"
            specific = True
        lead_only = bool(_LEAD_ONLY_RE.match(payload))
        if not specific and not lead_only and p.level != "error" and not _LEAD_RE.match(payload):
            return
        kind = _classify(payload)
        self.add(Event(self.source, lineno, raw, kind, key, self.ts_now, rank, local, role,
                       rank_from, generic=not specific, lead_only=lead_only))


def _events(source: str, text: str, *, ranks_per_node: int | None,
            first_rank: int | None) -> list[Event]:
    lines = log_lines(text)
    facts = _facts(lines, text)
    scan = _LogScan(source, lines, facts, ranks_per_node or facts.ranks_per_node, first_rank)
    for lineno, raw in enumerate(lines, 1):
        scan.line(lineno, raw)
    # a lead line ("Exception in thread X:") that opened no traceback is no error of its own
    return [e for e in scan.events if not e.lead_only]


def _infer_ranks(events: list[Event]) -> None:
    """A line with no rank of its own (a device-side assert, `terminate called ...`) takes the
    rank of the next error line in its log that names one, else of the previous, within
    INFER_WINDOW lines; symptoms and downstream lines lend no rank."""
    named = [e for e in events if e.rank is not None and e.kind in CAUSE_KINDS]
    for e in events:
        if (e.rank is not None or e.local_rank is not None or e.role is not None
                or e.kind not in CAUSE_KINDS):
            continue
        after = [n for n in named if n.source == e.source and 0 < n.lineno - e.lineno
                 <= INFER_WINDOW]
        before = [n for n in named if n.source == e.source and 0 < e.lineno - n.lineno
                  <= INFER_WINDOW]
        pick = min(after, key=lambda n: n.lineno) if after else (
            max(before, key=lambda n: n.lineno) if before else None)
        if pick is not None:
            e.rank = pick.rank
            e.rank_from = (f"inferred: the line itself names no rank; the "
                           f"{'next' if after else 'previous'} error line naming one is "
                           f"{pick.source}:{pick.lineno} (rank {pick.rank})")


def _mark_shutdown(source_lines: list[str], events: list[Event]) -> None:
    """Errors after a log's own shutdown began, when nothing failed before it in that log."""
    start = next((i for i, line in enumerate(source_lines, 1) if _SHUTDOWN_RE.search(line)),
                 None)
    if start is None:
        return
    if any(e.lineno < start for e in events):
        return  # the shutdown followed an error: it is that error's consequence
    for e in events:
        e.after_shutdown = True
        e.extra["shutdown_line"] = start


def _actor(e: Event) -> tuple:
    if e.rank is not None:
        return ("rank", e.rank)
    if e.local_rank is not None:
        return ("local", e.source, e.local_rank)
    return ("process", e.source, e.role or e.key)


def _describe(e: Event) -> str:
    if e.rank is not None:
        who = f"rank {e.rank}"
    elif e.local_rank is not None:
        who = f"local rank {e.local_rank} of {e.source}"
    else:
        who = f"{e.role or 'a process with no rank'} in {e.source}"
    if e.role and e.rank is not None:
        who += f" ({e.role})"
    return who


def _fmt_ts(ts: tuple | None) -> str | None:
    if ts is None:
        return None
    month, day, hour, minute, second, micro = ts
    text = f"{month:02d}-{day:02d} {hour:02d}:{minute:02d}:{second:02d}"
    return text + (f".{micro:06d}" if micro else "")


def _all_events(logs: Mapping[str, str], *, ranks_per_node: int | None,
                first_rank: Mapping[str, int], ignore_after_shutdown: bool) -> list[Event]:
    """Every log's events, in the logs' order, their ranks inferred and those after a log's
    own shutdown marked (when asked)."""
    every: list[Event] = []
    for source, text in logs.items():
        evs = _events(source, text, ranks_per_node=ranks_per_node,
                      first_rank=first_rank.get(source))
        _infer_ranks(evs)
        if ignore_after_shutdown:
            _mark_shutdown(log_lines(text), evs)
        every += evs
    return every


def _first_of_each(counted: Sequence[Event], order: Mapping[str, int]) -> dict[tuple, Event]:
    """Each actor's first event (its own log's order; across logs, by time)."""
    first_of: dict[tuple, Event] = {}
    for e in sorted(counted, key=lambda e: (e.ts is None, e.ts or (), order[e.source],
                                            e.lineno)):
        first_of.setdefault(_actor(e), e)
    # within one log, position decides (timestamps there are whole seconds at best)
    for e in counted:
        a = _actor(e)
        f = first_of[a]
        if f.source == e.source and e.lineno < f.lineno:
            first_of[a] = e
    return first_of


def _first_record(first: Event, lines: list[str], context: int) -> dict[str, Any]:
    """`triage`'s ``first``: the error line and the lines around it, quoted from its log."""
    # the error line: a traceback's last line when the error is one, else the line itself
    at, text = first.exception if first.exception else (first.lineno, _clean(first.line))
    lo, hi = max(1, at - context), min(len(lines), at + context)
    ctx = [_quote(first.source, n, lines[n - 1]) for n in range(lo, hi + 1)]
    return {
        "rank": first.rank, "local_rank": first.local_rank, "role": first.role,
        "source": first.source, "line_number": at, "line": text,
        "quote": _quote(first.source, at, text), "context": ctx,
        "block_start": first.lineno, "block_quote": first.quote(),
        "exception": (_quote(first.source, *first.exception) if first.exception else None),
        "kind": first.kind, "rank_from": first.rank_from, "timestamp": _fmt_ts(first.ts),
        "who": _describe(first),
    }


def triage(logs: Mapping[str, str], *, ranks_per_node: int | None = None,
           first_rank: Mapping[str, int] | None = None, context: int = CONTEXT_LINES,
           ignore_after_shutdown: bool = True) -> dict[str, Any]:
    """The first real error of a multi-rank job, from its logs ``{source name: text}``.

    ``ranks_per_node``: ranks on each node (read from test_ep's ``> Ranks: A x B`` or vLLM's
    ``data_parallel_size_local`` when not given), for DeepEP's barrier lines. ``first_rank``:
    the global rank of local rank 0 in each source (``{"worker.log": 8}``), for lines that name
    only a local rank (NCCL's cudaDev, torchrun's local_rank, mp.spawn's process index).

    Returns ``first``: None when no error line was found; else ``rank`` (None when the logs do
    not say), ``local_rank``, ``role`` (the writing process, e.g. "Worker_DP1_EP1"), ``who``,
    ``source``, ``line_number`` (grep -n's) and ``line`` of the error (a traceback's last line
    when the error is one), ``quote`` ("source:N: line"), ``context`` (the lines around it,
    quoted), ``block_start``/``block_quote`` (where its traceback or message began),
    ``exception``, ``kind`` (error | exit | symptom | downstream), ``rank_from`` (how the rank was
    read), ``timestamp``. Beside it: ``symptoms_only``, ``failed_ranks`` (ranks whose first error
    is not a timeout), ``symptom_lines``/``symptom_ranks``/``symptom_quotes`` (timeouts and
    dead-peer errors of the other ranks), ``downstream_lines`` (reports of a death: a launcher's
    summary, a rank its launcher stopped, a front end's dead engine), ``consequence_lines``
    (what ranks logged after their own first error), ``other_failed``, ``after_shutdown`` and
    ``after_shutdown_lines`` (not counted), ``ordered_by``, ``ambiguous`` (first errors of other
    logs that could not be ordered against it), ``sources``, ``events``.
    """
    every = _all_events(logs, ranks_per_node=ranks_per_node, first_rank=dict(first_rank or {}),
                        ignore_after_shutdown=ignore_after_shutdown)
    order = {s: i for i, s in enumerate(logs)}
    counted = [e for e in every if not e.after_shutdown]
    shutdown = [e for e in every if e.after_shutdown]
    first_of = _first_of_each(counted, order)
    firsts = list(first_of.values())
    causes = [e for e in firsts if e.kind in CAUSE_KINDS]
    pool = causes or [e for e in firsts if e.kind in SYMPTOM_KINDS]
    result: dict[str, Any] = {
        "first": None, "symptoms_only": False, "failed_ranks": sorted(
            {e.rank for e in causes if e.rank is not None}),
        "symptom_lines": 0, "symptom_ranks": [], "downstream_lines": 0,
        "consequence_lines": 0, "after_shutdown": [e.error_quote() for e in shutdown][:16],
        "after_shutdown_lines": len(shutdown), "ordered_by": None, "ambiguous": [],
        "sources": list(logs), "events": len(counted),
    }
    if not pool:
        return result
    first, ordered_by, ambiguous = _earliest(pool, order)
    result["first"] = _first_record(first, log_lines(logs[first.source]), context)
    result["symptoms_only"] = not causes
    mine = _actor(first)
    others = [e for e in counted if _actor(e) != mine]
    symptoms = [e for e in others if e.kind == "symptom"]
    result["symptom_lines"] = len(symptoms)
    result["symptom_ranks"] = sorted({e.rank for e in symptoms if e.rank is not None})
    result["symptom_quotes"] = [e.error_quote() for e in symptoms][:8]
    result["downstream_lines"] = sum(e.kind == "downstream" for e in others)
    result["consequence_lines"] = sum(1 for e in counted if first_of[_actor(e)] is not e)
    result["other_failed"] = [_describe(e) + f" at {e.error_quote()}" for e in causes
                              if e is not first][:8]
    result["ordered_by"] = ordered_by
    result["ambiguous"] = [e.error_quote() for e in ambiguous][:8]
    return result


def _earliest(pool: Sequence[Event], order: Mapping[str, int]):
    """The earliest event: by position inside one log, by timestamp across logs. Returns it,
    how it was ordered, and the events of other logs it could not be ordered against."""
    by_source: dict[str, Event] = {}
    for e in pool:
        if e.source not in by_source or e.lineno < by_source[e.source].lineno:
            by_source[e.source] = e
    heads = sorted(by_source.values(), key=lambda e: order[e.source])
    if len(heads) == 1:
        return heads[0], "position in its log", []
    timed = [e for e in heads if e.ts is not None]
    untimed = [e for e in heads if e.ts is None]
    if timed:
        best = min(timed, key=lambda e: (e.ts, order[e.source]))
        ties = [e for e in timed if e is not best and e.ts[:5] == best.ts[:5]
                and (e.ts[5] == best.ts[5] or not e.ts[5] or not best.ts[5])]
        return best, "the logs' timestamps", ties + untimed
    best = min(heads, key=lambda e: (e.lineno, order[e.source]))
    return best, "position only (no timestamps to order the logs)", [
        e for e in heads if e is not best]


def triage_gate(logs: Mapping[str, str], *, name: str = GATE_FIRST_RANK,
                evidence: Sequence[str] | None = None, **kwargs) -> dict:
    """Gate: FAIL naming the rank that failed first (its line, the lines around it and the
    traceback's last line), the timeouts elsewhere counted as its symptoms; PASS when no log
    holds an error line. ``kwargs`` go to `triage`."""
    t = triage(logs, **kwargs)
    ev = [str(e) for e in evidence or []]
    first = t["first"]
    observed = {k: t[k] for k in ("failed_ranks", "symptom_lines", "symptom_ranks",
                                  "downstream_lines", "after_shutdown_lines", "ordered_by")}
    expected = "no error line on any rank"
    sources = ", ".join(t["sources"])
    if first is None:
        reason = f"no error line in {len(t['sources'])} log(s) ({sources})"
        if t["after_shutdown_lines"]:
            reason += (f"; {t['after_shutdown_lines']} error line(s) logged after the job's own "
                       "shutdown began were not counted (nothing had failed before it)")
        return gate(name, True, observed, expected, reason, ev + t["after_shutdown"][:4]).as_dict()
    observed.update({"rank": first["rank"], "local_rank": first["local_rank"],
                     "role": first["role"], "source": first["source"],
                     "line_number": first["line_number"], "kind": first["kind"],
                     "timestamp": first["timestamp"]})
    exc = (f" (its traceback starts at {first['source']}:{first['block_start']})"
           if first["exception"] and first["block_start"] != first["line_number"] else "")
    how = f" (rank from {first['rank_from']})" if first["rank_from"] else ""
    n, ranks = t["symptom_lines"], t["symptom_ranks"]
    where = (f" on {len(ranks)} other rank(s) ({', '.join(map(str, ranks))})" if ranks
             else " elsewhere")
    if t["symptoms_only"]:
        reason = (f"only timeouts: no rank logged an error of its own; the earliest is "
                  f"{first['who']} at {first['quote']}{how}. Nothing else failed: a timeout is a "
                  "symptom of a peer that stopped answering, so look for a rank that died "
                  "without a word (killed, out of memory) or a log that was not collected")
        if n:
            reason += f"; {n} more timeout line(s){where}"
    else:
        reason = f"{first['who']} failed first: {first['quote']}{exc}{how}; "
        reason += (f"the {n} timeout line(s){where} are symptoms of it, not causes" if n else
                   "no other rank reported a timeout")
        if t["downstream_lines"]:
            reason += (f"; {t['downstream_lines']} line(s) only report a death (a launcher's "
                       "summary, a rank its launcher stopped, a front end's dead engine)")
        if t["other_failed"]:
            reason += f"; other ranks that failed on their own after it: {len(t['other_failed'])}"
    if t["ambiguous"]:
        reason += (f"; ordered by {t['ordered_by']}: {len(t['ambiguous'])} first error(s) in "
                   "other logs could not be ordered against it (" + "; ".join(t["ambiguous"][:2])
                   + ")")
    quotes = ([first["block_quote"]] if first["block_start"] < first["line_number"] - 3
              else []) + first["context"]
    quotes += t.get("symptom_quotes", [])[:4]
    return gate(name, False, observed, expected, reason, ev + quotes).as_dict()


# Exit codes a node's process gets when its launcher stops it because another node failed first
# (srun --kill-on-bad-exit, torchrun: SIGTERM), as a shell reports them: symptoms, not causes.
STOPPED_BY_LAUNCHER = (143, -15)


def first_failure_gate(outputs: Mapping[str, str], codes: Mapping[str, int | None], *,
                       evidence: Sequence[str] | None = None) -> dict:
    """Which node of a multi-node job failed first: from the logs (`triage_gate`) when a log
    names an error; else from the exit codes, when a process died without a word (SIGKILL,
    the OOM killer): the node whose code is not its launcher's SIGTERM, the others' 143
    counted as symptoms. PASS when every code is 0 and no log holds an error line."""
    from_logs = triage_gate(outputs, evidence=evidence)
    if from_logs["status"] == "FAIL" or all(c == 0 for c in codes.values()):
        return from_logs
    causes = {n: c for n, c in codes.items() if c not in (0, *STOPPED_BY_LAUNCHER)}
    stopped = sorted(n for n, c in codes.items() if c in STOPPED_BY_LAUNCHER)
    if not causes:
        return gate(GATE_FIRST_RANK, False, dict(codes), "exit code 0 on every node",
                    f"every failed node was stopped by its launcher (SIGTERM: {', '.join(stopped)}"
                    "); none says why in its log", list(evidence or [])).as_dict()
    named = ", ".join(f"{n} (exit {c}{', killed: SIGKILL' if c in (137, -9) else ''})"
                      for n, c in causes.items())
    return gate(GATE_FIRST_RANK, False, dict(codes), "exit code 0 on every node",
                f"{named} failed first, without an error line in its log; "
                + (f"{', '.join(stopped)} exited 143: stopped by the launcher after it, a "
                   "symptom" if stopped else "no other node failed"),
                list(evidence or [])).as_dict()
