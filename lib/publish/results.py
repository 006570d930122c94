"""The figures behind the results page, gathered across every run that may feed them.

Each function reads evidence files only (through the catalog) and returns a flat table: one row
per plotted or tabulated number, naming its run, so a page or a plot can cite each number's
evidence. A run feeds these tables only if the catalog says it may (real GPUs, the place it
names, its seal intact), and a stage's numbers only if that stage has no FAIL gate; otherwise
the number is absent, and the page says "not measured" with the reason.
"""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from lib.core import evidence
from lib.engines import vllm_logs
from lib.measure import published
from lib.measure.stats import MIN_ROUNDS_FOR_INTERVAL
from lib.publish.catalog import Run

KERNEL_SERIES = {  # test_ep.json's columns -> the series a reader sees
    "test_ep D+C p50 (us)": "DeepEP test_ep",
    "torch D+C p50 (us)": "torch benchmark",
    "NCCL floor p50 (us)": "NCCL floor (two all_to_all_single)",
}
SERVING_STAGES = ("05_sweep", "06_multicomm")
LATENCIES = ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")


def kernel_points(runs: list[Run]) -> pd.DataFrame:
    """dispatch+combine p50 against tokens per rank, per series, from every run whose 03 passed."""
    rows = []
    for run in runs:
        if not run.feeds_results or run.stages.get("03_kernel_test") != "PASS":
            continue
        stage = run.path / "03_kernel_test"
        if (stage / "test_ep.json").exists():
            for row in evidence.read_json(stage / "test_ep.json"):
                for column, series in KERNEL_SERIES.items():
                    rows.append({"run": run.run_id, "series": series, "tokens": row["tokens"],
                                 "p50_us": row[column], "hardware": run.hardware})
        elif (stage / "result.json").exists():  # the torch benchmark alone, at its one shape
            result = evidence.read_json(stage / "result.json")
            tokens = result.get("config", {}).get("num_tokens")
            dc = (result.get("phases_us") or {}).get("dispatch_combine") or {}
            if result.get("correct") and dc.get("p50") is not None:
                rows.append({"run": run.run_id, "series": "torch benchmark", "tokens": tokens,
                             "p50_us": dc["p50"], "hardware": run.hardware})
                rows.append({"run": run.run_id, "series": KERNEL_SERIES["NCCL floor p50 (us)"],
                             "tokens": tokens, "p50_us": result["floor_us"]["p50"],
                             "hardware": run.hardware})
    return pd.DataFrame(rows, columns=["run", "series", "tokens", "p50_us", "hardware"])


def published_kernel_point() -> dict:
    """The public reproduction's test_ep dispatch+combine p50: the same kernels and shape, other
    hardware (EP16 across two p5en nodes over EFA)."""
    table = published.reference_figures().set_index("figure")
    row = table.loc["test_ep D+C p50"]
    return {"series": "DeepEP test_ep, 2x p5en over EFA (cited)", "tokens":
            published.MICROBENCH_TOKENS, "p50_us": float(row["value"]),
            "hardware": row["hardware"], "date": row["date"], "source": row["source"]}


def _vllm_served(run: Run) -> bool:
    return run.feeds_results and (run.path / "04_serve" / "vllm_serve.json").exists()


def serving_cells(runs: list[Run]) -> pd.DataFrame:
    """Every AIPerf cell of every vLLM run (05 and 06), with whether it may be plotted."""
    frames = []
    for run in runs:
        if not _vllm_served(run):
            continue
        for stage in SERVING_STAGES:
            path = run.path / stage / "summary.csv"
            if not path.exists():
                continue
            cells = pd.read_csv(path)
            cells.insert(0, "stage", stage)
            cells.insert(0, "run", run.run_id)
            complete = (cells["requests_completed"] == cells["requests_requested"]) \
                & (cells["errors"] == 0) & cells["output_tps"].notna()
            cells["measured"] = complete
            frames.append(cells)
    if not frames:
        return pd.DataFrame(columns=["run", "stage", "arm", "concurrency", "repeat",
                                     "output_tps", "measured", *LATENCIES])
    return pd.concat(frames, ignore_index=True)


def serving_points(cells: pd.DataFrame) -> pd.DataFrame:
    """Per run, stage, arm and concurrency: output tok/s median with the repeats' spread, and the
    latency percentiles' medians, over the measured cells only."""
    measured = cells[cells["measured"]]
    if measured.empty:
        return pd.DataFrame(columns=["run", "stage", "arm", "concurrency", "repeats",
                                     "output_tps", "output_tps_min", "output_tps_max",
                                     *LATENCIES])
    grouped = measured.groupby(["run", "stage", "arm", "concurrency"])
    points = grouped["output_tps"].agg(["median", "min", "max", "count"]).rename(columns={
        "median": "output_tps", "min": "output_tps_min", "max": "output_tps_max",
        "count": "repeats"})
    points = points.join(grouped[list(LATENCIES)].median())
    return points.reset_index()


def lever_ratios(runs: list[Run]) -> pd.DataFrame:
    """Every A/B ratio (05's backend A/B, 06's levers) of every run that may feed results, with
    each paired round's own ratio; an interval only from MIN_ROUNDS_FOR_INTERVAL rounds."""
    rows = []
    for run in runs:
        if not _vllm_served(run):
            continue
        for stage in SERVING_STAGES:
            path = run.path / stage / "ratios.json"
            if not path.exists():
                continue
            for r in evidence.read_json(path):
                a, b = r.get("a_tps") or [], r.get("b_tps") or []
                rounds = [y / x for x, y in zip(a, b) if x]
                with_interval = r["ratio"] is not None and r["n"] >= MIN_ROUNDS_FOR_INTERVAL
                rows.append({
                    "run": run.run_id, "stage": stage, "lever": f"{r['b']} / {r['a']}",
                    "shape": r.get("shape", ""), "concurrency": r["concurrency"],
                    "rounds": r["n"], "ratio": r["ratio"],
                    "low": r["low"] if with_interval else None,
                    "high": r["high"] if with_interval else None,
                    "each_round": rounds,
                    "why_not": "" if r["ratio"] is not None else not_measured_reason(
                        run.path / stage, r["b"])})
    return pd.DataFrame(rows, columns=["run", "stage", "lever", "shape", "concurrency", "rounds",
                                       "ratio", "low", "high", "each_round", "why_not"])


def not_measured_reason(stage_dir: Path, arm: str) -> str:
    """Why an arm has no figure: where its server's log says why it died, that line and the
    step it was running; else the first FAIL gate that names the arm, else the stage's first."""
    slug = arm.lower().replace("+", "-").replace(", ", "-").replace(" ", "-")
    for log in sorted(stage_dir.glob(f"vllm-{slug}*.log")):
        text = log.read_text(encoding="utf-8", errors="replace")
        fatal = vllm_logs.first_fatal_line(text, log_name=log.name)
        if fatal:
            step = vllm_logs.crashed_step(text, log_name=log.name)
            return (f"the server died serving: {fatal[:200]}"
                    + (f"; {vllm_logs.describe_step(step)}" if step else ""))
    failed = [g for g in evidence.read_gates(stage_dir) or [] if g["status"] == "FAIL"]
    named = [g for g in failed if arm in g["gate"] or slug in g["gate"]]
    first = (named or failed or [None])[0]
    if first is None:
        return "no paired round completed"
    reason = " ".join(evidence.without_terminal_codes(first["reason"]).split())
    return f"{first['gate']}: {reason[:200]}"
