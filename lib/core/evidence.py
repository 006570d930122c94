"""Run directories, gates and hashes.

A run directory is append-only: files are created once (atomically) and never rewritten; a
second run gets a new run_id. The only files that grow are the transcript (one line per call)
and SHA256SUMS, which `seal` rewrites to cover everything in the run.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lib.core.errors import EvidenceError  # noqa: F401  (raised here; callers import it from here too)

STATUSES = ("PASS", "FAIL", "SKIP")
# A terminal's colour and cursor codes (AIPerf colours its exit-error box): noise in a gate's
# reason and in the book
_TERMINAL_CODES = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
SUMS_NAME = "SHA256SUMS"


@dataclass
class Gate:
    gate: str
    status: str
    observed: Any = None
    expected: Any = None
    reason: str = ""
    evidence: list[str] = field(default_factory=list)

    def __post_init__(self):
        if self.status not in STATUSES:
            raise ValueError(f"gate {self.gate!r}: status {self.status!r} not in {STATUSES}")
        if self.status == "SKIP" and not self.reason:
            raise ValueError(f"gate {self.gate!r}: a SKIP needs its reason")
        if self.status == "FAIL" and not self.reason:
            self.reason = f"observed {self.observed!r}, expected {self.expected!r}"

    def as_dict(self) -> dict:
        return {
            "gate": self.gate, "status": self.status, "observed": _plain(self.observed),
            "expected": _plain(self.expected), "reason": self.reason,
            "evidence": list(self.evidence),
        }


def _plain(value: Any) -> Any:
    """JSON-safe and stable: numpy scalars and tuples become plain Python."""
    if hasattr(value, "item") and callable(value.item):
        return value.item()
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


def without_terminal_codes(text: str) -> str:
    """`text` without the escape codes a terminal would have turned into colour."""
    return _TERMINAL_CODES.sub("", text)


def gate(name: str, ok: bool, observed: Any = None, expected: Any = None, reason: str = "",
         evidence: list[str] | None = None) -> Gate:
    """A PASS/FAIL gate from a condition."""
    return Gate(name, "PASS" if ok else "FAIL", observed, expected, reason, list(evidence or []))


def skip(name: str, reason: str, evidence: list[str] | None = None) -> Gate:
    return Gate(name, "SKIP", reason=reason, evidence=list(evidence or []))


def dumps(obj: Any) -> str:
    return json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n"


def write_new(path: Path, text: str | bytes) -> Path:
    """Create a file atomically; refuse to overwrite anything already recorded."""
    path = Path(path)
    if path.exists():
        raise EvidenceError(f"{path} is already recorded; a run directory is append-only")
    path.parent.mkdir(parents=True, exist_ok=True)
    mode = "wb" if isinstance(text, bytes) else "w"
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, mode) as fh:
        fh.write(text)
    os.link(tmp, path)  # fails if path appeared meanwhile: no silent overwrite
    os.unlink(tmp)
    return path


def write_json_new(path: Path, obj: Any) -> Path:
    return write_new(path, dumps(obj))


def read_json(path: Path) -> Any:
    return json.loads(Path(path).read_text(encoding="utf-8"))


def read_gates(stage_dir: Path) -> list[dict] | None:
    path = Path(stage_dir) / "gates.json"
    return read_json(path) if path.exists() else None


def summarize_gates(gates: list[dict]) -> dict[str, int]:
    counts = {s: 0 for s in STATUSES}
    for g in gates:
        counts[g["status"]] += 1
    return counts


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def list_run_files(run_dir: Path) -> list[str]:
    run_dir = Path(run_dir)
    files = [
        p.relative_to(run_dir).as_posix() for p in run_dir.rglob("*")
        if p.is_file() and p.name != SUMS_NAME and not p.name.startswith(".")
    ]
    return sorted(files)


def seal(run_dir: Path) -> Path:
    """Write SHA256SUMS over every file of the run, in `sha256sum -c` format."""
    run_dir = Path(run_dir)
    lines = [f"{file_digest(run_dir / rel)}  {rel}\n" for rel in list_run_files(run_dir)]
    path = run_dir / SUMS_NAME
    tmp = run_dir / f".{SUMS_NAME}.tmp"
    tmp.write_text("".join(lines), encoding="utf-8")
    os.replace(tmp, path)
    return path


def verify(run_dir: Path) -> list[str]:
    """Problems found checking SHA256SUMS (empty when every listed file matches)."""
    run_dir = Path(run_dir)
    sums = run_dir / SUMS_NAME
    if not sums.exists():
        return [f"{sums} is missing"]
    problems = []
    for line in sums.read_text(encoding="utf-8").splitlines():
        digest, rel = re.match(r"([0-9a-f]{64})  (.+)", line).groups()
        target = run_dir / rel
        if not target.exists():
            problems.append(f"{rel}: missing")
        elif file_digest(target) != digest:
            problems.append(f"{rel}: changed")
    return problems


def stage_hashes(run_dir: Path, stage: str) -> dict[str, str]:
    """Digests of a stage's files, used to decide whether a resumed run may skip it."""
    stage_dir = Path(run_dir) / stage
    return {
        rel: file_digest(Path(run_dir) / rel)
        for rel in list_run_files(run_dir) if rel.startswith(f"{stage}/")
    } if stage_dir.exists() else {}
