"""Tables and pages for the book, from evidence only (a run directory), never from the world."""
from __future__ import annotations

import re
from pathlib import Path

import pandas as pd

from lib.core import evidence
from lib.stages.registry import STAGES


def run_record(run_dir: Path) -> dict:
    return evidence.read_json(Path(run_dir) / "run.json")


def gates_table(run_dir: Path) -> pd.DataFrame:
    rows = []
    for stage in STAGES:
        for g in evidence.read_gates(Path(run_dir) / stage) or []:
            rows.append({"stage": stage, **g})
    return pd.DataFrame(rows, columns=["stage", "gate", "status", "observed", "expected",
                                       "reason", "evidence"])


def stage_summary(run_dir: Path) -> pd.DataFrame:
    rows = []
    for stage in STAGES:
        gates = evidence.read_gates(Path(run_dir) / stage)
        if gates is None:
            rows.append({"stage": stage, "PASS": 0, "FAIL": 0, "SKIP": 0, "state": "not run"})
            continue
        counts = evidence.summarize_gates(gates)
        state = "FAIL" if counts["FAIL"] else ("PASS" if counts["PASS"] else "SKIP")
        rows.append({"stage": stage, **counts, "state": state})
    return pd.DataFrame(rows)


def _md_cell(v) -> str:
    text = ", ".join(map(str, v)) if isinstance(v, list) else ("" if v is None else str(v))
    return text.replace("|", "\\|").replace("\n", " ")


def _md_table(df: pd.DataFrame) -> str:
    head = "| " + " | ".join(df.columns) + " |\n|" + "---|" * len(df.columns) + "\n"
    return head + "".join("| " + " | ".join(_md_cell(v) for v in row) + " |\n"
                          for row in df.itertuples(index=False))


def verification_level(run: dict) -> str:
    sha = (run.get("guide") or {}).get("git_sha") or "not recorded (no git history where it ran)"
    if run.get("level"):  # what the run's place was when it was not real hardware, as recorded
        return (f"{run['level']}; run `{run['run_id']}` on the `{run['context']}` context, "
                f"guide `{sha}`")
    return (f"measured here end-to-end, run `{run['run_id']}` on the `{run['context']}` context "
            f"({run.get('platform', 'unknown platform')}), guide `{sha}`")


def run_page(run_dir: Path) -> str:
    run_dir = Path(run_dir)
    run = run_record(run_dir)
    problems = evidence.verify(run_dir)
    sealed = "verified: every file matches SHA256SUMS" if not problems else (
        "NOT verified: " + "; ".join(problems[:5]))
    gates = gates_table(run_dir)
    gates["evidence"] = gates["evidence"].map(lambda e: ", ".join(f"`{p}`" for p in e or []))
    return (
        f"# The run this book shows\n\n"
        f"Verification level of every number on the stage pages: **{verification_level(run)}**.\n\n"
        f"| | |\n|---|---|\n| run | `{run['run_id']}` |\n| created (UTC) | {run['created_utc']} |\n"
        f"| context | `{run['context']}` |\n| seed | {run['seed']} |\n"
        f"| guide git SHA | `{(run['guide'] or {}).get('git_sha')}` "
        f"(uncommitted changes: {(run['guide'] or {}).get('dirty')}) |\n"
        f"| pins digest (sha256 of pins.yaml) | `{run['pins_digest']}` |\n"
        f"| evidence | `results/{run['run_id']}/`, {sealed} |\n"
        f"| audit | `{run['replay_with']} pytest --nbval results/{run['run_id']}/notebooks/` |\n\n"
        f"## Stages\n\n{_md_table(stage_summary(run_dir))}\n"
        f"A SKIP always carries its reason; a FAIL stops the stages that depend on it.\n\n"
        f"## Every gate\n\n{_md_table(gates)}"
    )


def comparison_page(run_dir: Path) -> str:
    from lib.measure import published

    run_dir = Path(run_dir)
    runs = [run_dir] + [run_dir.parent / r for r in replayed_notebooks(run_dir.parent)
                        if r != run_dir.name]
    out = [
        "# Comparison with published figures\n",
        "Each published figure (cited, with its source and date) beside a run's value, the "
        "ratio, and a flag outside +/-10 percent.\n",
        "The hardware differs unless a run says otherwise: the published figures are from 2x "
        "p5en (16 H200, EFA, DeepEP's own test_ep and vLLM). The runs here measured the "
        "kernel with this guide's torch benchmark (`lib.bench.moe_a2a`, the same shape and "
        "meaning of its parameters, not DeepEP's kernels) or, where a run's line says so, with "
        "DeepEP V2's own test_ep: the same kernels and shape, but EP2 over one machine's NVLink "
        "with GIN off, against EP16 across two nodes over EFA, so its kernel figures are "
        "expected to be far lower; they served either through "
        "`transformers serve` (a tiny model: its serving rows are not comparable at all) or "
        "through vLLM 0.24.0 on one machine's GPUs over NVLink (EP over 2 GPUs, not 16 over "
        "EFA; a 2-layer random-weight model at the default model's per-layer shape, not the "
        "full model), as each run's line below says. A ratio across them is shown for "
        "orientation, never as a result.\n",
    ]
    sources = published.reference_figures()[["hardware", "date", "source"]].drop_duplicates()
    out.append("Cited: " + "; ".join(f"`{r.source}`, {r.hardware}, {r.date}"
                                     for r in sources.itertuples()) + ".\n")
    for run in runs:
        record = run_record(run)
        table = published.compare(run_figures(run))
        table = pd.DataFrame({
            "figure": table["figure"], "published": table["reference"], "unit": table["unit"],
            "this run": table["run"].map(lambda v: "not measured" if pd.isna(v) else f"{v:.1f}"),
            "ratio": table["ratio"].map(lambda v: "" if pd.isna(v) else f"{v:.2f}"),
            "flag": table["flag"], "date": table["date"],
        })
        out.append(f"## Run `{run.name}`\n\n{verification_level(record)}. "
                   f"{run_setup(run)}\n")
        out.append(_md_table(table))
    return "\n".join(out)


def run_setup(run_dir: Path) -> str:
    """What a run measured with, from its evidence: the kernel implementation and the engine."""
    run_dir = Path(run_dir)
    parts = []
    kernel = run_dir / "03_kernel_test" / "result.json"
    if kernel.exists():
        cfg = evidence.read_json(kernel).get("config", {})
        if _deepep_figures(run_dir):
            parts.append(f"Kernel: DeepEP's own test_ep (EP{cfg.get('world_size')} over NVLink "
                         "on one machine, GIN off), its figures in the table; the torch "
                         "benchmark beside it.")
        else:
            parts.append(f"Kernel: the torch benchmark, {cfg.get('world_size')} ranks over "
                         f"{cfg.get('backend')}.")
    served = run_dir / "04_serve" / "vllm_serve.json"
    if served.exists():
        info = evidence.read_json(served)
        parts.append(f"Serving: vLLM, EP over {info.get('gpus')} GPUs, "
                     f"{info.get('backend')}, a 2-layer seeded model (not the published one).")
    elif (run_dir / "04_serve" / "gates.json").exists():
        parts.append("Serving: transformers serve, a tiny seeded model.")
    return " ".join(parts)


def run_figures(run_dir: Path) -> dict[str, float]:
    """The run's figures named as in the published table, from its evidence files only."""
    from lib.measure import published

    figures: dict[str, float] = {}
    kernel = Path(run_dir) / "03_kernel_test" / "result.json"
    if kernel.exists():
        result = evidence.read_json(kernel)
        if result.get("correct"):
            phases = result.get("phases_us") or {}
            figures.update(published.figures_from_microbench(
                {name: stats for name, stats in phases.items()},
                (phases.get("dispatch_combine") or {}).get("p50")))
    # DeepEP's own kernels, where the run has them, are what the published figures measured
    figures.update(_deepep_figures(run_dir))
    summary = Path(run_dir) / "05_sweep" / "summary.csv"
    if summary.exists():
        figures.update(published.figures_from_summary(pd.read_csv(summary)))
    return figures


def _deepep_figures(run_dir: Path) -> dict[str, float]:
    from lib.measure import published

    gates = Path(run_dir) / "03_kernel_test" / "gates.json"
    return published.figures_from_test_ep_gates(evidence.read_json(gates)) if gates.exists() else {}


REPLAYED_LIST = "REPLAYED"  # results/REPLAYED: notebooks of further reference runs nbval replays


def replayed_notebooks(results: Path) -> dict[str, list[str]]:
    """Further reference runs and which of their notebooks `make test` replays."""
    listing = Path(results) / REPLAYED_LIST
    runs: dict[str, list[str]] = {}
    if listing.exists():
        for line in listing.read_text(encoding="utf-8").split():
            parts = Path(line).parts  # results/<run>/notebooks/<stage>.ipynb
            runs.setdefault(parts[1], []).append(Path(line).stem)
    return runs


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


def reference_runs_page(results: Path) -> str:
    """Every further reference run: what it is, its stages, its figures, what replays."""
    results = Path(results)
    out = ["# Further reference runs\n",
           "Runs recorded on other hardware and committed beside the CPU reference run. Each is "
           "checked through its evidence (gates, SHA256SUMS, tables re-computed here); the "
           "notebooks listed as replayed are re-executed by `make test` against their "
           "transcript. A notebook recorded with an older version of the guide is shown, "
           "labelled with the guide version that recorded it, and not replayed.\n"]
    for run_id, replayed in replayed_notebooks(results).items():
        run_dir = results / run_id
        run = run_record(run_dir)
        problems = evidence.verify(run_dir)
        out.append(f"## `{run_id}`\n")
        out.append(f"Verification level: **{verification_level(run)}**. Evidence "
                   f"`results/{run_id}/`: "
                   f"{'every file matches SHA256SUMS' if not problems else 'NOT verified'}. "
                   f"Replayed by `make test`: {', '.join(replayed)}.\n")
        notes = results / f"{run_id}.notes.md"  # beside the sealed run, never inside it
        if notes.exists():
            out.append(notes.read_text(encoding="utf-8") + "\n")
        out.append(_md_table(stage_summary(run_dir)))
        kernel = kernel_figures(run_dir)
        if kernel:
            out.append("\n### Kernel test (03)\n")
            out.append(_md_table(pd.DataFrame([kernel]).T.reset_index().rename(
                columns={"index": "figure", 0: "value"})))
        ratio_path = run_dir / "06_multicomm" / "ratio.json"
        if ratio_path.exists():
            ratio = evidence.read_json(ratio_path)
            out.append(f"\n### Lever (06)\n\n{ratio['b']} / {ratio['a']} dispatch+combine p50: "
                       f"**{ratio['ratio']:.2f}** (95% interval {ratio['low']:.2f} to "
                       f"{ratio['high']:.2f}, {ratio['method']}).\n")
        out += vllm_sections(run_dir)
        failed = gates_table(run_dir)
        failed = failed[failed.status == "FAIL"]
        if len(failed):
            out.append("\n### FAIL gates, as recorded\n")
            out.append(_md_table(failed_gate_rows(failed)))
    return "\n".join(out)


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
