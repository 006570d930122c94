"""The book built from the committed runs: answers first, results with plots, the appendix, and
every number traced to its evidence (a changed number shows, a removed stage says why not)."""
from __future__ import annotations

import json
from html import unescape
import re
import shutil
from pathlib import Path

import pandas as pd
import pytest

from lib.core import evidence
from lib.core.door import REPO_ROOT
from lib.measure import published
from lib.publish import appendix, book, coverage, pages, scan, sources
from lib.publish.catalog import catalog

RESULTS = REPO_ROOT / "results"
REFERENCE = (RESULTS / "REFERENCE").read_text().strip()
KERNEL_RUN = "gpu-2xh200-deepep-20261130c"     # the latest run with DeepEP's test_ep passing
BROKEN_SEAL = "gpu-2xh200-deepep-vllm-20261130b"  # committed with a log changed after sealing
RUN_IDS = sorted(d.name for d in RESULTS.iterdir() if (d / "run.json").is_file())


@pytest.fixture(scope="module")
def built(reference_book):
    """The real book: every committed run, the reference run's notebooks as the stages."""
    return reference_book


def text_of(html: Path) -> str:
    """A page's words without tags, so a test reads what a reader reads."""
    words = unescape(re.sub(r"<[^>]+>", " ", html.read_text(encoding="utf-8")))
    return re.sub(r"\s+", " ", words.replace("\u2019", "'").replace("\u201c", '"')
                  .replace("\u201d", '"'))


def test_the_catalog_says_which_runs_may_feed_results():
    runs = {r.run_id: r for r in catalog(RESULTS)}
    assert sorted(runs) == RUN_IDS
    for run_id in ("kube-ctlplane-20261207g", "slurm-2nodes-20261207f"):
        assert not runs[run_id].feeds_results
        assert runs[run_id].why_not_results == runs[run_id].record["level"]
    assert not runs[REFERENCE].feeds_results and "CPU host" in runs[REFERENCE].why_not_results
    assert runs[KERNEL_RUN].feeds_results and runs[KERNEL_RUN].label == "current"
    # a changed file after sealing: listed, labelled, never a figure
    assert runs[BROKEN_SEAL].verdict == "refused (evidence changed)"
    assert not runs[BROKEN_SEAL].feeds_results
    assert "vllm-eager-ep.log" in runs[BROKEN_SEAL].why_not_results
    # an earlier test_ep run is superseded by the later one that repeated it and passed
    assert runs["gpu-2xh200-deepep-20261130b"].superseded_by == KERNEL_RUN
    assert runs["gpu-2xh200-deepep-20261130"].failed_stages == ["03_kernel_test"]


def test_the_landing_page_answers_the_four_questions_with_levels(built):
    page = text_of(built / "book" / "intro.html")
    for _, question in pages.QUESTIONS:
        assert question.split(",")[0] in page
    test_ep = json.loads((RESULTS / KERNEL_RUN / "03_kernel_test" / "test_ep.json").read_text())
    at_128 = next(r for r in test_ep if r["tokens"] == 128)["test_ep D+C p50 (us)"]
    assert f"{at_128:.1f}" in page
    assert "measured here end-to-end" in page and "cited" in page
    assert "443.6 us" in page  # the public cross-node figure, cited beside ours


def test_the_results_page_has_its_tables_and_plots(built):
    html = (built / "book" / "results.html").read_text(encoding="utf-8")
    for name in ("kernel", "serving", "latency", "levers"):
        assert f"figures/{name}.png" in html or f"{name}.png" in html, name
    images = {p.name for p in (built / "_images").glob("*.png")}
    assert {"kernel.png", "serving.png", "latency.png", "levers.png"} <= images
    assert html.count("<table") >= 4
    page = text_of(built / "book" / "results.html")
    assert "1. Does it work?" in page and "2. How fast?" in page
    # no interval from 3 rounds: every measured ratio row says why
    assert "3 rounds: no interval (needs 5); each round plotted" in page
    # the CUDA-graph arm that died on deepep_v2: a FAIL with the line its server's log says it
    # died at, and the step it was running, not a blank; too long for its cell, it is the
    # table's note (a table wider than the page's column would scroll sideways)
    html_works = html.split('id="works"', 1)[1].split('id="fast"', 1)[0]
    works = re.sub(r"\s+", " ", unescape(re.sub(r"<[^>]+>", " ", html_works)))
    assert "FAIL: note 1" in works
    assert "<ol" in html_works  # note 1 is the first of a numbered list
    assert "Notes: the server died serving: vllm-graphs-ep-1.log:712:" in works
    assert "index out of bounds" in works and "135 scheduled tokens" in works


def test_the_appendix_lists_every_committed_run_with_a_page_each(built):
    history = text_of(built / "book" / "history.html")
    for run_id in RUN_IDS:
        assert run_id in history, run_id
        assert (built / "book" / "runs" / f"{run_id}.html").is_file(), run_id
    page = text_of(built / "book" / "runs" / f"{BROKEN_SEAL}.html")
    assert "NOT verified" in page and "vllm-eager-ep.log" in page


def test_a_stage_chapter_opens_with_prose_and_shows_every_skip_reason(built):
    page = text_of(built / "book" / "stages" / "02_image.html")
    gates = evidence.read_gates(RESULTS / REFERENCE / "02_image")
    for g in gates:
        if g["status"] != "PASS":
            assert evidence.without_terminal_codes(g["reason"])[:60].split()[0] in page
    assert "The notebook as run" in page  # the notebook is on the chapter's page, not apart
    assert not (built / "notebooks").exists()


def test_the_built_book_publishes_no_identities(built):
    scan.refuse_identities(built)  # its FAIL path: tests/test_publish_scan.py


def test_a_tampered_run_is_refused_by_the_book_naming_the_file(tmp_path):
    with pytest.raises(book.BookRefused, match=r"06_multicomm/vllm-eager-ep\.log"):
        book.build(RESULTS / BROKEN_SEAL, out_root=tmp_path)
    assert not (tmp_path / "_build" / "html").exists()


def copy_runs(tmp_path: Path, *run_ids: str, link_the_rest: bool = False,
              link: tuple[str, ...] = ()) -> Path:
    """A results directory holding copies of `run_ids` (to change) and, linked as they are,
    the runs of `link`, or with link_the_rest every other committed run (a book built from a
    few runs says of the others it cites that they are not in its results)."""
    results = tmp_path / "results"
    results.mkdir()
    for run_id in RUN_IDS:
        if run_id in run_ids:
            shutil.copytree(RESULTS / run_id, results / run_id)
        elif link_the_rest or run_id in link:
            (results / run_id).symlink_to(RESULTS / run_id, target_is_directory=True)
    (results / "REFERENCE").write_text(REFERENCE + "\n")
    return results


def test_a_changed_number_shows_on_the_rebuilt_results_page_and_plot(tmp_path):
    results = copy_runs(tmp_path, KERNEL_RUN, link=(REFERENCE,))  # a small book: two runs
    run = results / KERNEL_RUN
    original = pd.read_csv(_figures_of(results, tmp_path / "before") / "kernel.csv")
    path = run / "03_kernel_test" / "test_ep.json"
    rows = json.loads(path.read_text())
    rows[0]["test_ep D+C p50 (us)"] = 12.345  # 128 tokens: 29.5 us as measured
    path.write_text(json.dumps(rows, indent=2))
    assert evidence.verify(run)  # changed: the copy must be sealed anew to be published
    (run / evidence.SUMS_NAME).unlink()
    evidence.seal(run)
    book.build(results / REFERENCE, out_root=tmp_path)
    html = tmp_path / "_build" / "html"
    assert "12.3" in text_of(html / "book" / "results.html")
    assert "12.3 / " in text_of(html / "book" / "intro.html")
    plotted = pd.read_csv(tmp_path / "_build" / ".src" / "book" / "figures" / "kernel.csv")
    mine = plotted[(plotted["series"] == "DeepEP test_ep") & (plotted["tokens"] == 128)
                   & (plotted["run"] == KERNEL_RUN)]
    assert mine["p50_us"].tolist() == [12.345]
    assert 12.345 not in original["p50_us"].tolist()
    before = (tmp_path / "before" / "kernel.png").read_bytes()
    assert (html / "_images" / "kernel.png").read_bytes() != before


def _figures_of(results: Path, out: Path) -> Path:
    ev = pages.Evidence(catalog(results))
    pages.results_page(ev, out)
    return out


def test_a_removed_stage_shows_not_measured_with_the_reason(tmp_path):
    results = copy_runs(tmp_path, REFERENCE, KERNEL_RUN)
    run = results / KERNEL_RUN
    shutil.rmtree(run / "03_kernel_test")
    (run / evidence.SUMS_NAME).unlink()
    evidence.seal(run)
    ev = pages.Evidence(catalog(results))
    results_md = pages.results_page(ev, tmp_path / "figures")
    kernel = results_md.split("### Kernel", 1)[1].split("###", 1)[0]
    assert "not measured: no recorded run has DeepEP's test_ep" in kernel
    works, fast, *_ = pages.answers(ev)  # the other answers: beats, trains
    assert fast[0].startswith("Kernel: not measured here (no recorded run has DeepEP's test_ep")
    assert works[0].startswith("**not measured here** (no recorded run has DeepEP's test_ep")
    assert not (tmp_path / "figures" / "kernel.png").exists()


def test_a_sphinx_warning_fails_the_build(tmp_path):
    """-W: a broken cross-reference in a generated page (here, a run's notes) is an error."""
    results = copy_runs(tmp_path, link=(REFERENCE,))  # a small book: its one run
    (results / f"{REFERENCE}.notes.md").write_text("See [the missing page](missing-page.md).\n")
    with pytest.raises(RuntimeError, match="warnings are errors"):
        book.build(results / REFERENCE, out_root=tmp_path)


def test_the_parameters_page_counts_hostile_values_tried_and_accepted(built, monkeypatch):
    from lib.core.params import Param, Rule
    from lib.stages import registry

    class TakesAnything(Rule):
        allowed, kind = "anything", "text"

        def __call__(self, value):
            return value

        def edges(self):
            return ["x"]

        def beyond(self):
            return []

    page = text_of(built / "book" / "parameters.html")
    tried, accepted, _ = pages.hostile_tally()
    assert tried >= 60 and accepted == 0
    assert f"{tried} tried" in page and "0 accepted" in page
    for entry in pages.parameter_entries():  # what each does, from the stages' models
        # a word of what it does (Sphinx curls quotes and dashes, a code span splits a phrase)
        said = max(re.findall(r"[A-Za-z]{3,}", entry["does"]), key=len)
        assert entry["name"] in page and said.lower() in page.lower(), entry["name"]
    # its FAIL path: a parameter whose rule takes anything is counted and named
    lax = Param("lax_probe", TakesAnything(), {"*": ""}, "a planted lax rule")
    monkeypatch.setitem(registry.PARAMS, "lax_probe", lax)
    tried_with, accepted_with, which = pages.hostile_tally()
    assert tried_with > tried and accepted_with > 0
    assert all(w.startswith("lax_probe = ") for w in which)
    assert "a defect: lax_probe = " in pages.parameters_page()


def test_an_unsealed_run_is_published_only_as_incomplete(tmp_path):
    import nbformat

    results = copy_runs(tmp_path, REFERENCE)
    (results / REFERENCE / evidence.SUMS_NAME).unlink()  # as a run interrupted before sealing
    book.refuse_unpublishable(results / REFERENCE)  # not refused: published, labelled
    src = book.stage_sources(results / REFERENCE, tmp_path / "src", results)
    history = (src / "book" / "history.md").read_text()
    row = next(line for line in history.splitlines() if f"`{REFERENCE}`" in line)
    assert "| incomplete |" in row
    page = (src / "book" / "runs" / f"{REFERENCE}.md").read_text()
    assert "incomplete: no SHA256SUMS" in page
    for stage in ("00_cluster", "05_sweep"):
        chapter = nbformat.read(src / "book" / "stages" / f"{stage}.ipynb", as_version=4)
        assert "\n**Incomplete run**" in chapter.cells[0].source, stage


def test_the_coverage_page_says_what_runs_where_from_the_runs_and_cites_the_rest(built):
    """Its cells' computation: tests/test_publish_coverage.py; here, the built page."""
    from lib.publish import cited

    runs = catalog(RESULTS)
    # a cell's level is bold: its tag left a space before the colon
    page = re.sub(r" ([:;,])", r"\1", text_of(built / "book" / "coverage.html"))
    vllm = coverage.coverage_table(runs).set_index("engine / lane").loc["vLLM"]
    assert vllm["one GPU host"].startswith("**measured**")
    assert vllm["Kubernetes"].startswith(f"**{coverage.SIMULATED_NODES}**")
    assert f"{coverage.SIMULATED_NODES}: 1 run, 1 passing; latest kube-ctlplane-20261207g" in page
    source = sources.strip_links(
        (built.parent / ".src" / "book" / "coverage.md").read_text(encoding="utf-8"))
    for claim in cited.CLAIMS:  # in the page's source: Sphinx typesets '--' as a dash
        assert claim["claim"] in source and claim["date"] in source
    assert "not a single-variable A/B" in page
    for stack in published.cross_engine_figures()["stack"]:
        assert stack in page
    assert "SGLang 0.5.11 with a seam patch, EP_NUM_COMMS 8 (the overlay) 34.5 67.2 255.2" in page
    seed_runs = sum(r.pin_set == "seed-2026-07" for r in runs)
    assert f"seed-2026-07 (served-e2e): {seed_runs} committed runs" in page


def test_prose_citing_a_run_not_in_the_results_keeps_the_citation_as_text():
    text = ("See [`kept-run`](../runs/kept-run.md), [`gone-run`](runs/gone-run.md) and "
            "[a page](missing.md).")
    out = book.unlink_absent_runs(text, {"kept-run"})
    assert "[`kept-run`](../runs/kept-run.md)" in out
    assert "`gone-run` (a run not in this book's results)" in out and "runs/gone-run" not in out
    assert "[a page](missing.md)" in out  # any other link is left to fail the build (-W)


def test_the_pin_sets_page_shows_every_set_and_the_one_gpu_diagnostic_from_its_evidence(tmp_path):
    from lib.roots import pins

    page = appendix.pin_sets_table(RESULTS)
    for row in pins.set_overview():
        assert f"| {row['set']} | {row['level']} |" in page
    compare = json.loads((RESULTS / "diagnostics" / appendix.CURRENT_SET_DIAGNOSTIC
                          / "compare.json").read_text())
    for arm, pair in compare["0.26.0 against 0.24.0"].items():
        assert f"| {arm} | {pair['tokens_same']} of {pair['positions']} |" in page
    # without the diagnostic's evidence: not measured, saying where it would be
    assert "not measured: `results/diagnostics/" in appendix.pin_sets_table(tmp_path)


def test_an_interrupted_stage_is_said_so_in_the_appendix(tmp_path):
    """A stage the runner stopped (its incomplete.json, lib.runner) and no attempt finished."""
    results = copy_runs(tmp_path, REFERENCE)
    run = results / REFERENCE
    shutil.rmtree(run / "06_multicomm")
    (run / "06_multicomm").mkdir()
    (run / "06_multicomm" / "incomplete.json").write_text('{"signal": "SIGINT"}')
    (run / evidence.SUMS_NAME).unlink()
    evidence.seal(run)
    (mine,) = catalog(results)
    assert mine.stages["06_multicomm"] == "interrupted"
    assert mine.verdict == "incomplete: 06 interrupted"
    history = appendix.history_page([mine])
    assert "incomplete: 06 interrupted (make run RUN=<id> resumes it)" in history
    # a group of one run is a two-column table, the rest said once above it: it fits a window
    assert "The one run here: date: " in history and "| run | status |" in history
    summary = appendix.run_page(mine, REFERENCE)
    assert "| 06_multicomm | 0 | 0 | 0 | interrupted |" in summary


def test_a_reason_too_long_for_its_cell_becomes_the_tables_note_once():
    notes = pages.Notes()
    assert notes.said("no run that may feed results") == "no run that may feed results"
    assert notes.markdown() == ""  # every reason fitted its cell: no notes
    long_line = "the server died serving: " + "x" * 80
    a_path = "see /pytorch/aten/src/ATen/native/cuda/IndexKernel.cu"  # short, one long word
    assert notes.said(long_line) == "note 1"
    assert notes.said(a_path) == "note 2"
    assert notes.said(long_line) == "note 1"  # the same reason, the same note
    assert notes.said("gpu-2xh200-deepep-vllm-20261130d failed") == (
        "gpu-2xh200-deepep-vllm-20261130d failed")  # hyphens wrap: it fits
    assert notes.markdown() == f"\nNotes:\n\n1. {long_line}\n2. {a_path}\n"


def test_the_history_page_names_every_run_taken_out_of_the_tree_with_its_commit():
    """results/REMOVED: each re-recorded run taken out is named with the commit that holds it
    (git has it there) and linked to the run that replaces it today (a replacement re-recorded
    since: its own replacement)."""
    import subprocess

    from lib.publish import appendix, catalog as catalog_mod

    shallow = subprocess.run(["git", "rev-parse", "--is-shallow-repository"],
                             cwd=RESULTS.parent, capture_output=True, text=True).stdout.strip()
    if shallow == "true":
        pytest.skip("a shallow clone holds none of the commits results/REMOVED names")
    removed = catalog_mod.removed_runs(RESULTS)
    assert removed, "results/REMOVED lists no run"
    present = {d.name for d in RESULTS.iterdir() if (d / "run.json").is_file()}
    section = appendix.removed_section(removed)
    for run in removed:
        assert run.run_id not in present
        held = subprocess.run(["git", "cat-file", "-e", f"{run.commit}:results/{run.run_id}/"
                               "run.json"], cwd=RESULTS.parent, capture_output=True)
        assert held.returncode == 0, f"{run.commit} does not hold {run.run_id}"
        assert f"`{run.run_id}`" in section and f"`{run.commit[:12]}`" in section
    linked = set(re.findall(r"\(runs/([^)]+)\.md\)", section))
    assert linked and linked <= present  # every replacement linked is a run of the tree
