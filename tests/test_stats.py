"""lib.stats: bootstrap summaries, arm ratios and scaling columns."""

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from lib.measure.aiperf import read_exports
from lib.measure.stats import paired_ratio, scaling_columns, summarize_repeats

FIXTURES = Path(__file__).resolve().parents[1].parent / "shared" / "fixtures"
PUBLIC = FIXTURES / "public-repro"

# Five repeats of one cell's aggregate tokens/s, spread like the anchors' ~10% variance.
REPEATS = [39.4, 41.2, 37.9, 40.3, 43.8]


def test_interval_contains_the_point_estimate():
    summary = summarize_repeats(REPEATS)
    assert summary["n"] == 5
    assert summary["mean"] == pytest.approx(np.mean(REPEATS))
    assert summary["median"] == pytest.approx(40.3)
    assert summary["low"] <= summary["estimate"] <= summary["high"]
    assert summary["low"] < summary["high"]
    assert "scipy.stats.bootstrap" in summary["method"]


def test_median_interval_on_request():
    summary = summarize_repeats(REPEATS, statistic="median")
    assert summary["estimate"] == summary["median"]
    assert summary["low"] <= summary["median"] <= summary["high"]


def test_deterministic_for_a_fixed_seed():
    assert summarize_repeats(REPEATS, seed=7) == summarize_repeats(REPEATS, seed=7)
    a, b = [10.0, 11.0, 12.5, 9.8], [20.5, 21.7, 25.1, 19.0]
    assert paired_ratio(a, b, seed=3) == paired_ratio(a, b, seed=3)


def test_wider_confidence_gives_a_wider_interval():
    narrow = summarize_repeats(REPEATS, confidence=0.80)
    wide = summarize_repeats(REPEATS, confidence=0.99)
    assert wide["low"] <= narrow["low"] and narrow["high"] <= wide["high"]


def test_single_value_is_returned_with_its_reason():
    summary = summarize_repeats([273.04])
    assert summary["n"] == 1
    assert summary["low"] == summary["high"] == summary["mean"] == 273.04
    assert "n=1" in summary["method"]


def test_identical_values_do_not_crash():
    summary = summarize_repeats([40.0, 40.0, 40.0])
    assert summary["low"] == summary["high"] == 40.0
    assert "identical" in summary["method"]


def test_missing_values_are_dropped_and_empty_is_an_error():
    assert summarize_repeats([1.0, np.nan, 3.0])["n"] == 2
    with pytest.raises(ValueError, match="no values"):
        summarize_repeats([])
    with pytest.raises(ValueError, match="statistic"):
        summarize_repeats(REPEATS, statistic="mode")


def test_paired_ratio_of_doubled_arm_is_two_with_a_tight_interval():
    a = np.array([19.46, 19.9, 18.7, 20.3])
    result = paired_ratio(a, 2 * a)
    assert result["paired"] is True
    assert result["ratio"] == pytest.approx(2.0)
    assert result["low"] == pytest.approx(2.0) and result["high"] == pytest.approx(2.0)


def test_paired_ratio_with_noise_uses_scipy_and_stays_tight():
    a = np.array([19.46, 19.9, 18.7, 20.3, 19.1])
    b = 2 * a * np.array([1.004, 0.997, 1.002, 0.999, 1.001])
    result = paired_ratio(a, b)
    assert result["low"] <= result["ratio"] <= result["high"]
    assert result["high"] - result["low"] < 0.05
    assert 1.98 < result["low"] and result["high"] < 2.02
    assert "paired" in result["method"] and "scipy.stats.bootstrap" in result["method"]


def test_unequal_lengths_are_resampled_independently():
    result = paired_ratio([19.5, 19.2, 20.1], [39.4, 38.1, 40.7, 39.9])
    assert result["paired"] is False
    assert "independent" in result["method"]
    assert result["low"] <= result["ratio"] <= result["high"]


def test_ratio_of_means_on_request():
    result = paired_ratio([1.0, 2.0, 6.0], [2.0, 4.0, 13.0], statistic="mean")
    assert result["ratio"] == pytest.approx(19.0 / 9.0)


def test_ratio_edge_cases():
    single = paired_ratio([19.5], [39.4])
    assert single["low"] == single["high"] == pytest.approx(39.4 / 19.5)
    assert "n=1" in single["method"]
    with pytest.raises(ValueError, match="ratio is undefined"):
        paired_ratio([0.0, 0.0], [1.0, 2.0])


def test_scaling_columns_on_the_public_sweep():
    public = PUBLIC
    assert public.exists(), f"fixture missing: {public}"
    table = scaling_columns(read_exports(public))
    epnc1 = table[table["arm"] == "epnc1"].set_index("concurrency")
    assert list(epnc1["x_multiple_of_lowest"]) == [1.0, 2.0, 8.0]
    assert epnc1.loc[4, "pct_of_linear"] == pytest.approx(100.0)
    expected = 100 * (epnc1.loc[32, "output_tps"] / epnc1.loc[4, "output_tps"]) / 8
    assert epnc1.loc[32, "pct_of_linear"] == pytest.approx(expected)
    # Each arm is its own baseline.
    epnc8 = table[table["arm"] == "epnc8"].set_index("concurrency")
    assert epnc8.loc[4, "pct_of_linear"] == pytest.approx(100.0)


def test_scaling_columns_use_the_median_of_repeats_at_the_lowest_x():
    df = pd.DataFrame({"concurrency": [4, 4, 4, 8], "output_tps": [18.0, 20.0, 30.0, 40.0]})
    table = scaling_columns(df)
    assert table["pct_of_linear"].iloc[3] == pytest.approx(100.0)
    with pytest.raises(ValueError, match="output_tps"):
        scaling_columns(df.drop(columns="output_tps"))
