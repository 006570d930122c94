"""Build the Jupyter Book (1.x) from the committed runs, publishing one run's notebooks.

The book is staged in _build/.src: the prose pages of book/, the published run's executed
notebooks as the stage chapters (each after its stage's prose page, which gets that run's gate
table), and the pages generated from evidence across every run of the results directory (the
landing page's answers, results with plots, comparison, coverage, the appendix with a page per
run). Then `jupyter-book build -W` renders it into _build/html without executing anything:
a Sphinx warning (a broken link, a missing page) fails the build.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
from pathlib import Path

import nbformat

from lib.core import evidence
from lib.core.errors import BookRefused  # noqa: F401  raised here; callers import it here
from lib.core.door import REPO_ROOT, Door
from lib.publish import appendix, cited, coverage, pages, scan, sources
from lib.publish.catalog import by_id, catalog, removed_runs
from lib.stages.registry import STAGES

PUBLIC_TREE = REPO_ROOT.parent / "shared" / "fixtures" / "public-repro" / "results"


def public_tree():
    """The public reproduction's AIPerf results, read whole where a copy is beside the checkout;
    None elsewhere (the comparison page then says it was not available)."""
    from lib.measure import aiperf

    if not PUBLIC_TREE.is_dir() or not hasattr(aiperf, "read_public_tree"):
        return None
    return aiperf.read_public_tree(PUBLIC_TREE)


def stage_sources(run_dir: Path, src: Path, results: Path,
                  digests: evidence.DigestCache | None = None) -> Path:
    if src.exists():
        shutil.rmtree(src)
    src.mkdir(parents=True)
    shutil.copytree(REPO_ROOT / "book", src / "book")
    for name in ("_config.yml", "_toc.yml"):
        shutil.copyfile(REPO_ROOT / name, src / name)
    runs = catalog(results, digests)
    if run_dir.name not in by_id(runs):  # a run outside the results directory: list it too
        runs = runs + catalog_one(run_dir)
    published = by_id(runs)[run_dir.name]
    ev = pages.Evidence(runs)
    book = src / "book"
    write = lambda name, text: (book / name).write_text(text, encoding="utf-8")  # noqa: E731
    write("intro.md", pages.landing_page((book / "intro.md").read_text(encoding="utf-8"), ev))
    write("results.md", pages.results_page(ev, book / "figures"))
    write("stages/index.md", pages.stages_index((book / "stages" / "index.md").read_text(
        encoding="utf-8")))
    write("cluster.md", pages.cluster_page((book / "cluster.md").read_text(encoding="utf-8"), ev))
    write("bounds.md", pages.bounds_page(ev))
    write("comparison.md", pages.comparison_page(ev, public_tree()))
    write("coverage.md", coverage.coverage_page(runs, list(cited.CLAIMS)))
    write("history.md", appendix.history_page(runs, removed_runs(results)))
    write("parameters.md", pages.parameters_page())
    write("pin_sets.md", (book / "pin_sets.md").read_text(encoding="utf-8")
          + appendix.pin_sets_table(results))
    (book / "runs").mkdir()
    for run in runs:
        write(f"runs/{run.run_id}.md", appendix.run_page(run, published.run_id))
    for stage in STAGES:
        prose = book / "stages" / f"{stage}.md"
        # what the stage proves (the prose's opening), then what its best evidence says, then
        # the rest of the prose (its gates, pitfalls), then the published run's gates
        opening, _, rest = prose.read_text(encoding="utf-8").partition("\n## ")
        chapter = (opening + pages.stage_evidence(stage, ev, book / "figures")
                   + ("\n## " + rest if rest else "")
                   + appendix.stage_gates_section(published, stage))
        prose.unlink()  # the chapter is one page: the prose, the evidence and the run, a notebook
        nbformat.write(stage_chapter(stage, chapter, run_dir, published),
                       book / "stages" / f"{stage}.ipynb")
    run_ids = {run.run_id for run in runs}
    for page in book.rglob("*.md"):
        page.write_text(sources.link_references(unlink_absent_runs(
            page.read_text(encoding="utf-8"), run_ids)), encoding="utf-8")
    for page in (book / "stages").glob("*.ipynb"):
        notebook = nbformat.read(page, as_version=4)
        for cell in notebook.cells:
            if cell.cell_type == "markdown":
                cell.source = sources.link_references(unlink_absent_runs(cell.source, run_ids))
        nbformat.write(notebook, page)
    return src


# The notebook's cells a chapter leaves out: its title (the prose's own heading says it), the
# wall of `name = None` papermill reads parameters from, and its gates (shown above, grouped).
_LEFT_OUT_TAGS = {"parameters"}


def stage_chapter(stage: str, chapter: str, run_dir: Path, published) -> nbformat.NotebookNode:
    """One page per stage: the chapter's prose and evidence as its first cell, then the
    published run's executed notebook (the guide's own check where that run is the CPU
    reference), its code folded away, the parameters it was given behind a toggle, and no
    parameters cell of `None`s."""
    executed = run_dir / "notebooks" / f"{stage}.ipynb"
    incomplete = ("**Incomplete run** (interrupted before it was sealed): its files cannot "
                  "be told from files changed since. " if published.seal == "unsealed" else "")
    check = ("" if published.feeds_results else
             " It is a check that the guide runs here, not a performance figure.")
    heading = (f"\n## The notebook as run `{published.run_id}` executed it\n\n{incomplete}"
               f"**Verification level:** {published.level}.{check} Run "
               f"[`{published.run_id}`](../runs/{published.run_id}.md); evidence: "
               f"`results/{run_dir.name}/{stage}/`. Each cell's code is folded; the outputs are "
               "what the run printed.\n")
    cells = []
    if executed.exists():
        notebook = nbformat.read(executed, as_version=4)
        for cell in notebook.cells[1:]:  # [0] is the notebook's title
            tags = set(cell.get("metadata", {}).get("tags", []))
            if tags & _LEFT_OUT_TAGS:
                continue
            if cell.cell_type == "code":
                # injected parameters: folded whole; other code: the code folded, outputs shown
                fold = "hide-cell" if "injected-parameters" in tags else "hide-input"
                cell.metadata["tags"] = sorted(tags | {fold})
            cells.append(cell)
    else:  # a stage the published run did not run: its chapter says so, with no notebook
        notebook = nbformat.read(REPO_ROOT / "notebooks" / f"{stage}.ipynb", as_version=4)
        heading = f"\n## The notebook\n\n**Not run** in `{run_dir.name}`.\n"
    notebook.cells = [nbformat.v4.new_markdown_cell(chapter + heading)] + cells
    return notebook


# ---- an unchanged page is not read or written again ---------------------------------------------
# Sphinx reads a page again when its source is newer than its last read, and writes it when the
# source is newer than its html. The sources are written anew each build, so a file whose bytes
# equal the last build's gets that build's modification time back: after `make run` only the
# pages a new run changes are read and written (the history, the results, its own page), not
# the other runs' pages and the prose. What Sphinx cannot see invalidates everything: the book's
# own extensions and the versions of the packages that render it (BUILD_INPUTS), or a page that
# went away (its html would stay, linking to what may be gone).
MANIFEST = ".src-manifest.json"
# the book build's door folder under _build/ (its transcript and streams), and its deadline,
# only so that a hung Sphinx ends: a whole build with no _build/ took 10 s (make book on this
# 2-core machine, 2026-12-07, jupyter-book's own 5.8 s), far under it
BUILD_CALLS = "build-calls"
BUILD_TIMEOUT_S = 1800.0


def build_inputs() -> str:
    """A digest of what renders the pages besides their sources: the book's extensions and the
    rendering packages' versions."""
    from importlib import metadata

    h = hashlib.sha256()
    for path in sorted((REPO_ROOT / "book" / "_ext").glob("*.py")):
        h.update(path.name.encode() + path.read_bytes())
    for package in ("jupyter-book", "sphinx", "myst-nb", "myst-parser", "sphinx-book-theme",
                    "pydata-sphinx-theme", "sphinx-design", "docutils"):
        h.update(f"{package}={metadata.version(package)}".encode())
    return h.hexdigest()


def source_manifest(src: Path) -> dict[str, list]:
    """{path inside the sources: [sha256, mtime_ns]} of the last build's sources."""
    manifest = src.parent / MANIFEST
    try:
        return json.loads(manifest.read_text(encoding="utf-8")) if src.is_dir() else {}
    except (OSError, ValueError):
        return {}


def keep_unchanged_times(src: Path, before: dict[str, list], build_dir: Path) -> None:
    inputs = build_inputs()
    pages = {rel for rel in before if rel.endswith((".md", ".ipynb"))}
    now: dict[str, list] = {"": [inputs, 0]}
    for path in sorted(p for p in src.rglob("*") if p.is_file()):
        rel = path.relative_to(src).as_posix()
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        if rel in before and before[rel][0] == digest:
            os.utime(path, ns=(before[rel][1], before[rel][1]))
        now[rel] = [digest, path.stat().st_mtime_ns]
    gone = pages - set(now)
    if before.get("", [None])[0] != inputs or gone:
        forget_build(build_dir)
    (build_dir / MANIFEST).write_text(json.dumps(now), encoding="utf-8")


def forget_build(build_dir: Path) -> None:
    """The next build is a whole one: no doctrees, no html, no manifest."""
    for name in (".doctrees", "html", MANIFEST):
        target = build_dir / name
        if target.is_dir():
            shutil.rmtree(target)
        elif target.exists():
            target.unlink()


# a link to a run's page in prose: [`<run id>`](runs/<run id>.md) or (../runs/<run id>.md)
_RUN_LINK = re.compile(r"\[([^\]]*)\]\((?:\.\./)?runs/([A-Za-z0-9][A-Za-z0-9._-]*)\.md\)")


def unlink_absent_runs(text: str, run_ids: set[str]) -> str:
    """The prose pages cite committed runs by link; a book built from another results folder
    (a user's own runs, a test's) has no page for them: the citation stays, as text saying so,
    and every other broken link still fails the build."""
    def keep_or_say(m: re.Match) -> str:
        if m.group(2) in run_ids:
            return m.group(0)
        return f"{m.group(1)} (a run not in this book's results)"
    return _RUN_LINK.sub(keep_or_say, text)


def catalog_one(run_dir: Path):
    from lib.publish.catalog import read_run

    return [read_run(run_dir, [], reference=run_dir.name)]


def refuse_unpublishable(run_dir: Path, digests: evidence.DigestCache | None = None) -> None:
    """A run whose files changed after sealing is never published; an unsealed run (interrupted
    before it was sealed) is, labelled incomplete on every page that shows it."""
    if not (run_dir / "run.json").exists():
        raise FileNotFoundError(f"{run_dir} is not a recorded run (no run.json)")
    if evidence.seal_state(run_dir, digests) == "tampered":
        raise BookRefused(f"run {run_dir.name}: its evidence does not match SHA256SUMS, so it "
                          "is not published: " + "; ".join(evidence.verify(run_dir, digests)))


def build(run_dir: Path, out_root: Path = REPO_ROOT, results: Path | None = None) -> Path:
    """Build into <out_root>/_build/html (the repository's by default) from every run of
    `results` (the run's own parent directory by default), publishing `run_dir`'s notebooks."""
    run_dir = Path(run_dir).absolute()  # not resolve(): a linked run belongs to its link's folder
    build_dir = Path(out_root) / "_build"
    # every listed run's seal is checked each build; a file's digest is hashed again only when
    # its size, time or inode changed since the last build (evidence.DigestCache)
    digests = evidence.DigestCache(build_dir / ".digest-cache.json")
    refuse_unpublishable(run_dir, digests)
    results = Path(results).absolute() if results else run_dir.parent
    before = source_manifest(build_dir / ".src")
    src = stage_sources(run_dir, build_dir / ".src", results, digests)
    digests.save()
    keep_unchanged_times(src, before, build_dir)
    jb = Path(sys.executable).with_name("jupyter-book")
    # through the door, as every process: its group stopped on Ctrl-C, its argv and streams
    # recorded (cleaned of secrets and identities) in the build's own folder, the last build's
    shutil.rmtree(build_dir / BUILD_CALLS, ignore_errors=True)
    done = Door(build_dir / BUILD_CALLS, "_book").run(
        [str(jb), "build", str(src), "--path-output", str(out_root), "-W", "-n", "--keep-going"],
        timeout=BUILD_TIMEOUT_S, check=False)
    log = build_dir / "book-build.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(done.stdout + done.stderr, encoding="utf-8")
    index = build_dir / "html" / "index.html"
    if done.rc != 0 or done.timed_out or not index.exists():
        forget_build(build_dir)  # the next build reads every page again and says every warning
        warnings = [line for line in (done.stdout + done.stderr).splitlines()
                    if "WARNING" in line or "ERROR" in line]
        stopped = f", stopped after {BUILD_TIMEOUT_S:.0f} s" if done.timed_out else ""
        raise RuntimeError(f"jupyter-book build failed (rc {done.rc}{stopped}, warnings are "
                           f"errors); see {log}:\n" + "\n".join(warnings[:20]))
    # nothing that names a private address, an account, a token or a person's home is published
    scan.refuse_identities(build_dir / "html")
    print(f"book: _build/html/index.html (from run {run_dir.name})", flush=True)
    return index
