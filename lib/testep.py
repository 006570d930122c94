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
from typing import Any

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
