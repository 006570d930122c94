"""lib.published: the reference table and the comparison of a run against it."""

from pathlib import Path

import pandas as pd
import pytest

from lib.measure.aiperf import read_exports
from lib.measure.published import (SOURCE, compare, figures_from_microbench, figures_from_summary,
                           reference_figures)
from lib.measure.testep import first_case, parse_test_ep_log, read_published_microbench

FIXTURES = Path(__file__).resolve().parents[1].parent / "shared" / "fixtures"
PUBLIC = FIXTURES / "public-repro"
PUBLISHED_MICROBENCH = (PUBLIC / "results" / "vllm-deepep-dropin-20260706" / "vllm"
                        / "t2_ep16_2node_test_ep_microbench.json")


def fixture(path: Path) -> Path:
    assert path.exists(), f"fixture missing: {path}"
    return path


def figure(name: str) -> pd.Series:
    table = reference_figures()
    rows = table[table["figure"] == name]
    assert len(rows) == 1, f"expected one reference figure {name!r}"
    return rows.iloc[0]


def test_reference_table_columns_and_source():
    table = reference_figures()
    for column in ("figure", "value", "unit", "hardware", "date", "source"):
        assert column in table
    assert table["figure"].is_unique
    assert set(table["source"]) == {SOURCE}


def test_microbenchmark_figures():
    assert figure("test_ep D+C p50")["value"] == 443.6
    assert figure("test_ep dispatch p50")["value"] == 185.4
    assert figure("test_ep combine p50")["value"] == 258.2
    assert figure("test_ep D+C p50")["date"] == "2026-07-06"
    assert "p5en" in figure("test_ep D+C p50")["hardware"]


@pytest.mark.parametrize("arm,metric,values", [
    ("epnc1", "output_tps", (19.5, 38.8, 144.6)),
    ("epnc8", "output_tps", (39.4, 76.5, 273.0)),
    ("epnc1", "ttft_p50_ms", (475, 510, 899)),
    ("epnc8", "ttft_p50_ms", (196, 237, 280)),
    ("epnc1", "itl_p50_ms", (203, 203, 206)),
    ("epnc8", "itl_p50_ms", (100, 103, 106)),
])
def test_serving_figures(arm, metric, values):
    for concurrency, value in zip((4, 8, 32), values):
        row = figure(f"vllm {arm} c{concurrency} {metric}")
        assert row["value"] == value and row["date"] == "2026-07-07"


def test_public_reproduction_compares_within_tolerance():
    run = figures_from_summary(read_exports(fixture(PUBLIC)))
    table = compare(run)
    serving = table[table["figure"].str.startswith("vllm ")]
    assert len(serving) == 24
    assert (serving["flag"] == "within ±10%").all()
    assert serving["ratio"].between(0.99, 1.01).all()
    micro = table[table["figure"].str.startswith("test_ep ")]
    assert (micro["flag"] == "not measured").all() and micro["ratio"].isna().all()
    assert micro["outside_tolerance"].isna().all()


def test_published_microbenchmark_compares_to_itself():
    published = read_published_microbench(fixture(PUBLISHED_MICROBENCH))
    run = figures_from_microbench(published["phases_us"], published["dc_p50_us"])
    table = compare(run).set_index("figure")
    assert table.loc["test_ep D+C p50", "ratio"] == pytest.approx(1.0)
    assert table.loc["test_ep dispatch p50", "flag"] == "within ±10%"


def test_two_h200_test_ep_is_flagged_outside_the_cross_node_figure():
    log = fixture(FIXTURES / "deepep-test_ep-2xh200" / "test_ep_128tok_h7168_top8_e256.log")
    case = first_case(parse_test_ep_log(log))
    table = compare(figures_from_microbench(case["phases_us"], case["dc_p50_us"]))
    row = table.set_index("figure").loc["test_ep D+C p50"]
    assert row["flag"] == "outside ±10%" and bool(row["outside_tolerance"])
    assert row["ratio"] == pytest.approx(case["dc_p50_us"] / 443.6)


def test_compare_accepts_a_dataframe_and_flags_both_sides():
    run = pd.DataFrame({"figure": ["vllm epnc8 c4 output_tps", "vllm epnc1 c4 output_tps",
                                   "not a reference figure"],
                        "value": [39.4 * 1.2, 19.5 * 0.95, 1.0]})
    table = compare(run).set_index("figure")
    assert table.loc["vllm epnc8 c4 output_tps", "flag"] == "outside ±10%"
    assert table.loc["vllm epnc1 c4 output_tps", "flag"] == "within ±10%"
    assert "not a reference figure" not in table.index
    assert table.loc["vllm epnc8 c8 output_tps", "flag"] == "not measured"


def test_compare_with_a_custom_reference_and_tolerance():
    reference = reference_figures().head(1)
    table = compare({reference["figure"].iloc[0]: reference["value"].iloc[0] * 1.04},
                    reference=reference, tolerance=0.03)
    assert list(table["flag"]) == ["outside ±3%"]


def test_bad_run_table_is_refused():
    with pytest.raises(ValueError, match="'figure' and 'value'"):
        compare(pd.DataFrame({"name": ["x"], "v": [1.0]}))
