"""The appendix and what shows one run's gates: the history of every recorded run, a page per
run, the pin sets' table, and the published run's gates appended to each stage's chapter.

Every figure comes from the run's own evidence (its run.json, gates.json files and notes)."""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from lib.core import evidence
from lib.publish import report
from lib.publish.catalog import END_TO_END, Run
from lib.publish.pages import NOT_MEASURED, _md_table, run_link

# --- the history -------------------------------------------------------------------------------

def history_page(runs: list[Run]) -> str:
    table = pd.DataFrame([{
        "run": run_link(r.run_id, prefix=""), "date": r.date, "hardware": r.hardware,
        "context": r.context, "pin set": r.pin_set,
        "measured": ", ".join(s[:2] for s in r.measured),
        "verdict": r.verdict, "status": r.label,
        "replayed by make test": ", ".join(s[:2] for s in r.replayed) or "no",
        "feeds results": "yes" if r.feeds_results else "no",
    } for r in runs])
    return ("# Appendix: every recorded run\n\n"
            "Every run committed under `results/`, oldest first, failed and superseded ones "
            "included. A run feeds the [results](results.md) only when it ran on real GPUs on "
            "the place it names with its evidence intact; the others show their level on their "
            "page. *Superseded* means a later run on the same hardware measured the same stages "
            "with the same kernel and engine and passed; *has FAIL gates* means a stage FAILed and "
            "no later run repeated it; its other figures may still feed the results. Stages are named by number (00 to 06).\n\n"
            + _md_table(table))


def run_page(run: Run, published_run: str) -> str:
    out = [f"# Run `{run.run_id}`\n"]
    if run.run_id == published_run:
        out.append("The run whose executed notebooks are the stage chapters of this book.\n")
    status = run.label
    sealed = {"sealed": "every file matches SHA256SUMS",
              "unsealed": "incomplete: no SHA256SUMS (interrupted before it was sealed)"}.get(
        run.seal, f"NOT verified ({run.seal})")
    guide = run.record.get("guide") or {}
    out.append(_md_table(pd.DataFrame([
        {"": "level", " ": run.level},
        {"": "status", " ": status},
        {"": "date (UTC)", " ": run.record.get("created_utc", "")},
        {"": "hardware", " ": run.hardware},
        {"": "context", " ": f"`{run.context}`"},
        {"": "pin set", " ": pin_set_said(run)},
        {"": "kernel", " ": run.kernel or "not run"},
        {"": "serving", " ": run.serving or "not run"},
        {"": "feeds the results page", " ": "yes" if run.feeds_results else
         f"no: {run.why_not_results}"},
        {"": "evidence", " ": f"`results/{run.run_id}/`, {sealed}"},
        {"": "guide", " ": f"`{guide.get('git_sha')}` (uncommitted changes: {guide.get('dirty')})"},
        {"": "replayed by make test", " ": ", ".join(run.replayed) or "no"},
        {"": "audit", " ": f"`REPRO_REPLAY=results/{run.run_id} pytest --nbval "
                           f"results/{run.run_id}/notebooks/`"},
    ])))
    if run.notes:
        out.append("\n## Notes recorded with the run\n\n" + demote_headings(run.notes))
    out.append("\n## Stages\n\n" + _md_table(report.stage_summary(run.path)))
    kernel = report.kernel_figures(run.path)
    if kernel:
        out.append("\n## Kernel test (03)\n")
        out.append(_md_table(pd.DataFrame([kernel]).T.reset_index().rename(
            columns={"index": "figure", 0: "value"})))
    out += [s.replace("\n### ", "\n## ") for s in report.vllm_sections(run.path)]
    out.append("\n## Gates that did not pass\n\n" + not_passed_gates(run.path))
    return "\n".join(out)


def pin_set_said(run: Run) -> str:
    from lib.roots import pins

    level = ((pins.load().get("sets") or {}).get(run.pin_set) or {}).get("level", "")
    said = f"`{run.pin_set}` ({level})" if level else f"`{run.pin_set}`"
    if "pin_set" not in run.record:
        said += ": recorded before pin sets existed, read as the stack every such run used"
    return said


# A single-GPU diagnostic of the `current` set (results/diagnostics/<name>/compare.json): the
# same seeded model and prompts served by vLLM 0.26.0 and 0.24.0 on one H200.
CURRENT_SET_DIAGNOSTIC = "vllm-0.26.0-1xh200-20261201"


def pin_sets_table(results: Path) -> str:
    """Appended to book/pin_sets.md: every set's main roots, from pins.yaml, and what one GPU
    showed of the `current` set, from its diagnostic's evidence."""
    from lib.roots import pins

    out = ["\n## Every set, from pins.yaml\n", _md_table(pd.DataFrame(pins.set_overview()))]
    out.append("\n## What one H200 showed of `current`\n")
    folder = Path(results) / "diagnostics" / CURRENT_SET_DIAGNOSTIC
    compare = folder / "compare.json"
    if not compare.exists():
        out.append(f"{NOT_MEASURED}: `results/diagnostics/{CURRENT_SET_DIAGNOSTIC}/` is not in "
                   "this book's results.\n")
        return "\n".join(out)
    pairs = evidence.read_json(compare)["0.26.0 against 0.24.0"]
    rows = [{"arm, how asked": arm, "tokens the same": f"{p['tokens_same']} of {p['positions']}",
             "prompts that agree (lib.measure.agreement)":
                 f"{p['agreement']['prompts_agree']} of {p['agreement']['prompts']}",
             "largest logprob difference (nats)": p["max_diff_nats"]}
            for arm, p in pairs.items()]
    out.append(f"vLLM 0.26.0 against 0.24.0, the guide's seeded model on one H200, the same 8 "
               f"fixed greedy prompts; {END_TO_END} (a diagnostic, not a guide run: "
               f"`results/diagnostics/{CURRENT_SET_DIAGNOSTIC}/`, its README and SHA256SUMS). One "
               "GPU: no expert parallelism and no all-to-all backend in play, so deepep_v2 with "
               "CUDA graphs on this set is not measured yet (it needs two GPUs).\n")
    out.append(_md_table(pd.DataFrame(rows)))
    return "\n".join(out)


def demote_headings(markdown: str) -> str:
    """Notes are written with their own headings; on a run page they sit under level 2."""
    return "\n".join("##" + line if line.startswith("#") else line
                     for line in markdown.splitlines())


def not_passed_gates(run_dir: Path) -> str:
    """Every FAIL (grouped per AIPerf cell family) and every SKIP with its reason."""
    gates = report.gates_table(run_dir)
    failed = gates[gates.status == "FAIL"]
    skipped = gates[gates.status == "SKIP"]
    out = []
    if len(failed):
        out.append("FAIL:\n\n" + _md_table(report.failed_gate_rows(failed)))
    if len(skipped):
        rows = pd.DataFrame({"stage": skipped["stage"], "gate": skipped["gate"],
                             "reason": skipped["reason"].map(evidence.without_terminal_codes)})
        out.append("SKIP:\n\n" + _md_table(rows))
    return "\n".join(out) or "Every gate passed."


def stage_gates_section(run: Run, stage: str) -> str:
    """Appended to a stage's prose page: the published run's gates of that stage, every SKIP's
    and FAIL's reason shown."""
    gates = evidence.read_gates(run.path / stage)
    if gates is None:
        return (f"\n## Gates in the published run\n\n{NOT_MEASURED}: `{run.run_id}` did not run "
                "this stage.\n")
    table = pd.DataFrame([{
        "gate": g["gate"], "status": g["status"],
        "observed": "" if g["status"] != "PASS" else report._md_cell(g["observed"])[:120],
        "expected": report._md_cell(g["expected"])[:80],
        "reason": evidence.without_terminal_codes(g["reason"])[:300]} for g in gates])
    return (f"\n## Gates in the published run\n\nRun {run_link(run.run_id, '../')}, "
            f"{run.level}:\n\n" + _md_table(table))


