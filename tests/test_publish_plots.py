"""The results page's figures (lib.publish.plots) read in the page column and on a phone, say what
they compare, and are cached by what they were drawn from.

Every figure is checked the way a reader meets it: its PNG's pixel size (at most the 784-px page
column), the size of every text drawn (at least plots.MIN_FONT_PT), every text inside the image,
no two tick labels of an axis overlapping, no legend over any axes' data, at most two panels side
by side, and the title naming the comparison. Small tables are made here; the committed runs'
tables (lib.publish.results) are drawn too."""
from __future__ import annotations

import itertools
from pathlib import Path

import pandas as pd
import pytest
from matplotlib.container import ErrorbarContainer
from PIL import Image

from lib.core.door import REPO_ROOT
from lib.measure.stats import MIN_ROUNDS_FOR_INTERVAL
from lib.publish import pages, plots, results
from lib.publish.catalog import catalog

RESULTS = REPO_ROOT / "results"
COLUMN_PX = 784  # the book's page column (a 1400-px window)


# ---- what a reader sees --------------------------------------------------------------------------
def drawn_texts(fig):
    """Every text the figure draws: its title, each axes' title, axis labels and the tick labels
    inside the axis' view, and every legend's entries."""
    texts = [fig._suptitle] if fig._suptitle is not None else []
    for ax in fig.axes:
        texts += [ax.title, ax.xaxis.label, ax.yaxis.label]
        for axis in (ax.xaxis, ax.yaxis):
            low, high = sorted(axis.get_view_interval())
            span = (high - low) * 1e-9
            for tick in axis.get_major_ticks():
                if low - span <= tick.get_loc() <= high + span and tick.label1.get_visible():
                    texts.append(tick.label1)
    for legend in [*fig.legends, *(ax.get_legend() for ax in fig.axes if ax.get_legend())]:
        texts += legend.get_texts()
    return [t for t in texts if t.get_visible() and t.get_text().strip()]


def tick_labels(axis):
    low, high = sorted(axis.get_view_interval())
    span = (high - low) * 1e-9
    return [t.label1 for t in axis.get_major_ticks()
            if low - span <= t.get_loc() <= high + span and t.label1.get_visible()
            and t.label1.get_text()]


def assert_readable(fig, name: str = "") -> None:
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    width, height = fig.bbox.width, fig.bbox.height
    assert width <= COLUMN_PX, (name, width)
    for text in drawn_texts(fig):
        assert text.get_fontsize() >= plots.MIN_FONT_PT, (name, text.get_text())
        box = text.get_window_extent(renderer)
        assert box.x0 >= -1 and box.y0 >= -1 and box.x1 <= width + 1 and box.y1 <= height + 1, (
            name, text.get_text(), box, width, height)
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            boxes = [t.get_window_extent(renderer) for t in tick_labels(axis)]
            for a, b in itertools.combinations(boxes, 2):
                assert not a.overlaps(b), (name, "tick labels overlap", axis.axis_name,
                                           [t.get_text() for t in tick_labels(axis)])
    titles = [ax.title.get_window_extent(renderer) for ax in fig.axes if ax.get_title()]
    for a, b in itertools.combinations(titles, 2):
        assert not a.overlaps(b), (name, "panel titles overlap")
    legends = [*fig.legends, *(ax.get_legend() for ax in fig.axes if ax.get_legend())]
    for legend, ax in itertools.product(legends, fig.axes):
        assert not legend.get_window_extent(renderer).overlaps(ax.get_window_extent(renderer)), (
            name, "a legend covers an axes")
    rows = {}
    for ax in fig.axes:
        rows.setdefault(round(ax.get_position().y0, 3), []).append(ax)
    assert max(len(r) for r in rows.values()) <= 2, (name, "more than two panels side by side")


def png_size(path: Path) -> tuple[int, int]:
    with Image.open(path) as image:
        return image.size


def all_text(fig) -> str:
    return "\n".join(t.get_text() for t in drawn_texts(fig))


# ---- small tables made here ----------------------------------------------------------------------
DECODE = "decode: 120 tokens in, 128 out"
PREFILL = "prefill: 1536 tokens in, 16 out"


def serving_table(gpus=2) -> pd.DataFrame:
    """05's backend A/B as lib.publish.results.serving_points gives it: two arms, two shapes."""
    rows = []
    for (order, backend), (shape, said), c in itertools.product(
            enumerate(["allgather_reducescatter", "deepep_v2"]),
            [("decode", DECODE), ("prefill", PREFILL)], [4, 8, 32]):
        tps = 100.0 * c * (1 + order) + (7 if shape == "prefill" else 0)
        rows.append({"run": "gpu-2xh200-test-run", "stage": "05_sweep",
                     "arm": f"vllm-{backend.replace('_', '-')}-{shape}", "concurrency": c,
                     "repeats": 3, "output_tps": tps, "output_tps_min": tps * 0.9,
                     "output_tps_max": tps * 1.1, "ttft_p50_ms": 20.0 + c,
                     "ttft_p99_ms": 40.0 + 9 * c,
                     "itl_p50_ms": 7.0 + order, "itl_p99_ms": 9.0 + order, "gpus": gpus,
                     "place": "2x H200", "engine": "vLLM 0.24.0", "date": "2026-11-30",
                     "comparison": "backends", "backend": backend, "arm_label": backend,
                     "arm_order": order, "shape": shape, "shape_said": said})
    table = pd.DataFrame(rows)
    for total in ("output_tps", "output_tps_min", "output_tps_max"):
        table[f"{total.replace('output_tps', 'output_tps_per_gpu')}"] = table[total] / gpus
    return table


def ratio_table(rounds: int) -> pd.DataFrame:
    """One lever at one concurrency, as lib.publish.results.lever_ratios gives it: an interval
    only from MIN_ROUNDS_FOR_INTERVAL rounds."""
    each = [0.9 + 0.05 * i for i in range(rounds)]
    interval = rounds >= MIN_ROUNDS_FOR_INTERVAL
    return pd.DataFrame([{
        "run": "gpu-2xh200-test-run", "stage": "06_multicomm", "lever": "graphs+EP / eager+EP",
        "shape": "", "concurrency": 8, "rounds": rounds, "ratio": sorted(each)[rounds // 2],
        "low": min(each) if interval else None, "high": max(each) if interval else None,
        "each_round": each, "why_not": "", "comparison": "levers",
        "backend": "allgather_reducescatter", "place": "2x H200", "engine": "vLLM 0.24.0",
        "date": "2026-12-01"}])


KERNEL = pd.DataFrame([
    {"run": f"gpu-2xh200-k{i}", "series": series, "tokens": tokens, "p50_us": base * tokens / 128
     + i, "hardware": "2x NVIDIA H200, one host"}
    for i in range(2) for series, base in (("DeepEP test_ep", 30.0), ("torch benchmark", 55.0),
                                            ("NCCL floor (two all_to_all_single)", 40.0))
    for tokens in (128, 512, 4096)])
PUBLISHED = {"series": "DeepEP test_ep, 2x p5en over EFA (cited)", "tokens": 128, "p50_us": 443.6,
             "hardware": "2x p5en.48xlarge (16x H200), EP16 across 2 nodes over EFA",
             "date": "2026-07-06", "source": "a public reproduction"}
STEPS = pd.DataFrame([{"run": run, "step": s, "loss": 8.7 - 0.2 * s + fail * s * s * 0.3,
                       "grad_norm": 2.0 + fail * s, "crossing": 0, "ranks": 1,
                       "level": "measured here end-to-end", "state": "FAIL" if fail else "PASS",
                       "hardware": "1x NVIDIA H200, one host"}
                      for run, fail in (("gpu-1xh200-train-a", 0), ("gpu-1xh200-train-b", 1))
                      for s in range(5)])


# ---- each figure ---------------------------------------------------------------------------------
def test_serving_names_the_comparison_and_reads_per_gpu(tmp_path):
    table = serving_table()
    [(spec, fig, rows)] = plots.serving_drawings(table)
    assert spec.name == "serving" and len(rows) == len(table)
    title = fig._suptitle.get_text()
    assert title.startswith("deepep_v2 vs allgather_reducescatter: output tok/s per GPU")
    assert "vLLM 0.24.0, 2x H200" in title
    assert_readable(fig, "serving")
    decode, prefill = fig.axes
    assert (decode.get_title(), prefill.get_title()) == (DECODE, PREFILL)  # the shape, not a run
    assert decode.get_ylabel().startswith("output tok/s per GPU")
    assert "gpu-2xh200-test-run" not in all_text(fig)
    assert decode.get_ylim() != prefill.get_ylim()  # each panel its own y-axis
    drawn = {bars.get_label(): list(bars.lines[0].get_ydata()) for bars in decode.containers}
    expected = table[(table["shape"] == "decode")
                     & (table["arm_label"] == "deepep_v2")].sort_values("concurrency")
    assert drawn["deepep_v2"] == pytest.approx(list(expected["output_tps"] / 2))
    assert "gpu-2xh200-test-run" in spec.caption and "2 GPUs one server spans" in spec.caption
    png = plots.serving_plot(table, tmp_path, cache_dir=None)
    assert png == tmp_path / "serving.png" and png_size(png)[0] <= COLUMN_PX
    assert spec.data == "serving-backends.csv"
    for data in ("serving.csv", spec.data):  # every served row; the rows this figure drew
        assert pd.read_csv(tmp_path / data)["output_tps"].tolist() == \
            table["output_tps"].tolist()


def test_two_runs_of_one_comparison_say_their_dates_not_their_ids():
    other = serving_table().assign(run="gpu-2xh200-test-run-b", date="2026-12-01")
    [(spec, fig, _)] = plots.serving_drawings(pd.concat([serving_table(), other]))
    assert [ax.get_title().replace("\n", " ") for ax in fig.axes] == [
        f"{DECODE} (2026-11-30)", f"{PREFILL} (2026-11-30)", f"{DECODE} (2026-12-01)",
        f"{PREFILL} (2026-12-01)"]
    assert_readable(fig, "serving, two runs")
    assert "gpu-2xh200-test-run`, `gpu-2xh200-test-run-b" in spec.caption


def test_a_table_without_the_gpu_count_says_whole_server():
    table = serving_table().drop(columns=["gpus", "place"])
    [(spec, fig, _)] = plots.serving_drawings(table)
    assert "output tok/s (whole server)" in spec.title and "per GPU" not in spec.title
    assert "not recorded" in spec.caption


def test_latency_one_row_of_ttft_and_itl_per_shape():
    [(spec, fig, _)] = plots.serving_drawings(serving_table(), plots.draw_latency)
    assert spec.name == "latency"
    assert fig._suptitle.get_text().startswith("deepep_v2 vs allgather_reducescatter: latency")
    assert [ax.get_title().replace("\n", " ") for ax in fig.axes] == [
        f"TTFT, {DECODE}", f"ITL, {DECODE}", f"TTFT, {PREFILL}", f"ITL, {PREFILL}"]
    assert_readable(fig, "latency")


def levers_drawn(rounds: int):
    fig = plots.draw_levers(ratio_table(rounds))
    [ax] = fig.axes
    dots = [c for c in ax.collections if c.get_gid() == "rounds"]
    intervals = [c for c in ax.containers if isinstance(c, ErrorbarContainer)]
    return fig, ax, dots, intervals


def test_three_rounds_draw_each_round_and_no_interval():
    fig, ax, dots, intervals = levers_drawn(3)
    assert len(dots) == 1 and sorted(dots[0].get_offsets()[:, 0]) == pytest.approx(
        [0.9, 0.95, 1.0])  # each paired round's b / a
    [ratio] = [c for c in ax.collections if c.get_gid() == "ratio"]
    assert ratio.get_offsets()[0, 0] == pytest.approx(0.95)
    assert intervals == []
    assert ax.get_yticklabels()[0].get_text() == "c=8 (3 rounds)"
    assert ax.get_title() == "graphs+EP over eager+EP, EP arms on allgather_reducescatter"
    assert "graphs+EP slower" in ax.get_xlabel() and "graphs+EP faster" in ax.get_xlabel()
    assert any(list(line.get_xdata()) == [1.0, 1.0] for line in ax.get_lines())  # the line at 1
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert "1 = no difference" in legend and not any("interval" in t for t in legend)
    assert_readable(fig, "levers, 3 rounds")


def test_an_interval_from_fewer_rounds_is_not_drawn():
    table = ratio_table(3).assign(low=0.9, high=1.0)  # as a bootstrap over 3 rounds gives it
    ax = plots.draw_levers(table).axes[0]
    assert not [c for c in ax.containers if isinstance(c, ErrorbarContainer)]


def test_five_rounds_draw_an_interval():
    fig, ax, dots, intervals = levers_drawn(MIN_ROUNDS_FOR_INTERVAL)
    assert len(dots) == 1 and len(dots[0].get_offsets()) == MIN_ROUNDS_FOR_INTERVAL
    assert len(intervals) == 1
    segment = intervals[0].lines[2][0].get_segments()[0]
    assert sorted(segment[:, 0]) == pytest.approx([0.9, 1.1])  # low to high
    assert any("interval" in t.get_text() for t in fig.legends[0].get_texts())
    assert_readable(fig, "levers, 5 rounds")


def test_kernel_and_training_read(tmp_path):
    fig = plots.draw_kernel(KERNEL, PUBLISHED)
    assert fig._suptitle.get_text().startswith(
        "DeepEP test_ep vs torch benchmark vs NCCL floor: dispatch + combine p50")
    assert "measured on 2x H200" in fig._suptitle.get_text()
    assert_readable(fig, "kernel")
    fig = plots.draw_training(STEPS)
    assert "loss and grad norm per step" in fig._suptitle.get_text()
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert labels == ["1x H200, EP 1: 07 PASS", "1x H200, EP 1: 07 FAIL"]
    assert_readable(fig, "training")
    for png in (plots.kernel_plot(KERNEL, PUBLISHED, tmp_path, cache_dir=None),
                plots.training_plot(STEPS, tmp_path, cache_dir=None)):
        assert png_size(png)[0] <= COLUMN_PX


# ---- the committed runs' tables ------------------------------------------------------------------
@pytest.fixture(scope="module")
def committed():
    runs = catalog(RESULTS)
    ev = pages.Evidence(runs)
    table = results.bound_rows(runs)
    lines, points = results.bound_lines(results._dc_points(table))
    return {"runs": runs, "ev": ev, "lines": lines, "points": points,
            "steps": results.training_steps(runs)}


def test_serving_points_are_per_gpu_from_the_runs_record(committed):
    serving = committed["ev"].serving
    assert len(serving) and (serving["gpus"] == 2).all()  # 04's vllm_serve.json: DP = EP = 2
    assert serving["output_tps_per_gpu"].tolist() == pytest.approx(
        (serving["output_tps"] / serving["gpus"]).tolist())
    assert set(serving["place"]) == {"2x H200"} and set(serving["engine"]) == {"vLLM 0.24.0"}
    ab = serving[serving["comparison"] == "backends"]
    assert set(ab["arm_label"]) == {"deepep_v2", "allgather_reducescatter"}
    assert set(ab["shape_said"]) == {DECODE, PREFILL}


def test_every_committed_figure_reads_in_the_column(committed, tmp_path):
    ev = committed["ev"]
    figures = [("kernel", plots.draw_kernel(ev.kernel, ev.published_kernel)),
               ("levers", plots.draw_levers(ev.ratios)),
               ("bounds", plots.draw_bounds(committed["lines"], committed["points"])),
               ("training", plots.draw_training(committed["steps"]))]
    for draw in (None, plots.draw_latency):
        figures += [(spec.name, fig) for spec, fig, _ in plots.serving_drawings(ev.serving, draw)]
    names = [name for name, _ in figures]
    assert names[:4] == ["kernel", "levers", "bounds", "training"]
    assert {"serving", "latency", "serving-levers", "latency-levers"} <= set(names)
    run_ids = {r.run_id for r in committed["runs"]}
    for name, fig in figures:
        assert_readable(fig, name)
        titles = [fig._suptitle.get_text(), *(ax.get_title() for ax in fig.axes)]
        assert not any(run in title for run in run_ids for title in titles), name
    paths = [plots.kernel_plot(ev.kernel, ev.published_kernel, tmp_path, cache_dir=None),
             plots.serving_plot(ev.serving, tmp_path, cache_dir=None),
             plots.latency_plot(ev.serving, tmp_path, cache_dir=None),
             plots.lever_plot(ev.ratios, tmp_path, cache_dir=None),
             plots.bounds_plot(committed["lines"], committed["points"], tmp_path, cache_dir=None),
             plots.training_plot(committed["steps"], tmp_path, cache_dir=None)]
    assert [p.name for p in paths] == ["kernel.png", "serving.png", "latency.png", "levers.png",
                                       "bounds.png", "training.png"]
    for spec in [*plots.serving_figures(ev.serving), *plots.latency_figures(ev.serving)]:
        assert (tmp_path / spec.png).exists() and (tmp_path / spec.data).exists()
        assert spec.alt and spec.caption and spec.runs
    for png in tmp_path.glob("*.png"):
        assert png_size(png)[0] <= COLUMN_PX, png.name


def test_the_nvlink_bound_is_named_for_what_it_is(committed):
    fig = plots.draw_bounds(committed["lines"], committed["points"])
    nvlink, efa = fig.axes
    assert nvlink.get_title() == "Within one node, over NVLink"
    said = " ".join(t.get_text().replace("\n", " ") for t in nvlink.get_legend().get_texts())
    assert "EP 2: 1 x 2xh200-lent, bound on NCCL all_to_all_single floor measured here" in said
    assert "EP 2: 1 x 2xh200-lent, the wire, NVLink 4 specification (450 GB/s" in said
    assert efa.get_title().startswith("Across nodes, over EFA")
    spec = plots.bounds_spec(committed["lines"], committed["points"])
    assert "not the wire" in spec.caption and "NCCL's all_to_all_single" in spec.alt


# ---- the cache -----------------------------------------------------------------------------------
def test_the_cache_gives_the_same_bytes_and_redraws_when_a_number_changes(tmp_path, monkeypatch):
    cache, first, second = tmp_path / "cache", tmp_path / "a", tmp_path / "b"
    plots.kernel_plot(KERNEL, PUBLISHED, first, cache_dir=cache)
    entries = list(cache.glob("kernel-*"))
    assert len(entries) == 1

    def no_drawing(*args, **kwargs):
        raise AssertionError("drawn again from the same data")

    monkeypatch.setattr(plots, "draw_kernel", no_drawing)
    plots.kernel_plot(KERNEL.copy(), dict(PUBLISHED), second, cache_dir=cache)
    for name in ("kernel.png", "kernel.csv"):
        assert (second / name).read_bytes() == (first / name).read_bytes()
    monkeypatch.undo()
    changed = KERNEL.copy()
    changed.loc[0, "p50_us"] += 1.0
    plots.kernel_plot(changed, PUBLISHED, second, cache_dir=cache)
    assert len(list(cache.glob("kernel-*"))) == 2
    assert (second / "kernel.png").read_bytes() != (first / "kernel.png").read_bytes()
    assert pd.read_csv(second / "kernel.csv")["p50_us"].iloc[0] == changed["p50_us"].iloc[0]


def test_a_book_build_caches_beside_its_figures_folder(tmp_path):
    figures = tmp_path / "_build" / ".src" / "book" / "figures"
    assert plots.cache_root(figures, plots.AUTO) == tmp_path / "_build" / ".figure-cache"
    assert plots.cache_root(tmp_path / "elsewhere", plots.AUTO) is None
    plots.training_plot(STEPS, figures)
    assert len(list((tmp_path / "_build" / ".figure-cache").glob("training-*"))) == 1
    assert (figures / "training.png").exists()


def test_the_digest_follows_the_data_and_the_code(monkeypatch):
    key = plots.digest("kernel", {"points": KERNEL, "published": PUBLISHED})
    assert key == plots.digest("kernel", {"points": KERNEL.copy(), "published": dict(PUBLISHED)})
    nudged = KERNEL.copy()
    nudged.loc[3, "p50_us"] *= 1 + 1e-12  # any change of a number, however small
    assert key != plots.digest("kernel", {"points": nudged, "published": PUBLISHED})
    monkeypatch.setattr(plots, "code_version", lambda: "another version of plots.py")
    assert key != plots.digest("kernel", {"points": KERNEL, "published": PUBLISHED})
