"""Statistics for repeated benchmark cells: bootstrap intervals, arm ratios, scaling columns.

Intervals come from ``scipy.stats.bootstrap`` (BCa by default). Where the bootstrap cannot give an
interval (one value, all values identical, every resample equal), the point estimate is returned
with low == high and ``method`` says why, rather than a NaN or a crash. All resampling uses
``numpy.random.default_rng(seed)``, so a fixed seed gives identical results.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Sequence

import numpy as np
import pandas as pd
from scipy import stats as scipy_stats

N_RESAMPLES = 9999
_STATISTICS: dict[str, Callable[..., Any]] = {"mean": np.mean, "median": np.median}


# A bootstrap over fewer paired rounds draws from too few distinct resamples (10 for 3 rounds)
# to mean anything: below this, the rounds are shown and no interval (the book; issue 23).
MIN_ROUNDS_FOR_INTERVAL = 5

def _as_values(values: Sequence[float] | np.ndarray | pd.Series, name: str) -> np.ndarray:
    array = np.asarray(pd.Series(values, dtype="float64").dropna(), dtype=float)
    if array.size == 0:
        raise ValueError(f"{name}: no values (after dropping missing ones)")
    return array


def _statistic(name: str) -> Callable[..., Any]:
    if name not in _STATISTICS:
        raise ValueError(f"statistic must be one of {sorted(_STATISTICS)}, not {name!r}")
    return _STATISTICS[name]


def _bootstrap_interval(data: tuple[np.ndarray, ...], statistic: Callable[..., Any], *,
                        paired: bool, confidence: float, seed: int) -> tuple[float, float, str]:
    """(low, high, method) via scipy; BCa first, percentile when BCa is undefined."""
    for method in ("BCa", "percentile"):
        with warnings.catch_warnings():
            # A degenerate resample distribution is handled below, not warned about.
            warnings.simplefilter("ignore", category=scipy_stats.DegenerateDataWarning)
            warnings.simplefilter("ignore", category=RuntimeWarning)
            result = scipy_stats.bootstrap(
                data, statistic, paired=paired, vectorized=True, n_resamples=N_RESAMPLES,
                confidence_level=confidence, method=method, rng=np.random.default_rng(seed))
        low, high = float(result.confidence_interval.low), float(result.confidence_interval.high)
        if np.isfinite(low) and np.isfinite(high):
            return low, high, f"scipy.stats.bootstrap {method}, {N_RESAMPLES} resamples"
    raise ValueError("bootstrap gave no finite interval")  # unreachable for finite data


def summarize_repeats(values: Sequence[float], confidence: float = 0.95, seed: int = 0,
                      statistic: str = "mean") -> dict[str, Any]:
    """n, mean, median and a bootstrap confidence interval [low, high] of ``statistic``.

    The interval is for the mean by default (what a table of repeats reports); pass
    ``statistic="median"`` for the median. ``estimate`` holds the statistic the interval is for.
    """
    array = _as_values(values, "summarize_repeats values")
    point = float(_statistic(statistic)(array))
    summary = {"n": int(array.size), "mean": float(np.mean(array)),
               "median": float(np.median(array)), "statistic": statistic, "estimate": point}
    if array.size == 1:
        return {**summary, "low": point, "high": point,
                "method": "n=1: a single value has no interval"}
    if np.all(array == array[0]):
        return {**summary, "low": point, "high": point,
                "method": f"all {array.size} values identical: zero spread, no interval"}
    stat = _statistic(statistic)
    low, high, method = _bootstrap_interval(
        (array,), lambda x, axis=-1: stat(x, axis=axis), paired=False,
        confidence=confidence, seed=seed)
    return {**summary, "low": low, "high": high, "method": method}


def paired_ratio(a: Sequence[float], b: Sequence[float], confidence: float = 0.95, seed: int = 0,
                 statistic: str = "median") -> dict[str, Any]:
    """Ratio statistic(b) / statistic(a) of arm b over arm a, with a bootstrap interval.

    Medians by default (robust to one slow repeat); ``statistic="mean"`` for means. When a and b
    have the same length they are taken as paired repeats (repeat i of a with repeat i of b) and
    resampled together (``paired=True``); otherwise each arm is resampled independently (scipy's
    two-sample bootstrap).
    """
    a_values, b_values = _as_values(a, "paired_ratio a"), _as_values(b, "paired_ratio b")
    stat = _statistic(statistic)
    denominator = float(stat(a_values))
    if denominator == 0:
        raise ValueError(f"paired_ratio: the {statistic} of a is 0, the ratio is undefined")
    ratio = float(stat(b_values)) / denominator
    paired = a_values.size == b_values.size
    result = {"ratio": ratio, "statistic": statistic, "paired": paired,
              "n_a": int(a_values.size), "n_b": int(b_values.size)}
    if min(a_values.size, b_values.size) == 1:
        return {**result, "low": ratio, "high": ratio,
                "method": "n=1 in an arm: a single value has no interval"}

    def ratio_of(x, y, axis=-1):
        return stat(y, axis=axis) / stat(x, axis=axis)

    if _resampled_ratios_are_constant(a_values, b_values, paired):
        return {**result, "low": ratio, "high": ratio,
                "method": "every resample gives the same ratio: zero spread, no interval"}
    low, high, method = _bootstrap_interval((a_values, b_values), ratio_of, paired=paired,
                                            confidence=confidence, seed=seed)
    kind = "paired" if paired else "independent two-sample"
    return {**result, "low": low, "high": high, "method": f"{method} ({kind})"}


def interleaved(repeats: int, a: Any, b: Any) -> list[tuple[int, Any]]:
    """(repeat, arm) pairs of an A/B: a then b on odd repeats, b then a on even ones, so drift
    falls on both arms alike."""
    order = []
    for r in range(1, repeats + 1):
        pair = (a, b) if r % 2 else (b, a)
        order += [(r, pair[0]), (r, pair[1])]
    return order


def time_ratio_verdict(ratio: dict[str, Any], a: str, b: str) -> str:
    """What paired_ratio's interval of a time b / a says (lower is faster)."""
    if ratio["high"] < 1:
        return f"{b} is faster than {a} here (interval below 1)"
    if ratio["low"] > 1:
        return f"{b} is slower than {a} here (interval above 1)"
    return f"no difference between {a} and {b} resolved here (interval spans 1)"


def _resampled_ratios_are_constant(a: np.ndarray, b: np.ndarray, paired: bool) -> bool:
    """True when no resample can change the ratio, so scipy would see a degenerate distribution:
    paired arms with b == k * a exactly (the mean and the median both scale by k), or two
    constant arms."""
    if paired and np.all(a != 0):
        ratios = b / a
        return bool(np.allclose(ratios, ratios[0], rtol=1e-12, atol=0.0))
    return bool(np.all(a == a[0]) and np.all(b == b[0]))


def scaling_columns(df: pd.DataFrame, x: str = "concurrency", y: str = "output_tps",
                    by: Sequence[str] | str | None = ("arm",)) -> pd.DataFrame:
    """A copy of ``df`` with 'x_multiple_of_lowest' and 'pct_of_linear' added.

    Within each group of ``by`` (columns absent from ``df`` are ignored; by default per arm):
    x_multiple_of_lowest = x / lowest x; pct_of_linear = 100 * (y / y at the lowest x) /
    x_multiple_of_lowest, so perfect linear scaling reads 100. With several rows at the lowest x
    (repeats), y at the lowest x is their median.
    """
    for column in (x, y):
        if column not in df:
            raise ValueError(f"scaling_columns: column {column!r} not in the table "
                             f"(columns: {list(df.columns)})")
    groups = [by] if isinstance(by, str) else list(by or [])
    groups = [g for g in groups if g in df]
    result = df.copy()
    keys = [result[g] for g in groups] if groups else [np.zeros(len(result))]
    x_values = pd.to_numeric(result[x], errors="coerce").astype(float)
    y_values = pd.to_numeric(result[y], errors="coerce").astype(float)
    lowest_x = x_values.groupby(keys).transform("min")
    at_lowest = y_values.where(x_values == lowest_x)
    y_at_lowest = at_lowest.groupby(keys).transform("median")
    result["x_multiple_of_lowest"] = x_values / lowest_x
    result["pct_of_linear"] = 100.0 * (y_values / y_at_lowest) / result["x_multiple_of_lowest"]
    return result
