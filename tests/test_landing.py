"""The landing page's answers: their direction words are computed from the evidence.

Unit cases for the words (lib.publish.answers), then the committed GPU run behind the backend
answer, copied and re-sealed with one recorded figure changed, read back through the catalog as
the book reads it: the sentence changes direction with the figure.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from lib.core import evidence
from lib.measure.stats import MIN_ROUNDS_FOR_INTERVAL
from lib.publish import answers, pages
from lib.publish.catalog import catalog

RESULTS = Path(__file__).resolve().parents[1] / "results"
BACKEND_RUN = "gpu-2xh200-deepep-vllm-20261130"  # 05's backend A/B on 2x H200


def cell(ratio, a=(100.0, 100.0, 100.0), b=None, rounds=3, low=None, high=None, label="c4"):
    b = b or tuple(x * ratio for x in a)
    return answers.Cell(label, ratio, rounds, list(a), list(b), low, high)


def test_a_ratio_below_one_is_slower_above_faster_and_near_one_about_even():
    assert answers.direction(0.87) == "slower"
    assert answers.direction(1.3) == "faster"
    assert answers.direction(1 + answers.EVEN_WITHIN / 2) == "about even"
    assert answers.by_how_much(0.87) == "13%" and answers.by_how_much(3.253) == "3.25x"


def test_an_interval_gives_the_direction_only_where_it_excludes_one():
    n = MIN_ROUNDS_FOR_INTERVAL
    assert cell(0.9, rounds=n, low=0.85, high=0.95).word == "slower"
    assert cell(0.9, rounds=n, low=0.85, high=1.02).word == "no clear difference"
    assert cell(1.2, rounds=n, low=1.1, high=1.3).word == "faster"
    # under MIN_ROUNDS_FOR_INTERVAL rounds an interval is not trusted: the ratio decides
    assert cell(0.9, rounds=n - 1, low=0.85, high=1.02).word == "slower"


def test_the_sentence_counts_cells_by_direction_and_says_how_sure():
    said = answers.comparison("deepep_v2", "allgather_reducescatter",
                              [cell(0.97), cell(0.87, label="c8"), cell(1.05, label="c32")])
    assert said.startswith("**deepep_v2 is 3% to 13% slower than allgather_reducescatter in "
                           "2 of 3 cells**")
    assert "5% faster in 1 (c32)" in said
    assert f"3 paired rounds a cell, too few for an interval (it takes {MIN_ROUNDS_FOR_INTERVAL})" \
        in said
    flipped = answers.comparison("b", "a", [cell(1.2), cell(1.1, label="c8")])
    assert flipped.startswith("**b is 10% to 20% faster than a in 2 of 2 cells**")


def test_an_arm_whose_own_rounds_spread_twofold_is_named_unstable():
    collapsed = cell(3.25, a=(392.0, 1858.0, 553.0), b=(1797.0, 1826.0, 1782.0), label="prefill c32")
    said = answers.comparison("deepep_v2", "allgather_reducescatter", [cell(0.9), collapsed])
    assert ("unstable, so not a win or a loss of the backend: prefill c32, where "
            "allgather_reducescatter's own rounds read 392, 1858, 553 tok/s") in said


@pytest.fixture(scope="module")
def copied_results(tmp_path_factory):
    root = tmp_path_factory.mktemp("results")
    shutil.copytree(RESULTS / BACKEND_RUN, root / BACKEND_RUN)
    return root


def backend_answer(results: Path) -> str:
    ev = pages.Evidence(catalog(results))
    return pages.beats_answer(ev)[0]


def test_the_committed_backend_a_b_reads_slower_and_a_changed_figure_reads_faster(copied_results):
    said = backend_answer(copied_results)
    assert said.startswith("**deepep_v2 is 3% to 13% slower than allgather_reducescatter in 4 of "
                           "6 cells**"), said
    assert BACKEND_RUN in said
    ratios_file = copied_results / BACKEND_RUN / "05_sweep" / "ratios.json"
    ratios = json.loads(ratios_file.read_text())
    for r in ratios:  # deepep_v2's every round 30% above allgather_reducescatter's
        r["b_tps"] = [a * 1.3 for a in r["a_tps"]]
        r["ratio"] = 1.3
    ratios_file.write_text(json.dumps(ratios))
    evidence.seal(copied_results / BACKEND_RUN)  # as recorded so, else the book refuses the run
    said = backend_answer(copied_results)
    assert said.startswith("**deepep_v2 is 30% faster than allgather_reducescatter in 6 of 6 "
                           "cells**"), said
    assert "slower" not in said


# ---- the built book: the landing and the chapter for running it on a cluster ------------------

def page_text(html_file: Path) -> str:
    import re
    from html import unescape

    text = re.sub(r"<script.*?</script>|<style.*?</style>", " ", html_file.read_text(),
                  flags=re.S)
    text = unescape(re.sub(r"<[^>]+>", " ", text)).replace("\u2019", "'")  # Sphinx curls quotes
    return " ".join(text.split())


def test_the_landing_links_the_cluster_chapter_and_each_answer_has_a_figure_and_a_direction(
        reference_book):
    landing = (reference_book / "book" / "intro.html").read_text()
    assert 'href="cluster.html"' in landing  # one click from the landing
    text = page_text(reference_book / "book" / "intro.html")
    for _, question in pages.QUESTIONS:
        assert question in text
    assert " us at 128 / 512 / 4096 tokens" in text           # the kernel, with its unit
    assert "output tok/s" in text and "per GPU" in text        # served, per GPU
    assert "slower than allgather_reducescatter in" in text   # the backend A/B's direction
    assert "With CUDA graphs it does not" in text              # the failure that answers


def test_the_cluster_chapter_says_how_to_run_it_on_eks_and_slurm(reference_book):
    text = page_text(reference_book / "book" / "cluster.html")
    for needed in ("lib.runner profile", "-p context plan", "gdrdrv", "hugepages",
                   "EFA device plugin", "GPU device plugin", "privileged namespace", "Slurm",
                   "GPU-minutes"):
        assert needed in text, needed
