"""The transfer bound where figures appear: 03's table (test_ep beside its bound, replayed from a
committed 2x H200 run), plan's 03 for a cluster (EP 32, nothing run), the results page's section
and plot, and the book page made of lib/measure/BOUNDS.md with its table computed.

Expected bounds are computed here by hand from the model's arithmetic (bytes per token as test_ep
counts them, the probability that a token's top-8 hits a group of experts, the link figures of
links.yaml and the latency latency_fit shows), not read back from the function under test."""
from __future__ import annotations

import json
import math
import re
import tempfile
from pathlib import Path

import pandas as pd
import pytest

from lib.core.door import REPO_ROOT, Door
from lib.core.stage import REPLAY_ENV, Stage
from lib.measure import bounds
from lib.publish import pages, plots, results
from lib.publish.catalog import read_run
from lib.stages import kernel, registry

RESULTS = REPO_ROOT / "results"
GUIDE_RUN = "gpu-2xh200-deepep-20261130b"  # test_ep at 128 / 512 / 4096 tokens, not fitted on
FIT_RUN = "gpu-2xh200-deepep-20261130c"    # the run links.yaml fits NVLink's fixed cost on
DISPATCH_BYTES = 7168 + 7168 // 128 * 4 + 8 * (8 + 4)  # FP8 x, fp32 scales, top-k idx + weight
COMBINE_BYTES = 7168 * 2 + 8 * 4                       # BF16 x, top-k weights
NVLINK_GBPS, EFA_GBPS = 312, 16 * 200 / 8 / 8          # links.yaml: best NCCL point; p5en NICs
WIRE_GBPS = 900 / 2  # H200 NVLink 4: 900 GB/s both directions together (NVIDIA), one direction


def hit(group: int, experts: int = 256, topk: int = 8) -> float:
    return 1 - math.comb(experts - group, topk) / math.comb(experts, topk)


def latency() -> float:
    return bounds.latency_fit()["latency_us"]


def ep2_dc_bound(tokens: int) -> float:
    """EP 2 on one node: every token to the other rank with p(hit its 128 experts), over NVLink."""
    sent = tokens * hit(128)
    return (2 * latency() + sent * DISPATCH_BYTES / (NVLINK_GBPS * 1e3)
            + sent * COMBINE_BYTES / (NVLINK_GBPS * 1e3))


def ep32_phase_bound(tokens: int, token_bytes: int) -> float:
    """EP 32 = 4 nodes x 8, hybrid: a token crosses to each of the 3 other nodes it hits, once,
    over EFA (the bottleneck: NVLink's share is under half of it)."""
    return latency() + tokens * hit(64) * 3 * token_bytes / (EFA_GBPS * 1e3)


# ---- 03 ---------------------------------------------------------------------------------------
def shown_by(stage: Stage, data: dict, capsys) -> str:
    """What 03's show() prints, every table column on one line (no terminal decides here)."""
    capsys.readouterr()
    with pd.option_context("display.width", 250, "display.max_columns", 20):
        kernel.show(stage, data)
    return capsys.readouterr().out


def plan_stage(run_dir: Path, **given) -> Stage:
    resolved = registry.resolve("03_kernel_test", {"context": "plan", **given})
    return Stage("03_kernel_test", resolved, run_dir, Door(run_dir, "03_kernel_test", plan=True),
                 None)


def test_plan_shows_the_bound_for_ep32_at_three_token_counts(tmp_path, capsys):
    stage = plan_stage(tmp_path / "run", nodes=4)
    data = kernel.run(stage)
    at = data["bounds"]
    assert (at["ep"], at["nodes"], at["ranks_per_node"], at["instance"]) == (
        32, 4, 8, "p5en.48xlarge")
    assert [r["tokens"] for r in at["rows"]] == [128, 512, 4096]
    for row in at["rows"]:
        dispatch = ep32_phase_bound(row["tokens"], DISPATCH_BYTES)
        combine = ep32_phase_bound(row["tokens"], COMBINE_BYTES)
        assert row["dispatch bound (us)"] == pytest.approx(dispatch, rel=1e-9)
        assert row["D+C bound (us)"] == pytest.approx(dispatch + combine, rel=1e-9)
        assert row["bottleneck D / C"] == "rdma / rdma"
    assert at["rows"][0]["D+C bound (us)"] == pytest.approx(158.2, abs=0.05)
    # nothing ran: every row's measured figure and ratio are absent, the bound is there
    rows = kernel.beside_bounds(data["test_ep"], at)
    assert [(r["test_ep D+C p50 (us)"], r[kernel.RATIO_COLUMN]) for r in rows] == [(None, None)] * 3
    assert [round(r[kernel.BOUND_COLUMN], 1) for r in rows] == [158.2, 613.2, 4859.8]
    shown = shown_by(stage, data, capsys)
    assert ("Transfer bound (lib.measure.bounds: a bound, not a measurement) for EP 32 "
            "(4 nodes x 8 GPUs, p5en.48xlarge)") in shown
    assert re.search(r"\n0\s+128\s+55\.2\s+103\.0\s+158\.2\s+rdma / rdma", shown)
    assert re.search(r"\n2\s+4096\s+1666\.0\s+3193\.8\s+4859\.8", shown)
    assert "RDMA p5en-efa: 50 GB/s per GPU" in shown and "Nothing ran here" in shown
    assert (tmp_path / "run" / "03_kernel_test" / "test_ep.json").exists()
    assert "D+C bound" not in (tmp_path / "run" / "03_kernel_test" / "test_ep.json").read_text()


def test_a_committed_gpu_run_shows_test_ep_beside_its_bound(tmp_path, capsys):
    """A GPU run recorded by an older guide is shown through its evidence (it no longer
    replays): its recorded test_ep rows beside the bound today's code computes for its
    parameters and place (the run's run.json: a measurement on 2xh200-lent), and 03's table."""
    recorded_params = json.loads((RESULTS / GUIDE_RUN / "03_kernel_test" / "params.json")
                                 .read_text())
    stage = local_stage(tmp_path, level="measured here end-to-end",
                        test_ep_tokens=",".join(map(str, recorded_params["test_ep_tokens"])))
    at = kernel.transfer_bounds(stage, GPU_CFG)
    recorded = json.loads((RESULTS / GUIDE_RUN / "03_kernel_test" / "test_ep.json").read_text())
    rows = kernel.beside_bounds(recorded, at)
    assert [r["test_ep D+C p50 (us)"] for r in rows] == [r["test_ep D+C p50 (us)"]
                                                         for r in recorded]
    for row in rows:
        expected = ep2_dc_bound(row["tokens"])
        assert row[kernel.BOUND_COLUMN] == pytest.approx(expected, rel=1e-9)
        assert row[kernel.RATIO_COLUMN] == pytest.approx(row["test_ep D+C p50 (us)"] / expected)
    assert [round(r[kernel.RATIO_COLUMN], 2) for r in rows] == [1.93, 1.34, 1.02]
    assert at["instance"] == "2xh200-lent" and at["ep"] == 2
    result = json.loads((RESULTS / GUIDE_RUN / "03_kernel_test" / "result.json").read_text())
    shown = shown_by(stage, {"test_ep": recorded, "bounds": at, "result": result}, capsys)
    # test_ep.json's columns as recorded (sorted), the bound and the ratio after them
    assert re.search(r"D\+C bound \(us\)\s+test_ep / bound\s*\n"
                     r"0\s+42\.5\s+29\.9\s+128\s+54\.9\s+15\.5\s+1\.93\n", shown)
    assert "for EP 2 (2 GPUs of one node, 2xh200-lent)" in shown
    assert "informational, never a gate" in shown


def local_stage(tmp_path: Path, context: str = "local", level: str | None = None,
                **given) -> Stage:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    if level is not None:
        (run_dir / "run.json").write_text(json.dumps({"context": context, "level": level}))
    resolved = registry.resolve("03_kernel_test", {"context": context, **given})
    return Stage("03_kernel_test", resolved, run_dir, Door(run_dir, "03_kernel_test"), None)


GPU_CFG = {"nproc": 2, "hidden": 7168, "num_topk": 8, "num_experts": 256}


def test_a_run_of_simulated_nodes_shows_no_bound_and_its_rows_as_recorded(tmp_path):
    level = json.loads((RESULTS / "kube-ctlplane-20261207g" / "run.json").read_text())["level"]
    stage = local_stage(tmp_path, "kube", level=level)
    assert kernel.transfer_bounds(stage, {**GPU_CFG, "nproc": 8}) is None
    rows = [{"tokens": 128, "test_ep D+C p50 (us)": 29.189}]
    assert kernel.beside_bounds(rows, None) == rows


def test_a_place_the_model_refuses_says_why_and_shows_no_ratio(tmp_path):
    stage = local_stage(tmp_path, ranks=4)
    at = kernel.transfer_bounds(stage, {**GPU_CFG, "nproc": 4})
    assert "no transfer bound for 1 node(s) x 4 ranks on 2xh200-lent" in at["why_not"]
    assert "ranks_per_node" in at["why_not"] and "2 GPUs per node" in at["why_not"]
    rows = kernel.beside_bounds([{"tokens": 128, "test_ep D+C p50 (us)": 30.0}], at)
    assert rows == [{"tokens": 128, "test_ep D+C p50 (us)": 30.0, kernel.BOUND_COLUMN: None,
                     kernel.RATIO_COLUMN: None}]


def test_the_local_machine_is_bounded_by_nvlink_alone(tmp_path):
    at = kernel.transfer_bounds(local_stage(tmp_path, level=None), GPU_CFG)
    assert at["instance"] == bounds.local_instance() == "2xh200-lent"
    assert [r["bottleneck D / C"] for r in at["rows"]] == ["nvlink / nvlink"] * 3
    assert not any(line.lstrip().startswith("RDMA") for line in at["sources"])
    assert bounds.ratio(None, 10.0) is None and bounds.ratio(30.0, None) is None
    assert bounds.ratio(30.0, 15.0) == 2.0


# ---- the results page -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def guide_runs():
    return [read_run(RESULTS / run_id, []) for run_id in (GUIDE_RUN, FIT_RUN)]


@pytest.fixture(scope="module")
def table(guide_runs):
    return results.bound_rows(guide_runs)


def test_bound_rows_are_computed_from_the_committed_runs_and_cited_figures(table):
    guide = table[table["run"] == GUIDE_RUN]
    assert sorted(guide["tokens"].unique()) == [128, 512, 4096]
    recorded = json.loads((RESULTS / GUIDE_RUN / "03_kernel_test" / "test_ep.json").read_text())
    for row in recorded:  # measured read from the run's test_ep logs = what its 03 recorded
        dc = guide[(guide["tokens"] == row["tokens"]) & (guide["phase"] == "dc")].iloc[0]
        assert dc["measured_us"] == pytest.approx(row["test_ep D+C p50 (us)"])
        assert dc["bound_us"] == pytest.approx(ep2_dc_bound(row["tokens"]), rel=1e-9)
        assert dc["level"] == "measured here end-to-end" and dc["date"] == "2026-11-30"
    assert not guide["fitted_on"].any() and table[table["run"] == FIT_RUN]["fitted_on"].all()
    cited = table[table["kind"] == "cited"]
    entries = bounds.load_cited()["cited"]
    assert len(cited) == sum(len(e["phases"]) for e in entries)
    proxy = cited[(cited["figure"] == "repro-gate1-proxy") & (cited["phase"] == "dc")].iloc[0]
    expected = ep16 = (2 * latency() + 128 * hit(128) * (DISPATCH_BYTES + COMBINE_BYTES)
                       / (EFA_GBPS * 1e3))
    assert proxy["bound_us"] == pytest.approx(expected, rel=1e-9)
    assert proxy["ratio"] == pytest.approx(443.6 / ep16) and proxy["level"] == "cited"
    assert (table["ratio"] >= 1).all()


def test_bounds_plot_draws_every_point_against_its_line(table, tmp_path):
    lines, points = results.bound_lines(results._dc_points(table))
    png = plots.bounds_plot(lines, points, tmp_path)
    assert png == tmp_path / "bounds.png" and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = pd.read_csv(tmp_path / "bounds.csv")
    drawn = data[data["series"] == "bound"]
    cluster = drawn[drawn["cluster"].astype(bool)]
    assert sorted(cluster["ep"].unique()) == [8, 16, 32, 64]
    assert sorted(cluster["tokens"].unique()) == [128, 256, 512, 1024, 2048, 4096, 8192]
    ep32 = cluster[(cluster["ep"] == 32) & (cluster["tokens"] == 128)]["bound_us"].iloc[0]
    assert ep32 == pytest.approx(ep32_phase_bound(128, DISPATCH_BYTES)
                                 + ep32_phase_bound(128, COMBINE_BYTES), rel=1e-9)
    measured = data[data["series"] == "measured"]
    gda = measured[measured["figure"] == "repro-gda-native"].iloc[0]
    assert gda["measured_us"] == pytest.approx(338.5 + 480.7)  # no D+C cited: D + C
    assert gda["line"] == "EP 16: 2 x p5en.48xlarge"
    guide = measured[measured["run"] == GUIDE_RUN].sort_values("tokens")
    assert list(guide["measured_us"]) == pytest.approx([29.899, 56.552, 298.9805])
    assert set(measured["line"]) <= set(drawn["line"])  # every point has its bound line


def test_the_nvlink_lines_are_nccls_floor_and_beside_it_the_wire(table):
    """On NVLink the bound every ratio is taken against is NCCL's all_to_all_single curve
    measured here, named so; the wire is the link's specification, a line of its own (the same
    bytes at 450 GB/s, no fixed cost), where a guide run was measured, never a denominator."""
    lines, _ = results.bound_lines(results._dc_points(table))
    ep2 = lines[lines["line"] == "EP 2: 1 x 2xh200-lent"]
    bound = ep2[ep2["kind"] == "bound"].set_index("tokens")
    wire = ep2[ep2["kind"] == "wire"].set_index("tokens")
    for tokens in (128, 512, 4096):
        assert bound.loc[tokens, "bound_us"] == pytest.approx(ep2_dc_bound(tokens), rel=1e-9)
        sent = tokens * hit(128)
        assert wire.loc[tokens, "bound_us"] == pytest.approx(
            sent * (DISPATCH_BYTES + COMBINE_BYTES) / (WIRE_GBPS * 1e3), rel=1e-9)
    assert set(bound["basis"]) == {
        "NCCL all_to_all_single floor measured here (312 GB/s per GPU per direction)"}
    assert set(wire["basis"]) == {
        "the wire, NVLink 4 specification (450 GB/s per GPU per direction)"}
    assert set(lines.loc[lines["kind"] == "wire", "line"]) == {"EP 2: 1 x 2xh200-lent"}
    efa = lines[lines["nodes"] > 1]
    assert efa["basis"].str.startswith("the wire, EFA: ").all()
    # the ratios are still measured / NCCL's floor: 1.02 at 4096 tokens, ~1.5 of the wire
    guide = table[(table["run"] == GUIDE_RUN) & (table["phase"] == "dc")].set_index("tokens")
    assert guide.loc[4096, "ratio"] == pytest.approx(
        guide.loc[4096, "measured_us"] / bound.loc[4096, "bound_us"])


def test_the_wire_figure_is_a_cited_specification():
    import yaml

    links = yaml.safe_load(bounds.LINKS_PATH.read_text())
    spec = links["nvlink"]["h200-nvlink4-spec"]
    assert spec["basis"] == "specification" and spec["latency"] == "none"
    assert spec["url"] == "https://www.nvidia.com/en-us/data-center/h200/" and spec["date"]
    assert "900GB/s" in spec["source"] and spec["corroborating_url"].startswith("https://")
    assert spec["GBps"] * 2 == spec["stated_GBps_both_directions"] == 900
    assert links["nvlink"]["h200-nccl-2gpu"]["specification"] == "h200-nvlink4-spec"
    assert bounds.wire_nvlink("2xh200-lent") == bounds.wire_nvlink("p5en.48xlarge") \
        == "h200-nvlink4-spec"
    assert bounds.wire_nvlink("p6-b200.48xlarge") is None  # its figure names no specification
    # no instance is bounded by the specification: every ratio stays against what was measured
    assert all(m["nvlink"] != "h200-nvlink4-spec" for m in links["instances"].values())
    figures = bounds.link_figures("2xh200-lent", nvlink="h200-nvlink4-spec")
    assert figures["nvlink"]["GBps"] == 450 and figures["nvlink"]["latency_us"] == 0.0
    with pytest.raises(ValueError, match="nvlink"):
        bounds.link_figures("2xh200-lent", nvlink="no-such-link")


def test_results_section_and_the_bounds_page(guide_runs, table, tmp_path):
    ev = pages.Evidence(guide_runs)
    section = "\n".join(pages.bounds_section(ev, tmp_path))
    assert (tmp_path / "bounds.png").exists()
    assert "| test_ep 128 tokens | EP 2, 1 x 2xh200-lent, fp8 dispatch | 128 | D+C | " \
           "15.5 / 29.9 | 1.93 |" in section
    assert "| repro-gate1-proxy | EP 16, 2 x p5en.48xlarge, fp8 dispatch | 128 | D+C | " \
           "62.3 / 443.6 | 7.12 | cited (2026-07-06): note 1 |" in section
    assert "its latency fit" in section and "[the transfer bound](bounds.md)" in section
    page = pages.bounds_page(ev, table)
    assert page.startswith("# How close to the wire")
    assert "| guide, 2x H200 NVLink, EP 2 |" not in page  # BOUNDS.md's typed table, replaced
    assert "15.5 / 29.9 | 1.93" in page and "### The proxy's issue rate" in page
    assert "every ratio is at least 1, so the bound held" in page
    below = table.copy()
    below.loc[below.index[0], "ratio"] = 0.5  # a figure faster than its bound: the model failed
    assert "**1 below 1: the bound failed there.**" in pages.bounds_page(ev, below)


def test_the_typed_table_of_bounds_md_is_the_computed_one():
    """BOUNDS.md's rounded table may not drift from checked_table(): each bound and ratio it
    types is a computed one at that token count, at the precision typed."""
    computed = bounds.checked_table()
    text = bounds.Path(bounds.__file__).with_name("BOUNDS.md").read_text(encoding="utf-8")
    typed = [line.split("|")[1:-1] for line in text.splitlines()
             if re.match(r"\| (guide|public|repro|AWS|whn09)", line)]
    assert len(typed) == 10
    for cells in typed:
        at = computed[computed["tokens"] == int(cells[1])]
        for column, cell in (("bound_us", cells[2]), ("ratio", cells[4])):
            for number in re.findall(r"\d+\.\d+", cell):
                digits = len(number.split(".")[1])
                assert any(round(v, digits) == float(number) for v in at[column]), (
                    cells[0], column, number)
