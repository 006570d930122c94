"""The results page's plots, drawn from lib.publish.results' tables (evidence only).

Every plot is written with the table it was drawn from (`<name>.csv` beside `<name>.png`), so a
reader, or a test, can check each plotted point against the run that measured it.
"""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display where the book is built
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402
import pandas as pd  # noqa: E402

# Fixed per series, so a colour means the same thing on every build and every plot.
SERIES_STYLE = {
    "DeepEP test_ep": dict(color="tab:blue", marker="o"),
    "torch benchmark": dict(color="tab:orange", marker="s"),
    "NCCL floor (two all_to_all_single)": dict(color="tab:gray", marker="^"),
}
OTHER_HARDWARE = dict(color="black", marker="*", s=180, zorder=5)
# A PNG carries matplotlib's version by default: a rebuild from the same evidence must give the
# same bytes wherever it is built.
STABLE_PNG = {"Software": None}


def _plain_ticks(axis, values) -> None:
    """Log axes label the measured values themselves (4, 8, 32), not powers of ten."""
    values = sorted({int(v) for v in values})
    axis.set_ticks(values, [str(v) for v in values])
    axis.set_minor_formatter(matplotlib.ticker.NullFormatter())


def _short(run_id: str) -> str:
    return run_id.replace("gpu-2xh200-", "")


def _save(fig, data: pd.DataFrame, out: Path, name: str) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    png = out / f"{name}.png"
    fig.tight_layout()
    fig.savefig(png, dpi=110, bbox_inches="tight", metadata=STABLE_PNG)
    plt.close(fig)
    data.to_csv(out / f"{name}.csv", index=False)
    return png


def kernel_plot(points: pd.DataFrame, published: dict, out: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7.5, 4.6))
    for series, style in SERIES_STYLE.items():
        rows = points[points["series"] == series]
        if rows.empty:
            continue
        ax.scatter(rows["tokens"], rows["p50_us"], alpha=0.55, color=style["color"],
                   marker=style["marker"], label=f"{series} (each run)")
        median = rows.groupby("tokens")["p50_us"].median()
        if len(median) > 1:
            ax.plot(median.index, median.values, color=style["color"], alpha=0.8)
    ax.scatter([published["tokens"]], [published["p50_us"]], label=(
        f"{published['series']}: other hardware, {published['date']}"), **OTHER_HARDWARE)
    ax.set(xscale="log", yscale="log", xlabel="tokens per rank",
           ylabel="dispatch + combine p50 (us)",
           title="Kernel: dispatch + combine, 2x H200 over NVLink (measured) and 2x p5en (cited)")
    _plain_ticks(ax.xaxis, [*points["tokens"], published["tokens"]])
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")  # the cited point sits top left, at 128 tokens
    data = pd.concat([points, pd.DataFrame([published])], ignore_index=True)
    return _save(fig, data, out, "kernel")


def serving_plot(points: pd.DataFrame, out: Path) -> Path:
    panels = list(dict.fromkeys(zip(points["run"], points["stage"])))
    fig, axes = plt.subplots(1, max(len(panels), 1), figsize=(4.2 * max(len(panels), 1), 3.8),
                             squeeze=False, sharey=True)
    for ax, (run, stage) in zip(axes[0], panels):
        for arm, rows in points[(points["run"] == run) & (points["stage"] == stage)].groupby("arm"):
            rows = rows.sort_values("concurrency")
            spread = [rows["output_tps"] - rows["output_tps_min"],
                      rows["output_tps_max"] - rows["output_tps"]]
            ax.errorbar(rows["concurrency"], rows["output_tps"], yerr=spread, marker="o",
                        capsize=3, label=arm)
        ax.set(xscale="log", xlabel="concurrency", title=f"{run}\n{stage}")
        _plain_ticks(ax.xaxis, points["concurrency"])
        ax.title.set_fontsize(7)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=6)
    axes[0][0].set_ylabel("output tok/s (median, bars: min to max of repeats)")
    return _save(fig, points, out, "serving")


def latency_plot(points: pd.DataFrame, out: Path) -> Path:
    panels = list(dict.fromkeys(zip(points["run"], points["stage"])))
    fig, axes = plt.subplots(2, max(len(panels), 1), figsize=(4.2 * max(len(panels), 1), 6.4),
                             squeeze=False)
    for col, (run, stage) in enumerate(panels):
        rows = points[(points["run"] == run) & (points["stage"] == stage)]
        for row, metric in enumerate(("ttft", "itl")):
            ax = axes[row][col]
            for arm, arm_rows in rows.groupby("arm"):
                arm_rows = arm_rows.sort_values("concurrency")
                line = ax.plot(arm_rows["concurrency"], arm_rows[f"{metric}_p50_ms"], marker="o",
                               label=f"{arm} p50")[0]
                ax.plot(arm_rows["concurrency"], arm_rows[f"{metric}_p99_ms"], marker="x",
                        linestyle="--", color=line.get_color(), label=f"{arm} p99")
            ax.set(xscale="log", xlabel="concurrency", ylabel=f"{metric.upper()} (ms)")
            _plain_ticks(ax.xaxis, points["concurrency"])
            ax.set_title(f"{run} {stage}", fontsize=7)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=5)
    return _save(fig, points, out, "latency")


def lever_plot(ratios: pd.DataFrame, out: Path) -> Path:
    measured = ratios[ratios["ratio"].notna()].reset_index(drop=True)
    fig, ax = plt.subplots(figsize=(7.5, 0.32 * max(len(measured), 3) + 1.2))
    labels = []
    for y, r in measured.iterrows():
        shape = f" {r['shape']}" if r["shape"] else ""
        labels.append(f"{r['lever']}{shape} c{r['concurrency']} ({_short(r['run'])})")
        ax.scatter(r["each_round"], [y] * len(r["each_round"]), color="tab:gray", s=12,
                   label="each paired round" if y == 0 else None)
        ax.scatter([r["ratio"]], [y], color="tab:blue", marker="D",
                   label="ratio of medians" if y == 0 else None)
        if r["low"] is not None and pd.notna(r["low"]):
            ax.plot([r["low"], r["high"]], [y, y], color="tab:blue")
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_yticks(range(len(labels)), labels, fontsize=7)
    ax.set(xscale="log", xlabel="b / a, output tok/s (1 = no difference)",
           title="Levers: each ratio and every paired round (an interval only from 5 rounds)")
    ax.grid(True, axis="x", which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    return _save(fig, ratios.assign(each_round=ratios["each_round"].map(
        lambda v: " ".join(f"{x:.4f}" for x in v))), out, "levers")


def bounds_plot(lines: pd.DataFrame, points: pd.DataFrame, out: Path) -> Path:
    """Measured D+C against the transfer bound across tokens: a line per place (solid: the
    cluster's instance at EP 8 to 64; dashed: another place a figure was measured at), each
    point in its place's colour (circles: the guide's runs; stars: cited)."""
    fig, ax = plt.subplots(figsize=(7.8, 5.0))
    colours = {}
    for i, (line, rows) in enumerate(lines.groupby("line", sort=False)):
        rows = rows.sort_values("tokens")
        drawn = ax.plot(rows["tokens"], rows["bound_us"], color=f"C{i % 10}",
                        linestyle="-" if rows["cluster"].iloc[0] else "--",
                        label=f"bound, {line}")[0]
        colours[line] = drawn.get_color()
    for (line, kind), rows in points.groupby(["line", "kind"], sort=False):
        guide = kind == "guide run"
        ax.scatter(rows["tokens"], rows["measured_us"], color=colours[line],
                   marker="o" if guide else "*", s=36 if guide else 110, zorder=5,
                   edgecolors="black", linewidths=0.4,
                   label=f"measured, {line} ({'the guide' if guide else 'cited'})")
    ax.set(xscale="log", yscale="log", xlabel="tokens per rank",
           ylabel="dispatch + combine (us)",
           title="How close to the wire: measured D+C against its transfer bound "
                 "(lib.measure.bounds)")
    ax.title.set_fontsize(9)
    _plain_ticks(ax.xaxis, lines["tokens"])
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=6, loc="upper left", ncol=2)
    data = pd.concat([lines.assign(series="bound"),
                      points.assign(series="measured")], ignore_index=True)
    return _save(fig, data, out, "bounds")


def training_plot(steps: pd.DataFrame, out: Path) -> Path:
    """Loss (top) and global grad norm (bottom) per step, a line per run (lib.publish.results'
    training_steps): a run whose 07 FAILed is dashed and says FAIL in its label."""
    fig, (loss_ax, norm_ax) = plt.subplots(2, 1, figsize=(7.5, 5.6), sharex=True)
    for i, (run, rows) in enumerate(steps.groupby("run", sort=False)):
        rows = rows.sort_values("step")
        failed = rows["state"].iloc[0] == "FAIL"
        style = dict(color=f"C{i % 10}", marker="o", markersize=3,
                     linestyle="--" if failed else "-")
        label = f"{run}: EP {rows['ranks'].max()}, {rows['level'].iloc[0]}" + (
            ", 07 FAIL" if failed else "")
        loss_ax.plot(rows["step"], rows["loss"], label=label, **style)
        norm_ax.plot(rows["step"], rows["grad_norm"], **style)
    loss_ax.set(ylabel="loss (averaged over ranks)",
                title="Training through the MoE all-to-all (07): loss and grad norm per step")
    loss_ax.title.set_fontsize(9)
    norm_ax.set(xlabel="step (as logged, from 0)", ylabel="global grad norm")
    for ax in (loss_ax, norm_ax):
        ax.grid(True, alpha=0.3)
    loss_ax.legend(fontsize=6)
    return _save(fig, steps, out, "training")
