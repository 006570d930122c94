"""Re-record the cheap runs, replacing them in the tree: `make rerecord` (or `.venv/bin/python
-m tests.rerecord [KIND ...]`).

DESIGN.md, Reference runs age: a run replays while today's stages make the calls it recorded.
A change that alters them re-records, in the same commit, every run that costs nothing but
this machine's time:

- `local`: the CPU reference (`python -m lib.runner run`, every stage; then its notebooks are
  the committed notebooks/ and results/REFERENCE names it);
- `kube-ctlplane`, `kube-ctlplane-sglang`, `kube-ctlplane-trtllm`: the guide on the real control
  plane with simulated nodes (tests/record_kube_run.py);
- `slurm-2nodes`: the guide on the real two-node Slurm (tests/record_slurm_run.py);
- `plan-{kube,slurm}-{train,sglang,trtllm}`: what a plan renders (the context plan).

Each new run is recorded first; only when it passed is the run it replaces removed from the tree
(`git rm`), named in results/REMOVED with the commit that still holds it and the run that
replaced it (the book's history page lists them), and every mention of the old id in the book's
prose and the tests is turned into the new one. results/REPLAYED lists every notebook of the new
runs. A GPU run is never re-recorded here: it is shown through its evidence.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

from lib import runner
from lib.core.door import REPO_ROOT

RESULTS = REPO_ROOT / "results"
REMOVED = RESULTS / "REMOVED"
REPLAYED = RESULTS / "REPLAYED"
# Where a run id may be named outside results/: turned into the new id when a run is replaced.
MENTIONS = ("book/*.md", "book/stages/*.md", "tests/*.py", "lib/publish/*.py",
            "lib/publish/*.yaml")


def _plan(plan_for: str, what: str) -> tuple[list[str], dict[str, str]]:
    if what == "train":
        return ["00_cluster", "07_train"], {"plan_for": plan_for, "nodes": "2"}
    return ["04_serve", "05_sweep"], {"plan_for": plan_for, "nodes": "2", "engine": what}


# kind -> the pattern of its run ids (the date and an optional letter after the kind)
KINDS = ("local", "kube-ctlplane", "kube-ctlplane-sglang", "kube-ctlplane-trtllm",
         "slurm-2nodes", *(f"plan-{p}-{w}" for p in ("kube", "slurm")
                           for w in ("train", "sglang", "trtllm")))


def id_pattern(kind: str) -> re.Pattern:
    if kind == "local":
        return re.compile(r"local-\d{8}T\d{6}Z(-\d+)?")
    return re.compile(re.escape(kind) + r"-\d{8}[a-z]?")


def tracked_runs(kind: str) -> list[str]:
    """The committed runs of `kind` (their run.json is in git's index)."""
    listed = subprocess.run(["git", "ls-files", "results/*/run.json"], cwd=REPO_ROOT,
                            capture_output=True, text=True, check=True).stdout.split()
    pattern = id_pattern(kind)
    return sorted(p.split("/")[1] for p in listed if pattern.fullmatch(p.split("/")[1]))


def removed_ids() -> set[str]:
    """The runs results/REMOVED names: taken out of the tree, still theirs in git's history."""
    if not REMOVED.exists():
        return set()
    return {line.split()[0] for line in REMOVED.read_text(encoding="utf-8").splitlines()
            if line.strip() and not line.startswith("#")}


def new_id(kind: str) -> str:
    """Today's first id of `kind` that no run holds, in the tree or in results/REMOVED (an id
    names one run for good: a removed run's id given again would make the history's
    replacement chain a loop and its commit ambiguous)."""
    day = datetime.now(timezone.utc).strftime("%Y%m%d")
    taken = removed_ids()
    for letter in ["", *"bcdefghijklmnopqrstuvwxyz"]:
        candidate = f"{kind}-{day}{letter}"
        if not (RESULTS / candidate).exists() and candidate not in taken:
            return candidate
    raise SystemExit(f"{kind}: 26 runs today already")


def record(kind: str) -> str:
    """Record a new run of `kind` in this process's environment as it was before (a recorder
    sets what its run.json says was real, REPRO_LEVEL, and the clients' KUBECONFIG or
    SLURM_CONF: none of it may reach the next kind's run); its id, or SystemExit where it did
    not pass."""
    saved = dict(os.environ)
    try:
        return _record(kind)
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _record(kind: str) -> str:
    if kind == "local":
        run_dir, rc = runner.run_guide("local", None, {})
        run_id = run_dir.name
    else:
        run_id = new_id(kind)
        if kind.startswith("kube-ctlplane"):
            from tests import record_kube_run
            engine = kind.removeprefix("kube-ctlplane").strip("-")
            rc = record_kube_run.main([run_id, engine] if engine else [run_id])
        elif kind == "slurm-2nodes":
            from tests import record_slurm_run
            rc = record_slurm_run.main([run_id])
        else:
            _, plan_for, what = kind.split("-")
            stages, params = _plan(plan_for, what)
            _, rc = runner.run_guide("plan", run_id, params, stages)
    if rc != 0:
        raise SystemExit(f"{kind}: the new run {run_id} did not pass (exit {rc}); nothing was "
                         "replaced (its evidence is kept under results/ to read)")
    return run_id


def notebooks_of(run_id: str) -> list[str]:
    return sorted(f"results/{run_id}/notebooks/{p.name}"
                  for p in (RESULTS / run_id / "notebooks").glob("*.ipynb")
                  if ".attempt-" not in p.name)


def head() -> str:
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                          text=True, check=True).stdout.strip()


def notes_for(new: str, old: list[str], commit: str) -> str:
    replaced = ", ".join(f"`{o}`" for o in old) or "no earlier run"
    return (f"Re-recorded by `make rerecord` on "
            f"{datetime.now(timezone.utc):%Y-%m-%d}, with the change of the commit that adds "
            f"it: its run.json says the guide had uncommitted changes (that change, recorded "
            f"before it was committed, on top of `{commit[:12]}`). It replaces {replaced} "
            f"(removed from the tree; git history keeps it at `{commit[:12]}`, and the book's "
            "history page names it).\n")


def replace(kind: str, new: str, commit: str) -> list[str]:
    """Remove the runs of `kind` that `new` replaces; return their ids."""
    old = [r for r in tracked_runs(kind) if r != new]
    for run_id in old:
        paths = [f"results/{run_id}"] + [
            f"results/{p.name}" for p in RESULTS.glob(f"{run_id}.*")]
        subprocess.run(["git", "rm", "-r", "-q", "--", *paths], cwd=REPO_ROOT, check=True)
        with REMOVED.open("a", encoding="utf-8") as listing:
            listing.write(f"{run_id} {commit} {new}\n")
        rename_mentions(run_id, new)
    (RESULTS / f"{new}.notes.md").write_text(notes_for(new, old, commit), encoding="utf-8")
    lines = [line for line in REPLAYED.read_text(encoding="utf-8").split()
             if line.split("/")[1] not in old]
    REPLAYED.write_text("\n".join(lines + notebooks_of(new)) + "\n", encoding="utf-8")
    return old


def rename_mentions(old: str, new: str) -> None:
    for pattern in MENTIONS:
        for path in REPO_ROOT.glob(pattern):
            text = path.read_text(encoding="utf-8")
            if old in text:
                path.write_text(text.replace(old, new), encoding="utf-8")


def main(argv: list[str]) -> int:
    kinds = argv or list(KINDS)
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        print(f"rerecord: unknown kind(s) {', '.join(unknown)}; kinds: {', '.join(KINDS)}",
              file=sys.stderr)
        return 2
    commit = head()
    # every run records from the committed notebooks/: their parameters cells first follow the
    # parameter models (a parameter added since would otherwise be missing from every new run)
    from lib.publish import notebooks
    for path in notebooks.write_parameters_cells():
        print(f"rerecord: {path.name}: parameters cell rewritten from its stage's model",
              flush=True)
    added = ["results/REPLAYED", "results/REFERENCE", "notebooks"]
    for kind in kinds:
        new = record(kind)
        if kind == "local":
            runner.store_reference(new)
            # the reference's notebooks are the committed notebooks/, replayed as such
            old = replace(kind, new, commit)
            lines = [line for line in REPLAYED.read_text(encoding="utf-8").split()
                     if line.split("/")[1] != new]
            REPLAYED.write_text("\n".join(lines) + "\n", encoding="utf-8")
        else:
            old = replace(kind, new, commit)
        added += [f"results/{new}", f"results/{new}.notes.md"] + (
            ["results/REMOVED"] if old else [])
        print(f"rerecord: {kind}: {new} replaces {', '.join(old) or 'nothing'}", flush=True)
    # what this command wrote, staged for the commit of the change (mentions renamed: git diff)
    subprocess.run(["git", "add", "--", *dict.fromkeys(added)], cwd=REPO_ROOT, check=True)
    from lib.publish.catalog import results_size
    print(results_size(RESULTS), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
