"""Tables and pages for the book, from evidence only (a run directory), never from the world."""
from __future__ import annotations

import re
from pathlib import Path

import pandas as pd

from lib.core import evidence
from lib.stages.registry import STAGES


def gates_table(run_dir: Path) -> pd.DataFrame:
    rows = []
    for stage in STAGES:
        for g in evidence.read_gates(Path(run_dir) / stage) or []:
            rows.append({"stage": stage, **g})
    return pd.DataFrame(rows, columns=["stage", "gate", "status", "observed", "expected",
                                       "reason", "evidence"])


def stage_summary(run_dir: Path) -> pd.DataFrame:
    """Per stage: its gate counts and its state (catalog.stage_states: the one rule)."""
    from lib.publish.catalog import stage_states

    rows = []
    for stage, state in stage_states(Path(run_dir)).items():
        gates = evidence.read_gates(Path(run_dir) / stage) or []
        rows.append({"stage": stage, **evidence.summarize_gates(gates), "state": state})
    return pd.DataFrame(rows)


def _md_cell(v) -> str:
    """A table cell's text: a list, a dict or an unrounded float as a reader would write it
    (value_said), never its Python repr; a pipe escaped and a newline a space, so the row holds."""
    if v is None:
        text = ""
    elif isinstance(v, (dict, list, tuple)):
        text = value_said(v)
    elif isinstance(v, float) and _unrounded(v):
        text = number_said(v)
    else:
        text = str(v)
    return text.replace("|", "\\|").replace("\n", " ")


# --- values as a reader writes them --------------------------------------------------------------

# A key's unit, from the suffix the guide's gates give it (ready_after_s, dc_p50_us, ...): said
# after the number, and the suffix dropped from the key.
UNITS = {"_us": "µs", "_ms": "ms", "_s": "s", "_nats": "nats", "_mib": "MiB", "_gib": "GiB",
         "_tps": "tok/s", "_gbps": "GB/s"}
SIGNIFICANT = 3
# A float whose shortest repr has more digits than this was never rounded by whoever wrote the
# table (a measurement's 15 digits): it is said at SIGNIFICANT figures; a rounded one as it is.
_ROUNDED_DIGITS = 6
# A value longer than this in a gate table is cut (gates.json holds it whole).
LONGEST_VALUE = 240


def _unrounded(x: float) -> bool:
    if x != x or x in (float("inf"), float("-inf")):
        return False
    digits = repr(abs(x)).split("e")[0].replace(".", "").lstrip("0")
    return len(digits) > _ROUNDED_DIGITS


def number_said(x) -> str:
    """An int as it is; a float at 3 significant figures without an exponent and without
    trailing zeros, its whole part always whole (251.8 -> 252, 1234.56 -> 1235, 2000.0 -> 2000,
    1.3836 -> 1.38, 0.000123456 -> 0.000123)."""
    if isinstance(x, bool) or not isinstance(x, float):
        return str(x).lower() if isinstance(x, bool) else str(x)
    if x != x or x in (float("inf"), float("-inf")):
        return str(x)
    if x == 0:
        return "0"
    if abs(x) >= 10 ** SIGNIFICANT:
        return str(round(x))
    rounded = float(f"{x:.{SIGNIFICANT}g}")
    if rounded.is_integer():
        return str(int(rounded))
    return f"{rounded:.12f}".rstrip("0").rstrip(".")


def _int_runs(values: list[int]) -> str:
    """0, 1, 2, ..., 15 -> 0-15: a rank list reads as its range (runs of three or more)."""
    out, start = [], 0
    for i in range(1, len(values) + 1):
        if i == len(values) or values[i] != values[i - 1] + 1:
            run = values[start:i]
            out.append(f"{run[0]}-{run[-1]}" if len(run) >= 3 else ", ".join(map(str, run)))
            start = i
    return ", ".join(out)


def _key_and_unit(key: str) -> tuple[str, str]:
    for suffix, unit in UNITS.items():
        if key.lower().endswith(suffix) and len(key) > len(suffix):
            return key[: -len(suffix)], unit
    return key, ""


def value_said(v, nested: bool = False) -> str:
    """An observed or expected value of a gate as words: a dict as "key value; key value" (keys
    with spaces for underscores, a unit from the key's suffix, a nested dict in parentheses),
    a list joined by commas (consecutive integers as a range, an empty one "none"), numbers at
    three significant figures, None "none" inside a value and empty on its own."""
    if v is None:
        return "none" if nested else ""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return number_said(v)
    if isinstance(v, (list, tuple)):
        if not v:
            return "none"
        if all(isinstance(x, int) and not isinstance(x, bool) for x in v):
            return _int_runs(list(v))
        return ", ".join(value_said(x, nested=True) for x in v)
    if isinstance(v, dict):
        if not v:
            return "none"
        values = list(v.values())
        keys = list(v)
        # a per-rank count: 16 keys with the same value read as one statement
        if len(v) > 8 and all(values[0] == x for x in values):
            numeric = all(str(k).isdigit() for k in keys)
            which = (_int_runs(sorted(int(k) for k in keys)) if numeric
                     else f"{len(keys)} keys")
            return f"{which}: each {value_said(values[0], nested=True)}"
        parts = []
        for key, value in v.items():
            name, unit = _key_and_unit(str(key))
            said = value_said(value, nested=True)
            if isinstance(value, dict):
                said = f"({said})"
            if unit and isinstance(value, (int, float)) and not isinstance(value, bool):
                said = f"{said} {unit}"
            parts.append(f"{name.replace('_', ' ')} {said}")
        return (", " if nested else "; ").join(parts)
    return str(v)


def _cut(text: str, longest: int = LONGEST_VALUE) -> str:
    return text if len(text) <= longest else text[:longest].rstrip() + " ... (whole in gates.json)"


def _md_table(df: pd.DataFrame) -> str:
    head = "| " + " | ".join(df.columns) + " |\n|" + "---|" * len(df.columns) + "\n"
    return head + "".join("| " + " | ".join(_md_cell(v) for v in row) + " |\n"
                          for row in df.itertuples(index=False))


def kernel_figures(run_dir: Path) -> dict | None:
    path = Path(run_dir) / "03_kernel_test" / "result.json"
    if not path.exists():
        return None
    result = evidence.read_json(path)
    cfg = result.get("config", {})
    dc = (result.get("phases_us") or {}).get("dispatch_combine") or {}
    return {
        "shape": f"{cfg.get('num_tokens')} tokens x hidden {cfg.get('hidden')}, top-"
                 f"{cfg.get('num_topk')} of {cfg.get('num_experts')} experts, "
                 f"{cfg.get('world_size')} ranks, {cfg.get('backend')} {cfg.get('dtype')}",
        "dispatch+combine p50 (us)": round(dc.get("p50", float("nan")), 1),
        "floor p50 (us)": round((result.get("floor_us") or {}).get("p50", float("nan")), 1),
        "D+C / floor": round(result.get("dc_over_floor") or float("nan"), 2),
        "GB/s per rank": round(result.get("gbps_per_rank") or float("nan"), 1),
        "timing": dc.get("method"),
        # which combine moved the figure: results before the field used index_select + sum
        "combine": result.get("combine_impl") or "index_select_sum (recorded before the field)",
        "correct": result.get("correct"),
    }


def vllm_sections(run_dir: Path) -> list[str]:
    """A vLLM run's figures: the serve (backend proven by its log), the sweep, the A/B ratios."""
    out = []
    serve_path = Path(run_dir) / "04_serve" / "vllm_serve.json"
    if serve_path.exists():
        served = evidence.read_json(serve_path)
        out.append("\n### vLLM serve (04)\n")
        out.append(f"vLLM on {served.get('gpus')} GPUs, DP = EP = {served.get('gpus')}, "
                   f"`--all2all-backend {served.get('backend')}`; ready after "
                   f"{served.get('ready_s')} s from launch ({served.get('startup_s')} s from "
                   "vLLM's first log line to the last API server up). Backend gates from its "
                   f"log: {', '.join(served.get('backend_gates') or [])}.\n")
    summary_path = Path(run_dir) / "05_sweep" / "summary.csv"
    if serve_path.exists() and summary_path.exists():
        frame = pd.read_csv(summary_path)
        # per arm: a backend A/B's summary holds one arm per backend and traffic shape
        table = (frame.groupby(["arm", "concurrency"])["output_tps"]
                 .agg(["median", "min", "max", "count"]).round(1).reset_index()
                 .rename(columns={"median": "output tok/s (median)", "count": "repeats"}))
        out.append("\n### vLLM sweep (05)\n")
        out.append(_md_table(table))
    for stage, title in (("05_sweep", "vLLM backend A/B (05), output tok/s, arms interleaved"),
                         ("06_multicomm", "vLLM serving A/B (06), output tok/s, arms "
                                          "interleaved")):
        ratios_path = Path(run_dir) / stage / "ratios.json"
        if ratios_path.exists():
            out.append(f"\n### {title}\n")
            out.append(_md_table(ratio_rows(evidence.read_json(ratios_path))))
            out.append(FEW_REPEATS_NOTE)
            servers_path = Path(run_dir) / stage / "servers.json"  # runs recorded before: none
            if servers_path.exists():
                out.append(servers_line(evidence.read_json(servers_path)))
            answers = answers_line(Path(run_dir) / stage)
            if answers:
                out.append(answers)
    test_ep_path = Path(run_dir) / "03_kernel_test" / "test_ep.json"
    if test_ep_path.exists():
        out.append("\n### DeepEP test_ep beside the torch benchmark and the NCCL floor (03)\n")
        out.append(_md_table(pd.DataFrame(evidence.read_json(test_ep_path)).round(1)))
    return out


def servers_line(servers: dict) -> str:
    """How an A/B's servers were arranged, and each one's seconds from launch to ready."""
    ready = "; ".join(f"{arm} " + ", ".join("?" if s["ready_s"] is None else f"{s['ready_s']:.1f}"
                                            for s in starts)
                      for arm, starts in servers["arms"].items())
    return (f"\nServers: {servers['layout']}. Seconds from launch to ready, per start: "
            f"{ready}.\n")


def answers_line(stage_dir: Path) -> str | None:
    """Whether each compared arm answered the fixed prompts as its baseline did (lib.agreement's
    gates); None for a stage recorded before arms were asked."""
    gates = [g for g in evidence.read_gates(stage_dir) or [] if " answers as " in g["gate"]]
    if not gates:
        return None

    def said(g: dict) -> str:
        seen = g.get("observed") or {}
        if g["status"] == "SKIP":
            return f"{g['gate']}: SKIP ({g['reason']})"
        return (f"{g['gate']}: **{g['status']}** ({seen.get('agree')} of {seen.get('prompts')} "
                f"prompts; largest logprob difference "
                f"{value_said(seen.get('max_diff_nats'))} nats)")
    return ("\nAnswers (each arm asked the same greedy prompts before its cells, "
            "lib.agreement): " + "; ".join(said(g) for g in gates) + ".\n")


NOT_MEASURED = "not measured"  # a ratio with fewer than two paired repeats


def ratio_rows(rows: list[dict]) -> pd.DataFrame:
    """A/B ratios (lib.stages.serving_ab's ratios.json) as a table."""
    return pd.DataFrame([{
        "arm b / arm a": f"{r['b']} / {r['a']}", **({"shape": r["shape"]} if "shape" in r else {}),
        "concurrency": r["concurrency"], "paired repeats": r["n"],
        "ratio": NOT_MEASURED if r["ratio"] is None else round(r["ratio"], 3),
        "95% interval": NOT_MEASURED if r["low"] is None else f"{r['low']:.3f} to {r['high']:.3f}",
        # the repeats themselves: with three, an interval is coarse and they are what to read
        "arm a, each repeat": _each(r.get("a_tps")), "arm b, each repeat": _each(r.get("b_tps")),
        "b / a, each repeat": _each_ratio(r.get("a_tps"), r.get("b_tps"))}
        for r in rows])


# Under every ratio table: why the repeats sit beside the interval.
FEW_REPEATS_NOTE = ("\nA repeat pairs the two arms measured in the same round, so `b / a, each "
                    "repeat` is that round's own ratio. With n paired repeats the bootstrap "
                    "resamples draw from few distinct sets (10 for n = 3), so an interval can "
                    "end at the ratio itself; read it beside the rounds' own ratios.\n")


def _each(values: list[float] | None) -> str:
    return ", ".join(f"{v:.0f}" for v in values or [])


def _each_ratio(a: list[float] | None, b: list[float] | None) -> str:
    """b_i / a_i per paired repeat (ratios.json lists both arms' paired repeats in one order)."""
    return ", ".join(f"{y / x:.3f}" if x else "n/a" for x, y in zip(a or [], b or []))


_CELL = re.compile(r"\bc(\d+) repeat (\d+)\b")  # an AIPerf cell in a gate's name
LONGEST_REASON = 200  # a reason longer than this is cut in a table (gates.json holds it whole)


def failed_gate_rows(failed: pd.DataFrame) -> pd.DataFrame:
    """FAIL gates for the book: the same check failing in several AIPerf cells is one row
    naming the cells (its first reason shown), terminal codes gone, long reasons cut; a gate
    of its own says what was observed against what was expected after its reason."""
    rows: dict[tuple, dict] = {}
    for g in failed.itertuples():
        key = (g.stage, _CELL.sub("c{C} repeat {R}", g.gate))
        row = rows.setdefault(key, {"stage": g.stage, "gate": key[1], "cells": [],
                                    "reason": evidence.without_terminal_codes(g.reason or ""),
                                    "observed": g.observed, "expected": g.expected})
        cell = _CELL.search(g.gate)
        if cell:
            row["cells"].append(f"c{cell.group(1)} r{cell.group(2)}")
    out = []
    for row in rows.values():
        cells = row["cells"]
        gate = row["gate"] + (f" ({len(cells)}: {', '.join(cells)})" if cells else "")
        reason = _cut(row["reason"], LONGEST_REASON)
        if len(cells) <= 1:
            reason = " ".join(filter(None, [reason, _observed_against_expected(row)]))
        out.append({"stage": row["stage"], "gate": gate, "reason": reason})
    return pd.DataFrame(out, columns=["stage", "gate", "reason"])


def _observed_against_expected(gate) -> str:
    observed, expected = value_said(gate["observed"]), value_said(gate["expected"])
    if not observed and not expected:
        return ""
    return (f"Observed: {_cut(observed or 'nothing')}."
            + (f" Expected: {_cut(expected)}." if expected else ""))


def skipped_gate_rows(skipped: pd.DataFrame) -> pd.DataFrame:
    """SKIP gates, one row per stage and reason, naming every gate that SKIPped for it: a stage
    whose network was out SKIPs a dozen gates for one reason, which is one thing to read."""
    rows: dict[tuple, dict] = {}
    for g in skipped.itertuples():
        reason = evidence.without_terminal_codes(g.reason or "")
        row = rows.setdefault((g.stage, reason), {"stage": g.stage, "gates": [],
                                                  "reason": _cut(reason, LONGEST_REASON)})
        row["gates"].append(g.gate)
    return pd.DataFrame([{"stage": r["stage"],
                          "gates": "; ".join(r["gates"]) + (f" ({len(r['gates'])} gates)"
                                                            if len(r["gates"]) > 1 else ""),
                          "reason": r["reason"]} for r in rows.values()],
                        columns=["stage", "gates", "reason"])


def passed_gate_rows(passed: pd.DataFrame) -> pd.DataFrame:
    """PASS gates: what each observed against what it expected, as words (value_said), with
    the reason where a gate gave one (01's "VERIFIED: listed among 32 versions")."""
    table = pd.DataFrame({"stage": passed["stage"], "gate": passed["gate"],
                          "observed": passed["observed"].map(lambda v: _cut(value_said(v))),
                          "expected": passed["expected"].map(lambda v: _cut(value_said(v))),
                          "reason": passed["reason"].map(
                              lambda r: evidence.without_terminal_codes(r or ""))})
    return table if (table["reason"] != "").any() else table.drop(columns="reason")


def gate_tables(gates: pd.DataFrame, *, with_stage: bool, with_pass: bool = True) -> str:
    """A run's (or one stage's) gates for a page: FAIL, then SKIP grouped by reason, each with
    its reason in view, then the PASS gates collapsed behind a dropdown with their count.
    `gates` is gates_table's frame; `with_stage` keeps the stage column (a run's page)."""
    counts = {status: int((gates.status == status).sum()) for status in ("PASS", "FAIL", "SKIP")}
    drop = [] if with_stage else ["stage"]
    out = []
    if counts["FAIL"]:
        out.append(f"**FAIL:** {_gates(counts['FAIL'])}.\n")
        out.append(_md_table(failed_gate_rows(gates[gates.status == "FAIL"]).drop(columns=drop)))
    if counts["SKIP"]:
        out.append(f"**SKIP:** {_gates(counts['SKIP'])}, one row per reason.\n")
        out.append(_md_table(skipped_gate_rows(gates[gates.status == "SKIP"]).drop(columns=drop)))
    if with_pass and counts["PASS"]:
        out.append(f":::{{dropdown}} PASS: {_gates(counts['PASS'])}\n")
        out.append(_md_table(passed_gate_rows(gates[gates.status == "PASS"]).drop(columns=drop)))
        out.append(":::\n")
    return "\n".join(out)


def _gates(n: int) -> str:
    return f"{n} gate" + ("" if n == 1 else "s")
