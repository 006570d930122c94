"""Run the guide: the seven notebooks in order with papermill, then seal the run and build the book.

    python -m lib.runner run [--context local] [--run-id ID] [-p NAME VALUE ...]
    python -m lib.runner book RUN_ID
    python -m lib.runner reference RUN_ID   # store a run's executed notebooks in notebooks/

A stage whose gates FAIL stops the stages that read its evidence (lib.stages.registry); the run
goes on with the others, and the exit code is 1. A notebook that raises stops the run at once.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import nbformat

from lib import places
from lib.core import evidence
from lib.core.door import REPO_ROOT, redact_file
from lib.core.errors import ParameterError
from lib.core.stage import new_run_id
from lib.stages import registry
from lib.stages.registry import STAGES, check_run_request

NOTEBOOKS = REPO_ROOT / "notebooks"
RESULTS = REPO_ROOT / "results"
NOTEBOOK_TIMEOUT_S = 1800


def papermill_argv(stage: str, run_dir: Path, params: dict[str, str]) -> list[str]:
    # Both paths always: with stdin a pipe, a single path is taken as the OUTPUT (TOOLCHAIN.md).
    argv = [sys.executable, "-m", "papermill", str(NOTEBOOKS / f"{stage}.ipynb"),
            str(run_dir / "notebooks" / f"{stage}.ipynb"), "--cwd", str(NOTEBOOKS),
            "--kernel", "python3", "--no-progress-bar", "--execution-timeout",
            str(NOTEBOOK_TIMEOUT_S)]
    for name, value in params.items():
        argv += ["-p", name, str(value)]
    return argv


def failed_stages(run_dir: Path) -> set[str]:
    failed = set()
    for stage in STAGES:
        gates = evidence.read_gates(run_dir / stage)
        if gates and any(g["status"] == "FAIL" for g in gates):
            failed.add(stage)
    return failed


def stage_engine(run_dir: Path, context: str, given: dict[str, str]) -> str:
    """The engine a serving stage of this run resolves: as given, else as 04 recorded it in
    this run, else the place's pick (lib.places)."""
    if given.get("engine"):
        return given["engine"]
    served = run_dir / "04_serve" / "params.json"
    if served.exists():
        engine = evidence.read_json(served).get("engine")
        if engine:
            return engine
    return places.engine_default({"context": context})


def blocked_by(stage: str, run_dir: Path, context: str = "local",
               given: dict[str, str] | None = None) -> list[str]:
    """The stages this one reads (lib.stages.registry) that FAILED in the run."""
    failed = failed_stages(run_dir)
    upstream = registry.upstream(stage, stage_engine(run_dir, context, given or {}))
    return [d for d in upstream if d in failed]


def changed_since_sealed(run_dir: Path, stage: str) -> list[str]:
    """A recorded stage's files that no longer match SHA256SUMS (none when never sealed)."""
    if not (run_dir / evidence.SUMS_NAME).exists():
        return []
    return [p for p in evidence.verify(run_dir) if p.startswith(f"{stage}/")]


def run_guide(context: str, run_id: str | None, extra: dict[str, str],
              stages: list[str] | None = None) -> tuple[Path, int]:
    run_id = run_id or new_run_id(RESULTS, context)
    run_dir = RESULTS / run_id
    (run_dir / "notebooks").mkdir(parents=True, exist_ok=True)
    params = {"context": context, "run_id": run_id, **extra}
    print(f"run {run_id} · context {context} · evidence in results/{run_id}/", flush=True)
    rc = 0
    for stage in stages or STAGES:
        if evidence.read_gates(run_dir / stage) is not None:
            changed = changed_since_sealed(run_dir, stage)
            if changed:
                print(f"[{stage}] recorded, but its files changed since the run was sealed "
                      f"({', '.join(changed[:3])}): resume refused; start a new run", flush=True)
                return run_dir, 2
            print(f"[{stage}] already recorded in this run, hashes match: kept as is", flush=True)
            continue
        blocked = blocked_by(stage, run_dir, context, extra)
        if blocked:
            print(f"[{stage}] not run: {', '.join(blocked)} FAILED", flush=True)
            rc = 1
            continue
        print(f"[{stage}] running ...", flush=True)
        started = time.monotonic()
        log = run_dir / "notebooks" / f"{stage}.papermill.log"
        with open(log, "w", encoding="utf-8") as out:  # papermill's own chatter, kept whole
            done = subprocess.run(papermill_argv(stage, run_dir, params), cwd=REPO_ROOT,
                                  stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
        redact_file(log, run_dir=run_dir)
        gates = evidence.read_gates(run_dir / stage)
        took = time.monotonic() - started
        if done.returncode != 0 or gates is None:
            tail = "\n".join(log.read_text(encoding="utf-8").splitlines()[-25:])
            print(f"[{stage}] the notebook failed (papermill rc {done.returncode}) after "
                  f"{took:.0f} s: see results/{run_id}/notebooks/{stage}.ipynb\n{tail}",
                  flush=True)
            evidence.seal(run_dir)
            return run_dir, 2
        counts = evidence.summarize_gates(gates)
        print(f"[{stage}] {counts['PASS']} PASS, {counts['FAIL']} FAIL, {counts['SKIP']} SKIP "
              f"in {took:.0f} s", flush=True)
        for g in gates:
            if g["status"] == "FAIL":
                print(f"    FAIL {g['gate']}: {g['reason']}", flush=True)
                rc = 1
    evidence.seal(run_dir)
    return run_dir, rc


def store_reference(run_id: str) -> None:
    """Make a recorded run the committed reference: its executed notebooks into notebooks/,
    without papermill's injected-parameters cell. That cell names the reference run; kept, a
    newcomer's first plain `papermill notebooks/NN.ipynb out.ipynb` would aim at the reference
    run (refused: already recorded). Without it, such a call starts a new run, and nbval's
    replay still finds its run from REPRO_REPLAY (run_id '' is accepted there)."""
    run_dir = RESULTS / run_id
    for stage in STAGES:
        notebook = nbformat.read(run_dir / "notebooks" / f"{stage}.ipynb", as_version=4)
        notebook.cells = [c for c in notebook.cells
                          if "injected-parameters" not in c.get("metadata", {}).get("tags", [])]
        nbformat.write(notebook, NOTEBOOKS / f"{stage}.ipynb")
    (RESULTS / "REFERENCE").write_text(run_id + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lib.runner")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the seven stages, seal the run, build the book")
    run.add_argument("--context", default="local")
    run.add_argument("--run-id", default=None)
    run.add_argument("--stages", default=None, help="comma-separated subset, e.g. 00_cluster")
    run.add_argument("--no-book", action="store_true")
    run.add_argument("-p", nargs=2, action="append", default=[], metavar=("NAME", "VALUE"))
    book = sub.add_parser("book", help="build the book from a recorded run")
    book.add_argument("run_id")
    ref = sub.add_parser("reference", help="store a run's executed notebooks in notebooks/")
    ref.add_argument("run_id")
    args = parser.parse_args(argv)

    from lib.publish import book as book_mod

    if args.command == "run":
        stages = args.stages.split(",") if args.stages else None
        try:  # before anything is written: no empty or misplaced run is left behind
            check_run_request(args.context, args.run_id, stages, dict(args.p))
        except ParameterError as err:
            print(f"python -m lib.runner run: {err}", file=sys.stderr)
            return 2
        run_dir, rc = run_guide(args.context, args.run_id, dict(args.p), stages)
        if not args.no_book:
            book_mod.build(run_dir)
        print(f"run {run_dir.name}: {'PASS' if rc == 0 else 'FAIL'} (exit {rc})", flush=True)
        return rc
    try:
        check_run_request("local", args.run_id, [], {})
    except ParameterError as err:
        print(f"python -m lib.runner {args.command}: {err}", file=sys.stderr)
        return 2
    if args.command == "book":
        book_mod.build(RESULTS / args.run_id)
        return 0
    store_reference(args.run_id)
    return 0


if __name__ == "__main__":
    sys.exit(main())
