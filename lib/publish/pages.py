"""The book's generated pages: the landing page's answers, the results page, the appendix (the
run history and a page per run) and the comparison (the coverage: lib.publish.coverage).

Every number comes from lib.publish.results (evidence, through the catalog) or from
lib.measure.published (cited, with source and date). A number whose evidence is missing or whose
gates failed is written NOT_MEASURED with its reason.
"""
from __future__ import annotations

import re
from pathlib import Path

import pandas as pd

from lib.core import evidence
from lib.measure import published
from lib.measure.stats import MIN_ROUNDS_FOR_INTERVAL
from lib.publish import answers as answer_words
from lib.publish import plots, report, sources, training
from lib.publish import results as figures
from lib.publish.catalog import END_TO_END, Run, by_id
from lib.stages.registry import STAGES

NOT_MEASURED = "not measured"
QUESTIONS = (
    ("works", "Does DeepEP-V2's expert-parallel all-to-all work, kernel and served with vLLM?"),
    ("fast", "How fast is it, kernel and served?"),
    ("beats", "When does it beat vLLM's default all-to-all (allgather_reducescatter), and do the "
              "levers (CUDA graphs, EP_NUM_COMMS) pay?"),
    ("trains", "Does a training step's all-to-all work?"),
)
CITED = f"cited: {published.SOURCE}"


def run_link(run_id: str, prefix: str = "") -> str:
    return f"[`{run_id}`]({prefix}runs/{run_id}.md)"


def _md_table(df: pd.DataFrame) -> str:
    return report._md_table(df)  # the one markdown-table writer (escapes pipes and newlines)


def _latest(runs: list[Run], keep) -> Run | None:
    chosen = [r for r in runs if r.feeds_results and keep(r)]
    return chosen[-1] if chosen else None


def _level(run: Run) -> str:
    return f"{END_TO_END} ({run.hardware})" if run.level == END_TO_END else run.level


# --- the evidence per question -------------------------------------------------------------

class Evidence:
    """The best evidence for each question, computed once per build from the catalog."""

    def __init__(self, runs: list[Run]):
        self.runs = runs
        self.kernel = figures.kernel_points(runs)
        self.cells = figures.serving_cells(runs)
        self.serving = figures.serving_points(self.cells)
        self.ratios = figures.lever_ratios(runs)
        self.published_kernel = figures.published_kernel_point()
        self.kernel_run = _latest(runs, lambda r: r.stages.get("03_kernel_test") == "PASS"
                                  and (r.path / "03_kernel_test" / "test_ep.json").exists())
        self.deepep_serve = _latest(runs, lambda r: r.serving == "vLLM, deepep_v2"
                                    and r.stages.get("04_serve") == "PASS")

    def kernel_row(self, series: str, tokens: int) -> float | None:
        if self.kernel_run is None:
            return None
        rows = self.kernel[(self.kernel["run"] == self.kernel_run.run_id)
                           & (self.kernel["series"] == series) & (self.kernel["tokens"] == tokens)]
        return float(rows["p50_us"].iloc[0]) if len(rows) else None

    def why_no_kernel(self) -> str:
        tried = [r.run_id for r in self.runs if (r.path / "03_kernel_test" / "test_ep.json").exists()]
        if not tried:
            return "no recorded run has DeepEP's test_ep (03 with a DeepEP build)"
        return ("no run that may feed results has a passing 03 with test_ep (runs with test_ep: "
                + ", ".join(tried) + ")")


def sets_said(ev: "Evidence", run_ids) -> str:
    """The pin sets of the runs behind a figure, said under it."""
    sets = sorted({r.pin_set for r in ev.runs if r.run_id in set(run_ids)})
    return "Pin set" + ("s" if len(sets) > 1 else "") + ": " + ", ".join(f"`{x}`" for x in sets) \
        + " ([pin sets](pin_sets.md))."


class Notes:
    """Reasons too long for a table cell (a log line quoted whole, a path): the cell names a
    numbered note and the notes follow the table, each reason once, so that no table is wider
    than the page's column (tests/test_book_browser.py measures it at a 1400-pixel window)."""

    LONGEST_CELL = 80   # characters of a reason kept in its cell
    LONGEST_WORD = 24   # characters of one unbroken word (a path does not wrap)

    def __init__(self):
        self.reasons: list[str] = []

    def said(self, reason: str) -> str:
        """The reason itself where it fits a cell, else "note N" (N from 1, in order)."""
        words = reason.replace("-", " ").replace("_", " ").split()
        if len(reason) <= self.LONGEST_CELL and all(len(w) <= self.LONGEST_WORD for w in words):
            return reason
        if reason not in self.reasons:
            self.reasons.append(reason)
        return f"note {self.reasons.index(reason) + 1}"

    def markdown(self) -> str:
        """The notes as a numbered list (empty when every reason fitted its cell)."""
        if not self.reasons:
            return ""
        return "\nNotes:\n\n" + "\n".join(f"{i}. {r}" for i, r in
                                           enumerate(self.reasons, start=1)) + "\n"


def figure_md(spec, prefix: str = "figures/") -> str:
    """A figure as a page shows it: the image with its alt text, its caption, its data."""
    return (f"![{spec.alt}]({prefix}{spec.png})\n\n{spec.caption} Data: "
            f"[{spec.data}]({prefix}{spec.data}).\n")


def dropdown(title: str, body: str) -> str:
    """Details a reader opens when they want them (sphinx-design's dropdown)."""
    return f"\n:::{{dropdown}} {title}\n\n{body}\n:::\n"


def _fmt(value: float | None, digits: int = 1, unit: str = "") -> str:
    return NOT_MEASURED if value is None or pd.isna(value) else f"{value:.{digits}f}{unit}"


# --- landing page ---------------------------------------------------------------------------

def answers(ev: Evidence) -> list[list[str]]:
    """Per question, its answer in one line (the direction and an absolute figure with its unit)
    and then the lines it rests on: each figure with its verification level and its run, the
    failures that answer the question, the cited EFA figures beside ours. Every word of
    direction is computed from the evidence (lib.publish.answers)."""
    return [works_answer(ev), fast_answer(ev), beats_answer(ev),
            training.training_answer(ev.runs, run_link)]


def _graphs_on(ev: Evidence, backend: str) -> pd.DataFrame:
    rows = ev.ratios[ev.ratios["lever"] == "graphs+EP / eager+EP"]
    return rows[[by_id(ev.runs)[r].serving.endswith(backend) for r in rows["run"]]] \
        if len(rows) else rows


def works_answer(ev: Evidence) -> list[str]:
    pub = ev.published_kernel
    cited = (f"Across p5en nodes over EFA: {NOT_MEASURED} here; the public reproduction reports "
             f"16 of 16 ranks passing ({CITED}, {pub['date']}).")
    if not (ev.kernel_run and ev.deepep_serve):
        missing = ev.why_no_kernel() if not ev.kernel_run else "no passing deepep_v2 serve"
        return [f"**{NOT_MEASURED} here** ({missing}).", cited]
    tokens = sorted(set(ev.kernel[ev.kernel["run"] == ev.kernel_run.run_id]["tokens"]))
    engine = figures.engine_said(ev.deepep_serve, "04_serve")
    failed = _graphs_on(ev, "deepep_v2")
    failed = failed[failed["ratio"].isna()]
    lines = [f"**Yes on one host{', eager only' if len(failed) else ''}**: DeepEP's test_ep "
             f"passes its correctness checks on every rank at {', '.join(map(str, tokens))} "
             f"tokens ({run_link(ev.kernel_run.run_id)}), and {engine} serves with "
             f"`--all2all-backend deepep_v2 --enforce-eager`, proven in its log "
             f"({run_link(ev.deepep_serve.run_id)}); {END_TO_END}, 2x H200 over NVLink."]
    if len(failed):
        run = failed["run"].iloc[-1]
        why = " ".join(str(failed["why_not"].iloc[-1]).split())[:140]
        lines.append(f"**With CUDA graphs it does not**: "
                     f"{figures.engine_said(by_id(ev.runs)[run], '06_multicomm')} on deepep_v2 "
                     f"served no request ({run_link(run)}, {END_TO_END}: {why}); vLLM #52894 "
                     "reports the same mode crashing upstream.")
    return lines + [cited]


def fast_answer(ev: Evidence) -> list[str]:
    pub = ev.published_kernel
    served = ev.serving[(ev.serving["stage"] == "05_sweep")
                        & (ev.serving["backend"] == "deepep_v2")] \
        if "backend" in ev.serving else ev.serving.iloc[0:0]
    if ev.kernel_run:
        at = {t: ev.kernel_row("DeepEP test_ep", t) for t in (128, 512, 4096)}
        kernel = (f"Kernel: test_ep dispatch+combine p50 **{' / '.join(_fmt(v) for v in at.values())}"
                  f" us** at {' / '.join(map(str, at))} tokens per rank, EP 2 over NVLink on "
                  f"2x H200 ({END_TO_END}, {run_link(ev.kernel_run.run_id)}).")
    else:
        kernel = f"Kernel: {NOT_MEASURED} here ({ev.why_no_kernel()})."
    lines = [kernel]
    if len(served):
        best = served.loc[served["output_tps"].idxmax()]
        run = by_id(ev.runs)[best["run"]]
        shape = f" ({best['shape_said']})" if best.get("shape_said") else ""
        lines.append(f"Served: {best['engine']} with deepep_v2, **{best['output_tps']:.0f} output "
                     f"tok/s, {best['output_tps_per_gpu']:.0f} per GPU**, at concurrency "
                     f"{best['concurrency']}{shape}, serving {answer_words.served_model(run.path)}"
                     f" (the default model's per-layer shape) on {best['place']} over NVLink "
                     f"({END_TO_END}, {run_link(run.run_id)}).")
    else:
        lines.append(f"Served: {NOT_MEASURED} here (no vLLM deepep_v2 sweep on GPUs).")
    epnc1, epnc8 = (published_serving("epnc1", 32), published_serving("epnc8", 32))
    gpus = published_gpus()
    lines.append(f"Across 2x p5en over EFA, EP 16 ({CITED}): test_ep {pub['p50_us']:.1f} us at "
                 f"{pub['tokens']} tokens ({pub['date']}); Qwen3-30B-A3B-FP8 served at "
                 f"concurrency 32, {epnc1['output_tps']:.1f} tok/s ({epnc1['output_tps'] / gpus:.1f}"
                 f" per GPU, ITL p50 {epnc1['itl_p50_ms']:.0f} ms) with EP_NUM_COMMS 1 and "
                 f"{epnc8['output_tps']:.1f} ({epnc8['output_tps'] / gpus:.1f} per GPU, ITL p50 "
                 f"{epnc8['itl_p50_ms']:.0f} ms) with 8 (2026-07-07). Another model, transport "
                 "and scale than ours: set beside, never divided.")
    return lines


def published_gpus() -> int:
    """The GPUs of the public reproduction's serve, as its hardware line says them ("16x H200")."""
    return int(re.search(r"(\d+)x H\d+", published.HARDWARE).group(1))


def published_serving(arm: str, concurrency: int) -> dict:
    table = published.reference_figures().set_index("figure")["value"]
    return {metric: float(table[published.serving_figure_name(arm, concurrency, metric)])
            for metric in ("output_tps", "itl_p50_ms")}


def _lever_cells(ev: Evidence, rows: pd.DataFrame) -> tuple[str, list]:
    """The latest run's measured cells of one lever."""
    rows = rows[rows["ratio"].notna()]
    if not len(rows):
        return "", []
    run = rows["run"].iloc[-1]
    return run, answer_words.cells_of(rows[rows["run"] == run])


def beats_answer(ev: Evidence) -> list[str]:
    ratios = ev.ratios
    run, cells = _lever_cells(ev, ratios[ratios["lever"] == "deepep_v2 / allgather_reducescatter"])
    lines, every = [], []
    if cells:
        every += cells
        lines.append(answer_words.comparison("deepep_v2", "allgather_reducescatter", cells,
                                             how_sure=False, unstable=False)
                     + f"; output tok/s, {figures.engine_said(by_id(ev.runs)[run], '05_sweep')}"
                       f" on 2x H200 ({END_TO_END}, {run_link(run)}).")
        unstable = answer_words.unstable_said("deepep_v2", "allgather_reducescatter", cells)
        if unstable:
            lines.append(unstable[0].upper() + unstable[1:] + ".")
    else:
        lines.append(f"**deepep_v2 against allgather_reducescatter: {NOT_MEASURED} here.**")
    run, cells = _lever_cells(ev, _graphs_on(ev, "allgather_reducescatter"))
    if cells:
        every += cells
        lines.append("CUDA graphs: " + answer_words.comparison(
            "graphs+EP", "eager+EP", cells, how_sure=False).replace("**", "")
            + f" on allgather_reducescatter ({run_link(run)}); on deepep_v2 graphs serve nothing "
              "(question 1).")
    run, cells = _lever_cells(ev, ratios[ratios["lever"] == "eager, no EP / eager+EP"])
    if cells:
        every += cells
        backend = by_id(ev.runs)[run].serving.replace("vLLM, ", "")
        lines.append("Expert parallelism itself: " + answer_words.comparison(
            "eager without EP", "eager+EP", cells, how_sure=False).replace("**", "")
            + f" on {backend} ({run_link(run)}).")
    epnc = published_epnc_ratio()
    lines.append(f"EP_NUM_COMMS 8 against 1: {NOT_MEASURED} here (a lever of DeepEP's GIN across "
                 f"nodes; one host runs with GIN off); cited {epnc:.2f}x output tok/s at "
                 f"concurrency 32 on 2x p5en, one run per arm ({CITED}, 2026-07-07).")
    if every:
        lines.append(f"How sure: {answer_words.how_sure_said(every)}; every round is on the "
                     "results page.")
    return lines


def graphs_backend(ev: Evidence, run_id: str) -> str:
    return by_id(ev.runs)[run_id].serving.replace("vLLM, ", "backend ")


def published_epnc_ratio(concurrency: int = 32) -> float:
    table = published.reference_figures().set_index("figure")["value"]
    return (table[published.serving_figure_name("epnc8", concurrency, "output_tps")]
            / table[published.serving_figure_name("epnc1", concurrency, "output_tps")])


def landing_page(template: str, ev: Evidence) -> str:
    """The template's `<!-- answers -->` replaced: per question a heading, its one-line answer,
    then the lines it rests on as a list."""
    out = []
    for i, ((anchor, question), lines) in enumerate(zip(QUESTIONS, answers(ev)), start=1):
        out.append(f"## {i}. {question}\n\n{lines[0]}\n")
        out += [f"- {line}" for line in lines[1:]]
        out.append(f"\nThe evidence, with plots: {{ref}}`results <{anchor}>`.\n")
    return template.replace("<!-- answers -->", "\n".join(out))


# --- results page ---------------------------------------------------------------------------

def results_page(ev: Evidence, figures_dir: Path) -> str:
    out = ["# Results\n",
           "The best evidence for each of the guide's questions, computed from the committed runs "
           "at build time. Only runs on real GPUs recorded on the place they name feed this page; "
           "runs with simulated nodes or a tiny served model are in the "
           "[appendix](history.md) with their level. Each row links to its run's page.\n"]
    out += works_section(ev)
    out += fast_section(ev, figures_dir)
    out += beats_section(ev, figures_dir)
    out += bounds_section(ev, figures_dir)
    out += training.training_section(ev.runs, figures_dir, run_link)
    return "\n".join(out)


def evidence_cell(run: Run | None, engine: str, why_not: str = "") -> str:
    """One cell naming a row's run, hardware, engine and level (a narrow table reads on a page)."""
    if run is None:
        return why_not
    return (f"{run_link(run.run_id)}; {run.hardware}; {engine}; pin set `{run.pin_set}`; "
            f"{_level(run)}")


def works_section(ev: Evidence) -> list[str]:
    rows = []
    run = ev.kernel_run
    rows.append({"claim": "DeepEP V2's kernels run and are correct (DeepEP's own test_ep, and "
                          "the guide's torch benchmark checked against a reference)",
                 "result": "PASS" if run else NOT_MEASURED,
                 "evidence": evidence_cell(run, "DeepEP test_ep, EP2, GIN off",
                                           ev.why_no_kernel())})
    serve = ev.deepep_serve
    detail = ""
    if serve:
        info = evidence.read_json(serve.path / "04_serve" / "vllm_serve.json")
        detail = (f" (ready {info.get('ready_s')} s; "
                  f"{', '.join(info.get('backend_gates') or [])})")
    rows.append({"claim": "vLLM serves with `--all2all-backend deepep_v2`, proven by its log "
                          "(manager, prepare/finalize, EP split, no fallback)",
                 "result": f"PASS{detail}" if serve else NOT_MEASURED,
                 "evidence": evidence_cell(serve, serve.serving if serve else "",
                                           "no run that may feed results has a passing 04 on "
                                           "deepep_v2")})
    graphs = ev.ratios[(ev.ratios["lever"] == "graphs+EP / eager+EP")]
    notes = Notes()
    for run_id, rows_of_run in graphs.groupby("run", sort=False):
        run = by_id(ev.runs)[run_id]
        measured = rows_of_run["ratio"].notna().all()
        why = rows_of_run["why_not"].iloc[0]
        rows.append({"claim": f"vLLM with CUDA graphs on {run.serving.replace('vLLM, ', '')}",
                     "result": "PASS: served every cell" if measured else
                               f"FAIL: {notes.said(why)}",
                     "evidence": evidence_cell(run, run.serving)})
    rows.append({"claim": "across p5en nodes over EFA (EP16, GIN through aws-ofi-nccl)",
                 "result": f"{NOT_MEASURED} here: no p5en cluster was lent; the Kubernetes and "
                           "Slurm paths are tested on a real control plane and a real scheduler "
                           "(see the appendix)",
                 "evidence": f"{published.HARDWARE}; DeepEP test_ep and vLLM; {CITED}, "
                             "2026-07-06: works"})
    return ["(works)=", "## 1. Does it work?\n", _md_table(pd.DataFrame(rows)), notes.markdown(),
            "\nThe answers check (each arm asked the same greedy prompts, `lib.measure.agreement`)"
            " came after the GPU runs above: none of them carries it yet.\n"]


def fast_section(ev: Evidence, figures_dir: Path) -> list[str]:
    out = ["(fast)=", "## 2. How fast?\n", "### Kernel\n"]
    kernel = ev.kernel
    if kernel.empty:
        out.append(f"{NOT_MEASURED}: {ev.why_no_kernel()}.\n")
    else:
        plots.kernel_plot(kernel, ev.published_kernel, figures_dir)
        out.append(figure_md(plots.kernel_spec(kernel, ev.published_kernel)))
        out.append(sets_said(ev, kernel["run"]) + "\n")
        table = kernel.pivot_table(index=["run", "tokens"], columns="series",
                                   values="p50_us").round(1).reset_index()
        sets = {r.run_id: r.pin_set for r in ev.runs}
        table.insert(1, "pin set", table["run"].map(sets))
        table["run"] = table["run"].map(run_link)
        out.append(dropdown(f"Every kernel figure: {len(table)} rows (run, tokens, series)",
                            _md_table(table.astype(object).where(table.notna(), NOT_MEASURED))))
        pub = ev.published_kernel
        out.append(f"\nEvery run: 2x H200 over NVLink, EP2, GIN off ({END_TO_END}); the star is "
                   f"{pub['series']} at {pub['tokens']} tokens, {pub['p50_us']:.1f} us "
                   f"({pub['hardware']}; {pub['source']}, {pub['date']}): the same kernels and "
                   "shape on other hardware, shown for scale, not compared.\n")
    out += ["(served)=", "### Served\n"]
    if ev.serving.empty:
        out.append(f"{NOT_MEASURED}: no vLLM run that may feed results has a sweep.\n")
        return out
    plots.serving_plot(ev.serving, figures_dir)
    plots.latency_plot(ev.serving, figures_dir)
    first = ev.serving.iloc[0]
    out.append(f"{first['engine']}, DP = EP = {first['gpus']} on {first['place']} over NVLink, "
               "a seeded model of the default model's per-layer shape (not the full model), "
               f"AIPerf against the server: {END_TO_END}. Output tok/s is read per GPU. Not "
               "comparable with the public 2x p5en serving figures (other model and hardware): "
               "see [comparison](comparison.md).\n")
    served = plots.serving_figures(ev.serving)
    more = served[1:] + plots.latency_figures(ev.serving)
    out.append(figure_md(served[0]))
    if more:
        out.append(dropdown(f"{len(more)} more served figures: the other comparisons' "
                            "output tok/s per GPU, and every comparison's latencies",
                            "\n".join(figure_md(spec) for spec in more)))
    out.append(sets_said(ev, ev.serving["run"]) + "\n")
    sets = {r.run_id: r.pin_set for r in ev.runs}
    table = pd.DataFrame({
        "run": ev.serving["run"].map(run_link), "pin set": ev.serving["run"].map(sets),
        "stage": ev.serving["stage"].str[:2],
        "arm": ev.serving["arm"], "c": ev.serving["concurrency"],
        "output tok/s (min to max)": [f"{m:.0f} ({lo:.0f} to {hi:.0f}), {n} repeats" for m, lo, hi, n
                                      in zip(ev.serving["output_tps"], ev.serving["output_tps_min"],
                                             ev.serving["output_tps_max"], ev.serving["repeats"])],
        "per GPU": [f"{v:.0f}" if pd.notna(v) else NOT_MEASURED
                    for v in ev.serving.get("output_tps_per_gpu", pd.Series(dtype=float))],
        "TTFT p50 / p99 (ms)": [f"{a:.0f} / {b:.0f}" for a, b in
                                zip(ev.serving["ttft_p50_ms"], ev.serving["ttft_p99_ms"])],
        "ITL p50 / p99 (ms)": [f"{a:.1f} / {b:.1f}" for a, b in
                               zip(ev.serving["itl_p50_ms"], ev.serving["itl_p99_ms"])]})
    out.append(dropdown(f"Every served cell: {len(table)} rows (run, arm, concurrency)",
                        _md_table(table)))
    dropped = ev.cells[~ev.cells["measured"]]
    if len(dropped):
        counts = dropped.groupby(["run", "stage", "arm"]).size()
        out.append(f"\n{len(dropped)} AIPerf cells are not plotted (errors, or fewer completed "
                   "than requested): " + "; ".join(
                       f"{run_link(run)} {stage[:2]} {arm}: {n}"
                       for (run, stage, arm), n in counts.items()) + ".\n")
    out.append("Data: [serving.csv](figures/serving.csv).\n")
    return out


def beats_section(ev: Evidence, figures_dir: Path) -> list[str]:
    out = ["(beats)=", "## 3. When does it beat allgather_reducescatter, and do the levers pay?\n"]
    ratios = ev.ratios
    if ratios["ratio"].notna().any():
        plots.lever_plot(ratios, figures_dir)
        out.append(figure_md(plots.lever_spec(ratios)))
        out.append(sets_said(ev, ratios["run"]) + "\n")
    notes = Notes()
    out += [dropdown(f"Every ratio: {len(ratios)} rows (lever, cell, rounds)",
                     _md_table(lever_table(ev, notes)) + "\n" + notes.markdown())]
    epnc = published_epnc_ratio()
    out.append(f"\nA round pairs the two arms measured back to back, so each round's b / a is "
               f"read beside the ratio of medians; with fewer than {MIN_ROUNDS_FOR_INTERVAL} "
               f"rounds no interval is drawn. All measured on 2x H200 over NVLink, vLLM 0.24.0, a "
               f"2-layer model ({END_TO_END}).\n\n"
               f"EP_NUM_COMMS 8 against 1: {NOT_MEASURED} here. It is a lever of DeepEP's GIN "
               f"across nodes; one host runs with GIN off, and the Kubernetes run's arms are "
               f"simulated (appendix). Cited: {epnc:.2f}x output tok/s at concurrency 32 on "
               f"{published.HARDWARE} ({CITED}, 2026-07-07).\n")
    return out


def lever_table(ev: Evidence, notes: Notes) -> pd.DataFrame:
    """Each lever's ratio per cell, six columns wide: the shape with its concurrency, the rounds
    with their interval, the run with its pin set; a reason too long for a cell in `notes`."""
    ratios = ev.ratios
    sets = {r.run_id: r.pin_set for r in ev.runs}
    return pd.DataFrame({
        "b / a": ratios["lever"],
        "shape, c": [f"{shape}, c{c}" if shape else f"c{c}"
                     for shape, c in zip(ratios["shape"], ratios["concurrency"])],
        "ratio": [(_fmt(r, 3) if pd.notna(r) else f"{NOT_MEASURED}: {notes.said(why)}")
                  for r, why in zip(ratios["ratio"], ratios["why_not"])],
        "interval (95%)": [f"{lo:.3f} to {hi:.3f}, {n} rounds"
                           if lo is not None and pd.notna(lo) else
                           f"{n} rounds: no interval (needs {MIN_ROUNDS_FOR_INTERVAL}); each "
                           "round plotted"
                           for lo, hi, n in zip(ratios["low"], ratios["high"], ratios["rounds"])],
        "each round": ratios["each_round"].map(lambda v: ", ".join(f"{x:.3f}" for x in v)),
        "run (pin set)": [f"{run_link(run)} ({sets.get(run, '')})" for run in ratios["run"]],
    })


# --- comparison ------------------------------------------------------------------------------

# The public tree's columns as a reader names them (a snake_case header does not wrap)
PUBLIC_TREE_HEADERS = {"run_folder": "run folder", "concurrency": "c",
                       "output_tps": "output tok/s", "ttft_p50_ms": "TTFT p50 (ms)",
                       "itl_p50_ms": "ITL p50 (ms)"}


def comparison_page(ev: Evidence, public_tree: pd.DataFrame | None) -> str:
    out = ["# Comparison with published figures\n",
           f"The public reproduction ({published.SOURCE}) measured {published.HARDWARE}. A "
           "figure of ours is set beside one of theirs only where the work is the same: the same "
           "kernels at the same shape. Everything else is said in one line, with why.\n",
           "## DeepEP test_ep, 128 tokens per rank, hidden 7168, top-8 of 256 experts\n"]
    table = published.reference_figures()
    micro = table[table["figure"].str.startswith("test_ep")]
    run = ev.kernel_run
    ours = published.figures_from_test_ep_gates(
        evidence.read_gates(run.path / "03_kernel_test") or []) if run else {}
    rows = [{"figure": r.figure, f"published ({r.date})": r.value,
             "ours": _fmt(ours.get(r.figure)),
             "ours / published": _fmt(ours[r.figure] / r.value, 3) if r.figure in ours else ""}
            for r in micro.itertuples()]
    out.append(_md_table(pd.DataFrame(rows)))
    out.append(f"\nOurs: {run_link(run.run_id) if run else NOT_MEASURED}, EP2 over NVLink on one "
               "host with GIN off, against EP16 across two nodes over EFA: the same kernels and "
               "shape, so the ratio says how much the cross-node path costs, not whether the "
               "reproduction holds. No tolerance band is applied.\n")
    out.append("## Not compared\n")
    out.append("- **The torch benchmark** (`lib.bench.moe_a2a`): the same shape, other kernels "
               "(two all_to_all_single calls); it is the guide's own baseline, in "
               "{ref}`results <fast>`.")
    out.append("- **Serving**: ours serve a 2-layer seeded model with vLLM 0.24.0 on one host; "
               "theirs serve Qwen/Qwen3-30B-A3B-FP8 across two p5en nodes. Different work: no "
               "ratio is meaningful.")
    out.append("- **CPU, Kubernetes and Slurm runs**: checks of the guide on this machine (gloo, "
               "a tiny model, simulated nodes): never compared with a cluster figure.\n")
    out.append("## The published serving figures, read from their results tree\n")
    if public_tree is None or public_tree.empty:
        out.append(f"{NOT_MEASURED}: the public results tree was not available at build time.\n")
    else:
        cols = [c for c in ("run_folder", "engine", "date", "arm", "concurrency", "output_tps",
                            "ttft_p50_ms", "itl_p50_ms") if c in public_tree]
        out.append(f"{CITED}; {published.HARDWARE}; read by `lib.measure.aiperf` from the "
                   "reproduction's own AIPerf exports, arms named from their folders:\n")
        out.append(_md_table(public_tree[cols].round(1).rename(columns=PUBLIC_TREE_HEADERS)))
    out.append(sources.comparison_efa_section())
    return "\n".join(out)


# --- parameters -----------------------------------------------------------------------------

def hostile_tally() -> tuple[int, int, list[str]]:
    """Every hostile value generated from each parameter's bound (lib.core.params), put through
    that parameter's own check at build time: how many were tried, how many were accepted, and
    which (none, or the page says so)."""
    from lib.core.params import checked, hostile_values
    from lib.core.errors import ParameterError
    from lib.stages.registry import PARAMS

    tried, accepted = 0, []
    for param in PARAMS.values():
        for value in hostile_values(param.rule):
            tried += 1
            try:
                checked(param, value)
            except ParameterError:
                continue
            accepted.append(f"{param.name} = {value!r}"[:120])
    return tried, len(accepted), accepted


def parameter_entries() -> list[dict[str, str]]:
    """Every parameter once, in the table's order, as the stages' typed models describe it: its
    type, what it does (the field's help), the stages whose model has it, what it allows (the
    words its refusal says) and its default per context."""
    from lib.core.param_model import type_said
    from lib.stages.registry import MODELS, PARAMS, STAGES, defaults_said

    entries = []
    for name, param in PARAMS.items():
        stages = [stage for stage in STAGES if name in MODELS[stage].model_fields]
        if not stages:  # in the table, taken by no stage: no notebook shows it
            continue
        field = MODELS[stages[0]].model_fields[name]
        entries.append({"name": name, "type": type_said(param.rule), "does": field.description,
                        "stages": "all" if len(stages) == len(STAGES)
                        else ", ".join(s[:2] for s in stages),
                        "allowed": field.json_schema_extra["allowed"],
                        "default": defaults_said(param)})
    return entries


def parameters_page() -> str:
    tried, accepted, which = hostile_tally()
    verdict = (f"**{accepted} accepted**" if not accepted else
               f"**{accepted} accepted**, a defect: " + "; ".join(which[:20]))
    entries = "\n\n".join(
        f"`{e['name']}`: {e['type']}, stages {e['stages']}\n"
        f":   {e['does'][0].upper() + e['does'][1:]}. **Allowed**: {e['allowed']}. "
        f"**Default**: {e['default']}."
        for e in parameter_entries())
    return ("# Parameters and their bounds\n\n"
            "Every parameter of every notebook: its type, what it does, the stages that take it, "
            "what it allows and its default per context. A value outside is refused in the "
            "notebook's first cell, before anything runs or is written, by an error that names "
            "the parameter and these words. Each stage's parameters are one typed, frozen model "
            "(`lib/stages/registry.py`, MODELS); this page, each notebook's parameters cell and "
            "`papermill --help-notebook notebooks/NN_stage.ipynb` are all made from those "
            "models.\n\n"
            f"Hostile values generated from these bounds (each bound's edges and beyond, wrong "
            f"types, shell and YAML metacharacters, path traversal, empty and oversized strings) "
            f"and checked when this book was built: **{tried} tried**, {verdict}. "
            "`tests/test_params_hostile.py` puts the same values through every notebook's first "
            "cell and checks that `results/` is unchanged after.\n\n" + entries + "\n")


# --- how close to the wire: each figure beside its transfer bound (lib.measure.bounds) -------

BOUNDS_PROSE = Path(__file__).resolve().parents[1] / "measure" / "BOUNDS.md"
PHASE_SAID = {"dispatch": "dispatch", "combine": "combine", "dc": "D+C"}


def _bound_evidence(row, ev: Evidence, notes: Notes) -> str:
    if row.kind != "guide run":
        return f"cited ({row.date}): {notes.said(row.source)}"
    fitted = "; its latency fit" if row.fitted_on else ""
    return f"{run_link(row.run)}; {by_id(ev.runs)[row.run].level}, {row.date}{fitted}"


def bounds_table(table: pd.DataFrame, ev: Evidence, notes: Notes) -> pd.DataFrame:
    """One row per figure and phase: its place, the bound beside the measured figure, the
    ratio, and its evidence (the run, or the cited source in `notes`), seven columns wide."""
    return pd.DataFrame({
        "figure": table["figure"],
        "place": [f"EP {n * r}, {n} x {i}, {d} dispatch" for n, r, i, d in zip(
            table["nodes"], table["ranks_per_node"], table["instance"], table["dispatch_dtype"])],
        "tokens": table["tokens"],
        "phase": table["phase"].map(PHASE_SAID),
        "bound / measured (us)": [f"{b:.1f} / {m:.1f}" for b, m in
                                  zip(table["bound_us"], table["measured_us"])],
        "measured / bound": [f"{r:.2f}" for r in table["ratio"]],
        "evidence": [_bound_evidence(row, ev, notes) for row in table.itertuples()]})


def bounds_section(ev: Evidence, figures_dir: Path) -> list[str]:
    """The results page's section: every figure (the guide's test_ep runs, read from their
    logs now, and every cited one) beside its transfer bound, with the plot across tokens."""
    table = figures.bound_rows(ev.runs)
    lines, points = figures.bound_lines(figures._dc_points(table))
    plots.bounds_plot(lines, points, figures_dir)
    notes = Notes()
    out = ["(wire)=", "## 4. How close to the wire?\n",
           "Each all-to-all figure beside its transfer bound (`lib.measure.bounds`): the busiest "
           "rank's bytes over each link at that link's bandwidth, plus NVLink's fixed cost fitted "
           "on the guide's own run; link figures and their sources in `lib/measure/links.yaml`. "
           "The bound is computed, **a bound, not a measurement**; measured / bound is 1 at the "
           "bound. Over EFA the bound is the NICs' specification; **on NVLink it is NCCL's "
           "all_to_all_single floor measured here**, not the wire, so a ratio of 1 there means "
           "as fast as that NCCL call (the NVLink 4 wire, its specification, is drawn dotted "
           "beside it). The guide's rows are read from the committed runs' test_ep logs when "
           "this book is built, the figures others measured from "
           "`lib/measure/cited_figures.yaml`, each row's figure linked to its source. What the "
           "bound leaves out, with these ratios as the evidence: [the transfer bound](bounds.md).\n",
           figure_md(plots.bounds_spec(lines, points)),
           dropdown(f"Every figure beside its bound: {len(table)} rows",
                    _md_table(bounds_table(table, ev, notes)) + "\n" + notes.markdown())]
    return out


def bounds_page(ev: Evidence, table: pd.DataFrame | None = None) -> str:
    """lib/measure/BOUNDS.md as a book page, its checked-against table computed now (the
    guide's committed test_ep runs and every cited figure beside their bounds, or `table`, as
    figures.bound_rows gives it), not typed."""
    prose = BOUNDS_PROSE.read_text(encoding="utf-8")
    start, end = "## Checked against what was measured", "## What the model leaves out"
    head, rest = prose.split(start, 1)
    _, tail = rest.split(end, 1)
    table = figures.bound_rows(ev.runs) if table is None else table
    notes = Notes()
    checked = table[~table["fitted_on"].astype(bool)]  # the fit's own rows touch 1 by design
    least, most = checked.loc[checked["ratio"].idxmin()], checked.loc[checked["ratio"].idxmax()]
    computed = (f"{start}\n\nComputed when this book was built, from the same rows as the "
                "{ref}`results page <wire>`. Ratio = measured / bound, over the rows not fitted "
                f"on: from {least['ratio']:.2f} ({least['figure']}, "
                f"{PHASE_SAID[least['phase']]}, {least['run'] or 'cited'}) to "
                f"{most['ratio']:.2f} ({most['figure']}, {PHASE_SAID[most['phase']]}); "
                "the rows marked 'its latency fit' are of the run NVLink's fixed cost was fitted "
                "on (its lower envelope, so one of them is 1.00 by construction); "
                + ("every ratio is at least 1, so the bound held for every figure."
                   if (table["ratio"] >= 1).all() else
                   f"**{int((table['ratio'] < 1).sum())} below 1: the bound failed there.**")
                + "\n\n" + _md_table(bounds_table(table, ev, notes)) + notes.markdown() + "\n")
    return head + computed + end + tail


# --- run it on your cluster ------------------------------------------------------------------

def stage_wall_s(run: Run, stage: str) -> float | None:
    """The stage's wall time as papermill recorded it in the executed notebook's metadata."""
    path = run.path / "notebooks" / f"{stage}.ipynb"
    if not path.exists():
        return None
    duration = (evidence.read_json(path).get("metadata", {}).get("papermill") or {}).get("duration")
    return float(duration) if duration else None


def stage_costs(ev: Evidence) -> pd.DataFrame:
    """Per stage, the latest run on real GPUs that passed it: its wall time, the GPUs it held and
    the GPU-minutes they make; what the same wall time holds on a cluster of p5en nodes."""
    from lib.stages import registry

    nodes = registry.resolve("00_cluster", {"context": "plan"})["nodes"]
    per_node = figures.cluster_shape()["ranks_per_node"]
    rows = []
    for stage in STAGES:
        passed = [r for r in ev.runs if r.feeds_results and r.stages.get(stage) == "PASS"
                  and stage_wall_s(r, stage)]
        if not passed:
            rows.append({"stage": stage, "wall time here": NOT_MEASURED, "GPUs here": "",
                         "GPU-minutes here": "",
                         f"GPU-minutes at that wall time on {nodes} nodes": "", "run": ""})
            continue
        run = passed[-1]
        wall = stage_wall_s(run, stage)
        gpus = len(figures.host_facts(run.path).get("gpus") or [])
        rows.append({"stage": stage, "wall time here": f"{wall / 60:.1f} min",
                     "GPUs here": f"{gpus}x {run.hardware.split('x ', 1)[-1].split(',')[0]}",
                     "GPU-minutes here": f"{wall * gpus / 60:.1f}",
                     f"GPU-minutes at that wall time on {nodes} nodes":
                         f"{wall * nodes * per_node / 60:.0f}",
                     "run": run_link(run.run_id)})
    return pd.DataFrame(rows)


def cluster_page(template: str, ev: Evidence) -> str:
    """book/cluster.md with its table of what each stage cost on the GPUs here."""
    from lib.stages import registry

    p = registry.resolve("04_serve", {"context": "plan"})
    table = (f"What each stage held on the GPUs here ({END_TO_END}), and what the same wall time "
             f"holds on {p['nodes']} nodes of {p['instance_type']} ({p['nodes']} x "
             f"{figures.cluster_shape()['ranks_per_node']} GPUs: every stage holds every GPU of "
             "its nodes while it runs). A cluster adds what one host does not have: the image "
             "pull, the model's download into `model_cache_dir`, pods scheduled across nodes. "
             "A stage that hangs holds its nodes until its timeout: "
             f"`schedule_timeout_s` {p['schedule_timeout_s']:.0f} s for pods to start, "
             f"`server_timeout_s` {p['server_timeout_s']:.0f} s for a server to be ready, "
             f"`job_timeout_s` {p['job_timeout_s']:.0f} s for a rank job "
             "([parameters](parameters.md)).\n\n" + _md_table(stage_costs(ev)))
    return template.replace("<!-- stage costs -->", table)


# --- a stage's chapter: its best evidence ----------------------------------------------------

# The results page's figure that answers each stage's question (drawn there, in book/figures/).
STAGE_FIGURES = {
    "03_kernel_test": [("kernel.png", "dispatch+combine p50 against tokens per rank")],
    "05_sweep": [("serving.png", "output tok/s per GPU against concurrency, per backend")],
    "06_multicomm": [("levers.png", "each lever's ratio with its paired rounds"),
                     ("serving-levers.png", "output tok/s per GPU of each lever's arms")],
    "07_train": [("training.png", "loss and grad norm per step")],
}
STAGE_ANSWER_ANCHORS = {"03_kernel_test": "fast", "04_serve": "works", "05_sweep": "beats",
                        "06_multicomm": "beats", "07_train": "trains"}


def stage_answer_lines(stage: str, ev: Evidence) -> list[str]:
    """The landing's lines that this stage's evidence makes (computed once, in answers)."""
    works, fast, beats = works_answer(ev), fast_answer(ev), beats_answer(ev)
    return {"03_kernel_test": [fast[0], fast[-1]],
            "04_serve": works,
            "05_sweep": [fast[1], beats[0]],
            "06_multicomm": beats[1:],
            "07_train": training.training_answer(ev.runs, run_link)}.get(stage, [])


def _kind_of(run: Run) -> str:
    if run.feeds_results:
        return "GPU"
    return {"kube": "cluster control plane", "slurm": "Slurm", "plan": "plan"}.get(
        run.context, "CPU")


def stage_runs_table(stage: str, ev: Evidence) -> pd.DataFrame:
    """The latest run of each kind (GPU, cluster control plane, Slurm, plan, CPU) that ran the
    stage: its verdict there, its level and its gate counts."""
    latest: dict[str, Run] = {}
    for run in ev.runs:
        if run.stages.get(stage, "not run") not in ("not run", "interrupted"):
            latest[_kind_of(run)] = run
    rows = []
    for kind in ("GPU", "cluster control plane", "Slurm", "plan", "CPU"):
        run = latest.get(kind)
        if run is None:
            continue
        counts = evidence.summarize_gates(evidence.read_gates(run.path / stage) or [])
        rows.append({"kind": kind, "run": run_link(run.run_id, "../"),
                     "stage": run.stages[stage],
                     "gates": ", ".join(f"{n} {s}" for s, n in counts.items() if n),
                     "level": _level(run)})
    return pd.DataFrame(rows)


def stage_evidence(stage: str, ev: Evidence, figures_dir: Path) -> str:
    """A stage chapter's section after its prose: what the best evidence says (the landing's
    lines this stage makes, with the results page's figure), then the latest run of each kind
    that ran the stage. The CPU run is labelled a check of the guide, never a figure."""
    out = ["\n## What the best evidence says\n"]
    lines = [line.replace("](runs/", "](../runs/") for line in stage_answer_lines(stage, ev)]
    if lines:
        out += [f"- {line}" for line in lines]
        anchor = STAGE_ANSWER_ANCHORS[stage]
        out.append(f"\nAll of it, with every round and run: {{ref}}`results <{anchor}>`.\n")
    else:
        out.append("This stage measures no figure: its gates are its answer, per run below.\n")
    for png, alt in STAGE_FIGURES.get(stage, []):
        if (Path(figures_dir) / png).exists():
            out.append(f"![{alt}](../figures/{png})\n")
    table = stage_runs_table(stage, ev)
    out.append("## Every kind of run of this stage\n")
    if table.empty:
        out.append(f"{NOT_MEASURED}: no committed run ran this stage.\n")
    else:
        out.append("The latest run of each kind. Only a GPU run measures a figure; a CPU, "
                   "control-plane, Slurm-on-one-host or plan run is a check of the guide itself, "
                   "not a performance figure ([verification levels](../intro.md#verification-levels)"
                   ").\n")
        out.append(_md_table(table))
    return "\n".join(out) + "\n"


def stages_index(template: str) -> str:
    """book/stages/index.md with the registry's table of stages (name, question, what it proves)."""
    from lib.stages.registry import SPECS

    table = pd.DataFrame([{"stage": f"[{name[:2]} · {spec.title.split(':')[0]}]({name}.ipynb)",
                           "asks": spec.title.split(": ", 1)[-1], "proves": spec.proves}
                          for name, spec in SPECS.items()])
    return template.replace("<!-- stages -->", _md_table(table))
