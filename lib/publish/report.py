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
    text = ", ".join(map(str, v)) if isinstance(v, list) else ("" if v is None else str(v))
    return text.replace("|", "\\|").replace("\n", " ")


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
                f"prompts; largest logprob difference {seen.get('max_diff_nats')} nats)")
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


def failed_gate_rows(failed: pd.DataFrame) -> pd.DataFrame:
    """FAIL gates for the book: the same check failing in several AIPerf cells is one row
    naming the cells (its first reason shown), terminal codes gone, long reasons cut."""
    rows: dict[tuple, dict] = {}
    for g in failed.itertuples():
        key = (g.stage, _CELL.sub("c{C} repeat {R}", g.gate))
        row = rows.setdefault(key, {"stage": g.stage, "gate": key[1], "cells": [],
                                    "reason": evidence.without_terminal_codes(g.reason)})
        cell = _CELL.search(g.gate)
        if cell:
            row["cells"].append(f"c{cell.group(1)} r{cell.group(2)}")
    out = []
    for row in rows.values():
        cells = row["cells"]
        gate = row["gate"] + (f" ({len(cells)}: {', '.join(cells)})" if cells else "")
        reason = row["reason"]
        reason = reason if len(reason) <= 200 else reason[:200] + " ... (whole in gates.json)"
        out.append({"stage": row["stage"], "gate": gate, "reason": reason})
    return pd.DataFrame(out, columns=["stage", "gate", "reason"])
