"""The words of the landing page's answers, computed from evidence: which way a comparison goes
("slower", "faster", "about even"), by how much, in how many cells, and how sure.

Pure functions over the ratio tables lib.publish.results makes (one row per cell, each with its
paired rounds), so a test can change one recorded figure and read the sentence change direction.
A ratio is always b / a of output tok/s: below 1, b is slower than a.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from lib.core import evidence
from lib.measure.stats import MIN_ROUNDS_FOR_INTERVAL

# A cell whose ratio of medians is within this of 1 reads "about even": the word for a
# difference smaller than the spread of one arm's own repeats in every committed GPU sweep
# (the 05 sweep of gpu-2xh200-deepep-vllm-20261130 repeats an arm 3 times, 4% to 50% apart).
EVEN_WITHIN = 0.02
# An arm whose own rounds in one cell differ by this factor or more is unstable there: the
# cell's ratio says more of that arm's bad round than of the other arm (said beside the figure).
UNSTABLE_SPREAD = 2.0


def direction(ratio: float) -> str:
    """b against a, in words, from the ratio b / a."""
    if abs(ratio - 1) <= EVEN_WITHIN:
        return "about even"
    return "slower" if ratio < 1 else "faster"


def interval_direction(low: float, high: float) -> str:
    """b against a from a confidence interval of b / a: a direction only when it excludes 1."""
    if high < 1:
        return "slower"
    if low > 1:
        return "faster"
    return "no clear difference"


def by_how_much(ratio: float) -> str:
    """'13%' below 2x, '3.25x' from 2x up (a percentage past 100 reads badly)."""
    if ratio >= 2:
        return f"{ratio:.2f}x"
    return f"{abs(ratio - 1) * 100:.0f}%"


def spread(values) -> float:
    values = [v for v in values if v]
    return max(values) / min(values) if values else 1.0


@dataclass
class Cell:
    """One compared cell: b / a with its paired rounds and where it was measured."""
    label: str          # "decode c32", "c8"
    ratio: float
    rounds: int
    a_tps: list
    b_tps: list
    low: float | None = None
    high: float | None = None

    @property
    def word(self) -> str:
        if self.low is not None and self.high is not None and self.rounds >= MIN_ROUNDS_FOR_INTERVAL:
            return interval_direction(self.low, self.high)
        return direction(self.ratio)

    def unstable_arm(self, a: str, b: str) -> str:
        """The arm whose own rounds spread UNSTABLE_SPREAD or more, with its range; else ''."""
        for name, values in ((a, self.a_tps), (b, self.b_tps)):
            if len(values) > 1 and spread(values) >= UNSTABLE_SPREAD:
                return (f"{self.label}, where {name}'s own rounds read "
                        + ", ".join(f"{v:.0f}" for v in values) + " tok/s")
        return ""


def cells_of(ratios: pd.DataFrame) -> list[Cell]:
    """The measured cells of one lever's rows of lib.publish.results.lever_ratios."""
    cells = []
    for row in ratios.itertuples():
        if row.ratio is None or pd.isna(row.ratio):
            continue
        label = f"{row.shape} c{row.concurrency}" if row.shape else f"c{row.concurrency}"
        a_tps, b_tps = list(getattr(row, "a_tps", []) or []), list(getattr(row, "b_tps", []) or [])
        low = None if row.low is None or pd.isna(row.low) else float(row.low)
        high = None if row.high is None or pd.isna(row.high) else float(row.high)
        cells.append(Cell(label, float(row.ratio), int(row.rounds), a_tps, b_tps, low, high))
    return cells


def _range(cells: list[Cell]) -> str:
    amounts = sorted(cells, key=lambda c: abs(c.ratio - 1))
    low, high = by_how_much(amounts[0].ratio), by_how_much(amounts[-1].ratio)
    return low if low == high else f"{low} to {high}"


def comparison(b: str, a: str, cells: list[Cell], how_sure: bool = True,
               unstable: bool = True) -> str:
    """'**deepep_v2 is 3% to 13% slower than allgather_reducescatter in 4 of 6 cells**, faster
    in 2 (...); ...': the direction, the size and the count, then how sure (the interval, or the
    paired rounds and why there is no interval), then the cells where an arm was unstable."""
    if not cells:
        return f"{b} against {a}: not measured"
    groups = {word: [c for c in cells if c.word == word] for word in
              ("slower", "faster", "about even", "no clear difference")}
    lead = max(("slower", "faster"), key=lambda w: len(groups[w]))
    parts = []
    if groups[lead]:
        parts.append(f"**{b} is {_range(groups[lead])} {lead} than {a} in "
                     f"{len(groups[lead])} of {len(cells)} cells**")
    other = "faster" if lead == "slower" else "slower"
    if groups[other]:
        parts.append(f"{_range(groups[other])} {other} in {len(groups[other])} ("
                     + ", ".join(c.label for c in groups[other]) + ")")
    for word in ("about even", "no clear difference"):
        if groups[word]:
            said = f"within {EVEN_WITHIN:.0%}" if word == "about even" else "its interval spans 1"
            parts.append(f"{word} in {len(groups[word])} ({said})")
    if not groups[lead]:
        parts[0] = f"**{b} against {a}: {parts[0]}**"
    sure = how_sure_said(cells)
    text = ", ".join(parts) + (f"; {sure}" if how_sure else "")
    if unstable and unstable_said(b, a, cells):
        text += "; " + unstable_said(b, a, cells)
    return text


def unstable_said(b: str, a: str, cells: list[Cell]) -> str:
    """The cells where an arm's own rounds spread UNSTABLE_SPREAD or more, or ''."""
    unstable = [u for u in (c.unstable_arm(a, b) for c in cells) if u]
    if not unstable:
        return ""
    return ("unstable, so not a win or a loss of the backend: " + "; ".join(unstable))


def how_sure_said(cells: list[Cell]) -> str:
    """What a direction rests on: each cell's interval, or its paired rounds and why no interval."""
    rounds = sorted({c.rounds for c in cells})
    if all(c.rounds >= MIN_ROUNDS_FOR_INTERVAL for c in cells):
        return f"each cell's 95% interval from {', '.join(map(str, rounds))} paired rounds"
    return (f"{', '.join(map(str, rounds))} paired round{'s' if rounds[-1] > 1 else ''} a cell, "
            f"too few for an interval (it takes {MIN_ROUNDS_FOR_INTERVAL})")


def served_model(run_dir: Path) -> str:
    """The model a run's 04 served, as its model.json describes it (the guide builds it)."""
    path = Path(run_dir) / "04_serve" / "model.json"
    if not path.exists():
        return "a model the run did not describe"
    info = evidence.read_json(path)
    return (f"a seeded Qwen3-MoE of {info.get('num_hidden_layers')} layers, "
            f"{info.get('num_experts')} experts top-{info.get('num_experts_per_tok')}, "
            f"{info.get('parameters', 0) / 1e9:.2f} B parameters")
