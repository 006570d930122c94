"""Parser for DeepEP V2 ``tests/elastic/test_ep.py`` output, in the published microbenchmark shape.

test_ep.py prints, per test case and per rank, one line per measured phase (kineto timings):

    > Testing with do_handle_copy=1, expert_alignment=128, use_fp8_dispatch=1, ... ...
      * EP:   1/2 | dispatch: 0 GB/s (SO), 128 GB/s (SU), 14.794 us, 1894464 bytes | copy: ...
      - EP:   1/2 | expanded dispatch: ...
      # EP:   0/2 | cached dispatch: ...
      @ EP:   0/2 | combine: 0 GB/s (SO), 253 GB/s (SU), 14.455 us, 3663840 bytes | reduce: ...
      + EP:   0/2 | reduced combine: ...

Lines may carry a launcher prefix (``[rank3]:``, ``3:``, a timestamp); only the text from the
phase marker on is read. The rank comes from ``EP: r/n`` itself, so logs of several nodes may be
concatenated. A ``Config:`` block (printed once per node before the cases) gives the token count.

Per phase the result is ``{n, p50, mean, min, max}`` across ranks, in microseconds, and
``dc_p50_us`` = dispatch p50 + combine p50: the shape of the published
``t2_ep16_2node_test_ep_microbench.json`` (``phases_us``, ``dc_p50_us``).
"""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path
from typing import Any, Mapping, Sequence

from lib.core.evidence import gate, skip
from lib.engines.transport import Transport, over_efa
from lib.engines.nccl_logs import gin_assigned_per_rank
from lib.engines.vllm_logs import efa_provider_per_rank

PHASES: tuple[str, ...] = ("dispatch", "expanded dispatch", "cached dispatch", "combine",
                           "reduced combine")
PHASE_MARKERS: dict[str, str] = {"*": "dispatch", "-": "expanded dispatch",
                                 "#": "cached dispatch", "@": "combine", "+": "reduced combine"}

_PHASE_LINE_RE = re.compile(
    r"(?P<marker>[*\-#@+])\s+EP:\s*(?P<rank>\d+)\s*/\s*(?P<ranks>\d+)\s*\|\s*"
    r"(?P<phase>expanded dispatch|cached dispatch|reduced combine|dispatch|combine):\s*"
    r"(?P<so_gbs>[\d.]+) GB/s \(SO\),\s*(?P<su_gbs>[\d.]+) GB/s \(SU\),\s*"
    r"(?P<us>[\d.]+) us,\s*(?P<bytes>[\d.]+) bytes")
_CASE_RE = re.compile(r"> Testing with (?P<params>.*?)\s*\.\.\.\s*$")
_TOKENS_RE = re.compile(r"> Tokens:\s*(?P<tokens>\d+)\s*\(max:\s*(?P<max>\d+)\)"
                        r"(?:,\s*hidden:\s*(?P<hidden>\d+))?")
_EXPERTS_RE = re.compile(r"> Experts:\s*(?P<topk>\d+)/(?P<experts>\d+)")
_PARAM_RE = re.compile(r"(\w+)=([^,\s]+)")
UNLABELLED_CASE = "(no 'Testing with' line)"


def _phase_stats(times_us: list[float]) -> dict[str, float | int]:
    return {"n": len(times_us), "p50": statistics.median(times_us),
            "mean": statistics.fmean(times_us), "min": min(times_us), "max": max(times_us)}


def _case_label(params: str, config: dict[str, Any]) -> str:
    # The token count is part of a case's identity: logs of several runs may be concatenated.
    return f"tokens={config['num_tokens']} | {params}" if "num_tokens" in config else params


def _new_case(key: str, params: str, config: dict[str, Any]) -> dict[str, Any]:
    parsed = {k: _number_or_text(v) for k, v in _PARAM_RE.findall(params)}
    return {"case": key, "params": parsed, **config, "ranks": {}}


def _number_or_text(text: str) -> int | float | str:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _place(cases: dict[str, dict], params: str, config: dict, phase: str, rank: int) -> dict:
    """The case instance for this line: the first one with this label still lacking this
    (phase, rank). Several nodes' output merges into one case; a repeat of the same
    configuration (pressure tests) opens a new one, keyed ``<label> [repeat k]``."""
    label, repeat = _case_label(params, config), 1
    while True:
        key = label if repeat == 1 else f"{label} [repeat {repeat}]"
        if key not in cases:
            cases[key] = _new_case(key, params, config)
        if (phase, rank) not in cases[key]["ranks"]:
            return cases[key]
        repeat += 1


def _summarize_case(case: dict[str, Any]) -> dict[str, Any]:
    by_phase: dict[str, list[float]] = {}
    for (phase, _rank), record in sorted(case["ranks"].items(), key=lambda kv: kv[0][1]):
        by_phase.setdefault(phase, []).append(record["us"])
    phases_us = {phase: _phase_stats(by_phase[phase]) for phase in PHASES if phase in by_phase}
    has_dc = "dispatch" in phases_us and "combine" in phases_us
    return {
        **{k: v for k, v in case.items() if k != "ranks"},
        "phases_us": phases_us,
        "dc_p50_us": (phases_us["dispatch"]["p50"] + phases_us["combine"]["p50"]) if has_dc
        else None,
        "missing_phases": [p for p in PHASES if p not in phases_us],
        "per_rank": [{"phase": phase, "rank": rank, **record}
                     for (phase, rank), record in sorted(case["ranks"].items())],
    }


def parse_test_ep_text(text: str, source: str = "<text>") -> dict[str, dict[str, Any]]:
    """All test cases in test_ep.py output, keyed by case label in the order they appear.

    The label is ``tokens=<N> | <the 'Testing with' parameters>`` (without the token part when
    no Config block was logged).

    Each case: ``case``, ``params`` (do_handle_copy, use_fp8_dispatch, ...), ``num_tokens`` and
    ``num_max_tokens`` / ``hidden`` / ``num_topk`` / ``num_experts`` when the Config block was
    logged, ``num_ranks``, ``phases_us``, ``dc_p50_us`` (None when dispatch or combine is
    missing), ``missing_phases`` and ``per_rank`` records. Raises ValueError when the text has
    no per-rank phase lines at all.
    """
    cases: dict[str, dict[str, Any]] = {}
    config: dict[str, Any] = {}
    params = UNLABELLED_CASE
    for line in text.splitlines():
        if match := _TOKENS_RE.search(line):
            # Rank 0 of each node prints max(1, num_tokens - rank); "max" is the configured count.
            config["num_tokens"] = int(match["max"])
            config["num_tokens_printed"] = int(match["tokens"])
            if match["hidden"]:
                config["hidden"] = int(match["hidden"])
        elif match := _EXPERTS_RE.search(line):
            config["num_topk"], config["num_experts"] = int(match["topk"]), int(match["experts"])
        elif match := _CASE_RE.search(line):
            params = match["params"]
        elif match := _PHASE_LINE_RE.search(line):
            phase, rank = match["phase"], int(match["rank"])
            if PHASE_MARKERS[match["marker"]] != phase:
                continue  # a marker/phase pair test_ep.py never prints: not one of its lines
            case = _place(cases, params, dict(config), phase, rank)
            case["num_ranks"] = int(match["ranks"])
            case["ranks"][(phase, rank)] = {
                "us": float(match["us"]), "bytes": float(match["bytes"]),
                "so_gbps": float(match["so_gbs"]), "su_gbps": float(match["su_gbs"])}
    if not cases:
        raise ValueError(f"{source}: no test_ep.py per-rank phase lines found (expected lines like "
                         f"'* EP: 0/2 | dispatch: ... us' for dispatch '*', expanded '-', cached "
                         f"'#', combine '@', reduced combine '+')")
    return {key: _summarize_case(case) for key, case in cases.items()}


def parse_test_ep_log(path: str | Path) -> dict[str, dict[str, Any]]:
    """``parse_test_ep_text`` on a log file; errors name the path."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"test_ep log not found: {path}")
    return parse_test_ep_text(path.read_text(errors="replace"), source=str(path))


def first_case(cases: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The first test case logged (what ``--test-first-only`` runs and the anchors publish)."""
    if not cases:
        raise ValueError("no test_ep cases to choose from")
    return next(iter(cases.values()))


def as_published_shape(case: dict[str, Any]) -> dict[str, Any]:
    """A case reduced to the published microbenchmark JSON's keys: phases_us, dc_p50_us."""
    return {"phases_us": case["phases_us"], "dc_p50_us": case["dc_p50_us"]}


def read_published_microbench(path: str | Path) -> dict[str, Any]:
    """The published test_ep microbenchmark JSON (e.g. t2_ep16_2node_test_ep_microbench.json).

    Checks that it has ``phases_us`` with dispatch and combine ``{n, p50, mean, min, max}`` and a
    ``dc_p50_us``; raises ValueError naming the path and the missing key otherwise.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"published microbenchmark JSON not found: {path}")
    document = json.loads(path.read_text())
    for key in ("phases_us", "dc_p50_us"):
        if key not in document:
            raise ValueError(f"{path}: missing key {key!r}")
    for phase in ("dispatch", "combine"):
        stats = document["phases_us"].get(phase)
        if not isinstance(stats, dict):
            raise ValueError(f"{path}: phases_us has no {phase!r} entry")
        absent = [k for k in ("n", "p50", "mean", "min", "max") if k not in stats]
        if absent:
            raise ValueError(f"{path}: phases_us[{phase!r}] lacks {absent}")
    return document


# The dispatch+combine p50 contract of the published cross-node run (EP16 on 2x p5en over EFA,
# 128 tokens, hidden 7168, top-8 of 256 experts): R's gate 1, ANCHORS 1.3 and 3. The one place
# this number lives; the published measurement itself (443.6 us) is lib.published's.
CONTRACT_DC_P50_US = 740.0
PUBLISHED_DC_P50_FIGURE = "test_ep D+C p50"

# Gate names.
GATE_EXIT = "test_ep exit code 0"
GATE_RANKS = "test_ep lines from every rank"
GATE_DC = "dispatch+combine p50 recorded"
GATE_DC_MAX = "dispatch+combine p50 within the contract"
GATE_EFA = "EFA provider selected on every rank"
GATE_GIN = "GIN type 5 loaded on every rank"


# ---- the kernel test: gates ---------------------------------------------------------------------
def published_dc_p50_us() -> float:
    """The published cross-node D+C p50 (443.6 us), from lib.published."""
    from lib.measure.published import reference_figures

    figures = reference_figures()
    return float(figures.loc[figures.figure == PUBLISHED_DC_P50_FIGURE, "value"].iloc[0])


# One exit code, one per node (in node order), or node name -> exit code; None: no exit code.
ExitCodes = int | None | Sequence[int | None] | Mapping[str, int | None]


def gates_from_test_ep(log_text: str, rc: ExitCodes, *, num_ranks: int, evidence: Sequence[str],
                       transport: Transport = "efa",
                       dc_p50_max_us: float | None = None,
                       no_exit_said: Mapping[str, str] | None = None) -> list[dict]:
    """The kernel test's gates from test_ep's output (every node's log, joined) and exit code(s).

    ``rc``: one exit code, or one per node (a list, or a mapping node name -> rc); None = no exit
    code (timed out, never started; ``no_exit_said``: what the place said of a node without
    one, by node name, e.g. stopped when a peer failed). ``num_ranks`` = nodes x processes per node. The threshold
    gate is made only when ``dc_p50_max_us`` is given (the cluster: ``CONTRACT_DC_P50_US``).
    Each gate: {gate, status PASS|FAIL|SKIP, observed, expected, reason, evidence}. What it
    is given is what the stage ran (its ranks, its place's transport) and the contract's
    threshold, never a value to check again.
    """
    ev = [str(e) for e in evidence]
    try:
        cases = parse_test_ep_text(log_text, source=ev[0] if ev else "test_ep output")
        parse_error = ""
    except ValueError as error:
        cases, parse_error = {}, str(error)
    case = first_case(cases) if cases else None
    gates = [_exit_gate(rc, ev, no_exit_said or {}), _ranks_gate(cases, parse_error, num_ranks, ev),
             _dc_gate(case, parse_error, num_ranks, ev)]
    if dc_p50_max_us is not None:
        gates.append(_dc_max_gate(case, float(dc_p50_max_us), num_ranks, ev))
    gates.append(_efa_gate(log_text, transport, num_ranks, ev))
    if transport == "gin_type5":  # the type a rank asked for is not proof of the one it loaded
        found = gin_assigned_per_rank(log_text, num_ranks, 5, log_name=ev[0] if ev else "log")
        gates.append({**found, "gate": GATE_GIN, "evidence": ev + list(found["evidence"])})
    return gates


def _exit_gate(rc, ev: list[str], no_exit_said: Mapping[str, str]) -> dict:
    codes = _exit_codes(rc)
    bad = {name: code for name, code in codes.items() if code != 0}
    observed = codes if len(codes) > 1 else next(iter(codes.values()))
    expected = "0 on every node" if len(codes) > 1 else 0
    if bad:
        said = "; ".join(f"{name}: no exit code ("
                         f"{no_exit_said.get(name) or 'timed out or never ran'})" if code is None
                         else f"{name}: exit {code}" for name, code in bad.items())
        reason = (f"test_ep failed ({said}); test_ep prints no PASS marker: the exit code is "
                  "the gate")
        return gate(GATE_EXIT, False, observed, expected, reason, ev).as_dict()
    return gate(GATE_EXIT, True, observed, expected,
                "test_ep prints no PASS marker: the exit code is the gate (its correctness "
                "asserts ran: --skip-check is never passed)", ev).as_dict()


def _exit_codes(rc: ExitCodes) -> dict[str, int | None]:
    """The exit codes by node name: one (`test_ep`), a mapping's, or a list's in node order."""
    if rc is None or isinstance(rc, int):
        return {"test_ep": rc}
    if isinstance(rc, Mapping):
        return {str(k): v for k, v in rc.items()}
    return {f"node {i}": v for i, v in enumerate(rc)}


def _ranks_gate(cases: dict, parse_error: str, num_ranks: int, ev: list[str]) -> dict:
    expected = {"ranks": list(range(num_ranks)), "phases": list(PHASES)}
    if parse_error:
        return gate(GATE_RANKS, False, {"ranks_seen": []}, expected,
                    f"no rank printed test_ep lines: {parse_error}", ev).as_dict()
    seen: set[int] = set()
    printed_sizes: set[int] = set()
    problems: list[str] = []
    missing_ranks: set[int] = set()
    for label, case in cases.items():
        printed_sizes.add(case["num_ranks"])
        have: dict[int, set[str]] = {}
        for record in case["per_rank"]:
            have.setdefault(record["rank"], set()).add(record["phase"])
        seen |= set(have)
        absent = [r for r in range(num_ranks) if r not in have]
        missing_ranks |= set(absent)
        if absent:
            problems.append(f"rank(s) {', '.join(map(str, absent))} of {num_ranks} printed no "
                            f"lines in case {label!r}")
        partial = {r: [p for p in PHASES if p not in have[r]] for r in sorted(have)
                   if r < num_ranks and set(PHASES) - have[r]}
        for r, phases in partial.items():
            problems.append(f"rank {r} lacks {', '.join(phases)} in case {label!r}")
    extra = sorted(r for r in seen if r >= num_ranks)
    if extra:
        problems.append(f"rank(s) {', '.join(map(str, extra))} outside 0..{num_ranks - 1}")
    if printed_sizes != {num_ranks}:
        problems.append(f"test_ep printed EP sizes {sorted(printed_sizes)}, expected {num_ranks}")
    observed = {"ranks_seen": sorted(seen), "missing_ranks": sorted(missing_ranks),
                "ep_sizes_printed": sorted(printed_sizes), "cases": len(cases)}
    if problems:
        return gate(GATE_RANKS, False, observed, expected, "; ".join(problems), ev).as_dict()
    return gate(GATE_RANKS, True, observed, expected,
                f"all {num_ranks} ranks printed every phase line in {len(cases)} case(s)",
                ev).as_dict()


def _dc_observed(case: dict | None) -> dict[str, Any]:
    if case is None:
        return {"dc_p50_us": None}
    phases = case["phases_us"]
    return {"ranks_timed": min((phases.get(p) or {}).get("n", 0) for p in ("dispatch", "combine")),
            "case": case["case"], "num_tokens": case.get("num_tokens"),
            "hidden": case.get("hidden"), "num_topk": case.get("num_topk"),
            "num_experts": case.get("num_experts"), "num_ranks": case.get("num_ranks"),
            "dispatch_p50_us": (phases.get("dispatch") or {}).get("p50"),
            "combine_p50_us": (phases.get("combine") or {}).get("p50"),
            "dc_p50_us": case["dc_p50_us"]}


def _incomplete(observed: dict, num_ranks: int) -> str:
    """Why a D+C p50 is not a measurement of every rank ('' when it is)."""
    if observed["dc_p50_us"] is not None and observed["ranks_timed"] != num_ranks:
        return (f"dispatch and combine were timed on {observed['ranks_timed']} of {num_ranks} "
                "ranks: a p50 over part of the ranks is not recorded")
    return ""


def _dc_gate(case: dict | None, parse_error: str, num_ranks: int, ev: list[str]) -> dict:
    observed = _dc_observed(case)
    expected = f"dispatch p50 + combine p50 of the first case, across all {num_ranks} ranks (us)"
    if case is None:
        return gate(GATE_DC, False, observed, expected,
                    f"nothing to record: {parse_error}", ev).as_dict()
    if case["dc_p50_us"] is None:
        lacking = [p for p in ("dispatch", "combine") if p in case["missing_phases"]]
        return gate(GATE_DC, False, observed, expected,
                    f"the first case lacks {' and '.join(lacking)} lines ({case['case']!r})",
                    ev).as_dict()
    if why := _incomplete(observed, num_ranks):
        return gate(GATE_DC, False, observed, expected, why, ev).as_dict()
    return gate(GATE_DC, True, observed, expected,
                f"D+C p50 {case['dc_p50_us']:.3f} us = dispatch {observed['dispatch_p50_us']:.3f} "
                f"+ combine {observed['combine_p50_us']:.3f} (first case, "
                f"{case.get('num_ranks')} ranks)", ev).as_dict()


def _dc_max_gate(case: dict | None, limit: float, num_ranks: int, ev: list[str]) -> dict:
    observed = _dc_observed(case)
    expected = f"<= {limit:g} us"
    if limit == CONTRACT_DC_P50_US:
        expected += f" (the contract; published {published_dc_p50_us():g} us on 2x p5en EP16)"
    dc = observed["dc_p50_us"]
    if dc is None:
        return gate(GATE_DC_MAX, False, observed, expected,
                    "no dispatch+combine p50 was recorded", ev).as_dict()
    if why := _incomplete(observed, num_ranks):
        return gate(GATE_DC_MAX, False, observed, expected, why, ev).as_dict()
    ok = dc <= limit
    reason = (f"D+C p50 {dc:.3f} us {'<=' if ok else '>'} {limit:g} us"
              + ("" if ok else ": slower than the threshold"))
    return gate(GATE_DC_MAX, ok, observed, expected, reason, ev).as_dict()


def _efa_gate(log_text: str, transport: Transport, num_ranks: int, ev: list[str]) -> dict:
    if not over_efa(transport):  # either GIN type crosses nodes over EFA
        return skip(GATE_EFA, f"the {transport} transport: one machine's NVLink with GIN off "
                    "(EP_DISABLE_GIN=1); no EFA provider is selected", ev).as_dict()
    found = efa_provider_per_rank(log_text, num_ranks, log_name=ev[0] if ev else "log")
    return {**found, "gate": GATE_EFA, "evidence": ev + list(found["evidence"])}


