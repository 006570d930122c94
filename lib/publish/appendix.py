"""The appendix and what shows one run's gates: the history of every recorded run, a page per
run, the pin sets' table, and the published run's gates appended to each stage's chapter.

Every figure comes from the run's own evidence (its run.json, gates.json files and notes)."""
from __future__ import annotations

import re
from pathlib import Path

import pandas as pd

from lib.core import evidence
from lib.publish import report
from lib.publish.catalog import END_TO_END, Run, host_facts
from lib.publish.pages import NOT_MEASURED, _md_table, run_link

# --- the history -------------------------------------------------------------------------------

# The appendix's groups, in the page's order: (key, title, what its runs are). A run's group
# follows from its run.json's context and its host facts (kind_of), never from its name.
HISTORY_GROUPS = (
    ("gpu", "GPU runs", "runs on real GPUs on the host named, the only runs that may feed the "
                        "results"),
    ("kube", "Cluster control plane (kube-ctlplane-*)",
     "a real Kubernetes control plane on a CPU host, its nodes played by a test kubelet"),
    ("slurm", "Slurm", "a real two-node Slurm on one CPU host"),
    ("plan", "Plans", "manifests or batch scripts rendered and checked, nothing started"),
    ("cpu", "CPU (local-*)", "the guide on this CPU host: gloo kernels and a tiny served model, "
                             "a check of the guide, not a figure"),
    ("other", "Other contexts", "a context this page does not know"),
)
OPEN_GROUPS = ("gpu",)  # shown open; the others are collapsed dropdowns


def kind_of(run: Run) -> str:
    """The history's group of a run (HISTORY_GROUPS)."""
    if run.context in ("plan", "kube", "slurm"):
        return run.context
    if run.context == "local":
        return "gpu" if host_facts(run.path).get("gpus") else "cpu"
    return "other"


def status_said(run: Run) -> str:
    """The run's verdict and what became of it, once: "PASS, current", "FAIL in 06, kept as
    recorded", "incomplete", "PASS, superseded by <run>"."""
    verdict, label = run.verdict, run.label
    if run.superseded_by and label == f"superseded by {run.superseded_by}":
        return f"{verdict}, superseded by {run_link(run.superseded_by)}"
    if label.startswith(verdict):
        return label
    if label == "has FAIL gates, kept as recorded":
        return f"{verdict}, kept as recorded"
    return f"{verdict}, {label}"


def history_row(run: Run) -> dict:
    return {"run": run_link(run.run_id, prefix=""), "date": run.date, "hardware": run.hardware,
            "context": f"`{run.context}`", "pin set": f"`{run.pin_set}`",
            "stages": ", ".join(s[:2] for s in run.measured) or "none",
            "status": status_said(run),
            "replayed by make test": ", ".join(s[:2] for s in run.replayed) or "no",
            "feeds results": "yes" if run.feeds_results else "no"}


# Never said once above a group's table, even where every run of the group has the same value.
_ALWAYS_A_COLUMN = ("run", "status")


def history_group(runs: list[Run]) -> str:
    """One group's table. A column whose value every run of the group shares (the hardware of
    nine control-plane runs) is said once above the table instead, so the table keeps the
    columns that tell its runs apart and fits the page (a group of one run: its run and status,
    the rest said above)."""
    table = pd.DataFrame([history_row(r) for r in runs])
    shared = [c for c in table.columns
              if c not in _ALWAYS_A_COLUMN and table[c].nunique() == 1]
    said = "; ".join(f"{c}: {table[c].iloc[0]}" for c in shared)
    lead = "Every run here" if len(runs) > 1 else "The one run here"
    return (f"{lead}: {said}.\n\n" if said else "") + _md_table(table.drop(columns=shared))


def removed_section(removed: list) -> str:
    """The runs taken out of the tree when they were re-recorded (results/REMOVED), each with
    the commit that still holds it and the run that replaced it."""
    if not removed:
        return ""
    later = {r.run_id: r.replaced_by for r in removed}

    def current(run_id: str) -> str:  # a replacement itself re-recorded since: the latest
        seen = {run_id}
        while run_id in later and later[run_id] not in seen:  # an id given twice: no loop
            run_id = later[run_id]
            seen.add(run_id)
        return run_id

    table = pd.DataFrame([{"run": f"`{r.run_id}`", "kept in git at": f"`{r.commit[:12]}`",
                           "replaced by": run_link(current(r.replaced_by), prefix="")}
                          for r in removed])
    return ("A run that costs nothing but a CPU's time (the CPU reference, the control-plane, "
            "Slurm and plan runs) is re-recorded by `make rerecord` whenever a change alters "
            "what the stages call, in the same commit, and the run it replaces leaves the tree "
            "(DESIGN.md, Reference runs age). Git keeps it: `git show <commit>:results/<run>/"
            "run.json`, or `git worktree add /tmp/old <commit>` to read or replay it with the "
            "guide that recorded it.\n\n" + _md_table(table) + "\n")


def history_page(runs: list[Run], removed: list = ()) -> str:
    out = ["# Appendix: every recorded run\n",
           "Every run committed under `results/`, oldest first within its group, failed and "
           "superseded ones included. A run feeds the [results](results.md) only when it ran on "
           "real GPUs on the place it names with its evidence intact; the others show their "
           "level on their page. *Superseded* means a later run on the same hardware measured "
           "the same stages with the same kernel and engine and passed; *kept as recorded* means "
           "a stage FAILed and no later run repeated it: its other figures may still feed the "
           "results. Stages are named by number (00 to 07); *replayed by make test*: the stages "
           "whose notebooks `make test` re-executes against the run's recorded evidence.\n"]
    by_kind: dict[str, list[Run]] = {}
    for run in runs:
        by_kind.setdefault(kind_of(run), []).append(run)
    for key, title, what in HISTORY_GROUPS:
        mine = by_kind.get(key)
        if not mine:
            continue
        heading = f"{title}: {len(mine)} run" + ("s" if len(mine) > 1 else "")
        body = f"{what[0].upper() + what[1:]}.\n\n" + history_group(mine)
        opened = "\n:open:" if key in OPEN_GROUPS else ""
        out.append(f":::{{dropdown}} {heading}{opened}\n\n{body}\n:::\n")
    if removed:
        out.append(":::{dropdown} " + f"Taken out of the tree: {len(removed)} re-recorded run"
                   + ("s" if len(removed) > 1 else "") + "\n\n"
                   + removed_section(list(removed)) + "\n:::\n")
    return "\n".join(out)


# --- a page per run -------------------------------------------------------------------------------

# A run's notes say why its run.json records uncommitted changes in sentences naming it so.
_DIRTY_WORDS = re.compile(r"\b(dirty|uncommitted)\b", re.IGNORECASE)
# a sentence ends at ". " (not at an ellipsis's, as in a command cut short: `gpu-run.sh ... 00`)
_SENTENCE_END = re.compile(r"(?<=[^.][.!?])\s+(?=[A-Z0-9`(*\[])")
_LIST_ITEM = re.compile(r"\n\s*(?:[-*+]|\d+\.)\s+")
LONGEST_QUOTE = 300  # a sentence longer than this is quoted by its clause that says why


def why_dirty(notes: str) -> str:
    """What a run's notes say about why its guide was dirty: each sentence that names it
    (paragraphs and list items kept apart, hard wraps undone), a long one narrowed to its clause
    that does, marked with "..."; "" where no sentence does."""
    said = []
    for block in _LIST_ITEM.split("\n" + notes.replace("\n\n", "\n- ")):
        for sentence in _SENTENCE_END.split(" ".join(block.split())):
            if _DIRTY_WORDS.search(sentence):
                said.append(sentence if len(sentence) <= LONGEST_QUOTE else
                            "... " + _clause_naming(sentence) + " ...")
    return " ".join(said)


def _clause_naming(sentence: str) -> str:
    """The clause of `sentence` (between top-level commas or semicolons: none inside
    parentheses or inline code) that names why the guide was dirty."""
    clauses, depth, code, start = [], 0, False, 0
    for i, char in enumerate(sentence):
        if char == "`":
            code = not code
        elif not code and char == "(":
            depth += 1
        elif not code and char == ")":
            depth = max(0, depth - 1)
        elif not code and depth == 0 and char in ",;" and sentence[i + 1:i + 2] == " ":
            clauses.append(sentence[start:i])
            start = i + 2
    clauses.append(sentence[start:])
    return "; ".join(c.strip() for c in clauses if _DIRTY_WORDS.search(c))


def guide_said(run: Run) -> str:
    """The guide's commit, and whether the files it ran from differed from it, and why."""
    guide = run.record.get("guide") or {}
    sha = f"commit `{guide.get('git_sha') or 'not recorded'}`"
    dirty = guide.get("dirty")
    if dirty is None:
        return f"{sha}; whether its files differed from it is not recorded"
    if not dirty:
        return f"{sha}, its files as committed"
    why = why_dirty(run.notes)
    because = (f"the notes say: \"{why}\"" if why else
               "the notes do not say why" if run.notes else "no notes were recorded with this run")
    return (f"{sha} with uncommitted changes (run.json's `guide.dirty`: the files the run used "
            f"differed from that commit); {because}")


def status_explained(run: Run) -> str:
    if run.seal != "sealed":
        return run.label
    if run.interrupted:
        return (f"{run.label}: a stage was stopped before it finished, and no later attempt "
                "of it finished")
    if run.superseded_by:
        return (f"superseded by {run_link(run.superseded_by, '../')}: a later run on the same "
                "hardware measured the same stages with the same kernel and engine and passed")
    if run.failed_stages:
        failed = ", ".join(s[:2] for s in run.failed_stages)
        return (f"FAIL in {failed}, kept as recorded: no later run on the same hardware "
                "repeated it; the gates that failed are listed below")
    return "current: every stage it ran passed, and no later run replaced it"


def run_facts(run: Run) -> list[tuple[str, str]]:
    """What a reader needs before trusting the run, each flag with what it means."""
    sealed = {"sealed": "every file matches SHA256SUMS (written when the run ended; a run whose "
                        "files changed since is never published)",
              "unsealed": "incomplete: no SHA256SUMS (interrupted before it was sealed)"}.get(
        run.seal, f"NOT verified ({run.seal})")
    replayed = (", ".join(s[:2] for s in run.replayed) + ": `make test` re-executes these "
                "stages' notebooks against this run's recorded evidence (nbval) and fails on a "
                "difference" if run.replayed else not_replayed_said(run))
    return [
        ("level", run.level),
        ("status", status_explained(run)),
        ("date", date_said(run.record.get("created_utc"))),
        ("hardware", run.hardware),
        ("context", f"`{run.context}`"),
        ("pin set", pin_set_said(run)),
        ("kernel", run.kernel or "not run"),
        ("serving", run.serving or "not run"),
        ("feeds the results page", "yes: it ran on real GPUs on the place it names, its evidence "
                                   "intact" if run.feeds_results else f"no: {run.why_not_results}"),
        ("evidence", f"`results/{run.run_id}/`: {sealed}"),
        ("guide", guide_said(run)),
        ("replayed by make test", replayed),
        ("audit", f"`REPRO_REPLAY=results/{run.run_id} pytest --nbval "
                  f"results/{run.run_id}/notebooks/`"),
    ]


def not_replayed_said(run: Run) -> str:
    """Why `make test` does not replay a run, and how it is shown instead."""
    sha = (run.record.get("guide") or {}).get("git_sha")
    guide = f"`{sha[:12]}`" if sha else "an unrecorded commit"
    return (f"no: recorded by the guide at {guide} (outputs version "
            f"{run.record.get('outputs_version', 1)}), whose stages made other calls than "
            "today's; it is shown through its evidence: its files checked against its "
            "SHA256SUMS (evidence, above), its gates as it recorded them, its tables and plots re-computed from "
            "its artifacts by today's code (DESIGN.md, Reference runs age)")


def date_said(created_utc) -> str:
    """run.json's created_utc (ISO 8601) as "2026-11-30 22:50:44 UTC"."""
    if not created_utc:
        return "not recorded"
    text = str(created_utc)
    match = re.fullmatch(r"(\d{4}-\d{2}-\d{2})T(\d{2}:\d{2}:\d{2})(?:\.\d+)?(?:\+00:00|Z)?", text)
    return f"{match.group(1)} {match.group(2)} UTC" if match else text


def definition_list(facts: list[tuple[str, str]]) -> str:
    """MyST's definition list (the `deflist` extension, book/_ext/table_fit.py): a term and its
    value, one under the other, which reads on a phone as well as in a window."""
    return "\n".join(f"{term}\n: {value}\n" for term, value in facts)


def run_page(run: Run, published_run: str) -> str:
    out = [f"# Run `{run.run_id}`\n"]
    if run.run_id == published_run:
        out.append("The run whose executed notebooks are the stage chapters of this book.\n")
    out.append(definition_list(run_facts(run)))
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
    said = f"{run.pin_set} ({level})" if level else f"`{run.pin_set}`"
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

    out = ["\n## Every set, from pins.yaml\n", *set_overview_sections(pins.set_overview())]
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


# set_overview's columns said in the first table's one `pins` cell, in this order; set and
# level are a column each, source and note the second table's.
_PIN_COLUMNS = ("vllm", "torch", "nccl", "nvshmem", "deepep", "efa_installer", "aiperf_public",
                "patches")


def set_overview_sections(rows: list[dict[str, str]]) -> list[str]:
    """pins.set_overview as two tables that fit the page: each set's level and pins (in one
    cell), then where each comes from. Its thirteen columns side by side were 2767 px wide in a
    784 px column, the prose of `source` and `note` squeezed to a few words a line."""
    pins_table = pd.DataFrame([{
        "set": r["set"], "level": r["level"],
        "pins": "; ".join(f"{name.replace('_', ' ')} `{r[name]}`" for name in _PIN_COLUMNS
                          if r.get(name))} for r in rows])
    sources_table = pd.DataFrame([{
        "set": r["set"] + (" (the base set)" if r.get("base") else ""),
        "where it comes from": r["source"], "note": r.get("note", "")} for r in rows])
    return [_md_table(pins_table), "\n### Where each set comes from\n", _md_table(sources_table)]


def demote_headings(markdown: str) -> str:
    """Notes are written with their own headings; on a run page they sit under level 2."""
    return "\n".join("##" + line if line.startswith("#") else line
                     for line in markdown.splitlines())


def not_passed_gates(run_dir: Path) -> str:
    """Every FAIL (grouped per AIPerf cell family) and every SKIP (grouped per reason), each
    with its reason."""
    return (report.gate_tables(report.gates_table(run_dir), with_stage=True, with_pass=False)
            or "Every gate passed.")


def stage_gates_section(run: Run, stage: str) -> str:
    """Appended to a stage's prose page: the published run's gates of that stage, FAIL and
    SKIP first with their reasons, the PASS gates behind a dropdown."""
    gates = evidence.read_gates(run.path / stage)
    if gates is None:
        return (f"\n## Gates in the published run\n\n{NOT_MEASURED}: `{run.run_id}` did not run "
                "this stage.\n")
    table = pd.DataFrame([{"stage": stage, **g} for g in gates],
                         columns=["stage", "gate", "status", "observed", "expected", "reason",
                                  "evidence"])
    counts = evidence.summarize_gates(gates)
    return (f"\n## Gates in the published run\n\nRun {run_link(run.run_id, '../')}, "
            f"{run.level}: {len(gates)} gates, "
            + ", ".join(f"{n} {status}" for status, n in counts.items()) + ".\n\n"
            + report.gate_tables(table, with_stage=False))
