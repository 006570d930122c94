"""lib.measure.aiperf against real AIPerf artifacts (0.10 public reproduction, 0.13 sweep).

Failure cases are built by copying a real fixture into tmp_path and editing it, so every format
here is one AIPerf actually wrote.
"""

import json
import re
import shutil
import subprocess
import sys
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path

import pandas as pd
import pytest

from lib.measure import aiperf
from lib.measure.aiperf import (PUBLIC_TREE_COLUMNS, SUMMARY_COLUMNS, find_cell_dirs, gate_cells,
                                infer_arm, read_exports, read_public_tree)

REPO = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).resolve().parents[1].parent / "shared" / "fixtures"
PUBLIC = FIXTURES / "public-repro"
PUBLIC_RESULTS = PUBLIC / "results"
PUBLIC_RUN_FOLDER = PUBLIC_RESULTS / "vllm-deepep-dropin-20260706"
VLLM_RESULTS = PUBLIC_RUN_FOLDER / "vllm"
EPNC8_C4 = VLLM_RESULTS / "aiperf-epnc8" / "aiperf-vllm-epnc8-c4_isl120"
EPNC1_C4 = VLLM_RESULTS / "aiperf-epnc1" / "aiperf-deepep-vllm-epnc1-c4_isl120"
SWEEP_013 = FIXTURES / "aiperf-0.13" / "sweep-c1-c2-c4"


def fixture(path: Path) -> Path:
    # Missing evidence must fail the suite, never skip it.
    assert path.exists(), f"fixture missing: {path} (expected the shared fixtures at {FIXTURES})"
    return path


@pytest.fixture(scope="module")
def public() -> pd.DataFrame:
    return read_exports(fixture(PUBLIC))


def cell(df: pd.DataFrame, arm: str, concurrency: int) -> pd.Series:
    rows = df[(df["arm"] == arm) & (df["concurrency"] == concurrency)]
    assert len(rows) == 1, f"expected one {arm} c{concurrency} row, got {len(rows)}"
    return rows.iloc[0]


def half_up(value: float, decimals: int) -> float:
    exponent = Decimal(1).scaleb(-decimals)
    return float(Decimal(str(value)).quantize(exponent, rounding=ROUND_HALF_UP))


# ---------------------------------------------------------------------------------------------
# Published figures
# ---------------------------------------------------------------------------------------------

def test_one_schema(public):
    assert list(public.columns) == list(SUMMARY_COLUMNS)
    assert len(public) == 6


@pytest.mark.parametrize("arm,expected", [
    ("epnc1", {4: 19.5, 8: 38.8, 32: 144.6}),
    ("epnc8", {4: 39.4, 8: 76.5, 32: 273.0}),
])
def test_aggregate_throughput_reproduces_published(public, arm, expected):
    for concurrency, published in expected.items():
        assert round(cell(public, arm, concurrency)["output_tps"], 1) == published


@pytest.mark.parametrize("arm,expected", [
    ("epnc1", {4: 475, 8: 510, 32: 899}),
    ("epnc8", {4: 196, 8: 237, 32: 280}),
])
def test_ttft_p50_matches_anchors_at_published_precision(public, arm, expected):
    # RESULTS.md rounds the summary JSON's 0.1 ms value to 1 ms (474.49 -> 474.5 -> 475), so the
    # published precision is reached through that same two-step rounding.
    for concurrency, published in expected.items():
        ttft = cell(public, arm, concurrency)["ttft_p50_ms"]
        assert half_up(half_up(ttft, 1), 0) == published
        assert abs(ttft - published) < 1.0


@pytest.mark.parametrize("arm", ["epnc1", "epnc8"])
def test_zero_errors_over_232_requests_per_arm(public, arm):
    rows = public[public["arm"] == arm]
    assert sorted(rows["concurrency"]) == [4, 8, 32]
    assert rows["requests_requested"].sum() == 232
    assert rows["requests_completed"].sum() == 232
    assert rows["errors"].sum() == 0
    assert set(rows["aiperf_version"]) == {"0.10.0"}


def test_public_gates_all_pass(public):
    gates = gate_cells(public)
    assert gates and {g["status"] for g in gates} == {"PASS"}


def test_cross_check_t3_hand_written_summary(public):
    summary = json.loads(fixture(VLLM_RESULTS / "t3_aiperf_epnc1_summary.json").read_text())
    assert summary["aiperf"]["version"] == "0.10.0"
    for published in summary["aiperf"]["cells"]:
        row = cell(public, "epnc1", published["concurrency"])
        assert row["requests_completed"] == published["requests"]
        assert row["errors"] == published["errors"]
        assert round(row["output_tps"], 2) == published["agg_tps"]
        assert round(row["output_tps_per_user"], 2) == published["per_user_tps"]
        assert round(row["ttft_p50_ms"], 1) == published["ttft_p50_ms"]
        assert round(row["ttft_p99_ms"], 1) == published["ttft_p99_ms"]


def test_cross_check_t8_hand_written_summary(public):
    path = VLLM_RESULTS / "aiperf-epnc8" / "t8_aiperf_epnc8_summary.json"
    summary = json.loads(fixture(path).read_text())
    for name, published in summary["cells"].items():
        concurrency = int(re.match(r"c(\d+)_", name).group(1))
        row = cell(public, "epnc8", concurrency)
        assert row["requests_completed"] == published["requests"]
        assert row["errors"] == sum(e.get("count", 0) for e in published["errors"])
        assert round(row["output_tps"], 2) == published["agg_tok_s"]
        assert round(row["output_tps_per_user"], 2) == published["per_user_tok_s"]
        assert round(row["ttft_p50_ms"], 1) == published["ttft_p50_ms"]
        assert round(row["itl_p50_ms"], 1) == published["itl_p50_ms"]


def test_cross_check_t8_sweep_log_cell_lines(public):
    log = fixture(VLLM_RESULTS / "aiperf-epnc8" / "t8_aiperf.log").read_text()
    lines = re.findall(r"CELL c(\d+)_\S+ .*?reqs ([\d.]+) agg_tps ([\d.]+)", log)
    assert len(lines) == 3
    for concurrency, requests, agg in lines:
        row = cell(public, "epnc8", int(concurrency))
        assert row["requests_completed"] == float(requests)
        assert round(row["output_tps"], 2) == float(agg)


def test_log_counts_read_from_real_010_log(public):
    row = cell(public, "epnc8", 4)
    assert row["cancelled"] == 0 and "log=0" in row["errors_from"]
    assert cell(public, "epnc1", 4)["cancelled"] is pd.NA  # epnc1 committed no logs


# ---------------------------------------------------------------------------------------------
# AIPerf 0.13 sweep
# ---------------------------------------------------------------------------------------------

def test_013_sweep_has_three_cells_and_no_aggregate_double_count():
    df = read_exports(fixture(SWEEP_013))
    assert list(df["concurrency"]) == [1, 2, 4]
    assert set(df["aiperf_version"]) == {"0.13.0"}
    assert all("aggregate" not in Path(s).parts for s in df["source"])


def test_013_uses_profiling_phase_not_warmup():
    df = read_exports(SWEEP_013)
    for row in df.itertuples():
        phases = Path(row.source) / "phases"
        profiling = json.loads((phases / "profiling" / "profile_export_aiperf.json").read_text())
        warmup = json.loads((phases / "warmup" / "profile_export_aiperf.json").read_text())
        warmup_requests = int(warmup["request_count"]["avg"])
        assert warmup_requests > 0
        assert row.requests_completed == profiling["completed_request_count"]["avg"] == 40
        assert row.requests_completed != 40 + warmup_requests
        assert row.requests_requested == 40
        assert row.output_tps == profiling["output_token_throughput"]["avg"]
        assert row.output_tps != warmup["output_token_throughput"]["avg"]


def test_013_single_cell_directory_and_whole_tree():
    one = read_exports(SWEEP_013 / "concurrency_2")
    assert len(one) == 1 and one["concurrency"].iloc[0] == 2
    everything = read_exports(fixture(FIXTURES))
    assert len(everything) == 9


def test_013_output_length_mismatch_is_pass_with_note():
    gates = gate_cells(read_exports(SWEEP_013))
    length = [g for g in gates if "output length" in g["gate"]]
    assert len(length) == 3
    for gate in length:
        assert gate["status"] == "PASS" and gate["observed"] > 0 and "note" in gate["reason"]
    assert {g["status"] for g in gates} == {"PASS"}


# ---------------------------------------------------------------------------------------------
# Naming conventions
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("path,arm", [
    # A cell folder alone: its whole <words>, the inverse of lib.measure.sweep.cell_dir.
    ("x/aiperf-vllm-epnc8-c4_isl120", "vllm-epnc8"),
    ("x/aiperf-deepep-vllm-epnc1-c32_isl120", "deepep-vllm-epnc1"),
    ("r/05_sweep/aiperf/repeat_1/aiperf-vllm-deepep-v2-decode-c4", "vllm-deepep-v2-decode"),
    ("r/06_multicomm/aiperf/repeat_1/aiperf-vllm-eager-ep-c4", "vllm-eager-ep"),
    ("x/aiperf-vllm-epnc8-c4_isl120/repeat_2/something", "vllm-epnc8"),
    # A cell folder in an aiperf-<arm> folder (the public layout): the arm folder's.
    ("vllm/aiperf-epnc1/aiperf-deepep-vllm-epnc1-c32_isl120", "epnc1"),
    ("vllm/aiperf-epnc8/aiperf-vllm-c4_isl120", "epnc8"),
    ("vllm/aiperf-epnc8/repeat_2/aiperf-vllm-c4_isl120", "epnc8"),
    # A 0.13 sweep: the sweep folder's name, never the folder above it.
    ("x/aiperf-epnc8/concurrency_4", "epnc8"),
    ("x/aiperf-deepep-vllm/concurrency_4", "deepep-vllm"),
    ("x/sweep-c1-c2-c4/concurrency_4", "sweep-c1-c2-c4"),
    ("fixtures/aiperf-0.13/sweep-c1-c2-c4/concurrency_4", "sweep-c1-c2-c4"),
])
def test_arm_inference_rule(path, arm):
    assert infer_arm(Path(path)) == arm


def test_explicit_arm_overrides_folder_names():
    df = read_exports(SWEEP_013, arm="local")
    assert set(df["arm"]) == {"local"}


def test_repeat_folders(tmp_path):
    for repeat in (1, 2):
        shutil.copytree(fixture(EPNC8_C4), tmp_path / f"repeat_{repeat}" / EPNC8_C4.name)
    df = read_exports(tmp_path)
    assert list(df["repeat"]) == [1, 2]
    assert list(df["arm"]) == ["vllm-epnc8", "vllm-epnc8"]


def test_two_cells_with_the_same_key_are_refused(tmp_path):
    shutil.copytree(fixture(EPNC8_C4), tmp_path / "a" / EPNC8_C4.name)
    shutil.copytree(EPNC8_C4, tmp_path / "b" / EPNC8_C4.name)
    with pytest.raises(ValueError, match="repeat_<n>"):
        read_exports(tmp_path)


def test_same_path_twice_is_read_once():
    assert len(read_exports(EPNC8_C4, EPNC8_C4)) == 1


def test_missing_and_empty_paths_are_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        read_exports(tmp_path / "does-not-exist")
    with pytest.raises(ValueError, match=str(tmp_path)):
        read_exports(tmp_path)


# ---------------------------------------------------------------------------------------------
# The public reproduction's results tree, whole
# ---------------------------------------------------------------------------------------------

def profiling_concurrencies(arm_folder: Path) -> list[int]:
    """Each cell's concurrency as AIPerf recorded it in its export's input_config."""
    concurrencies = []
    for export in sorted(arm_folder.glob(f"*/{aiperf.EXPORT_NAME}")):
        phases = json.loads(export.read_text())["input_config"]["phases"]
        [profiling] = [p for p in phases if p["name"] == "profiling"]
        concurrencies.append(profiling["concurrency"])
    return sorted(concurrencies)


def test_public_tree_reads_both_arms_apart_with_their_concurrencies():
    arm_folders = sorted(d for d in fixture(VLLM_RESULTS).iterdir()
                         if d.is_dir() and d.name.startswith("aiperf-"))
    assert [d.name for d in arm_folders] == ["aiperf-epnc1", "aiperf-epnc8"]
    df = read_exports(fixture(PUBLIC_RESULTS))
    assert sorted(set(df["arm"])) == ["epnc1", "epnc8"]
    for folder in arm_folders:
        rows = df[df["arm"] == folder.name.removeprefix("aiperf-")]
        expected = profiling_concurrencies(folder)
        assert len(expected) == len(list(folder.glob("aiperf-*-c*")))  # every cell has an export
        assert sorted(rows["concurrency"]) == expected
        assert list(rows["repeat"]) == [1] * len(expected)
        assert all(folder.resolve() in Path(source).parents for source in rows["source"])


def test_cli_summarizes_the_public_results_tree():
    result = run_cli("summarize", "../shared/fixtures/public-repro/results")
    assert result.returncode == 0, result.stderr
    for arm in ("epnc1", "epnc8"):
        assert len(re.findall(rf"^\d+\s+{arm}\s", result.stdout, re.MULTILINE)) == 3


def test_cells_named_alike_stay_apart_in_their_arm_folders(tmp_path):
    # aiperf_sweep.sh names a cell after its ARM; with ARM=vllm for both arms, only the arm
    # folders tell the two c4 cells apart.
    for source, arm in ((EPNC1_C4, "epnc1"), (EPNC8_C4, "epnc8")):
        shutil.copytree(fixture(source),
                        tmp_path / "vllm" / f"aiperf-{arm}" / "aiperf-vllm-c4_isl120")
    df = read_exports(tmp_path)
    assert list(df["arm"]) == ["epnc1", "epnc8"] and list(df["concurrency"]) == [4, 4]
    originals = {"epnc1": read_exports(EPNC1_C4), "epnc8": read_exports(EPNC8_C4)}
    for row in df.itertuples():
        assert row.output_tps == originals[row.arm]["output_tps"].iloc[0]


def test_cells_named_alike_without_arm_folders_are_refused(tmp_path):
    for source, holder in ((EPNC1_C4, "a"), (EPNC8_C4, "b")):
        shutil.copytree(fixture(source), tmp_path / holder / "aiperf-vllm-c4_isl120")
    claim = r"two AIPerf cells claim arm='vllm' concurrency=4 repeat=1"
    with pytest.raises(ValueError, match=claim):
        read_exports(tmp_path)


@pytest.fixture
def colliding_public_tree(tmp_path) -> Path:
    results = shutil.copytree(fixture(PUBLIC_RESULTS), tmp_path / "results")
    vllm = results / PUBLIC_RUN_FOLDER.name / VLLM_RESULTS.name
    # epnc1's c4 cell filed under epnc8 as well: two cells now claim epnc8 c4 repeat 1.
    shutil.copytree(vllm / "aiperf-epnc1" / EPNC1_C4.name, vllm / "aiperf-epnc8" / EPNC1_C4.name)
    return results


def test_two_public_cells_claiming_one_key_are_refused(colliding_public_tree):
    claim = r"two AIPerf cells claim arm='epnc8' concurrency=4 repeat=1"
    with pytest.raises(ValueError, match=claim) as refused:
        read_exports(colliding_public_tree)
    assert EPNC1_C4.name in str(refused.value) and EPNC8_C4.name in str(refused.value)
    with pytest.raises(ValueError, match=claim):
        read_public_tree(colliding_public_tree)
    result = run_cli("summarize", str(colliding_public_tree))
    assert result.returncode == 2 and result.stdout == ""
    assert "arm='epnc8' concurrency=4 repeat=1" in result.stderr


def test_read_public_tree_says_where_each_row_came_from():
    tree = read_public_tree(fixture(PUBLIC_RESULTS))
    assert list(tree.columns) == [*PUBLIC_TREE_COLUMNS, *SUMMARY_COLUMNS]
    assert PUBLIC_TREE_COLUMNS == ("run_folder", "engine", "date")
    assert set(tree["run_folder"]) == {PUBLIC_RUN_FOLDER.name}
    # The engine comes from the run folder's name; the <engine>/ folder inside it must agree.
    assert set(tree["engine"]) == {VLLM_RESULTS.name}
    assert set(tree["date"]) == {"2026-07-06"}
    assert sorted(set(tree["arm"])) == ["epnc1", "epnc8"]
    pd.testing.assert_frame_equal(tree[list(SUMMARY_COLUMNS)], read_exports(PUBLIC_RUN_FOLDER))
    pd.testing.assert_frame_equal(read_public_tree(PUBLIC_RUN_FOLDER), tree)


def test_read_public_tree_keeps_run_folders_apart(tmp_path):
    results = tmp_path / "results"
    shutil.copytree(fixture(PUBLIC_RUN_FOLDER), results / PUBLIC_RUN_FOLDER.name)
    # The same run filed again a day later: same engine, same arm folders.
    shutil.copytree(PUBLIC_RUN_FOLDER, results / "vllm-deepep-dropin-20260707")
    # A run folder with the microbenchmark alone gives no rows.
    microbench_only = results / "vllm-deepep-dropin-20260705" / "vllm"
    microbench_only.mkdir(parents=True)
    shutil.copy(VLLM_RESULTS / "t2_ep16_2node_test_ep_microbench.json", microbench_only)

    tree = read_public_tree(results)
    cells_per_run = len(read_exports(PUBLIC_RUN_FOLDER))
    assert tree.groupby("run_folder").size().to_dict() == {
        PUBLIC_RUN_FOLDER.name: cells_per_run, "vllm-deepep-dropin-20260707": cells_per_run}
    dates = tree.groupby("run_folder")["date"].unique().map(list).to_dict()
    assert dates == {PUBLIC_RUN_FOLDER.name: ["2026-07-06"],
                     "vllm-deepep-dropin-20260707": ["2026-07-07"]}
    # Read as one tree the two runs claim the same cells: why the reader goes by run folder.
    with pytest.raises(ValueError, match="two AIPerf cells claim"):
        read_exports(results)


def test_read_public_tree_refuses_what_it_cannot_place(tmp_path):
    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        read_public_tree(tmp_path / "does-not-exist")
    with pytest.raises(ValueError, match="no <engine>-deepep-dropin-<YYYYMMDD> folder"):
        read_public_tree(tmp_path)
    shutil.copytree(fixture(PUBLIC_RUN_FOLDER), tmp_path / PUBLIC_RUN_FOLDER.name)
    stray = shutil.copytree(fixture(SWEEP_013), tmp_path / SWEEP_013.name)
    with pytest.raises(ValueError, match="outside every") as refused:
        read_public_tree(tmp_path)
    assert str(stray / "concurrency_1") in str(refused.value)


# ---------------------------------------------------------------------------------------------
# The project's recorded runs read back as they were recorded
# ---------------------------------------------------------------------------------------------

COMMITTED_STAGES = sorted(d for pattern in ("results/*/05_sweep", "results/*/06_multicomm")
                          for d in REPO.glob(pattern) if d.is_dir() and find_cell_dirs(d))
RECORDED_STAGES = [d for d in COMMITTED_STAGES if (d / "summary.csv").is_file()]


def stage_id(stage: Path) -> str:
    return stage.relative_to(REPO / "results").as_posix()


def test_there_are_committed_runs_to_compare():
    assert RECORDED_STAGES, "no committed 05_sweep/06_multicomm with AIPerf cells and summary.csv"
    assert {s.name for s in RECORDED_STAGES} == {"05_sweep", "06_multicomm"}


@pytest.mark.parametrize("stage", COMMITTED_STAGES, ids=stage_id)
def test_committed_cells_read_back_to_the_folder_they_were_written_to(stage):
    # lib.measure.sweep.cell_dir writes (arm, C, r) to repeat_<r>/aiperf-<arm>-c<C>.
    df = read_exports(stage)
    for row in df.itertuples():
        source = Path(row.source)
        assert source.name == f"aiperf-{row.arm}-c{row.concurrency}", source
        assert source.parent.name == f"repeat_{row.repeat}", source


@pytest.mark.parametrize("stage", RECORDED_STAGES, ids=stage_id)
def test_committed_runs_read_the_arms_their_summary_recorded(stage):
    recorded = pd.read_csv(stage / "summary.csv")
    run_dir = stage.parent.resolve()
    read_back = {(row.arm, row.concurrency, row.repeat,
                  Path(row.source).relative_to(run_dir).as_posix())
                 for row in read_exports(stage).itertuples()}
    assert read_back == {(row.arm, row.concurrency, row.repeat, row.source)
                         for row in recorded.itertuples()}


# ---------------------------------------------------------------------------------------------
# Failed requests, from edited copies of real artifacts
# ---------------------------------------------------------------------------------------------

def edit_json(path: Path, edit) -> None:
    document = json.loads(path.read_text())
    edit(document)
    path.write_text(json.dumps(document))


def gates_by_check(gates, check: str):
    return [g for g in gates if g["gate"].endswith(check)]


def test_010_error_summary_counts_fail_the_cell(tmp_path):
    run = shutil.copytree(fixture(EPNC8_C4), tmp_path / EPNC8_C4.name)

    def inject_errors(export):
        # ErrorDetails as AIPerf models it: {code, type, message}; 3 + 2 failed requests.
        export["error_summary"] = [
            {"error_details": {"code": 422, "type": "Unprocessable Entity",
                              "message": "ignore_eos is not supported"}, "count": 3},
            {"error_details": {"code": 500, "type": "Internal Server Error",
                              "message": "engine dead"}, "count": 2}]
        export["request_count"]["avg"] = 35.0

    edit_json(run / "profile_export_aiperf.json", inject_errors)
    row = read_exports(run).iloc[0]
    assert row["errors"] == 5 and row["requests_completed"] == 35
    assert "error_summary=5" in row["errors_from"]
    gates = gate_cells(read_exports(run))
    [errors] = gates_by_check(gates, "zero request errors")
    assert errors["status"] == "FAIL" and errors["observed"] == 5 and errors["expected"] == 0
    assert "422" in errors["reason"] and str(run) in errors["evidence"]
    [completed] = gates_by_check(gates, "completed == requested")
    assert completed["status"] == "FAIL"
    assert (completed["observed"], completed["expected"]) == (35, 40)


def test_013_error_request_count_fails_the_cell(tmp_path):
    sweep = shutil.copytree(fixture(SWEEP_013), tmp_path / "sweep")

    def inject_errors(export):
        export["error_request_count"] = {"unit": "requests", "avg": 6.0}
        export["request_count"]["avg"] = 34.0

    for export in ("profile_export_aiperf.json", "phases/profiling/profile_export_aiperf.json"):
        edit_json(sweep / "concurrency_2" / export, inject_errors)
    df = read_exports(sweep)
    row = df[df["concurrency"] == 2].iloc[0]
    assert row["errors"] == 6 and row["requests_completed"] == 34
    assert "error_request_count=6" in row["errors_from"]
    failing = [g for g in gate_cells(df) if g["status"] == "FAIL"]
    assert {g["gate"] for g in failing} == {
        "aiperf sweep c2 repeat 1: zero request errors",
        "aiperf sweep c2 repeat 1: completed == requested"}


def test_013_timeouts_are_errors_and_never_counted_as_completed(tmp_path):
    """AIPerf 0.13 derives completed_request_count as successes + errors ("Completed Requests
    (Success + Error)"); request_count counts successes. A real run against transformers serve
    with --request-timeout-seconds shorter than half its answers (tests/test_load.py) exported
    completed_request_count 24, request_count 13, error_request_count 11 and one error_summary
    entry of TimeoutError (cause CancelledError) x 11: the edit below has that shape. Completed
    must read the successes, so completed + errors is every request sent, never more."""
    sweep = shutil.copytree(fixture(SWEEP_013), tmp_path / "sweep")
    requested, timed_out = 40, 6

    def time_out_some(export):
        assert export["completed_request_count"]["avg"] == requested  # stays: success + error
        export["request_count"]["avg"] = float(requested - timed_out)
        export["error_request_count"] = {"unit": "requests", "avg": float(timed_out)}
        export["error_summary"] = [{"error_details": {
            "type": "TimeoutError", "message": "TimeoutError()", "cause": "CancelledError()",
            "cause_chain": ["TimeoutError", "CancelledError"]}, "count": timed_out}]

    cell_2 = sweep / "concurrency_2"
    for export in ("profile_export_aiperf.json", "phases/profiling/profile_export_aiperf.json"):
        edit_json(cell_2 / export, time_out_some)
    row = aiperf.read_cell(cell_2)
    assert row["errors"] == timed_out and row["requests_completed"] == requested - timed_out
    assert row["requests_completed"] + row["errors"] == row["requests_requested"] == requested
    assert row["error_details"] == f"{timed_out}x TimeoutError()"
    gates = gate_cells(read_exports(cell_2))
    [completed] = gates_by_check(gates, "completed == requested")
    assert completed["status"] == "FAIL"
    assert (completed["observed"], completed["expected"]) == (requested - timed_out, requested)

    # without request_count (an export that left it out), the total less the errors
    for export in ("profile_export_aiperf.json", "phases/profiling/profile_export_aiperf.json"):
        edit_json(cell_2 / export, lambda e: e.pop("request_count"))
    assert aiperf.read_cell(cell_2)["requests_completed"] == requested - timed_out


def fail_every_request_in_log(log: Path, requests: int) -> None:
    text = log.read_text()
    text, n = re.subn(r"(Phase profiling(?: \(profiling\))? complete \| )completed=\d+, "
                      r"cancelled=0, errors=0",
                      rf"\g<1>completed={requests}, cancelled=0, errors={requests}", text)
    assert n == 1, f"{log}: expected one profiling complete line"
    text = re.sub(r"Processed \d+ valid requests and 0 errors",
                  f"Processed 0 valid requests and {requests} errors", text)
    log.write_text(text)


def test_010_run_without_export_is_a_failing_row(tmp_path):
    run = shutil.copytree(fixture(EPNC8_C4), tmp_path / EPNC8_C4.name)
    for name in ("profile_export_aiperf.json", "profile_export_aiperf.csv", "profile_export.jsonl"):
        (run / name).unlink()
    fail_every_request_in_log(run / "logs" / "aiperf.log", 40)

    df = read_exports(run)
    row = df.iloc[0]
    assert not row["has_export"]
    assert (row["arm"], row["concurrency"]) == ("vllm-epnc8", 4)
    assert (row["requests_requested"], row["requests_completed"], row["errors"]) == (40, 0, 40)
    assert row["aiperf_version"] == "0.10.0"  # from server_metrics_export.json
    assert pd.isna(row["output_tps"])
    statuses = {g["gate"].split(": ", 1)[1]: g["status"] for g in gate_cells(df)}
    assert statuses["summary export written"] == "FAIL"
    assert statuses["zero request errors"] == "FAIL"
    assert statuses["completed == requested"] == "FAIL"
    assert statuses["output length as requested (informational)"] == "SKIP"


def test_013_sweep_cell_without_export_keeps_its_row(tmp_path):
    sweep = shutil.copytree(fixture(SWEEP_013), tmp_path / "sweep")
    failed = sweep / "concurrency_4"
    for export in failed.rglob("profile_export*"):
        export.unlink()
    fail_every_request_in_log(failed / "logs" / "aiperf.log", 40)

    def fail_profiling_phase(manifest):
        for phase in manifest["phases"]:
            if phase["phase_kind"] == "profiling":
                phase.update(error_request_count=40, successful_request_count=0)

    edit_json(failed / "phase_manifest.json", fail_profiling_phase)
    df = read_exports(sweep)
    assert list(df["concurrency"]) == [1, 2, 4]
    row = df[df["concurrency"] == 4].iloc[0]
    assert not row["has_export"]
    assert (row["requests_requested"], row["requests_completed"], row["errors"]) == (40, 0, 40)
    assert "phase_manifest=40" in row["errors_from"] and "log=40" in row["errors_from"]
    failing = {g["gate"] for g in gate_cells(df) if g["status"] == "FAIL"}
    assert "aiperf sweep c4 repeat 1: zero request errors" in failing
    assert not any(" c1 " in g or " c2 " in g for g in failing)


def test_gate_records_have_the_evidence_shape(public):
    for gate in gate_cells(public):
        assert set(gate) == {"gate", "status", "observed", "expected", "reason", "evidence"}
        assert gate["status"] in {"PASS", "FAIL", "SKIP"}
        assert gate["reason"]
        assert gate["evidence"] and all(Path(p).exists() for p in gate["evidence"])
        json.dumps(gate)  # gates.json must be writable as is


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------

def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lib.measure.aiperf", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def test_cli_summarize_prints_the_table():
    result = run_cli("summarize", "../shared/fixtures/public-repro")
    assert result.returncode == 0, result.stderr
    for text in ("epnc1", "epnc8", "output_tps", "19.46", "273.04"):
        assert text in result.stdout


def test_cli_writes_csv(tmp_path):
    csv = tmp_path / "summary.csv"
    result = run_cli("summarize", str(SWEEP_013), "--csv", str(csv))
    assert result.returncode == 0, result.stderr
    table = pd.read_csv(csv)
    assert list(table.columns) == list(SUMMARY_COLUMNS)
    assert list(table["concurrency"]) == [1, 2, 4]


def test_cli_missing_path_exits_2_naming_it():
    result = run_cli("summarize", "no/such/dir")
    assert result.returncode == 2
    assert "no/such/dir" in result.stderr


def test_module_main_is_callable_in_process(capsys):
    assert aiperf.main(["summarize", str(EPNC8_C4), "--gates"]) == 0
    assert "PASS" in capsys.readouterr().out
