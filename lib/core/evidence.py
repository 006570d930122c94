"""Run directories, gates and hashes.

A run directory is append-only: files are created once (atomically) and never rewritten; a
second run gets a new run_id. The only files that grow are the transcript (one line per call)
and SHA256SUMS, which `seal` rewrites to cover everything in the run.

Atomically means: the bytes go to a temporary file in the same directory (`.<name>.*.partial`),
are flushed and fsynced, and only then is the file given its name (a hard link for a new file,
so a name that appeared meanwhile is refused, not replaced; a rename for SHA256SUMS). A writer
that fails half-way removes its temporary file, so a reader never sees part of a file.

What the seal covers, and what `require_intact` refuses: every file under the run directory but
SHA256SUMS itself and dot-named files (the writers' temporary files; tools' markers such as
AIPerf's `.aiperf_results_ready.json`, never read as evidence). A file the seal covers that is
modified, missing, or present without being listed, and a writer's temporary file left behind,
make the run "tampered"; a run without SHA256SUMS (interrupted before it was sealed) is
"unsealed". Replay refuses both (lib.core.stage.open_replay).
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import re
import stat
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal

from lib.core.errors import (EvidenceError, RunNotIntact, RunTampered,  # noqa: F401
                             RunUnsealed)  # raised here; callers import them from here too

STATUSES = ("PASS", "FAIL", "SKIP")
# A terminal's colour and cursor codes (AIPerf colours its exit-error box): noise in a gate's
# reason and in the book
_TERMINAL_CODES = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
SUMS_NAME = "SHA256SUMS"
# A writer's temporary file: dot-named (so the seal never lists it) and marked as unfinished.
PARTIAL_SUFFIX = ".partial"
# sha256sum's text-mode line, the format `seal` writes and `sha256sum -c` reads.
_SUMS_LINE = re.compile(r"([0-9a-f]{64})  (.+)")
# Enough of a digest to tell two apart in a message.
_DIGEST_SHOWN = 12
SealState = Literal["sealed", "unsealed", "tampered"]


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


def _jsonable(obj: Any) -> Any:
    """A stage's typed parameters (lib.core.param_model) as their values; anything else as its
    text (a Path, a datetime)."""
    as_dict = getattr(obj, "as_dict", None)
    return as_dict() if callable(as_dict) else str(obj)


_JSON_FORMAT = {"indent": 2, "sort_keys": True, "default": _jsonable}


def dumps(obj: Any) -> str:
    return json.dumps(obj, **_JSON_FORMAT) + "\n"


def write_new(path: Path, text: str | bytes) -> Path:
    """Create a file atomically; refuse to overwrite anything already recorded."""
    data = text if isinstance(text, bytes) else text.encode("utf-8")
    return _write_atomically(Path(path), lambda fh: fh.write(data), replace=False)


def write_json_new(path: Path, obj: Any) -> Path:
    """`dumps(obj)` into a new file, atomically. The JSON is streamed into the temporary file
    (a large record is never held twice in memory); an object that fails to serialise half-way
    leaves nothing behind."""
    def write(fh) -> None:
        text = io.TextIOWrapper(fh, encoding="utf-8", newline="", write_through=False)
        try:
            json.dump(obj, text, **_JSON_FORMAT)
            text.write("\n")
            text.flush()
        finally:
            text.detach()  # the binary file stays open for the fsync; closing is the caller's

    return _write_atomically(Path(path), write, replace=False)


def replace_atomically(path: Path, text: str) -> Path:
    """Rewrite a file of the stage being recorded, atomically: for the one rewrite a run allows,
    masking secrets in a stage's files before its gates.json is written (lib.core.door
    `redact_file`). A reader sees the old bytes or the new, never part of either."""
    data = text.encode("utf-8")
    return _write_atomically(Path(path), lambda fh: fh.write(data), replace=True)


def _write_atomically(path: Path, write: Callable[[Any], Any], *, replace: bool) -> Path:
    """`write(binary file)` into a temporary file beside `path`, flushed and fsynced, then give
    it the name: a hard link when `replace` is false (refused if the name exists, even when it
    appeared while writing), a rename otherwise. On any failure, interruption included, the
    temporary file is removed and `path` is as it was."""
    if not replace and (path.exists() or path.is_symlink()):
        raise EvidenceError(f"{path} is already recorded; a run directory is append-only")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.",
                                    suffix=PARTIAL_SUFFIX)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as fh:
            if replace and path.exists():  # a rewrite keeps the file's mode, not mkstemp's 0600
                os.fchmod(fh.fileno(), stat.S_IMODE(path.stat().st_mode))
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        if replace:
            os.replace(tmp, path)
        else:
            try:
                os.link(tmp, path)
            except FileExistsError:
                raise EvidenceError(f"{path} appeared while it was being written and is kept as "
                                    "it is; a run directory is append-only") from None
    finally:  # BaseException too: a KeyboardInterrupt half-way must not leave the temporary file
        tmp.unlink(missing_ok=True)
    _fsync_directory(path.parent)
    return path


def _fsync_directory(folder: Path) -> None:
    """Make the new name durable (a crash right after must not lose the file's entry)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # a file system that cannot sync a directory: the data itself was synced
        pass
    finally:
        os.close(fd)


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


class DigestCache:
    """sha256 digests remembered by what the file system says of each file (size, modification
    time in ns, inode), kept in one JSON file between book builds: the book verifies every run it
    lists, and hashing 160 MB of evidence each build cost more than reading the runs' summaries.
    A file whose size, time or inode changed is hashed again, so an edit after sealing is still
    found (an edit that keeps size and nanosecond mtime is not: the seal check on the run's own
    page says SHA256SUMS verified by this stat, and `sha256sum -c` or the runner's resume check
    hash the bytes)."""

    def __init__(self, path: Path | None = None):
        self.path = Path(path) if path else None
        self.entries: dict[str, list] = {}
        if self.path and self.path.is_file():
            try:
                self.entries = json.loads(self.path.read_text(encoding="utf-8"))
            except (ValueError, OSError):
                self.entries = {}  # a cache that cannot be read is rebuilt, never trusted
        self.hashed = 0

    def digest(self, path: Path) -> str:
        found = os.stat(path)
        key, seen = str(Path(path).absolute()), [found.st_size, found.st_mtime_ns, found.st_ino]
        entry = self.entries.get(key)
        if entry and entry[:3] == seen:
            return entry[3]
        self.hashed += 1
        digest = file_digest(path)
        self.entries[key] = seen + [digest]
        return digest

    def save(self) -> None:
        if self.path:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(json.dumps(self.entries), encoding="utf-8")


def _under_seal(rel: str) -> bool:
    """Whether the seal covers the file at `rel` (a path relative to the run directory)."""
    return rel != SUMS_NAME and not rel.rsplit("/", 1)[-1].startswith(".")


def _entries(run_dir: Path) -> list[str]:
    """Every entry under the run directory that is not a directory, relative, sorted: files,
    and links of any kind (a link to a folder is not walked into: it is one entry)."""
    found = []
    for folder, dirs, files in os.walk(run_dir):
        base = Path(folder)
        found += [(base / name).relative_to(run_dir).as_posix() for name in files]
        found += [(base / name).relative_to(run_dir).as_posix() for name in dirs
                  if (base / name).is_symlink()]
    return sorted(found)


def list_run_files(run_dir: Path) -> list[str]:
    """The files the seal covers, relative to the run directory, sorted."""
    run_dir = Path(run_dir)
    return [rel for rel in _entries(run_dir) if _under_seal(rel) and (run_dir / rel).is_file()]


def seal(run_dir: Path) -> Path:
    """Write SHA256SUMS over every file of the run, in `sha256sum -c` format."""
    run_dir = Path(run_dir)
    text = "".join(f"{file_digest(run_dir / rel)}  {rel}\n" for rel in list_run_files(run_dir))
    return _write_atomically(run_dir / SUMS_NAME, lambda fh: fh.write(text.encode("utf-8")),
                             replace=True)


@dataclass(frozen=True)
class SealProblem:
    """One thing wrong with a sealed run: `rel` names the file (or SHA256SUMS' line)."""

    rel: str
    kind: str  # modified | missing | extra | unfinished write | malformed
    detail: str = ""

    def __str__(self) -> str:
        return f"{self.rel}: {self.kind}" + (f" ({self.detail})" if self.detail else "")

    def listed(self) -> str:
        """As `verify` has always listed it (the book and lib.runner read these)."""
        if self.kind == "modified":
            return f"{self.rel}: changed"
        if self.kind == "missing":
            return f"{self.rel}: missing"
        return str(self)


def seal_problems(run_dir: Path, digests: DigestCache | None = None) -> list[SealProblem] | None:
    """Every file of the run that does not match its SHA256SUMS; None when the run is unsealed.

    Checks, in this order: each SHA256SUMS line is `<sha256>  <path inside the run>`, listed
    once; each listed file exists and has its digest; every file the seal covers is listed; no
    writer's temporary file was left behind."""
    run_dir = Path(run_dir)
    sums = run_dir / SUMS_NAME
    if not sums.is_file():
        return None
    problems: list[SealProblem] = []
    listed: dict[str, str] = {}
    text = sums.read_bytes().decode("utf-8", errors="replace")
    for number, line in enumerate(text.splitlines(), 1):
        match = _SUMS_LINE.fullmatch(line)
        rel = match.group(2) if match else ""
        where = f"{SUMS_NAME} line {number}"
        if not match:
            problems.append(SealProblem(where, "malformed",
                                        f"{line[:80]!r} is not '<sha256>  <path>'"))
        elif rel.startswith("/") or ".." in rel.split("/") or rel == SUMS_NAME:
            problems.append(SealProblem(where, "malformed",
                                        f"{rel!r} is not a file inside the run"))
        elif rel in listed:
            problems.append(SealProblem(where, "malformed", f"{rel} is listed twice"))
        else:
            listed[rel] = match.group(1)
    for rel, expected in listed.items():
        target = run_dir / rel
        if not target.is_file():
            problems.append(SealProblem(rel, "missing", "listed in SHA256SUMS, not in the run"))
            continue
        actual = digests.digest(target) if digests else file_digest(target)
        if actual != expected:
            problems.append(SealProblem(
                rel, "modified", f"sha256 expected {expected[:_DIGEST_SHOWN]}…, "
                                 f"actual {actual[:_DIGEST_SHOWN]}…"))
    for rel in _entries(run_dir):
        name = rel.rsplit("/", 1)[-1]
        if name.startswith(".") and name.endswith(PARTIAL_SUFFIX):
            problems.append(SealProblem(rel, "unfinished write",
                                        "a writer's temporary file, left behind"))
        elif _under_seal(rel) and rel not in listed:
            problems.append(SealProblem(rel, "extra", "in the run, not listed in SHA256SUMS"))
    return problems


def seal_state(run_dir: Path, digests: DigestCache | None = None) -> SealState:
    """"sealed" (every file matches SHA256SUMS), "unsealed" (no SHA256SUMS: an interrupted,
    incomplete run) or "tampered" (`seal_problems` names what)."""
    problems = seal_problems(run_dir, digests)
    if problems is None:
        return "unsealed"
    return "tampered" if problems else "sealed"


def verify(run_dir: Path, digests: DigestCache | None = None) -> list[str]:
    """Problems found checking SHA256SUMS (empty when every file matches and none is unlisted)."""
    problems = seal_problems(run_dir, digests)
    if problems is None:
        return [f"{Path(run_dir) / SUMS_NAME} is missing"]
    return [p.listed() for p in problems]


def require_intact(run_dir: Path) -> None:
    """Raise unless the run is sealed and every file matches its SHA256SUMS: RunUnsealed when
    there is none, RunTampered naming every offending file and what is wrong with it."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise RunNotIntact(run_dir, f"{run_dir}: no such run directory", [])
    problems = seal_problems(run_dir)
    if problems is None:
        raise RunUnsealed(
            run_dir, f"{run_dir} is unsealed: it has no {SUMS_NAME}, so the run is incomplete "
                     "(interrupted before it was sealed, or recorded with papermill alone, which "
                     "never seals) and its files cannot be told from files changed since; "
                     "refused. lib.runner (make run) seals a run when its last stage ends; seal "
                     "a run by hand (lib.core.evidence.seal) only where you know its files are "
                     "as recorded.", [])
    if problems:
        lines = "\n".join(f"  {p}" for p in problems)
        raise RunTampered(
            run_dir, f"{run_dir} does not match its {SUMS_NAME}, refused: {len(problems)} "
                     f"problem(s):\n{lines}\nA recorded run is never repaired: restore these "
                     "files as they were recorded, or record a new run.", problems)


def stage_hashes(run_dir: Path, stage: str) -> dict[str, str]:
    """Digests of a stage's files, used to decide whether a resumed run may skip it."""
    stage_dir = Path(run_dir) / stage
    return {
        rel: file_digest(Path(run_dir) / rel)
        for rel in list_run_files(run_dir) if rel.startswith(f"{stage}/")
    } if stage_dir.exists() else {}
