"""Run the guide: the seven notebooks in order with papermill, then seal the run and build the book.

    python -m lib.runner run [--context local] [--run-id ID] [-p NAME VALUE ...]
    python -m lib.runner book RUN_ID
    python -m lib.runner reference RUN_ID   # store a run's executed notebooks in notebooks/

A stage whose gates FAIL stops the stages that read its evidence (lib.stages.registry); the run
goes on with the others, and the exit code is 1. A notebook that raises stops the run at once
(exit 2). `-p results_dir DIR` puts the run under DIR (default results/).

Interrupted (SIGINT, what Ctrl-C sends to the group; SIGTERM; SIGHUP) while a stage runs, the
runner stops it, by PID and process group, and exits 128 + the signal (130, 143, 129):

1. the stage's kernel (the ledger's owner, lib.core.processes) gets SIGTERM: its running cell
   raises StageInterrupted, so the stage stops its own servers and AIPerf through the door,
   recorded, and papermill writes the notebook and ends (up to KERNEL_GRACE_S);
2. then papermill's session and the kernel's, should they still run (TERM, then KILL);
3. then every group of the stage's ledger still open (TERM, then KILL), and its ports must be
   closed;
4. `NN_stage/incomplete.json` says when, by which signal, what was stopped and what was left;
   a killed writer's temporary file is removed; the run is sealed (as after a failed notebook).

A papermill killed by a signal (its kernel then dies without its exit hook, and the reaper
stops what it started) and a notebook that ends without gates are settled the same way.
`--run-id` of an existing run resumes it: refused when its files changed since it was sealed
or a stage of it still runs; stages with gates.json are kept (their hashes checked); an
unfinished stage is kept as an attempt (`NN_stage.attempt-K/`, lib.core.stage
`retire_attempt`) and runs again.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

import nbformat

from lib import places
from lib.stages import profile
from lib.core import evidence
from lib.core.door import REPO_ROOT, attempt_of, read_transcript, redact_file
from lib.core.processes import (Attempt, Interrupted, Ledger, Signals, found_in_ledger, say,
                                 settle_leftovers, start_attempt)
from lib.core.errors import EvidenceError, ParameterError
from lib.core.stage import (INCOMPLETE_NAME, REFUSED_GATE, new_run_id, retire_attempt, unfinished_attempt,
                            unfinished_writes)
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


def results_root(extra: dict[str, str]) -> Path:
    """Where the run lives: `-p results_dir` as the stages resolve it, else RESULTS."""
    given = extra.get("results_dir")
    if not given:
        return RESULTS
    root = Path(given)
    return (root if root.is_absolute() else REPO_ROOT / root).resolve()


def resume_refused(run_dir: Path) -> str | None:
    """Why an existing run cannot be resumed now, or None. Its files must be as sealed (an
    unsealed run, whose runner was killed, is taken as it is), and no stage of it may still
    run (a live kernel in its ledger)."""
    if (run_dir / evidence.SUMS_NAME).exists():
        changed = evidence.verify(run_dir)
        if changed:
            return (f"its files changed since the run was sealed ({', '.join(changed[:3])}"
                    f"{', ...' if len(changed) > 3 else ''}): resume refused; start a new run")
    ledger = Ledger(run_dir)
    running = [o for o in ledger.owners() if o["pid"] != os.getpid()]
    if running:
        named = ", ".join(f"the runner (pid {o['pid']})" if o["stage"] == "_runner" else
                          f"{o['stage']} (kernel pid {o['pid']})" for o in running)
        return (f"it is still running: {named}; stop it first (kill -TERM <pid>: a runner or "
                "a stage stops what it started) or wait for it")
    return None


def settle(attempt: Attempt, how: str, signum: int | None, ask_kernel: bool) -> dict:
    """Stop what is left of the attempt (lib.core.processes.Attempt.stop), then write
    NN_stage/incomplete.json (evidence, under the seal)."""
    stop = attempt.stop(ask_kernel)
    record = attempt.incomplete(how, signum, stop)
    removed = [str(p.relative_to(attempt.run_dir)) for p in unfinished_writes(attempt.run_dir)]
    for rel in removed:  # a killed writer's temporary file: never evidence
        (attempt.run_dir / rel).unlink(missing_ok=True)
    record["removed_unfinished_writes"] = removed
    if (attempt.run_dir / attempt.stage / "gates.json").exists():
        return record  # its gates were written before it stopped: the stage is complete
    try:
        evidence.write_json_new(attempt.run_dir / attempt.stage / INCOMPLETE_NAME, record)
    except EvidenceError:  # written already (a stage cannot write it: only the runner)
        pass
    bad_ports = [p["port"] for p in record["ports"] if p["listening"]]
    say(f"[{attempt.stage}] stopped: {len(record['process_groups'])} process group(s) "
        f"it started, {len(record['left_running'])} process(es) left, ports "
        + (f"still listening: {bad_ports}" if bad_ports else "closed")
        + f"; marked incomplete: {attempt.stage}/{INCOMPLETE_NAME}")
    return record


def run_guide(context: str, run_id: str | None, extra: dict[str, str],
              stages: list[str] | None = None) -> tuple[Path, int]:
    root = results_root(extra)
    run_id = run_id or new_run_id(root, context)
    run_dir = root / run_id
    if run_dir.exists():
        refused = resume_refused(run_dir)
        if refused:
            print(f"run {run_id}: {refused}", flush=True)
            return run_dir, 2
        settle_leftovers(run_dir)
    (run_dir / "notebooks").mkdir(parents=True, exist_ok=True)
    Ledger(run_dir).owner("_runner")  # a second runner on this run refuses to resume it
    params = {"context": context, "run_id": run_id, **extra}
    print(f"run {run_id} · context {context} · evidence in {_shown(run_dir)}/", flush=True)
    now: list[Attempt] = []
    with Signals() as signals:
        try:
            rc = _run_stages(run_dir, context, extra, params, stages or STAGES, now, signals)
            if rc in (0, 1):
                evidence.seal(run_dir)
            signals.check()  # a signal after the last stage: the run is sealed, no book
        except Interrupted as stop:
            return run_dir, _interrupted(run_dir, now, stop.signum)
    return run_dir, rc


def _shown(run_dir: Path) -> str:
    try:
        return str(run_dir.relative_to(REPO_ROOT))
    except ValueError:
        return str(run_dir)


def _interrupted(run_dir: Path, now: list, signum: int) -> int:
    """The runner was signalled: stop the stage running (if any), mark it, seal, 128 + signal.
    Further signals are noted, never raised (Signals): the stop is not cut short."""
    name = signal.Signals(signum).name
    say(f"{name}: stopping the run")
    if now:
        attempt = now[-1]
        settle(attempt, f"the runner received {name}", signum, ask_kernel=True)
        redact_file(run_dir / "notebooks" / f"{attempt.stage}.papermill.log", run_dir=run_dir)
    settle_leftovers(run_dir)
    evidence.seal(run_dir)
    say(f"run {run_dir.name} interrupted by {name}: resume it with "
        f"`make run RUN={run_dir.name}` (python -m lib.runner run --run-id {run_dir.name})")
    return 128 + signum


def refused(gates: list[dict] | None) -> list[dict]:
    """The FAIL gates a stage recorded for its cluster's refusal (lib.core.stage.Stage.refuse)."""
    return [g for g in gates or [] if g["gate"] == REFUSED_GATE and g["status"] == "FAIL"]


def _stop_at_refusal(run_dir: Path, stage: str, gates: list[dict], now: list, log: Path,
                     took: float) -> int:
    """The stage's cluster refused (its notebook raised after writing its gates): the run
    stops there, sealed, exit 1; nothing after it could reach the cluster either."""
    settle(now[-1], "the cluster refused", None, ask_kernel=False)
    now.clear()
    redact_file(log, run_dir=run_dir)
    settle_leftovers(run_dir)
    counts = evidence.summarize_gates(gates)
    print(f"[{stage}] {counts['PASS']} PASS, {counts['FAIL']} FAIL, {counts['SKIP']} SKIP "
          f"in {took:.0f} s", flush=True)
    for g in refused(gates):
        print(f"    FAIL {g['gate']}: {g['reason']}", flush=True)
    print(f"[{stage}] the cluster refused: the run stops here (fix the context, then start a "
          "new run)", flush=True)
    evidence.seal(run_dir)
    return 1


def _run_stages(run_dir: Path, context: str, extra: dict[str, str], params: dict[str, str],
                stages: list[str], now: list, signals: Signals) -> int:
    run_id = run_dir.name
    rc = 0
    for stage in stages:
        signals.check()
        if evidence.read_gates(run_dir / stage) is not None:
            changed = changed_since_sealed(run_dir, stage)
            if changed:
                print(f"[{stage}] recorded, but its files changed since the run was sealed "
                      f"({', '.join(changed[:3])}): resume refused; start a new run", flush=True)
                return 2
            sealed = (run_dir / evidence.SUMS_NAME).exists()
            print(f"[{stage}] already recorded in this run, "
                  + ("hashes match: kept as is" if sealed else
                     "never sealed (its runner was killed): kept as found"), flush=True)
            continue
        blocked = blocked_by(stage, run_dir, context, extra)
        if blocked:
            print(f"[{stage}] not run: {', '.join(blocked)} FAILED", flush=True)
            rc = 1
            continue
        if unfinished_attempt(run_dir, stage):
            kept = retire_attempt(run_dir, stage, found_in_ledger(run_dir, stage))
            print(f"[{stage}] its attempt {kept['attempt']} ended without gates: kept as "
                  f"{kept['key']} ({kept['incomplete']}); running the stage again", flush=True)
        signals.check()  # nothing started yet: a signal that came meanwhile stops here
        print(f"[{stage}] running ...", flush=True)
        started = time.monotonic()
        log = run_dir / "notebooks" / f"{stage}.papermill.log"
        with open(log, "x", encoding="utf-8") as out:  # papermill's own chatter, kept whole
            # its own session: a terminal's Ctrl-C reaches the runner alone, which stops the
            # stage in order (its kernel sits in a session of its own too: jupyter_client)
            proc = start_attempt(papermill_argv(stage, run_dir, params), out)
            now.append(Attempt(run_dir, stage, proc, attempt_of(
                read_transcript(run_dir / "transcript.jsonl"), stage)))
            returncode = signals.wait(proc)
        gates = evidence.read_gates(run_dir / stage)
        took = time.monotonic() - started
        if returncode != 0 and refused(gates):
            return _stop_at_refusal(run_dir, stage, gates, now, log, took)
        if returncode != 0 or gates is None:
            killed = -returncode if returncode < 0 else None
            how = (f"papermill was killed by {signal.Signals(killed).name}" if killed else
                   f"the notebook ended without gates.json (papermill exit {returncode})")
            # its kernel first (a killed papermill's kernel may still write into the log)
            settle(now[-1], how, killed, ask_kernel=False)
            now.clear()
            redact_file(log, run_dir=run_dir)
            tail = "\n".join(log.read_text(encoding="utf-8").splitlines()[-25:])
            print(f"[{stage}] the notebook failed ({how}) after {took:.0f} s: see "
                  f"{_shown(run_dir)}/notebooks/{stage}.ipynb\n{tail}", flush=True)
            settle_leftovers(run_dir)
            evidence.seal(run_dir)
            if killed:
                print(f"run {run_id}: resume it with `make run RUN={run_id}` (python -m "
                      f"lib.runner run --run-id {run_id})", flush=True)
            return 128 + killed if killed else 2
        redact_file(log, run_dir=run_dir)
        now.clear()
        left = settle_leftovers(run_dir)  # a stage that leaked a process: stopped, said
        counts = evidence.summarize_gates(gates)
        print(f"[{stage}] {counts['PASS']} PASS, {counts['FAIL']} FAIL, {counts['SKIP']} SKIP "
              f"in {took:.0f} s" + (f"; {len(left)} process group(s) it left were stopped"
                                    if left else ""), flush=True)
        for g in gates:
            if g["status"] == "FAIL":
                print(f"    FAIL {g['gate']}: {g['reason']}", flush=True)
                rc = 1
    return rc


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


def profile_command(action: str | None, context: str | None, given: dict[str, str]) -> int:
    """`profile show`, or write the profile from --context and -p (checked first: a profile a
    stage would refuse is never written)."""
    if action == "show":
        print(profile.shown())
        return 0
    if not context and not given:
        print("usage: python -m lib.runner profile --context kube|slurm|plan -p NAME VALUE ..., "
              "or profile show", file=sys.stderr)
        return 2
    try:
        where = profile.write({**({"context": context} if context else {}), **given})
    except ParameterError as err:
        print(f"python -m lib.runner profile: {err}", file=sys.stderr)
        return 2
    print(f"wrote {where}; every notebook and `make run` now default to it "
          "(an explicit -p wins; `python -m lib.runner profile show` prints it)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lib.runner")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the seven stages, seal the run, build the book")
    run.add_argument("--context", default=None,
                     help="local, plan, kube or slurm (default: the cluster profile's, else local)")
    run.add_argument("--run-id", default=None,
                     help="an existing run resumes: its intact stages kept, the rest redone")
    run.add_argument("--stages", default=None, help="comma-separated subset, e.g. 00_cluster")
    run.add_argument("--no-book", action="store_true")
    run.add_argument("-p", nargs=2, action="append", default=[], metavar=("NAME", "VALUE"))
    book = sub.add_parser("book", help="build the book from a recorded run")
    book.add_argument("run_id")
    ref = sub.add_parser("reference", help="store a run's executed notebooks in notebooks/")
    ref.add_argument("run_id")
    prof = sub.add_parser("profile", help="write the cluster profile every notebook defaults to "
                                          "(`profile show` prints it)")
    prof.add_argument("action", nargs="?", choices=["show"])
    prof.add_argument("--context", default=None)
    prof.add_argument("-p", nargs=2, action="append", default=[], metavar=("NAME", "VALUE"))
    args = parser.parse_args(argv)
    if args.command == "profile":
        return profile_command(args.action, args.context, dict(args.p))

    from lib.publish import book as book_mod

    if args.command == "run":
        stages = args.stages.split(",") if args.stages else None
        try:  # before anything is written: no empty or misplaced run is left behind
            args.context = args.context or profile.load().get("context") or "local"
            check_run_request(args.context, args.run_id, stages, dict(args.p))
        except ParameterError as err:
            print(f"python -m lib.runner run: {err}", file=sys.stderr)
            return 2
        run_dir, rc = run_guide(args.context, args.run_id, dict(args.p), stages)
        if rc >= 128:  # interrupted: stopped, marked and sealed; no book
            return rc
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
