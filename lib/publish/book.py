"""Build the Jupyter Book (1.x) from one recorded run.

The book is staged in _build/.src: the prose pages of book/, the run's executed notebooks as the
stage chapters, and pages generated from the run's evidence (run.md, comparison.md). Then
`jupyter-book build` renders it into _build/html without executing anything.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import nbformat

from lib.publish import report
from lib.core.door import REPO_ROOT
from lib.stages.registry import STAGES

GENERATED = {"run.md": report.run_page, "comparison.md": report.comparison_page}


def stage_sources(run_dir: Path, src: Path) -> Path:
    if src.exists():
        shutil.rmtree(src)
    (src / "notebooks").mkdir(parents=True)
    shutil.copytree(REPO_ROOT / "book", src / "book")
    for name in ("_config.yml", "_toc.yml"):
        shutil.copyfile(REPO_ROOT / name, src / name)
    level = report.verification_level(report.run_record(run_dir))
    for stage in STAGES:
        executed = run_dir / "notebooks" / f"{stage}.ipynb"
        banner = (f"**Verification level:** {level}. Evidence: `results/{run_dir.name}/{stage}/`.")
        if not executed.exists():  # a stage that did not run still has its page, unexecuted
            executed = REPO_ROOT / "notebooks" / f"{stage}.ipynb"
            banner = f"**Not run** in `{run_dir.name}`: this page shows the notebook unexecuted."
        notebook = nbformat.read(executed, as_version=4)
        notebook.cells.insert(1, nbformat.v4.new_markdown_cell(banner))
        nbformat.write(notebook, src / "notebooks" / f"{stage}.ipynb")
    for name, make in GENERATED.items():
        (src / "book" / name).write_text(make(run_dir), encoding="utf-8")
    (src / "book" / "reference_runs.md").write_text(
        report.reference_runs_page(REPO_ROOT / "results"), encoding="utf-8")
    return src


def build(run_dir: Path, out_root: Path = REPO_ROOT) -> Path:
    """Build into <out_root>/_build/html (the repository's by default)."""
    run_dir = Path(run_dir).resolve()
    if not (run_dir / "run.json").exists():
        raise FileNotFoundError(f"{run_dir} is not a recorded run (no run.json)")
    build_dir = Path(out_root) / "_build"
    src = stage_sources(run_dir, build_dir / ".src")
    jb = Path(sys.executable).with_name("jupyter-book")
    done = subprocess.run([str(jb), "build", str(src), "--path-output", str(out_root)],
                          stdin=subprocess.DEVNULL, capture_output=True, text=True)
    log = build_dir / "book-build.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(done.stdout + done.stderr, encoding="utf-8")
    index = build_dir / "html" / "index.html"
    if done.returncode != 0 or not index.exists():
        raise RuntimeError(f"jupyter-book build failed (rc {done.returncode}); see {log}")
    print(f"book: _build/html/index.html (from run {run_dir.name})", flush=True)
    return index
