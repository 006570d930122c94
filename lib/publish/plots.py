"""The results page's plots, drawn from lib.publish.results' tables (evidence only).

Every figure is written with the table it was drawn from (FigureSpec.data: `<name>.csv` beside
`<name>.png`; a served figure's `serving-<comparison>.csv`, and serving.csv with every served
row), so a reader, or a test, can check each plotted point against the run that measured it; the
run ids are in that table and in the figure's caption (`*_spec`, `serving_figures`), never in a
title.

Drawn to be read in the book's page column (784 px): at most WIDTH_IN x DPI pixels wide, so
shown at their own size there, no text under MIN_FONT_PT, at most two panels side by side (more
are stacked), each panel its own y-axis, legends below the axes, never over the data. A phone
shows them scaled to its width (about two thirds on a 390-px screen); its reader zooms in.
One figure per question: the title says what is compared, on what and with which engine; each
panel title says the arm or traffic shape it shows.

Drawing costs seconds and the evidence rarely changes between builds: each figure set is cached
under `<out_root>/_build/.figure-cache/` by a digest of its input table and of this module's code
(and matplotlib's version), and copied from there into the build's figures folder, which the
build deletes every time. matplotlib is imported only when something must be drawn.
"""
from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import shutil
import textwrap
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Callable

import pandas as pd

from lib.measure.stats import MIN_ROUNDS_FOR_INTERVAL

WIDTH_IN = 7.0  # x DPI = 700 px: under the page column's 784 px, so never scaled up or cut
DPI = 100
MIN_FONT_PT = 9  # the smallest text drawn (tests/test_publish_plots.py measures every text)
FONTS = {"font.size": 10.5, "axes.titlesize": 10.5, "axes.labelsize": 10.5,
         "xtick.labelsize": 10, "ytick.labelsize": 10, "legend.fontsize": 10,
         "figure.titlesize": 11.5}
# Fixed per series, so a colour means the same thing on every build and every plot.
SERIES_STYLE = {
    "DeepEP test_ep": dict(color="tab:blue", marker="o"),
    "torch benchmark": dict(color="tab:orange", marker="s"),
    "NCCL floor (two all_to_all_single)": dict(color="tab:gray", marker="^"),
}
OTHER_HARDWARE = dict(color="black", marker="*", s=180, zorder=5)
ARM_COLOURS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown",
               "tab:pink", "tab:olive", "tab:cyan")
# A PNG carries matplotlib's version by default: a rebuild from the same evidence must give the
# same bytes wherever it is built.
STABLE_PNG = {"Software": None}
AUTO = "auto"  # cache_dir: the build's own cache when the figures folder is inside a book build
CACHE_KEEP = 4  # entries kept per figure set (older digests are deleted)
_DONE = ".complete"  # written last into a cache entry: an entry without it is never used
# the order a comparison's figures come in; the first is <name>.png, the others <name>-<key>.png
COMPARISON_ORDER = ("backends", "levers", "sweep")


@dataclass(frozen=True)
class FigureSpec:
    """What a page says around a figure: the file it is in, its title, alt text and caption."""
    name: str      # the image's stem under the figures folder: <name>.png
    title: str     # as drawn on the figure
    alt: str       # the image's alt text: what it shows, for a reader who cannot see it
    caption: str   # the line under it: how to read it and the runs it was drawn from
    runs: tuple[str, ...] = ()
    data: str = ""  # the CSV of the rows it drew, beside it (<name>.csv when not said)

    def __post_init__(self):
        if not self.data:
            object.__setattr__(self, "data", f"{self.name}.csv")

    @property
    def png(self) -> str:
        return f"{self.name}.png"


# ---- the cache -----------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def code_version() -> str:
    """This module's code and matplotlib's version: a change to either redraws every figure."""
    digest = hashlib.sha256(Path(__file__).read_bytes())
    digest.update(metadata.version("matplotlib").encode())
    return digest.hexdigest()


def _canonical(value) -> str:
    if isinstance(value, pd.DataFrame):  # full float precision; lists as their repr
        return value.to_csv(index=False)
    return json.dumps(value, sort_keys=True, default=str)


def digest(name: str, inputs: dict) -> str:
    """The cache key of a figure set: its name, its input tables and values, code_version()."""
    h = hashlib.sha256(f"{name}\n{code_version()}\n".encode())
    for key in sorted(inputs):
        h.update(f"\n{key}\n{_canonical(inputs[key])}".encode())
    return h.hexdigest()[:24]


def cache_root(out: Path, cache_dir) -> Path | None:
    """Where a figure set is cached: `cache_dir` when given, None (no cache) when None; AUTO:
    `<out_root>/_build/.figure-cache` for a figures folder inside a book build's `_build/.src`,
    else no cache."""
    if cache_dir is None:
        return None
    if cache_dir != AUTO:
        return Path(cache_dir)
    for parent in Path(out).absolute().parents:
        if parent.name == ".src" and parent.parent.name == "_build":
            return parent.parent / ".figure-cache"
    return None


def _publish(name: str, inputs: dict, out: Path, render: Callable[[Path], None],
             cache_dir) -> None:
    """Put the figure set `name` into `out`: copied from its cache entry when one of the same
    digest exists, else rendered (render(folder) writes every PNG and CSV of the set) into a
    new entry first. Without a cache, rendered straight into `out`."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    root = cache_root(out, cache_dir)
    if root is None:
        render(out)
        return
    entry = root / f"{name}-{digest(name, inputs)}"
    if not (entry / _DONE).exists():
        scratch = root / f".{entry.name}.{os.getpid()}"
        shutil.rmtree(scratch, ignore_errors=True)
        scratch.mkdir(parents=True)
        render(scratch)
        (scratch / _DONE).write_text("\n".join(sorted(p.name for p in scratch.iterdir())))
        shutil.rmtree(entry, ignore_errors=True)  # a half-written entry of a killed build
        try:
            scratch.rename(entry)
        except OSError:  # another build wrote the same entry meanwhile: its files are the same
            shutil.rmtree(scratch, ignore_errors=True)
        _prune(root, name)
    else:
        os.utime(entry / _DONE)  # in use: the last to be pruned
    for path in entry.iterdir():
        if path.name != _DONE:
            shutil.copyfile(path, out / path.name)


def _prune(root: Path, name: str) -> None:
    entries = sorted((p for p in root.glob(f"{name}-*") if (p / _DONE).exists()),
                     key=lambda p: (p / _DONE).stat().st_mtime, reverse=True)
    for old in entries[CACHE_KEEP:]:
        shutil.rmtree(old, ignore_errors=True)


# ---- drawing helpers -----------------------------------------------------------------------------
def _figure():
    """A figure of its own (no pyplot: no global state, nothing shown) on the Agg canvas; its
    height is set by _arrange once everything is drawn."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(WIDTH_IN, 4.0), dpi=DPI)
    FigureCanvasAgg(fig)
    return fig


def _rows(fig, columns: list[int], sharex: bool = False) -> list[list]:
    """Axes in rows of one or two (`columns`, top to bottom), placed later by _arrange."""
    rows, first = [], None
    for count in columns:
        row = []
        for _ in range(count):
            ax = fig.add_axes((0.0, 0.0, 1.0, 1.0), sharex=first if sharex else None)
            first = first or ax
            row.append(ax)
        rows.append(row)
    return rows


# Stack layout. matplotlib's constrained layout (or bbox_inches="tight") measures every artist of
# every axes twice on each save, which was most of the plots' time; these figures are simple
# stacks of rows, so only the texts that set a margin are measured (ticks' labels, axis labels,
# titles, legends) and every axes is placed once, the figure's height following its content.
PAD_IN = 0.08
TICK_IN = (3.5 + 3.5) / 72   # matplotlib's default tick length + tick label pad (points)
LABELPAD_IN = 4 / 72         # axes.labelpad
TITLEPAD_IN = 6 / 72         # axes.titlepad


def _extent(artist, renderer) -> tuple[float, float]:
    """(width, height) in inches of a drawn text or legend; (0, 0) when absent or empty."""
    if artist is None or not artist.get_visible() or (hasattr(artist, "get_text")
                                                      and not artist.get_text()):
        return 0.0, 0.0
    box = artist.get_window_extent(renderer)
    return box.width / DPI, box.height / DPI


def _tick_extent(axis, renderer) -> tuple[float, float, float]:
    """(widest, tallest, half the last one's width) of the axis' visible tick labels, inches."""
    from matplotlib.font_manager import FontProperties

    if not axis.get_tick_params().get("labelbottom", True) or \
            not axis.get_tick_params().get("labelleft", True):
        return 0.0, 0.0, 0.0
    low, high = sorted(axis.get_view_interval())
    span = (high - low) * 1e-9
    locs = [v for v in axis.get_majorticklocs() if low - span <= v <= high + span]
    labels = [t for t in axis.get_major_formatter().format_ticks(locs) if t]
    size = FONTS["xtick.labelsize" if axis.axis_name == "x" else "ytick.labelsize"]
    prop = FontProperties(size=size)
    sizes = [renderer.get_text_width_height_descent(t, prop, ismath=False) for t in labels]
    if not sizes:
        return 0.0, 0.0, 0.0
    return (max(w for w, _, _ in sizes) / DPI, max(h for _, h, _ in sizes) / DPI,
            sizes[-1][0] / 2 / DPI)


def _arrange(fig, rows: list[list], heights: list[float]) -> None:
    """Place every axes (rows of one or two, each row `heights[i]` inches tall) under the
    figure's title, with room for each one's title, tick labels, axis labels and legend, and the
    figure's legend under them all; the figure's height is what that takes."""
    renderer = fig.canvas.get_renderer()
    for row in rows:
        for ax in row:
            ax.get_xlim(), ax.get_ylim()  # autoscale now: the ticks' labels depend on it

    def left_need(ax):  # y tick labels and the y label, left of the axes
        return TICK_IN + _tick_extent(ax.yaxis, renderer)[0] + LABELPAD_IN + \
            _extent(ax.yaxis.label, renderer)[0] + PAD_IN

    def below(ax):  # x tick labels, the x label and an axes' own legend, under it
        legend = ax.get_legend()
        label = _extent(ax.xaxis.label, renderer)[1]
        return (TICK_IN + _tick_extent(ax.xaxis, renderer)[1]
                + (LABELPAD_IN + label if label else 0.0) + PAD_IN
                + (_extent(legend, renderer)[1] + PAD_IN if legend else 0.0))

    left = max(left_need(row[0]) for row in rows)
    right = max(_tick_extent(row[-1].xaxis, renderer)[2] for row in rows) + PAD_IN
    gap = max([left_need(row[1]) + _tick_extent(row[0].xaxis, renderer)[2]
               for row in rows if len(row) > 1] or [0.0])
    top = PAD_IN + _extent(fig._suptitle, renderer)[1] + PAD_IN
    legend = fig.legends[0] if fig.legends else None
    layout, cursor = [], top
    for row, height in zip(rows, heights):
        cursor += max(_extent(ax.title, renderer)[1] for ax in row) + TITLEPAD_IN
        layout.append((row, cursor, height))
        cursor += height + max(below(ax) for ax in row)
    figure_height = cursor + (_extent(legend, renderer)[1] + 2 * PAD_IN if legend else PAD_IN)
    fig.set_size_inches(WIDTH_IN, figure_height)
    for row, axes_top, height in layout:
        width = (WIDTH_IN - left - right - gap * (len(row) - 1)) / len(row)
        for i, ax in enumerate(row):
            x = left + i * (width + gap)
            ax.set_position((x / WIDTH_IN, 1 - (axes_top + height) / figure_height,
                             width / WIDTH_IN, height / figure_height))
            own = ax.get_legend()
            if own:  # under its axes' x label
                drop = below(ax) - _extent(own, renderer)[1] - PAD_IN
                own.set_bbox_to_anchor((0.0, -drop / height), transform=ax.transAxes)
    if fig._suptitle is not None:
        fig._suptitle.set_y(1 - PAD_IN / figure_height)
        fig._suptitle.set_verticalalignment("top")
    if legend:
        legend.set_bbox_to_anchor((0.5, PAD_IN / figure_height), transform=fig.transFigure)


def _suptitle(fig, title: str) -> None:
    """The figure's title, each line wrapped to the figure's width."""
    fig.suptitle("\n".join(_wrap(line, 78) for line in title.splitlines()))


def _save(fig, folder: Path, name: str, data: pd.DataFrame, data_name: str = "") -> None:
    fig.savefig(folder / f"{name}.png", dpi=DPI, metadata=STABLE_PNG)
    data.to_csv(folder / (data_name or f"{name}.csv"), index=False)


def _fonts():
    import matplotlib

    return matplotlib.rc_context(FONTS)


def _plain_ticks(axis, values) -> None:
    """A log axis labelled with the measured values themselves (4, 8, 32; 0.8, 1, 1.5), not
    powers of ten; no minor marks."""
    import matplotlib.ticker

    values = sorted({float(v) for v in values})
    axis.set_ticks(values, [f"{v:g}" for v in values])
    axis.set_minor_locator(matplotlib.ticker.NullLocator())  # unlabelled marks cost draw time


def _plain_log(axis) -> None:
    """A log axis labelled 20, 50, 100, not 2x10^1: 1-2-5 steps, finer where the data span too
    little for three of them. Called once the data are drawn (it reads the axis' limits)."""
    import matplotlib.ticker

    low, high = sorted(axis.get_view_interval())
    ticks = []
    for mantissas in ((1, 2, 5), (1, 1.5, 2, 3, 5, 7), (1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6, 7, 8, 9)):
        ticks = [m * 10 ** e for e in range(math.floor(math.log10(low)) - 1,
                                            math.ceil(math.log10(high)) + 1)
                 for m in mantissas if low <= m * 10 ** e <= high]
        if len(ticks) >= 3:
            break
    axis.set_major_locator(matplotlib.ticker.FixedLocator(ticks))
    axis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_locator(matplotlib.ticker.NullLocator())


def _wrap(text: str, width: int) -> str:
    return "\n".join(textwrap.wrap(text, width, break_on_hyphens=False)) or text


def _hardware(text: str) -> str:
    """'2x NVIDIA H200, one host' -> '2x H200'."""
    return str(text).replace("NVIDIA ", "").replace(", one host", "")


def _joined(values) -> str:
    seen = [str(v) for v in dict.fromkeys(values) if isinstance(v, str) and v]
    return " / ".join(seen)


def _legend_below(fig, handles, labels, columns: int | None = None) -> None:
    """The figure's legend under every axes (_arrange makes room for it), in as many columns as
    its longest entry lets fit across the figure."""
    if not handles:
        return
    if columns is None:
        longest = max(len(line) for label in labels for line in str(label).splitlines())
        entry_in = 0.75 + longest * FONTS["legend.fontsize"] * 0.55 / 72  # handle + text
        columns = max(1, int((WIDTH_IN - 0.3) // entry_in))
    fig.legend(handles, labels, loc="lower center", ncols=min(columns, len(handles)),
               frameon=False)


def _runs_said(runs) -> str:
    runs = list(dict.fromkeys(runs))
    return ("Run" + ("s " if len(runs) > 1 else " ") + ", ".join(f"`{r}`" for r in runs)
            if runs else "")


# ---- 2. kernel -----------------------------------------------------------------------------------
def kernel_spec(points: pd.DataFrame, published: dict) -> FigureSpec:
    cited = published["series"].replace(" (cited)", "")
    where = _joined(_hardware(h) for h in points["hardware"]) or "the guide's GPUs"
    series = [s for s in SERIES_STYLE if s in set(points["series"])]
    names = [s.split(" (")[0] for s in series]  # the series' own names, without their notes
    title = (f"{' vs '.join(names)}: dispatch + combine p50\n"
             f"measured on {where}; star: {published['series']}")
    alt = (f"Log-log plot of dispatch plus combine p50 in microseconds against tokens per rank, "
           f"one dot per run for each of {', '.join(series)} on {where}, a line through their "
           f"medians, and one star for the cited {cited} at "
           f"{published['tokens']} tokens.")
    caption = (f"Each dot is one run's p50; lines join the medians across runs. The star is "
               f"{cited}, cited ({published['source']}, {published['date']}): other "
               f"hardware, shown for scale, not compared. {_runs_said(points['run'])}; data: "
               "kernel.csv.")
    return FigureSpec("kernel", title, alt, caption, tuple(dict.fromkeys(points["run"])))


def draw_kernel(points: pd.DataFrame, published: dict):
    spec = kernel_spec(points, published)
    with _fonts():
        fig = _figure()
        [[ax]] = _rows(fig, [1])
        for series, style in SERIES_STYLE.items():
            rows = points[points["series"] == series]
            if rows.empty:
                continue
            ax.scatter(rows["tokens"], rows["p50_us"], alpha=0.6, color=style["color"],
                       marker=style["marker"], label=f"{series}, each run")
            median = rows.groupby("tokens")["p50_us"].median()
            if len(median) > 1:
                ax.plot(median.index, median.values, color=style["color"], alpha=0.8)
        ax.scatter([published["tokens"]], [published["p50_us"]],
                   label=f"{published['series']}, {published['date']}", **OTHER_HARDWARE)
        ax.set(xscale="log", yscale="log", xlabel="tokens per rank",
               ylabel="dispatch + combine p50 (µs)")
        _plain_ticks(ax.xaxis, [*points["tokens"], published["tokens"]])
        _plain_log(ax.yaxis)
        ax.grid(True, which="major", alpha=0.3)
        _suptitle(fig, spec.title)
        _legend_below(fig, *ax.get_legend_handles_labels())
        _arrange(fig, [[ax]], [3.4])
    return fig


def kernel_plot(points: pd.DataFrame, published: dict, out: Path, cache_dir=AUTO) -> Path:
    data = pd.concat([points, pd.DataFrame([published])], ignore_index=True)

    def render(folder: Path) -> None:
        _save(draw_kernel(points, published), folder, "kernel", data)

    _publish("kernel", {"points": points, "published": published}, out, render, cache_dir)
    return Path(out) / "kernel.png"


# ---- 2. served: throughput and latency, one figure per comparison --------------------------------
def _serving_frame(serving: pd.DataFrame) -> pd.DataFrame:
    """The serving table with every column the figures read: a table without the facts
    lib.publish.results adds (an older one, a test's) still draws, saying less."""
    frame = serving.copy()
    defaults = {"comparison": "sweep", "arm_label": None, "arm_order": 0, "shape": "",
                "shape_said": "", "backend": "", "engine": "", "place": "", "date": "",
                "gpus": float("nan")}
    for column, value in defaults.items():
        if column not in frame:
            frame[column] = value
    frame["arm_label"] = frame["arm_label"].where(frame["arm_label"].notna(), frame["arm"])
    for column in ("shape", "shape_said", "backend", "engine", "place", "date"):
        frame[column] = frame[column].fillna("").astype(str)
    gpus = pd.to_numeric(frame["gpus"], errors="coerce")
    frame["per_gpu"] = gpus.notna() & (gpus > 0)
    for total in ("output_tps", "output_tps_min", "output_tps_max"):
        frame[f"{total}_shown"] = frame[total] / gpus.where(frame["per_gpu"], 1.0)
    return frame


def _comparison_groups(frame: pd.DataFrame) -> list[tuple[str, pd.DataFrame]]:
    keys = list(dict.fromkeys(frame["comparison"]))
    keys.sort(key=lambda k: (COMPARISON_ORDER.index(k) if k in COMPARISON_ORDER
                             else len(COMPARISON_ORDER), k))
    return [(key, frame[frame["comparison"] == key]) for key in keys]


def _panels(rows: pd.DataFrame, comparison: str) -> list[tuple[str, pd.DataFrame]]:
    """One panel per run and traffic shape, titled by what it shows (the shape; for the levers
    the backend of the EP arms; for a sweep its arm). Where two panels would share a title (two
    runs of one comparison), each says its run's date, and where that is shared too, its run
    id's tail."""
    panels = []
    for (run, shape), cells in rows.groupby(["run", "shape"], sort=False):
        said = cells["shape_said"].iloc[0]
        if comparison == "levers":
            ep = [b for b in cells["backend"] if b and not b.startswith("none")]
            title = f"EP arms on {ep[0]}" if ep else "levers"
        elif comparison == "sweep":
            title = cells["arm_label"].iloc[0] + (f", {said}" if said else "")
        else:
            title = said or shape or "one shape"
        panels.append((title, run, cells))
    titles = [title for title, _, _ in panels]
    if len(set(titles)) < len(titles):
        dated = [f"{t} ({cells['date'].iloc[0]})" for t, _, cells in panels]
        if len(set(dated)) < len(dated):
            dated = [f"{t} ({run.split('-')[-1]})" for t, run, _ in panels]
        titles = [new if titles.count(old) > 1 else old for old, new in zip(titles, dated)]
    return [(title, cells) for title, (_, _, cells) in zip(titles, panels)]


def _arm_colours(frame: pd.DataFrame) -> dict[str, str]:
    """One colour per arm across every serving figure: in the stages' own arm order."""
    labels = frame.sort_values(["arm_order", "arm_label"])["arm_label"]
    return {label: ARM_COLOURS[i % len(ARM_COLOURS)]
            for i, label in enumerate(dict.fromkeys(labels))}


def _compared(rows: pd.DataFrame) -> str:
    """'deepep_v2 vs allgather_reducescatter': the arms compared with the stage's first (a)."""
    order = rows.sort_values("arm_order").drop_duplicates("arm_label")
    labels = list(order["arm_label"])
    if len(labels) == 1:
        return f"{labels[0]} alone"
    return f"{' and '.join(labels[1:])} vs {labels[0]}"


def _setting(rows: pd.DataFrame) -> str:
    return ", ".join(x for x in (_joined(rows["engine"]), _joined(rows["place"])) if x)


def _file_name(base: str, index: int, comparison: str) -> str:
    return base if index == 0 else f"{base}-{comparison}"


def serving_figures(serving: pd.DataFrame) -> list[FigureSpec]:
    """One throughput figure per comparison the runs measured (05's backend A/B, 06's levers,
    05's one-arm sweep): serving.png for the first, serving-<comparison>.png for the others."""
    frame = _serving_frame(serving)
    specs = []
    for i, (comparison, rows) in enumerate(_comparison_groups(frame)):
        per_gpu = bool(rows["per_gpu"].all())
        unit = "output tok/s per GPU" if per_gpu else "output tok/s (whole server)"
        title = f"{_compared(rows)}: {unit}\n{_setting(rows)}".strip()
        panels = [t for t, _ in _panels(rows, comparison)]
        gpus = _joined(str(int(g)) for g in pd.to_numeric(rows["gpus"], errors="coerce").dropna())
        alt = (f"{unit} against concurrent requests for {_compared(rows)}, "
               f"{len(panels)} panel{'s' if len(panels) > 1 else ''} ({'; '.join(panels)}); "
               "each arm a line of medians with bars from the least to the most of its repeats.")
        caption = ("Median output tok/s over the repeats, bars from the least to the most; "
                   + (f"divided by the {gpus} GPUs one server spans (DP = EP). " if per_gpu
                      else "the GPU count was not recorded: whole-server figures. ")
                   + f"{_runs_said(rows['run'])}; data: serving-{comparison}.csv.")
        specs.append(FigureSpec(_file_name("serving", i, comparison), title, alt, caption,
                                tuple(dict.fromkeys(rows["run"])), f"serving-{comparison}.csv"))
    return specs


def _pairs(count: int) -> list[int]:
    """Rows of two panels (the last alone when the count is odd)."""
    return [2] * (count // 2) + [1] * (count % 2)


def draw_serving(rows: pd.DataFrame, comparison: str, spec: FigureSpec, colours: dict):
    panels = _panels(rows, comparison)
    per_gpu = bool(rows["per_gpu"].all())
    with _fonts():
        fig = _figure()
        grid = _rows(fig, _pairs(len(panels)))
        axes = [ax for row in grid for ax in row]
        shown = {}
        for i, (ax, (title, cells)) in enumerate(zip(axes, panels)):
            for arm, arm_rows in cells.sort_values("arm_order").groupby("arm_label", sort=False):
                arm_rows = arm_rows.sort_values("concurrency")
                y = arm_rows["output_tps_shown"]
                spread = [y - arm_rows["output_tps_min_shown"],
                          arm_rows["output_tps_max_shown"] - y]
                drawn = ax.errorbar(arm_rows["concurrency"], y, yerr=spread, marker="o",
                                    capsize=3, color=colours[arm], label=arm)
                shown.setdefault(arm, drawn)
            ax.set(xscale="log", xlabel="concurrent requests", title=_wrap(title, 36))
            ax.set_ylim(bottom=0)
            _plain_ticks(ax.xaxis, cells["concurrency"])
            ax.grid(True, alpha=0.3)
            if i % 2 == 0:
                ax.set_ylabel(("output tok/s per GPU" if per_gpu else "output tok/s")
                              + "\n(median; bars: min to max)")
        _suptitle(fig, spec.title)
        _legend_below(fig, list(shown.values()), list(shown))
        _arrange(fig, grid, [2.7] * len(grid))
    return fig


def serving_drawings(serving: pd.DataFrame, draw=None) -> list[tuple[FigureSpec, object,
                                                                       pd.DataFrame]]:
    """(spec, figure, the rows it drew) for each comparison: draw_serving's figures by default,
    draw_latency's with latency_figures' specs when `draw` is draw_latency."""
    draw = draw or draw_serving
    frame = _serving_frame(serving)
    specs = (latency_figures if draw is draw_latency else serving_figures)(serving)
    colours = _arm_colours(frame)
    return [(spec, draw(rows, comparison, spec, colours), serving.loc[rows.index])
            for spec, (comparison, rows) in zip(specs, _comparison_groups(frame))]


def serving_plot(serving: pd.DataFrame, out: Path, cache_dir=AUTO) -> Path:
    """Every throughput figure of serving_figures (the first is serving.png, returned)."""
    specs = serving_figures(serving)

    def render(folder: Path) -> None:
        for spec, fig, rows in serving_drawings(serving):
            _save(fig, folder, spec.name, rows, spec.data)
        serving.to_csv(folder / "serving.csv", index=False)  # every served row: the page's table

    _publish("serving", {"serving": serving}, out, render, cache_dir)
    return Path(out) / (specs[0].png if specs else "serving.png")


def latency_figures(serving: pd.DataFrame) -> list[FigureSpec]:
    """One latency figure per comparison, as serving_figures: latency.png, latency-<key>.png."""
    frame = _serving_frame(serving)
    specs = []
    for i, (comparison, rows) in enumerate(_comparison_groups(frame)):
        title = (f"{_compared(rows)}: latency, p50 and p99\n"
                 f"time to first token (TTFT), between tokens (ITL); {_setting(rows)}").strip()
        panels = [t for t, _ in _panels(rows, comparison)]
        alt = (f"TTFT and ITL in milliseconds (log scale) against concurrent requests for "
               f"{_compared(rows)}, a row of two panels (TTFT, ITL) for each of: "
               f"{'; '.join(panels)}; solid lines p50, dashed p99, one colour per arm.")
        caption = ("Each point is the median over the repeats of that cell's p50 (solid) or p99 "
                   "(dashed); log scale, so one slow tail does not flatten the rest. "
                   f"{_runs_said(rows['run'])}; data: serving-{comparison}.csv.")
        specs.append(FigureSpec(_file_name("latency", i, comparison), title, alt, caption,
                                tuple(dict.fromkeys(rows["run"])), f"serving-{comparison}.csv"))
    return specs


def draw_latency(rows: pd.DataFrame, comparison: str, spec: FigureSpec, colours: dict):
    from matplotlib.lines import Line2D

    panels = _panels(rows, comparison)
    with _fonts():
        fig = _figure()
        grid = _rows(fig, [2] * len(panels))
        axes = [ax for row in grid for ax in row]
        arms = {}
        for row, (title, cells) in enumerate(panels):
            for col, (metric, said) in enumerate((("ttft", "TTFT"), ("itl", "ITL"))):
                ax = axes[2 * row + col]
                for arm, arm_rows in cells.sort_values("arm_order").groupby("arm_label",
                                                                             sort=False):
                    arm_rows = arm_rows.sort_values("concurrency")
                    ax.plot(arm_rows["concurrency"], arm_rows[f"{metric}_p50_ms"], marker="o",
                            color=colours[arm])
                    ax.plot(arm_rows["concurrency"], arm_rows[f"{metric}_p99_ms"], marker="x",
                            linestyle="--", color=colours[arm])
                    arms.setdefault(arm, colours[arm])
                ax.set(xscale="log", yscale="log", xlabel="concurrent requests",
                       ylabel=f"{said} (ms)", title=_wrap(f"{said}, {title}", 36))
                _plain_ticks(ax.xaxis, cells["concurrency"])
                _plain_log(ax.yaxis)
                ax.grid(True, which="major", alpha=0.3)
        handles = [Line2D([], [], color=c, marker="o") for c in arms.values()]
        handles += [Line2D([], [], color="black", linestyle="-"),
                    Line2D([], [], color="black", linestyle="--", marker="x")]
        _suptitle(fig, spec.title)
        _legend_below(fig, handles, [*arms, "p50", "p99"])
        _arrange(fig, grid, [2.5] * len(grid))
    return fig


def latency_plot(serving: pd.DataFrame, out: Path, cache_dir=AUTO) -> Path:
    """Every latency figure of latency_figures (the first is latency.png, returned)."""
    specs = latency_figures(serving)

    def render(folder: Path) -> None:
        for spec, fig, rows in serving_drawings(serving, draw_latency):
            _save(fig, folder, spec.name, rows, spec.data)  # the same rows as its throughput's
        serving.to_csv(folder / "latency.csv", index=False)  # every served row, as before

    _publish("latency", {"serving": serving}, out, render, cache_dir)
    return Path(out) / (specs[0].png if specs else "latency.png")


# ---- 3. levers: each ratio with its paired rounds ------------------------------------------------
def _lever_frame(ratios: pd.DataFrame) -> pd.DataFrame:
    measured = ratios[ratios["ratio"].notna()].copy()
    for column in ("comparison", "backend", "place", "engine", "date", "shape"):
        if column not in measured:
            measured[column] = ""
        measured[column] = measured[column].fillna("").astype(str)
    return measured.reset_index(drop=True)


def _lever_panels(measured: pd.DataFrame) -> list[tuple[str, str, pd.DataFrame]]:
    """One panel per lever (and, for 06's levers, the backend its EP arms ran): its title, the
    arm b it is about, and its rows; each row labelled by shape and concurrency (and the run's
    date or id where a panel holds several runs)."""
    panels = []
    for (lever, comparison, backend), rows in measured.groupby(
            ["lever", "comparison", "backend"], sort=False):
        b, a = lever.split(" / ", 1) if " / " in lever else (lever, "a")
        title = f"{b} over {a}" + (f", EP arms on {backend}" if comparison == "levers"
                                   and backend else "")
        rows = rows.sort_values(["run", "shape", "concurrency"])
        several = rows["run"].nunique() > 1
        labels = []
        for r in rows.itertuples():
            label = (f"{r.shape}, " if r.shape else "") + f"c={r.concurrency}"
            if several:
                label += f", {r.run.split('-')[-1]}"
            labels.append(f"{label} ({r.rounds} rounds)")
        panels.append((title, b, rows.assign(row_label=labels)))
    return panels


RATIO_TICKS = ((0.25, 0.5, 0.67, 0.8, 1.0, 1.25, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0),
               (0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 10.0))  # the second where the first crowds


def _ratio_ticks(low: float, high: float) -> list[float]:
    """Few, readable ticks on the ratio's log axis, 1 among them: at most 8 of them."""
    for candidates in RATIO_TICKS:
        ticks = [t for t in candidates if low <= t <= high]
        if len(ticks) <= 8:
            return ticks
    return [t for t in (0.1, 1.0, 10.0) if low <= t <= high]


def _has_interval(row) -> bool:
    """An interval is drawn from MIN_ROUNDS_FOR_INTERVAL paired rounds only (lib.publish.results
    gives low and high from as many; a table that carries them from fewer is not believed)."""
    return row.rounds >= MIN_ROUNDS_FOR_INTERVAL and all(
        v is not None and pd.notna(v) for v in (row.low, row.high))


def lever_spec(ratios: pd.DataFrame) -> FigureSpec:
    measured = _lever_frame(ratios)
    panels = _lever_panels(measured)
    title = (f"When does b beat a? b / a of output tok/s, every paired round\n"
             f"{_setting(measured)}; an interval only from {MIN_ROUNDS_FOR_INTERVAL} rounds"
             ).strip()
    with_interval = int(measured["low"].notna().sum()) if "low" in measured else 0
    alt = (f"Ratios b / a of output tokens per second on a log axis, one panel per lever "
           f"({'; '.join(t for t, _, _ in panels)}), a row per traffic shape and concurrency: "
           "a dot for each paired round, a diamond for the ratio of medians, "
           + ("an interval bar where there are enough rounds" if with_interval
              else "no interval (too few rounds)")
           + ", and a line at 1 (no difference): right of it b is faster, left slower.")
    caption = (f"A round runs arm a and arm b back to back; each grey dot is one round's b / a. "
               f"With fewer than {MIN_ROUNDS_FOR_INTERVAL} rounds no interval is drawn "
               f"(lib.measure.stats.MIN_ROUNDS_FOR_INTERVAL). {_runs_said(measured['run'])}; "
               "data: levers.csv.")
    return FigureSpec("levers", title, alt, caption, tuple(dict.fromkeys(measured["run"])))


def draw_levers(ratios: pd.DataFrame):
    from matplotlib.lines import Line2D

    measured = _lever_frame(ratios)
    spec = lever_spec(ratios)
    panels = _lever_panels(measured)
    plotted = [1.0]  # every value drawn, so that the axis holds them all and the line at 1
    for r in measured.itertuples():
        plotted += [*r.each_round, r.ratio] + ([r.low, r.high] if _has_interval(r) else [])
    plotted = [v for v in plotted if v and v > 0]
    low, high = min(plotted) / 1.15, max(plotted) * 1.15
    ticks = _ratio_ticks(low, high)
    with _fonts():
        heights = [0.3 * len(rows) + 0.3 for _, _, rows in panels] or [1.0]
        fig = _figure()
        grid = _rows(fig, [1] * len(heights))
        axes = [row[0] for row in grid]
        interval_drawn = False
        for ax, (title, b, rows) in zip(axes, panels):
            ax.axvspan(low, 1.0, color="tab:red", alpha=0.06, linewidth=0)
            ax.axvspan(1.0, high, color="tab:green", alpha=0.06, linewidth=0)
            ax.axvline(1.0, color="black", linewidth=1.0)
            for y, r in enumerate(rows.itertuples()):
                rounds = [v for v in r.each_round if v and v > 0]
                ax.scatter(rounds, [y] * len(rounds), color="tab:gray", s=22, zorder=3,
                           gid="rounds")
                ax.scatter([r.ratio], [y], color="tab:blue", marker="D", s=40, zorder=4,
                           gid="ratio")
                if _has_interval(r):
                    ax.errorbar([r.ratio], [y], xerr=[[r.ratio - r.low], [r.high - r.ratio]],
                                color="tab:blue", capsize=4, linewidth=1.5, zorder=2)
                    interval_drawn = True
            ax.set_yticks(range(len(rows)), list(rows["row_label"]))
            ax.set_ylim(len(rows) - 0.5, -0.5)
            ax.set_xscale("log")
            ax.set_xlim(low, high)
            _plain_ticks(ax.xaxis, ticks)
            ax.set_title(_wrap(title, 70))
            ax.set_xlabel(_wrap(f"← {b} slower   ·   b / a   ·   {b} faster →", 70))
            ax.grid(True, axis="x", alpha=0.3)
        handles = [Line2D([], [], color="tab:gray", marker="o", linestyle=""),
                   Line2D([], [], color="tab:blue", marker="D", linestyle=""),
                   Line2D([], [], color="black")]
        labels = ["each paired round", "ratio of medians", "1 = no difference"]
        if interval_drawn:
            handles.append(Line2D([], [], color="tab:blue", marker="|", markersize=10))
            labels.append("95% interval (bootstrap)")
        _suptitle(fig, spec.title)
        _legend_below(fig, handles, labels)
        _arrange(fig, grid, heights)
    return fig


def lever_plot(ratios: pd.DataFrame, out: Path, cache_dir=AUTO) -> Path:
    data = ratios.assign(each_round=ratios["each_round"].map(
        lambda v: " ".join(f"{x:.4f}" for x in v)))

    def render(folder: Path) -> None:
        _save(draw_levers(ratios), folder, "levers", data)

    _publish("levers", {"ratios": ratios}, out, render, cache_dir)
    return Path(out) / "levers.png"


# ---- 4. how close to the wire --------------------------------------------------------------------
def _bound_frames(lines: pd.DataFrame, points: pd.DataFrame):
    lines = lines.copy()
    for column, value in (("kind", "bound"), ("basis", ""), ("nodes", 1)):
        if column not in lines:
            lines[column] = value
    if "nodes" not in points:
        points = points.assign(nodes=1)
    return lines, points


def _bound_panels(lines: pd.DataFrame, points: pd.DataFrame):
    """Within one node (NVLink) above, across nodes (EFA) below: each its own y-axis. A panel
    whose bounds all rest on the same kind of figure (EFA's specification) says so in its title
    rather than in every legend entry."""
    panels = []
    for title, one_node in (("Within one node, over NVLink", True),
                            ("Across nodes, over EFA", False)):
        mine = lines[(lines["nodes"] == 1) == one_node]
        dots = points[(points["nodes"] == 1) == one_node]
        if not (len(mine) or len(dots)):
            continue
        bases = set(mine.loc[mine["kind"] == "bound", "basis"])
        said_once = not one_node and bases and all("EFA" in b for b in bases)
        if said_once:
            title += ": each bound on its instance's EFA specification"
        panels.append((title, mine, dots, not said_once))
    return panels


def bounds_spec(lines: pd.DataFrame, points: pd.DataFrame) -> FigureSpec:
    lines, points = _bound_frames(lines, points)
    title = ("How close to the wire? Measured dispatch + combine against its bound\n"
             "lines: lib.measure.bounds; dots: the guide's test_ep runs; stars: cited")
    wire = lines[lines["kind"] == "wire"]
    alt = ("Log-log plot of dispatch plus combine time in microseconds against tokens per rank, "
           "two panels: within one node over NVLink, the bound taken on NCCL's all_to_all_single "
           "floor measured here" + (" beside the wire's specification (dotted)" if len(wire)
                                    else "") +
           ", with the guide's test_ep runs as dots; across nodes over EFA, the bound at EP 16 "
           "to 64 on the cluster's instance and at each place a cited figure was measured, with "
           "the cited figures as stars.")
    caption = ("A point on its line is as fast as the bound allows. On NVLink the bound is "
               "NCCL's all_to_all_single floor measured here, not the wire: a ratio of 1 there "
               "means as fast as that NCCL call"
               + (f"; the dotted line is the wire itself, {_joined(wire['basis'])}: "
                  "lib/measure/links.yaml cites it" if len(wire) else "")
               + ". Across nodes the bound is the EFA NICs' specification. "
               f"{_runs_said(points.loc[points['run'].astype(str) != '', 'run'])}; data: "
               "bounds.csv.")
    return FigureSpec("bounds", title, alt, caption,
                      tuple(dict.fromkeys(r for r in points["run"] if isinstance(r, str) and r)))


def draw_bounds(lines: pd.DataFrame, points: pd.DataFrame):
    from matplotlib.legend_handler import HandlerTuple

    spec = bounds_spec(lines, points)
    lines, points = _bound_frames(lines, points)
    panels = _bound_panels(lines, points)
    with _fonts():
        fig = _figure()
        grid = _rows(fig, [1] * len(panels))
        axes = [row[0] for row in grid]
        for ax, (title, mine, dots, basis_in_legend) in zip(axes, panels):
            places = list(dict.fromkeys([*mine["line"], *dots["line"]]))
            colours = {line: f"C{i % 10}" for i, line in enumerate(places)}
            entries = {}  # place (or its wire) -> (handles, label): a line and its points as one
            for (line, kind), rows in mine.groupby(["line", "kind"], sort=False):
                rows = rows.sort_values("tokens")
                drawn = ax.plot(rows["tokens"], rows["bound_us"], color=colours[line],
                                linestyle=":" if kind == "wire" else "-",
                                linewidth=2.2 if kind == "wire" else 1.5)[0]
                basis = rows["basis"].iloc[0]
                if kind == "wire":
                    entries[(line, "wire")] = ([drawn], f"{line}, {basis}")
                else:
                    entries[(line, "bound")] = ([drawn], line + (
                        f", bound on {basis}" if basis_in_legend and basis else ""))
            for (line, kind), rows in dots.groupby(["line", "kind"], sort=False):
                guide = kind == "guide run"
                drawn = ax.scatter(rows["tokens"], rows["measured_us"],
                                   color=colours.get(line, "black"), marker="o" if guide else "*",
                                   s=40 if guide else 130, zorder=5, edgecolors="black",
                                   linewidths=0.5)
                handles, label = entries.get((line, "bound"), ([], line))
                said = "dots: measured by the guide (test_ep)" if guide else "stars: cited"
                entries[(line, "bound")] = ([*handles, drawn], f"{label}; {said}")
            ax.set(xscale="log", yscale="log", xlabel="tokens per rank",
                   ylabel="dispatch + combine (µs)", title=_wrap(title, 75))
            _plain_ticks(ax.xaxis, mine["tokens"] if len(mine) else dots["tokens"])
            _plain_log(ax.yaxis)
            ax.grid(True, which="major", alpha=0.3)
            ax.legend([tuple(h) for h, _ in entries.values()],
                      [_wrap(label, 70) for _, label in entries.values()],
                      handler_map={tuple: HandlerTuple(ndivide=None)}, loc="upper left",
                      frameon=False, borderaxespad=0.0)
        _suptitle(fig, spec.title)
        _arrange(fig, grid, [3.0] * len(grid))
    return fig


def bounds_plot(lines: pd.DataFrame, points: pd.DataFrame, out: Path, cache_dir=AUTO) -> Path:
    """Measured D+C against the transfer bound across tokens: a panel within one node (the bound
    on NCCL's all_to_all_single floor, solid; the wire's specification, dotted) and one across
    nodes (EFA), each point in its place's colour (circles: the guide's runs; stars: cited)."""
    data = pd.concat([lines.assign(series=lines.get("kind", "bound")),
                      points.assign(series="measured")], ignore_index=True)

    def render(folder: Path) -> None:
        _save(draw_bounds(lines, points), folder, "bounds", data)

    _publish("bounds", {"lines": lines, "points": points}, out, render, cache_dir)
    return Path(out) / "bounds.png"


# ---- 5. training ---------------------------------------------------------------------------------
def _training_labels(steps: pd.DataFrame) -> dict[str, str]:
    labels = {}
    for run, rows in steps.groupby("run", sort=False):
        hardware = _hardware(rows["hardware"].iloc[0]) if "hardware" in rows else ""
        level = rows["level"].iloc[0]
        label = ", ".join(x for x in (hardware, f"EP {rows['ranks'].max()}") if x)
        label += f": 07 {rows['state'].iloc[0]}"
        if "measured here end-to-end" not in str(level):
            label += f" ({level})"
        labels[run] = label
    said = list(labels.values())
    return {run: (f"{label}, run {run.split('-')[-1]}" if said.count(label) > 1 else label)
            for run, label in labels.items()}


def training_spec(steps: pd.DataFrame) -> FigureSpec:
    title = ("Training through the MoE all-to-all (07): loss and grad norm per step\n"
             "megatron-core, a line per run; dashed: a run whose 07 FAILed")
    labels = _training_labels(steps)
    alt = ("Two panels sharing the step axis: loss (averaged over ranks) above, global grad norm "
           f"below, one line per run: {'; '.join(labels.values())}.")
    caption = (f"{_runs_said(steps['run'])}; data: training.csv. Compare the curves' shape, not "
               "their values: each run has its own model size and vocabulary.")
    return FigureSpec("training", title, alt, caption, tuple(dict.fromkeys(steps["run"])))


def draw_training(steps: pd.DataFrame):
    spec = training_spec(steps)
    labels = _training_labels(steps)
    with _fonts():
        fig = _figure()
        grid = _rows(fig, [1, 1], sharex=True)
        (loss_ax,), (norm_ax,) = grid
        loss_ax.tick_params(labelbottom=False)
        for i, (run, rows) in enumerate(steps.groupby("run", sort=False)):
            rows = rows.sort_values("step")
            failed = rows["state"].iloc[0] == "FAIL"
            style = dict(color=f"C{i % 10}", marker="o", markersize=4,
                         linestyle="--" if failed else "-")
            loss_ax.plot(rows["step"], rows["loss"], label=labels[run], **style)
            norm_ax.plot(rows["step"], rows["grad_norm"], **style)
        loss_ax.set(ylabel="loss (mean over ranks)")
        norm_ax.set(xlabel="step (as logged, from 0)", ylabel="global grad norm")
        for ax in (loss_ax, norm_ax):
            ax.grid(True, alpha=0.3)
        _suptitle(fig, spec.title)
        _legend_below(fig, *loss_ax.get_legend_handles_labels(), columns=1)
        _arrange(fig, grid, [2.3, 2.3])
    return fig


def training_plot(steps: pd.DataFrame, out: Path, cache_dir=AUTO) -> Path:
    """Loss (top) and global grad norm (bottom) per step, a line per run (lib.publish.results'
    training_steps): a run whose 07 FAILed is dashed and says FAIL in its label."""
    def render(folder: Path) -> None:
        _save(draw_training(steps), folder, "training", steps)

    _publish("training", {"steps": steps}, out, render, cache_dir)
    return Path(out) / "training.png"
