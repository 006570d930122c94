"""The results page's training section and the landing page's training answer (stage 07):
every run whose 07 may be shown (lib.publish.results.training_level) with its loss and grad
norm per step, plotted and tabulated from its steps.json and gates.json when the book is built,
beside the public reproduction's gate 5 (cited, other hardware and model size).

The page's run links are written by lib.publish.pages.run_link, passed in as `link` (pages
calls this module; this module does not import pages back).
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import pandas as pd

from lib.measure import published
from lib.publish import plots, report
from lib.publish import results as figures
from lib.publish.catalog import Run

NOT_MEASURED = "not measured"
REPRO = published.SOURCE.split(" ")[0]  # the public 2x p5en reproduction's repository
# The public reproduction's gate 5 (Megatron-LM on DeepEP-V2's ElasticBuffer), from its own
# record: results/megatron-shapeY-20260505/VALIDATION.md, its rank-0 log lines at their printed
# precision (tests/test_publish_training.py reads them back from the record).
PUBLIC_GATE5 = {
    "source": f"{REPRO}, results/megatron-shapeY-20260505/VALIDATION.md",
    "date": "2026-05-05",
    "hardware": "2x p5.48xlarge (16x H100) over EFA",
    "model": "a Qwen3-30B-A3B-style MoE block (hidden 2048, FFN 1024, 128 experts top-8, 2 MoE "
             "blocks), random weights",
    "steps": "1 warm-up + 3 logged",
    "loss": (26.4075, 25.1026, 24.6097),
    "grad_norm": (30.6430, 28.1979, 27.0909),
    "efa_tx_bytes": 1096495992,
}
Link = Callable[[str], str]


def _arrow(values, digits: int = 2) -> str:
    return " -> ".join(f"{v:.{digits}f}" for v in values)


def crossing_said(row) -> str:
    """The token copies sent to other ranks' experts per step, as the table says them."""
    if row.crossing_min is None or pd.isna(row.crossing_min):
        return NOT_MEASURED
    if row.ep == 1:
        return "0 (EP 1: none can cross)"
    low, high = int(row.crossing_min), int(row.crossing_max)
    return f"{low}" if low == high else f"{low} to {high}"


def state_said(row) -> str:
    """PASS, or FAIL with the gates that failed, by name."""
    if row.state == "PASS":
        return "PASS"
    return "FAIL: " + "; ".join(row.failed_gates) if row.failed_gates else row.state


def training_table(summary: pd.DataFrame, link: Link) -> pd.DataFrame:
    """Each shown run's row, then the cited public gate's, eight columns."""
    rows = [{"run": link(r.run), "hardware": r.hardware,
             "EP": "" if pd.isna(r.ep) else str(int(r.ep)),
             "steps": str(r.steps),
             "loss first -> last": (f"{r.first_loss:.4f} -> {r.last_loss:.4f}"
                                    if r.steps else NOT_MEASURED),
             "token copies crossing ranks per step": crossing_said(r),
             "07": state_said(r), "level": r.level} for r in summary.itertuples()]
    pub = PUBLIC_GATE5
    rows.append({"run": "the public reproduction's gate 5", "hardware": pub["hardware"],
                 "EP": "not stated (16 GPUs)", "steps": pub["steps"],
                 "loss first -> last": f"{pub['loss'][0]:.2f} -> {pub['loss'][-1]:.2f}",
                 "token copies crossing ranks per step":
                     f"not reported; EFA TX {pub['efa_tx_bytes'] / 1e9:.3f} GB over the run",
                 "07": "PASS, by its own record",
                 "level": f"cited, {pub['date']} (its source below the table)"})
    return pd.DataFrame(rows)


def training_section(runs: list[Run], figures_dir: Path, link: Link) -> list[str]:
    """The results page's section 5: the plot, the table, the public figure beside them."""
    steps = figures.training_steps(runs)
    summary = figures.training_summary(runs)
    pub = PUBLIC_GATE5
    out = ["(trains)=", "## 5. Does a training step's all-to-all work?\n",
           "megatron-core trains a small MoE GPT whose experts are spread over every rank "
           "(EP = world size), so each step's tokens go through the all-to-all dispatcher to "
           "their experts and back (stage 07, `lib/stages/train.py`). Shown: every committed "
           "run on real GPUs whose 07 ran, and the CPU reference run at its own level "
           f"(*{figures.CPU_TRAINING}*: two ranks over gloo, a check of the path, not a "
           "figure). Read from each run's `07_train/steps.json` and `gates.json` when this book "
           "is built. A run whose 07 has a FAIL gate is drawn dashed, named with that gate, "
           "and not counted as a pass.\n"]
    if summary.empty:
        out.append(f"{NOT_MEASURED}: no committed run that may be shown here ran 07.\n")
    else:
        plots.training_plot(steps, figures_dir)
        spec = plots.training_spec(steps)
        out.append(f"![{spec.alt}](figures/{spec.png})\n\n{spec.caption}\n")
        passed = int((summary["state"] == "PASS").sum())
        out.append(f"{len(summary)} runs shown, {passed} passing. Data: "
                   f"[{spec.data}](figures/{spec.data}).\n")
    out.append(report._md_table(training_table(summary, link)))
    out.append(f"\n**The public figure is cited, not compared** ({pub['source']}). The public reproduction's gate "
               f"5 ran Megatron-LM with its own DeepEP-V2 ElasticBuffer patch on "
               f"{pub['hardware']}: {pub['model']}, {pub['steps']} steps; loss "
               f"{_arrow(pub['loss'])}, grad norm {_arrow(pub['grad_norm'])}, EFA TX "
               f"{pub['efa_tx_bytes'] / 1e9:.3f} GB ({pub['source']}, {pub['date']}; cited). "
               "Other hardware, another model size, another vocabulary (its loss starts near "
               "the log of a real tokenizer's vocabulary, ours near that of `train_vocab`): "
               "compare the curves' shape, not their values. At EP 1 no token crosses a GPU: "
               "the one-H200 run proves megatron-core's path on CUDA, not the all-to-all across "
               "GPUs or over EFA, which are not measured here.\n")
    return out


def training_answer(runs: list[Run], link: Link) -> list[str]:
    """The landing page's answer: its first line the latest passing GPU run (or why there is
    none), then the CPU reference, the FAILed runs counted as such, and the cited public gate,
    each with its level."""
    summary = figures.training_summary(runs)
    gpu = summary[(summary["level"] != figures.CPU_TRAINING) & (summary["state"] == "PASS")]
    cpu = summary[(summary["level"] == figures.CPU_TRAINING) & (summary["state"] == "PASS")]
    failed = summary[summary["state"] == "FAIL"]
    lines = []
    if len(gpu):
        g = gpu.iloc[-1]
        crossing = ("no token crosses a GPU at EP 1, so the all-to-all across GPUs is "
                    f"{NOT_MEASURED} here" if g.ep == 1 else
                    f"{crossing_said(g)} token copies crossed ranks per step")
        lines.append(f"**Yes on {g.hardware}, EP {g.ep}**: megatron-core's alltoall dispatcher "
                     f"trained {g.steps} steps, loss {g.first_loss:.2f} -> {g.last_loss:.2f} "
                     f"({g.level}, {link(g.run)}); {crossing}.")
    else:
        lines.append(f"On GPUs: {NOT_MEASURED} (no passing 07 on real GPUs).")
    if len(cpu):
        c = cpu.iloc[-1]
        lines.append(f"on CPU, EP {c.ep} over gloo: loss {c.first_loss:.2f} -> "
                     f"{c.last_loss:.2f}, {crossing_said(c)} token copies crossing ranks per "
                     f"step ({figures.CPU_TRAINING}, {link(c.run)}): a check of the path, not "
                     "a figure.")
    if len(failed):
        gates = sorted({g for row in failed["failed_gates"] for g in row})
        lines.append(f"{len(failed)} run{'s' if len(failed) > 1 else ''} FAILed 07 ("
                     + "; ".join(f"'{g}'" for g in gates) + "), shown as such in the results.")
    pub = PUBLIC_GATE5
    lines.append(f"across 2x p5.48xlarge over EFA: {NOT_MEASURED} here; cited: loss "
                 f"{_arrow(pub['loss'])}, EFA TX {pub['efa_tx_bytes'] / 1e9:.3f} GB "
                 f"({pub['source']}, {pub['date']}), another model size.")
    return [lines[0]] + [line[0].upper() + line[1:] for line in lines[1:]]
