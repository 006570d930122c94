"""Gates and tables from a ``lib.bench.moe_a2a`` run (pure functions: no I/O, no clocks).

Inputs are what the door recorded: the result JSON rank 0 wrote (``None`` when it is missing),
torchrun's exit code and its stderr text.

The result JSON (schema ``moe_a2a/1``)::

    {schema, config: {num_tokens, hidden, num_topk, num_experts, num_comms, world_size, backend,
                      dtype, device, seed, warmup, iters, timing_method, b2b_calls, ...},
     ranks: [{rank, phases_us: {layout, dispatch, combine, dispatch_combine,
                                dispatch_combine_uncached: {p50, p99, mean, min, max, n, method}},
              floor_us: {...}, bytes: {dispatch_sent, combine_sent, layout_sent, ...},
              correct, max_abs_err, check: {...}, [phases_us_per_call (GPU)],
              [nccl_loaded: {libraries: [path, ...] | null, torch_build_version: str | null}],
              [combine: {impl: gather_sum | index_select_sum, fallback: str | null}]}],
     phases_us: {same phases, pooled over all ranks' samples}, floor_us: {p50, p99, ...},
     [phases_us_per_call (GPU)], bytes_per_rank_mean, gbps_per_rank, dc_over_floor, correct,
     [nccl_loaded: {libraries: [path, ...] | null, torch_build_version: str | null,
                    same_on_every_rank: bool, source: str}], [combine_impl: str],
     samples_us: {rank: {phase: [us, ...]}}}

``nccl_loaded`` says which NCCL actually moved the bytes: ``libraries`` are the mapped files
whose basename starts with ``libnccl`` (the library and its plugins, e.g. ``libnccl-net.so``),
read from each rank's ``/proc/self/maps`` after the process group's first collectives (sorted;
at the top level the union over ranks; null where the maps could not be read, i.e. not Linux);
``torch_build_version`` is ``torch.cuda.nccl.version()`` as a string (null without CUDA), the
version torch was built against, which a site folder on PYTHONPATH or an LD_PRELOAD can
override. On CPU with gloo (CPU-only torch) ``libraries`` is ``[]``: gloo loads no NCCL. The
field is optional: results written before it existed lack it (same schema ``moe_a2a/1``, an
added field), and nothing here requires it. So are ``combine`` / ``combine_impl`` (config
``combine_asked``): which implementation of the combine's gather + sum produced the figures,
``gather_sum`` (one Triton kernel, lib/bench/gather_sum.py) or ``index_select_sum`` (the two
torch kernels every result before them used).

Torchrun (torch 2.13) names a failed worker in its ChildFailedError report, e.g.::

    Root Cause (first observed failure):
    [0]:
      time      : 2026-11-30_10:19:21
      host      : localhost
      rank      : 1 (local_rank: 1)
      exitcode  : 3 (pid: 6602)

with the other failures (often ranks it SIGTERMed itself, ``exitcode : -15 ... (SIGTERM)``) under
``Failures:``, and logs ``failed (exitcode: 3) local_rank: 1 (pid: ...)`` before that.
"""
from __future__ import annotations

import math
import re
from typing import Any

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"

GATE_EXIT = "all ranks exited 0"
GATE_CORRECT = "correctness"
GATE_DISPATCH = "dispatch p50/p99 recorded"
GATE_COMBINE = "combine p50/p99 recorded"
GATE_DC = "dispatch+combine p50/p99 recorded"
GATE_FLOOR = "floor measured"

_RANK_RE = re.compile(r"^\s*rank\s*:\s*(\d+)\s*\(local_rank:\s*(\d+)\)")
_EXIT_RE = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)(?:.*\((SIG[A-Z0-9]+)\))?")
_HOST_RE = re.compile(r"^\s*host\s*:\s*(\S+)")
_AGENT_RE = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+) \(pid: \d+\)")


def failed_ranks_from_stderr(text: str) -> list[dict]:
    """The failed workers torchrun reports: [{rank, local_rank, exitcode, signal, host,
    root_cause}], root cause first. Falls back to the agent's ``failed (exitcode: N) local_rank:
    M`` lines (rank then unknown: None) when the ChildFailedError report is absent."""
    found: list[dict] = []
    section = None
    cur: dict | None = None
    for line in (text or "").splitlines():
        if line.startswith("Root Cause"):
            section = "root"
            continue
        if line.startswith("Failures:"):
            section = "other"
            continue
        if section is None:
            continue
        m = _HOST_RE.match(line)
        if m:
            cur = {"rank": None, "local_rank": None, "exitcode": None, "signal": None,
                   "host": m.group(1), "root_cause": section == "root"}
            found.append(cur)
            continue
        m = _RANK_RE.match(line)
        if m:
            if cur is None or cur["rank"] is not None:
                cur = {"rank": None, "local_rank": None, "exitcode": None, "signal": None,
                       "host": None, "root_cause": section == "root"}
                found.append(cur)
            cur["rank"], cur["local_rank"] = int(m.group(1)), int(m.group(2))
            continue
        m = _EXIT_RE.match(line)
        if m and cur is not None:
            cur["exitcode"] = int(m.group(1))
            cur["signal"] = m.group(2)
    found = [f for f in found if f["rank"] is not None]
    if not found:
        seen = set()
        for m in _AGENT_RE.finditer(text or ""):
            key = (int(m.group(2)), int(m.group(1)))
            if key in seen:
                continue
            seen.add(key)
            found.append({"rank": None, "local_rank": key[0], "exitcode": key[1], "signal": None,
                          "host": None, "root_cause": not found})
    found.sort(key=lambda f: (not f["root_cause"], f["rank"] if f["rank"] is not None else -1))
    return found


def _describe_failure(f: dict) -> str:
    who = f"rank {f['rank']}" if f["rank"] is not None else f"local rank {f['local_rank']}"
    if f["rank"] is not None and f["local_rank"] is not None and f["local_rank"] != f["rank"]:
        who += f" (local_rank {f['local_rank']})"
    code = f"exitcode {f['exitcode']}" + (f" {f['signal']}" if f["signal"] else "")
    tag = "root cause" if f["root_cause"] else (
        "terminated by torchrun after the first failure" if f["signal"] == "SIGTERM" else "also failed")
    return f"{who} {code} ({tag})"


def _gate(gate: str, status: str, observed: Any, expected: Any, reason: str, evidence: list[str]) -> dict:
    return {"gate": gate, "status": status, "observed": observed, "expected": expected,
            "reason": reason, "evidence": list(evidence)}


def _finite_pos(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def _exit_gate(rc: int, stderr: str, ev: list[str]) -> dict:
    expected = "torchrun rc 0 and every rank exit 0"
    if rc is None:  # no exit code: the place never started the ranks, or they timed out
        said = next((line.strip() for line in stderr.splitlines() if line.strip()),
                    "the place said nothing more")
        return _gate(GATE_EXIT, FAIL, "no exit code", expected,
                     f"no rank exited: {said}", ev)
    failures = failed_ranks_from_stderr(stderr)
    if rc == 0 and not failures:
        return _gate(GATE_EXIT, PASS, "torchrun rc=0", expected, "torchrun exited 0", ev)
    if failures:
        named = "; ".join(_describe_failure(f) for f in failures)
        ranks = [f["rank"] if f["rank"] is not None else f"local {f['local_rank']}" for f in failures]
        return _gate(GATE_EXIT, FAIL, f"torchrun rc={rc}; failed: {named}", expected,
                     f"rank(s) {', '.join(map(str, ranks))} failed; first: {_describe_failure(failures[0])}", ev)
    return _gate(GATE_EXIT, FAIL, f"torchrun rc={rc}", expected,
                 f"torchrun exited {rc}; no failed rank could be parsed from its stderr", ev)


def _correct_gate(res: dict | None, rc: int, ev: list[str]) -> dict:
    expected = "combined output equals the no-communication reference on every rank"
    if not res:
        return _gate(GATE_CORRECT, FAIL, "no result JSON", expected,
                     f"the result JSON is missing (torchrun rc={rc}): correctness unproven", ev)
    ranks = res.get("ranks") or []
    world = (res.get("config") or {}).get("world_size")
    bad = [r for r in ranks if not r.get("correct")]
    errs = ", ".join(f"rank {r.get('rank')}: max_abs_err={r.get('max_abs_err')}" for r in ranks)
    method = (ranks[0].get("check") or {}).get("method") if ranks else None
    observed = f"{len(ranks) - len(bad)}/{len(ranks)} ranks correct ({errs}; {method})"
    if world is not None and len(ranks) != world:
        return _gate(GATE_CORRECT, FAIL, observed, expected,
                     f"{len(ranks)} rank results for world size {world}", ev)
    if bad or not res.get("correct") or not ranks:
        names = ", ".join(str(r.get("rank")) for r in bad) or "unknown"
        return _gate(GATE_CORRECT, FAIL, observed, expected, f"correctness failed on rank(s) {names}", ev)
    return _gate(GATE_CORRECT, PASS, observed, expected, "every rank matched its reference", ev)


def _phase_gate(gate: str, phase: str, res: dict | None, rc: int, ev: list[str]) -> dict:
    expected = "finite p50 and p99 > 0 us, n >= 1"
    if not res:
        return _gate(gate, SKIP, None, expected, f"no result JSON (torchrun rc={rc})", ev)
    st = (res.get("phases_us") or {}).get(phase) or {}
    observed = {k: st.get(k) for k in ("p50", "p99", "n", "method")}
    if _finite_pos(st.get("p50")) and _finite_pos(st.get("p99")) and (st.get("n") or 0) >= 1:
        return _gate(gate, PASS, observed, expected,
                     f"p50 {st['p50']:.1f} us, p99 {st['p99']:.1f} us over {st['n']} samples", ev)
    return _gate(gate, FAIL, observed, expected, f"phases_us.{phase} lacks a finite p50/p99", ev)


def _floor_gate(res: dict | None, rc: int, ev: list[str]) -> dict:
    expected = "bare all_to_all_single with the same bytes, finite p50/p99 > 0 us"
    if not res:
        return _gate(GATE_FLOOR, SKIP, None, expected, f"no result JSON (torchrun rc={rc})", ev)
    fl = res.get("floor_us") or {}
    observed = {"p50": fl.get("p50"), "p99": fl.get("p99"), "dc_over_floor": res.get("dc_over_floor")}
    if _finite_pos(fl.get("p50")) and _finite_pos(fl.get("p99")):
        ratio = res.get("dc_over_floor")
        tail = f"; dispatch+combine / floor = {ratio:.2f}" if _finite_pos(ratio) else ""
        return _gate(GATE_FLOOR, PASS, observed, expected, f"floor p50 {fl['p50']:.1f} us{tail}", ev)
    return _gate(GATE_FLOOR, FAIL, observed, expected, "floor_us lacks a finite p50/p99", ev)


def gates_from_result(result_json: dict | None, torchrun_rc: int, torchrun_stderr: str,
                      evidence: list[str] | tuple[str, ...] = ()) -> list[dict]:
    """The benchmark's gates. ``evidence`` (paths) is attached to every gate."""
    ev = list(evidence)
    return [
        _exit_gate(torchrun_rc, torchrun_stderr, ev),
        _correct_gate(result_json, torchrun_rc, ev),
        _phase_gate(GATE_DISPATCH, "dispatch", result_json, torchrun_rc, ev),
        _phase_gate(GATE_COMBINE, "combine", result_json, torchrun_rc, ev),
        _phase_gate(GATE_DC, "dispatch_combine", result_json, torchrun_rc, ev),
        _floor_gate(result_json, torchrun_rc, ev),
    ]


# (label, phases_us key, bytes moved per rank for that phase)
_TABLE_ROWS = (
    ("dispatch", "dispatch", ("dispatch_sent",)),
    ("combine", "combine", ("combine_sent",)),
    ("dispatch+combine", "dispatch_combine", ("dispatch_sent", "combine_sent")),
    ("dispatch+combine (uncached layout)", "dispatch_combine_uncached",
     ("layout_sent", "dispatch_sent", "combine_sent")),
    ("layout", "layout", ("layout_sent",)),
    ("floor (bare all_to_all_single)", None, ("dispatch_sent", "combine_sent")),
)


def summary_rows(result_json: dict | None) -> list[dict]:
    """The table's rows as dicts: phase, p50_us, p99_us, GB/s (mean bytes per rank / p50)."""
    if not result_json:
        return []
    ranks = result_json.get("ranks") or []
    rows = []
    for label, key, byte_keys in _TABLE_ROWS:
        st = (result_json.get("floor_us") if key is None else (result_json.get("phases_us") or {}).get(key)) or {}
        p50, p99 = st.get("p50"), st.get("p99")
        moved = (sum(sum((r.get("bytes") or {}).get(b, 0) for b in byte_keys) for r in ranks) / len(ranks)
                 if ranks else 0.0)
        gbps = moved / (p50 * 1e-6) / 1e9 if _finite_pos(p50) and moved else None
        rows.append({"phase": label, "p50_us": p50, "p99_us": p99, "GB/s": gbps})
    return rows


def summary_table(result_json: dict | None):
    """pandas DataFrame (phase, p50_us, p99_us, GB/s) for display; empty when no result."""
    import pandas as pd

    return pd.DataFrame(summary_rows(result_json), columns=["phase", "p50_us", "p99_us", "GB/s"])
