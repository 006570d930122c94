"""Stage 01, public roots: every pin in pins.yaml resolves at its public source.

`run(stage)` reads pins.yaml through the stage's door (so a replay checks the pins the run
recorded), refuses malformed pins before any call, verifies every pin (lib/roots.py), writes
roots.json (the table) and adds one gate per row:

    VERIFIED -> PASS; MISSING -> FAIL; DRIFT -> PASS with the drift in its reason (reported,
    not a FAIL); SKIP -> SKIP with its reason (an unreachable source is never a PASS);
    FAIL -> FAIL.

Pin sets (pins.yaml `sets:`): when the pins read define sets, every set is verified, not only
the run's `pin_set`: each pin a set names itself (`<set>/<pin>` rows) is asked once (a pin equal to
one already asked is not asked again), and each set gets one gate, FAIL naming every pin of it
that is MISSING or FAIL, SKIP when some could not be asked, PASS otherwise; one more gate says
whether `pin_set` names a set of the pins read. roots.json then holds "pin_set" and "sets". What
is verified follows the pins the run read: a run recorded before sets existed read pins without
them, so its replay asks exactly the calls it recorded.

`show(stage, data)` returns the table for the notebook. Nothing here prints a timestamp.
"""
from __future__ import annotations

import sys
from pathlib import Path

from lib.roots import pins as pins_mod
from lib.roots import verify as roots
from lib.core.door import REPO_ROOT
from lib.core.evidence import Gate, gate, skip
from lib.stages.refusal import refusals_fail, shows_refusal

ROOTS_JSON = "roots.json"
COLUMNS = ["root", "kind", "level", "source", "pin", "resolved", "status", "reason", "evidence"]


def read_pins(stage, pins_path: Path | None = None) -> tuple[dict, str]:
    """(pins data, sha256 of the text) read through the door."""
    path = Path(pins_path) if pins_path else REPO_ROOT / "pins.yaml"
    text = stage.door.read_text(path)
    if text is None:
        raise pins_mod.PinsError(f"{path} could not be read")
    return pins_mod.loads(text), pins_mod.text_digest(text)


def row_gate(row: roots.Row, table: str) -> Gate:
    name = f"{row.root}: {row.kind}"
    evidence = [table] + list(row.evidence)
    if row.status == "SKIP":
        return skip(name, row.reason, evidence)
    return gate(name, row.status in ("VERIFIED", "DRIFT"), observed=row.resolved,
                expected=row.pin, reason=(f"{row.status}: {row.reason}" if row.reason
                                          else row.status), evidence=evidence)


@refusals_fail
def run(stage, *, pins_path: Path | None = None, python: str | None = None) -> dict:
    """Verify every pin; write roots.json; add the gates. Returns what roots.json holds."""
    data, digest = read_pins(stage, pins_path)
    problems = pins_mod.validate(data)
    stage.add(gate("pins.yaml follows its schema", not problems, observed=problems or "ok",
                   expected="no problems", reason="; ".join(problems)))
    if problems:
        table = {"pins_digest": digest, "rows": [], "counts": roots.summarize([]),
                 "problems": problems}
        stage.write_json(ROOTS_JSON, table)
        return table
    scratch = stage.path("scratch")
    sets = None
    try:
        rows = roots.verify_all(stage.door, data, scratch=scratch, python=python or sys.executable)
        if pins_mod.has_sets(data):
            extra, sets = roots.verify_sets(stage.door, data, scratch=scratch,
                                            python=python or sys.executable)
            rows += extra
    finally:
        stage.door.run(["rm", "-rf", str(scratch)], timeout=60, check=False)
    table = {"pins_digest": digest, "rows": [r.as_dict() for r in rows],
             "counts": roots.summarize(rows), "problems": []}
    if sets is not None:
        chosen = stage["pin_set"] or pins_mod.base_set(data)
        for name, entry in sets.items():
            entry["status"], entry["counts"], entry["reason"] = roots.set_verdict(entry["pins"],
                                                                                  rows)
        table.update({"pin_set": chosen, "sets": sets})
    rel = stage.write_json(ROOTS_JSON, table)
    stage.add([row_gate(r, rel) for r in rows])
    if sets is not None:
        stage.add(set_gates(table, rel))
    counts = table["counts"]
    print("roots: " + ", ".join(f"{n} {s}" for s, n in counts.items() if n))
    if sets is not None:
        print("sets: " + ", ".join(f"{n} {e['status']}" for n, e in sets.items())
              + f" (this run's pin_set: {table['pin_set']})")
    return table


def set_gates(table: dict, rel: str) -> list[Gate]:
    """One gate per set, then whether the run's pin_set is one of them."""
    gates = []
    chosen = table["pin_set"]
    for name, entry in table["sets"].items():
        gate_name = f"pin set {name}: every pin resolves"
        said = f"level {entry['level']}" + (", this run's pin_set" if name == chosen else "")
        reason = f"{entry['reason']} ({said})"
        if entry["status"] == "SKIP":
            gates.append(skip(gate_name, reason, [rel]))
        else:
            gates.append(gate(gate_name, entry["status"] == "PASS",
                              observed={k: v for k, v in entry["counts"].items() if v},
                              expected="every pin VERIFIED (or DRIFT)", reason=reason,
                              evidence=[rel]))
    gates.append(gate("pin_set names a set of pins.yaml", chosen in table["sets"],
                      observed=chosen, expected=list(table["sets"]),
                      reason=("" if chosen in table["sets"] else
                              f"pin_set {chosen!r} is not a set of the pins read"),
                      evidence=[rel]))
    return gates


@shows_refusal
def show(stage, data: dict | None = None):
    """The table of every root: source, pin, level, resolved, status and evidence (pandas)."""
    import pandas as pd

    data = data if data is not None else stage.read_json(ROOTS_JSON)
    rows = data["rows"] if isinstance(data, dict) else data
    frame = pd.DataFrame([{k: r.get(k) for k in COLUMNS} for r in rows], columns=COLUMNS)
    frame["evidence"] = frame["evidence"].map(lambda e: ", ".join(e or []))
    if isinstance(data, dict) and data.get("sets"):  # which sets each root serves
        serves: dict[str, list[str]] = {}
        for name, entry in data["sets"].items():
            for root in dict.fromkeys(entry["pins"].values()):
                serves.setdefault(root, []).append(name)
        frame.insert(1, "sets", frame["root"].map(lambda r: ", ".join(serves.get(r, []))))
    return frame
