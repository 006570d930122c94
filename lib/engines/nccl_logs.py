"""NCCL's own per-rank lines, read the same way whatever engine ran the ranks.

Pure functions: text in, gate dicts out. No engine prints a per-rank NCCL or EFA line of its own
(vLLM 0.24.0 and SGLang 0.5.19 print none; TensorRT-LLM neither): per-rank claims rest on what
NCCL and the aws-ofi-nccl plugin print with NCCL_DEBUG=INFO, which every engine's env sets.
Evidence entries are ``<log_name>:<line number>: <the line>``.
"""
from __future__ import annotations

import re
from collections import Counter, defaultdict

from lib.core.evidence import gate

_MAX_QUOTE = 240


def lines_of(text: str) -> list[str]:
    """The log's lines as `grep -n` numbers them: broken at line feeds only. A carriage return
    inside one (a progress bar's frames, CRLF banners) is dropped, which also keeps a worker's
    "(Worker pid=N) " prefix on the frame printed after it."""
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return [line.replace("\r", "") for line in lines]


def quote(log_name: str, lineno: int, line: str) -> str:
    line = line.rstrip()
    if len(line) > _MAX_QUOTE:
        line = line[:_MAX_QUOTE] + " ..."
    return f"{log_name}:{lineno}: {line}"


_lines, _quote = lines_of, quote


# --- NCCL: per-rank evidence --------------------------------------------------------------------
# Line format, from NCCL's own source (NVIDIA/nccl v2.30.4-1, src/debug.cc): an optional
# timestamp, then "%s:%d:%d " (hostname, pid, tid), then "[%d] NCCL INFO %s" (cudaDev, message).
# The communicator lines (src/init.cc, v2.30.4-1):
#   "%s comm %p rank %d nranks %d cudaDev %d nvmlDev %d busId %lx commId 0x%llx - Init COMPLETE"
#   "[Rank %d] %s comm %p rank %d nranks %d ... - Init START"
# (%s = the init function, e.g. ncclCommInitRank / ncclCommInitRankConfig; a split comm prints
# "parent %p childCount %d color %d key %d" instead of commId). Older NCCL printed
# "comm 0x.. rank 15 nranks 16 cudaDev 7 busId e7000 - Init COMPLETE" (NVIDIA/nccl issue #629).
# The plugin's provider line, from aws/aws-ofi-nccl v1.21.1 src/nccl_ofi_net.cpp:
#   NCCL_OFI_INFO(..., "Selected provider is %s, fabric is %s (found %d nics)") with the prefix
#   "NET/OFI " (include/nccl_ofi_log.h); v1.9.x printed "Selected Provider is %s (found %d nics)".
_NCCL_PREFIX_RE = re.compile(r"([^\s:]+):(\d+):(\d+) \[(\d+)\] NCCL (?:INFO|WARN)")
_NCCL_COMM_RE = re.compile(
    r"NCCL INFO (?:\[Rank \d+\] )?(?:\w+ )?comm (0x[0-9a-fA-F]+) rank (\d+) nranks (\d+)\b"
    r".*?- ?Init (START|COMPLETE)", re.IGNORECASE)
_PROVIDER_RE = re.compile(r"NET/OFI Selected [Pp]rovider is ([^\s,]+)")
_EFA_RE = re.compile(r"Selected [Pp]rovider is efa\b")


def nccl_comm_lines(log_text: str) -> list[dict]:
    """Every NCCL communicator init line: host, pid, cuda_dev, comm, rank, nranks, state, line."""
    out = []
    for i, line in enumerate(_lines(log_text), 1):
        m = _NCCL_COMM_RE.search(line)
        if not m:
            continue
        p = _NCCL_PREFIX_RE.search(line)
        out.append({
            "line": i, "host": p.group(1) if p else None, "pid": int(p.group(2)) if p else None,
            "cuda_dev": int(p.group(4)) if p else None, "comm": m.group(1),
            "rank": int(m.group(2)), "nranks": int(m.group(3)), "state": m.group(4).upper(),
        })
    return out


def per_rank_nccl(log_text: str, world: int, *, log_name: str = "log") -> dict:
    """Gate: every rank 0..world-1 completed an NCCL communicator of size ``world``.

    A per-rank source: NCCL prints each rank's own init line (NCCL_DEBUG=INFO, which
    every engine's env sets). ``log_text`` may be several logs joined (leader and workers).
    """
    name = "nccl_init_per_rank"
    expected = list(range(world))
    lines = _lines(log_text)
    comms = [c for c in nccl_comm_lines(log_text) if c["nranks"] == world]
    complete = sorted({c["rank"] for c in comms if c["state"] == "COMPLETE"})
    started = sorted({c["rank"] for c in comms if c["state"] == "START"})
    missing = [r for r in expected if r not in complete]
    stuck = [r for r in started if r not in complete]
    per_comm = Counter(c["comm"] for c in comms if c["state"] == "COMPLETE")
    observed = {"ranks_complete": complete, "missing": missing,
                "comm_lines_complete": sum(per_comm.values())}
    evidence = [_quote(log_name, c["line"], lines[c["line"] - 1]) for c in comms
                if c["state"] == "COMPLETE"][:64]
    if not comms:
        any_nccl = any("NCCL INFO" in l for l in lines)
        why = ("NCCL INFO lines exist but none is a communicator init of size "
               f"{world}" if any_nccl else
               "no NCCL INFO lines at all: run with NCCL_DEBUG=INFO and NCCL_DEBUG_SUBSYS "
               "including INIT (every engine's env sets both)")
        return gate(name, False, observed, expected, f"{why}; missing ranks: {missing}",
                    []).as_dict()
    if missing:
        reason = f"rank(s) {', '.join(map(str, missing))} of {world} never completed NCCL init"
        if stuck:
            reason += f" (started but not completed: {', '.join(map(str, stuck))})"
        return gate(name, False, observed, expected, reason, evidence).as_dict()
    return gate(name, True, observed, expected,
                f"all {world} ranks completed NCCL init ({sum(per_comm.values())} 'Init COMPLETE' "
                f"lines over {len(per_comm)} communicator(s) of size {world}); NCCL prints this "
                "per rank", evidence).as_dict()


def ranks_by_process(log_text: str, world: int | None) -> dict[tuple, set]:
    """(host, pid) -> the ranks its NCCL init lines name in communicators of size `world` (any
    size when None): how a per-process line (the provider, the network, an ENV setting, the GIN
    assignment), which carries no rank, is tied to ranks."""
    ranks: dict[tuple, set] = defaultdict(set)
    for c in nccl_comm_lines(log_text):
        if c["host"] is not None and (world is None or c["nranks"] == world):
            ranks[(c["host"], c["pid"])].add(c["rank"])
    return ranks


def efa_provider_per_rank(log_text: str, world: int | None = None, *,
                          log_name: str = "log") -> dict:
    """Gate: the aws-ofi-nccl plugin selected the EFA provider on every rank.

    Matches ``Selected [Pp]rovider is efa`` and rejects any other provider (``tcp;ofi_rxm``, ...).
    The provider line carries no rank, so each line is tied to a rank through the NCCL
    communicator lines of the same host:pid (one engine process per GPU); without them the
    count is per process. ``world`` None: only "no non-EFA provider and at least one EFA line".
    """
    name = "efa_provider_per_rank"
    lines = _lines(log_text)
    efa_procs: Counter = Counter()
    efa_lines, other_lines, other_provs = [], [], set()
    for i, line in enumerate(lines, 1):
        m = _PROVIDER_RE.search(line)
        if not m:
            continue
        p = _NCCL_PREFIX_RE.search(line)
        proc = (p.group(1), int(p.group(2))) if p else ("?", i)
        if _EFA_RE.search(line):
            efa_procs[proc] += 1
            efa_lines.append(_quote(log_name, i, line))
        else:
            other_lines.append(_quote(log_name, i, line))
            other_provs.add(m.group(1))
    proc_ranks = ranks_by_process(log_text, world)
    per_rank: Counter = Counter()
    for proc, n in efa_procs.items():
        for r in proc_ranks.get(proc, ()):
            per_rank[r] += n
    observed = {"efa_lines": len(efa_lines), "non_efa_lines": len(other_lines),
                "efa_processes": len(efa_procs),
                "per_rank": {str(r): per_rank[r] for r in sorted(per_rank)}}
    evidence = (other_lines + efa_lines)[:64]
    expected = {"non_efa_lines": 0,
                "ranks_with_efa": list(range(world)) if world is not None else "at least one"}
    fell_back = networks_not_libfabric(log_text, proc_ranks, log_name=log_name)
    if fell_back:
        who = sorted({w for w, _ in fell_back.values()})
        said = sorted({n for _, n in fell_back.values()})
        observed["not_libfabric"] = {w: n for w, n in fell_back.values()}
        return gate(name, False, observed, expected,
                    f"{', '.join(who)} used network {' and '.join(said)}, not Libfabric: NCCL "
                    "fell back from the aws-ofi-nccl plugin (traffic would not go over EFA)",
                    list(fell_back) + evidence[:63]).as_dict()
    if other_lines:
        return gate(name, False, observed, expected,
                    f"{len(other_lines)} provider line(s) selected "
                    f"{', '.join(sorted(other_provs))}, not efa (traffic would not go over EFA)",
                    evidence).as_dict()
    if not efa_lines:
        return gate(name, False, observed, expected,
                    "no 'Selected provider is efa' line: NCCL_DEBUG=INFO with NET in "
                    "NCCL_DEBUG_SUBSYS, and the aws-ofi-nccl plugin loaded?", []).as_dict()
    if world is None:
        return gate(name, True, observed, expected,
                    f"{len(efa_lines)} EFA provider line(s) from {len(efa_procs)} process(es), "
                    "no other provider", evidence).as_dict()
    if proc_ranks:
        missing = [r for r in range(world) if per_rank[r] == 0]
        if missing:
            return gate(name, False, observed, expected,
                        f"no EFA provider line from rank(s) {', '.join(map(str, missing))} of "
                        f"{world} (ranks tied to processes through their NCCL init lines)",
                        evidence).as_dict()
        return gate(name, True, observed, expected,
                    f"EFA provider selected by every rank of {world} (tied to ranks through "
                    "each process's NCCL init lines)", evidence).as_dict()
    ok = len(efa_procs) >= world
    return gate(name, ok, observed, expected,
                f"{len(efa_procs)} process(es) selected EFA for a world of {world}; no NCCL "
                "init lines tie them to ranks, so this counts processes, not named ranks",
                evidence).as_dict()


# --- NCCL: the network and the GIN plugin each rank loaded --------------------------------------
# NCCL prints the network it uses, once per process: "Using network %s" (NVIDIA/nccl src/init.cc,
# INFO(NCCL_INIT|NCCL_NET)); the aws-ofi-nccl plugin's is "Libfabric" (R's logs, 2026-07, and
# NVIDIA/nccl issue #1597) or "AWS Libfabric" (an older plugin's name); a plugin that failed to
# load leaves NCCL's internal "Socket" (or "IB"): the silent fallback of ANCHORS section 6
# (InferenceX PR #2979 review, 2026-09; NVIDIA-NeMo/RL #2410).
_NETWORK_RE = re.compile(r"NCCL INFO (?:NET/Plugin: )?Using network (.+?)\s*$")
LIBFABRIC_NETWORKS = ("Libfabric", "AWS Libfabric")


def networks_not_libfabric(log_text: str, proc_ranks: dict[tuple, set], *,
                           log_name: str = "log") -> dict[str, tuple[str, str]]:
    """Each "Using network X" line whose X is not the plugin's Libfabric, quoted, with who
    printed it ("rank 3", or "process host:pid" where no NCCL init line ties it to a rank) and
    X."""
    out = {}
    for i, line in enumerate(_lines(log_text), 1):
        m = _NETWORK_RE.search(line)
        if not m or m.group(1) in LIBFABRIC_NETWORKS:
            continue
        p = _NCCL_PREFIX_RE.search(line)
        proc = (p.group(1), int(p.group(2))) if p else None
        ranks = sorted(proc_ranks.get(proc, ())) if proc else []
        who = (f"rank {', '.join(map(str, ranks))}" if ranks
               else f"process {proc[0]}:{proc[1]}" if proc else f"line {i}")
        out[_quote(log_name, i, line)] = (who, m.group(1))
    return out


# The GIN plugin NCCL assigned to a communicator, and its type. NCCL 2.30.x prints "GIN/Plugin:
# Assigned plugin %s type %d to comm" (as public logs quote it: "Libfabric_GDAKI type 5" at
# 2.30.7 on p5en; "GIN_IB_GDAKI type 3"); later NCCL (NVIDIA/nccl src/plugin/gin.cc @0456df2)
# prints "Assigned GIN plugin %s to comm" without the type, and "Skipping GIN plugin %s index %d
# type %d: NCCL_GIN_TYPE=%ld requested" for the others. "Loaded gin plugin Libfabric_GDAKI (v14)"
# prints whichever type runs (the EFA installer 1.50.0 registers types 2 and 5 and NCCL picks 2
# by default: whn09/ep-benchmarks-efa, 2026-08), so only the assignment says what loaded. A
# plugin name without a type on its line is read through the names whose type is known.
_GIN_ASSIGNED_RE = re.compile(
    r"Assigned (?:GIN )?plugin (\S+?)(?: type (\d+))? to comm")
GIN_TYPE_OF_PLUGIN = {"Libfabric_GDAKI": 5, "GIN_IB_GDAKI": 3}


def gin_assigned_per_rank(log_text: str, world: int, gin_type: int, *,
                          log_name: str = "log") -> dict:
    """Gate: NCCL assigned every rank 0..world-1 a GIN plugin of type ``gin_type`` (its
    assignment line, tied to ranks through the same host:pid's NCCL init lines). A rank
    assigned another type FAILs it, named; so does a rank with no assignment line."""
    name = f"nccl_gin_type_{gin_type}_assigned_per_rank"
    proc_ranks = ranks_by_process(log_text, world)
    type_of_rank: dict[int, int | None] = {}
    quoted, wrong = [], []
    for i, line in enumerate(_lines(log_text), 1):
        m = _GIN_ASSIGNED_RE.search(line)
        if not m:
            continue
        plugin = m.group(1)
        loaded = int(m.group(2)) if m.group(2) else GIN_TYPE_OF_PLUGIN.get(plugin)
        p = _NCCL_PREFIX_RE.search(line)
        for r in proc_ranks.get((p.group(1), int(p.group(2))), ()) if p else ():
            type_of_rank[r] = loaded
        (quoted if loaded == gin_type else wrong).append(_quote(log_name, i, line))
    other = {r: t for r, t in sorted(type_of_rank.items()) if t != gin_type}
    missing = [r for r in range(world) if r not in type_of_rank]
    observed = {"type_per_rank": {str(r): t for r, t in sorted(type_of_rank.items())},
                "missing": missing}
    expected = {"type": gin_type, "ranks": list(range(world))}
    evidence = (wrong + quoted)[:64]
    if other:
        said = "; ".join(f"rank {r}: " + ("a plugin of unknown type" if t is None else f"type {t}")
                         for r, t in other.items())
        return gate(name, False, observed, expected,
                    f"{said}, not GIN type {gin_type} as the run asked (NCCL_GIN_TYPE is what a "
                    "rank asked; this line is what it loaded)", evidence).as_dict()
    if missing:
        return gate(name, False, observed, expected,
                    f"rank(s) {', '.join(map(str, missing))} of {world}: no 'Assigned ... "
                    "plugin' line from their process (NCCL_DEBUG=INFO with INIT or NET in "
                    "NCCL_DEBUG_SUBSYS; 'Failed to initialize any GIN plugin' means none loaded)",
                    evidence).as_dict()
    return gate(name, True, observed, expected,
                f"every rank of {world} was assigned GIN type {gin_type} (NCCL's assignment "
                "line, tied to ranks through each process's NCCL init lines)",
                evidence).as_dict()


# --- NCCL: a setting each rank read from its environment -----------------------------------------
# NCCL prints every NCCL_* parameter it takes from the environment, once per process, with
# NCCL_DEBUG=INFO and ENV in NCCL_DEBUG_SUBSYS (every engine's env sets both): "NCCL INFO
# NCCL_GIN_TYPE set by environment to 5." as the plugin's own GIN guide quotes it
# (aws/aws-ofi-nccl doc/gin-getting-started.md @ccf5264, "To confirm the EFA-GDA backend was
# used"; the same form a public type-5 campaign quotes beside "GIN/Plugin: Loaded gin plugin
# Libfabric_GDAKI (v14)"). No public log found here shows which GIN plugin each rank of this
# stack was assigned with a rank on the line, so the gate is the variable every rank read,
# tied to ranks through each process's communicator lines, as the provider line is.
_ENV_SET_RE = re.compile(r"NCCL INFO (NCCL_[A-Z0-9_]+) set by environment to ([^\s.]+)")


def env_setting_per_rank(log_text: str, world: int, var: str, value: str, *,
                         log_name: str = "log") -> dict:
    """Gate: every rank 0..world-1 read ``var`` = ``value`` from its environment (NCCL's ENV
    line, per process, tied to ranks through the same host:pid's NCCL init lines); a process
    that read another value FAILs it, quoted."""
    name = f"{var.lower()}_{value}_per_rank"
    lines = _lines(log_text)
    read_by: dict[tuple, str] = {}
    wrong, right = [], []
    for i, line in enumerate(lines, 1):
        m = _ENV_SET_RE.search(line)
        if not m or m.group(1) != var:
            continue
        p = _NCCL_PREFIX_RE.search(line)
        proc = (p.group(1), int(p.group(2))) if p else ("?", i)
        read_by[proc] = m.group(2)
        (right if m.group(2) == value else wrong).append(_quote(log_name, i, line))
    ranks_of = ranks_by_process(log_text, world)
    with_value = sorted({r for proc, v in read_by.items() if v == value
                         for r in ranks_of.get(proc, ())})
    missing = [r for r in range(world) if r not in with_value]
    observed = {"lines": len(right), "other_values": len(wrong), "ranks": with_value,
                "missing": missing}
    expected = {"value": value, "ranks": list(range(world))}
    evidence = (wrong + right)[:64]
    if wrong:
        return gate(name, False, observed, expected,
                    f"{len(wrong)} process(es) read {var} with another value than {value}",
                    evidence).as_dict()
    if not right:
        return gate(name, False, observed, expected,
                    f"no '{var} set by environment to {value}' line: {var} not set, or "
                    "NCCL_DEBUG=INFO without ENV in NCCL_DEBUG_SUBSYS", []).as_dict()
    if missing:
        return gate(name, False, observed, expected,
                    f"rank(s) {', '.join(map(str, missing))} of {world}: no such line from "
                    "their process (ranks tied to processes through their NCCL init lines)",
                    evidence).as_dict()
    return gate(name, True, observed, expected,
                f"every rank of {world} read {var}={value} (NCCL's ENV line, tied to ranks "
                "through each process's NCCL init lines)", evidence).as_dict()
