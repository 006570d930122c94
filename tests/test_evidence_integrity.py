"""Tampered evidence is refused, and evidence is written so that it cannot be half-written.

Every tampering is done to a copy of a committed run in tmp_path (nothing under results/ is
written), and each is refused twice: by `evidence.require_intact`, and by the replay a notebook
opens under REPRO_REPLAY (its own cells, executed up to `open_stage`, against the copy). The
same opening of the untouched copy succeeds, so a refusal can only come from the seal check.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from lib.core import evidence
from lib.core.door import REPO_ROOT, Door
from lib.core.errors import EvidenceError
from lib.core.evidence import RunNotIntact, RunTampered, RunUnsealed
from lib.core.stage import REPLAY_ENV, Stage
from lib.stages import registry

RESULTS = REPO_ROOT / "results"


def replayed_notebooks() -> dict[str, list[str]]:
    """results/REPLAYED: run id -> its notebooks that `make test` replays (paths in the run)."""
    found: dict[str, list[str]] = {}
    for line in (RESULTS / "REPLAYED").read_text(encoding="utf-8").split():
        _, run_id, rest = line.split("/", 2)
        found.setdefault(run_id, []).append(rest)
    return found


def run_bytes(run: Path) -> int:
    return sum(p.stat().st_size for p in run.rglob("*") if p.is_file())


# The smallest committed run that replays: small to copy, and a real notebook opens it.
SOURCE_ID = min(replayed_notebooks(), key=lambda run_id: run_bytes(RESULTS / run_id))
SOURCE = RESULTS / SOURCE_ID
NOTEBOOK = replayed_notebooks()[SOURCE_ID][0]  # e.g. notebooks/00_cluster.ipynb
STAGE = Path(NOTEBOOK).stem


def listed_files(run: Path) -> list[str]:
    return [line.split("  ", 1)[1] for line in
            (run / evidence.SUMS_NAME).read_text(encoding="utf-8").splitlines()]


def tree_bytes(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def run(tmp_path) -> Path:
    """A copy of SOURCE under its own name (the name is the run id its notebooks carry)."""
    copy = tmp_path / SOURCE_ID
    shutil.copytree(SOURCE, copy)
    return copy


@pytest.fixture
def replay_temp(tmp_path, monkeypatch) -> Path:
    """Replay's working copies go under tmp_path, not the machine's /tmp."""
    folder = tmp_path / "replay-tmp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


def open_as_the_notebook_does(run: Path, monkeypatch) -> Stage:
    """Execute the run's own notebook cells, in order, up to and including the one that calls
    open_stage, with REPRO_REPLAY naming `run`: what nbval does before the stage's first call."""
    monkeypatch.setenv(REPLAY_ENV, str(run))
    cells = json.loads((run / NOTEBOOK).read_text(encoding="utf-8"))["cells"]
    namespace: dict = {"__name__": "__main__"}
    for cell in cells:
        if cell["cell_type"] != "code":
            continue
        source = "".join(cell["source"])
        exec(compile(source, f"{NOTEBOOK} cell", "exec"), namespace)
        if "open_stage(" in source:
            return namespace["stage"]
    raise AssertionError(f"{NOTEBOOK} has no cell calling open_stage")


def first_listed(run: Path, prefix: str, suffix: str = "") -> str:
    """The first file SHA256SUMS lists under `prefix` ending in `suffix`."""
    return next(rel for rel in listed_files(run) if rel.startswith(prefix) and rel.endswith(suffix))


def change_one_byte(path: Path) -> None:
    """One digit of the file becomes another: same length, still JSON, different bytes."""
    data = bytearray(path.read_bytes())
    at = next(i for i, b in enumerate(data) if chr(b).isdigit())
    data[at] = ord("7") if data[at] != ord("7") else ord("3")
    path.write_bytes(bytes(data))


# ---- the untouched copy: the control every refusal below is measured against ---------------
def test_an_intact_copy_is_sealed_and_opens_for_replay(run, replay_temp, monkeypatch):
    assert evidence.verify(run) == []
    assert evidence.seal_state(run) == "sealed"
    evidence.require_intact(run)  # returns, raises nothing
    before = tree_bytes(run)
    stage = open_as_the_notebook_does(run, monkeypatch)
    assert stage.replay and stage.recorded_run == run and stage.name == STAGE
    assert stage.run_dir != run and replay_temp in stage.run_dir.parents  # its private copy
    assert tree_bytes(run) == before  # opening wrote nothing into the recorded run
    assert evidence.seal_state(run) == "sealed"


def test_sealing_a_copy_again_reproduces_its_recorded_sums_byte_for_byte(run):
    """The seal's rule (what it lists) and the checker's are the ones the run was sealed with."""
    recorded = (run / evidence.SUMS_NAME).read_bytes()
    evidence.seal(run)
    assert (run / evidence.SUMS_NAME).read_bytes() == recorded
    assert not [p for p in run.rglob(f"*{evidence.PARTIAL_SUFFIX}")]


# ---- each tampering, refused by require_intact and by the replay a notebook opens -----------
def refused(run: Path, monkeypatch, kind: type[RunNotIntact]) -> tuple[str, str]:
    """The messages of require_intact's and of the replay's refusals of `run` (both `kind`)."""
    with pytest.raises(kind) as direct:
        evidence.require_intact(run)
    with pytest.raises(kind) as replayed:
        open_as_the_notebook_does(run, monkeypatch)
    assert f"{REPLAY_ENV}={run}: replay refused" in str(replayed.value)
    assert str(direct.value) in str(replayed.value)
    return str(direct.value), str(replayed.value)


def test_one_byte_changed_in_a_json_is_refused(run, replay_temp, monkeypatch):
    # the stage's gates.json: replay reads it only when the stage finishes, never at opening
    rel = f"{STAGE}/gates.json"
    expected = evidence.file_digest(run / rel)
    change_one_byte(run / rel)
    actual = evidence.file_digest(run / rel)
    assert json.loads((run / rel).read_text()) and actual != expected
    assert evidence.seal_state(run) == "tampered"
    assert evidence.verify(run) == [f"{rel}: changed"]
    for message in refused(run, monkeypatch, RunTampered):
        assert f"{rel}: modified (sha256 expected {expected[:12]}…, actual {actual[:12]}…)" \
            in message
    assert not list(replay_temp.iterdir())  # refused before any copy was made


def test_a_removed_file_is_refused(run, replay_temp, monkeypatch):
    rel = first_listed(run, f"calls/{STAGE}/")  # a recorded stream: read only when replayed
    (run / rel).unlink()
    assert evidence.seal_state(run) == "tampered"
    assert evidence.verify(run) == [f"{rel}: missing"]
    for message in refused(run, monkeypatch, RunTampered):
        assert f"{rel}: missing (listed in SHA256SUMS, not in the run)" in message


def test_an_added_file_is_refused(run, replay_temp, monkeypatch):
    rel = f"{STAGE}/added-after-the-seal.json"
    (run / rel).write_text('{"p50_us": 1.0}\n')
    assert evidence.seal_state(run) == "tampered"
    assert evidence.verify(run) == [f"{rel}: extra (in the run, not listed in SHA256SUMS)"]
    for message in refused(run, monkeypatch, RunTampered):
        assert f"{rel}: extra" in message


def test_a_run_without_sha256sums_is_refused_as_unsealed(run, replay_temp, monkeypatch):
    (run / evidence.SUMS_NAME).unlink()
    assert evidence.seal_state(run) == "unsealed"
    assert evidence.verify(run) == [f"{run / evidence.SUMS_NAME} is missing"]
    for message in refused(run, monkeypatch, RunUnsealed):
        assert "unsealed" in message and "incomplete" in message
        assert evidence.SUMS_NAME in message


def test_every_offending_file_is_named_with_what_is_wrong(run, replay_temp, monkeypatch):
    modified = f"{STAGE}/gates.json"
    missing = first_listed(run, f"calls/{STAGE}/")
    extra = "notebooks/planted.ipynb"
    change_one_byte(run / modified)
    (run / missing).unlink()
    (run / extra).write_text("{}\n")
    with pytest.raises(RunTampered) as caught:
        evidence.require_intact(run)
    problems = {(p.rel, p.kind) for p in caught.value.problems}
    assert problems == {(modified, "modified"), (missing, "missing"), (extra, "extra")}
    assert caught.value.run_dir == run
    for message in refused(run, monkeypatch, RunTampered):
        assert "3 problem(s)" in message
        for rel, kind in problems:
            assert f"{rel}: {kind}" in message


def test_a_writers_temporary_file_left_in_a_run_is_refused(run, replay_temp, monkeypatch):
    rel = f"{STAGE}/.gates.json.k3x9q2ab{evidence.PARTIAL_SUFFIX}"
    (run / rel).write_text('{"half": ')
    assert evidence.seal_state(run) == "tampered"
    for message in refused(run, monkeypatch, RunTampered):
        assert f"{rel}: unfinished write" in message


@pytest.mark.parametrize("line, why", [
    ("not a digest line", "is not '<sha256>  <path>'"),
    (f"{'0' * 64}  ../outside.json", "is not a file inside the run"),
    (f"{'0' * 64}  /etc/hostname", "is not a file inside the run"),
])
def test_a_sha256sums_line_that_is_not_a_file_of_the_run_is_refused(run, line, why):
    sums = run / evidence.SUMS_NAME
    count = len(sums.read_text().splitlines())
    sums.write_text(sums.read_text() + line + "\n")
    with pytest.raises(RunTampered) as caught:
        evidence.require_intact(run)
    assert f"{evidence.SUMS_NAME} line {count + 1}: malformed" in str(caught.value)
    assert why in str(caught.value)


def test_a_file_listed_twice_is_refused(run):
    sums = run / evidence.SUMS_NAME
    first = sums.read_text().splitlines()[0]
    sums.write_text(sums.read_text() + first + "\n")
    with pytest.raises(RunTampered, match="listed twice"):
        evidence.require_intact(run)


def test_dot_named_files_are_outside_the_seal(run):
    """What is legitimately not listed: SHA256SUMS itself, and dot-named files (tools' markers
    such as AIPerf's .aiperf_results_ready.json, never read as evidence; committed runs hold
    130 of them, unlisted). A dot-named *writer's temporary* file is refused (test above)."""
    (run / STAGE / ".aiperf_results_ready.json").write_text("{}\n")
    assert evidence.seal_state(run) == "sealed"
    evidence.require_intact(run)


def test_a_run_directory_that_does_not_exist_is_refused(tmp_path):
    with pytest.raises(RunNotIntact, match="no such run directory"):
        evidence.require_intact(tmp_path / "absent")


# ---- writers: atomic, never a partial file, never an overwrite ------------------------------
class FailsWhenSerialised:
    """A value json.dump reaches only after everything sorted before it is written; turning it
    into text notes the folder's files at that moment, then raises `error`."""

    def __init__(self, folder: Path, error: BaseException):
        self.folder, self.error = folder, error
        self.seen: dict[str, int] = {}

    def __str__(self) -> str:  # json's `default=str` calls this
        self.seen = {p.name: p.stat().st_size for p in self.folder.iterdir()}
        raise self.error


@pytest.mark.parametrize("error", [ValueError("cannot serialise"), KeyboardInterrupt()])
def test_a_json_writer_interrupted_half_way_leaves_no_file_and_no_temporary(tmp_path, error):
    folder = tmp_path / "stage"
    folder.mkdir()
    bomb = FailsWhenSerialised(folder, error)
    record = {"a_first": ["measured"] * 50_000, "z_last": bomb}  # sort_keys: a_ is written first
    with pytest.raises(type(error)):
        evidence.write_json_new(folder / "result.json", record)
    # the failure came half-way: a temporary file already held part of the JSON, and no file
    # under the evidence name existed
    [(temporary, size)] = bomb.seen.items()
    assert temporary.startswith(".result.json.") and temporary.endswith(evidence.PARTIAL_SUFFIX)
    assert size > 100_000
    assert list(folder.iterdir()) == []  # and now neither exists


def test_a_json_writer_writes_what_dumps_says(tmp_path):
    record = {"b": [1, 2.5, None], "a": {"nested": "é"}, "t": (1, 2), "p": Path("/x")}
    path = evidence.write_json_new(tmp_path / "r.json", record)
    assert path.read_bytes() == evidence.dumps(record).encode("utf-8")
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]


def test_a_name_taken_while_writing_is_refused_and_the_other_file_kept(tmp_path):
    path = tmp_path / "gates.json"

    class TakesTheName:  # another writer creates the file while this one is half-way
        def __str__(self):
            path.write_bytes(b"the other writer's bytes\n")
            return "value"

    with pytest.raises(EvidenceError, match="appeared while it was being written") as caught:
        evidence.write_json_new(path, {"a": ["x"] * 10_000, "z": TakesTheName()})
    assert str(path) in str(caught.value)
    assert path.read_bytes() == b"the other writer's bytes\n"
    assert [p.name for p in tmp_path.iterdir()] == ["gates.json"]


@pytest.mark.parametrize("content", ["new text\n", b"new bytes\n"])
def test_writing_an_already_recorded_file_is_refused_and_keeps_its_bytes(tmp_path, content):
    path = evidence.write_new(tmp_path / "run.json", b'{"recorded": true}\n')
    with pytest.raises(EvidenceError, match="already recorded") as caught:
        evidence.write_new(path, content)
    assert str(path) in str(caught.value)
    with pytest.raises(EvidenceError, match="already recorded"):
        evidence.write_json_new(path, {"recorded": False})
    assert path.read_bytes() == b'{"recorded": true}\n'
    assert [p.name for p in tmp_path.iterdir()] == ["run.json"]


def test_a_stage_refuses_to_rewrite_its_recorded_files(tmp_path):
    name = "00_cluster"
    run_dir = tmp_path / "run"
    stage = Stage(name, registry.resolve(name, {}), run_dir, Door(run_dir, name), None)
    stage.write_text("host.txt", "recorded\n")
    with pytest.raises(EvidenceError, match="already recorded"):
        stage.write_text("host.txt", "rewritten\n")
    stage.add(evidence.gate("host recorded", True))
    stage.finish()
    gates = (stage.dir / "gates.json").read_bytes()
    stage.add(evidence.gate("a second verdict", False))
    with pytest.raises(EvidenceError, match="gates.json is already recorded"):
        stage.finish()
    assert (stage.dir / "host.txt").read_text() == "recorded\n"
    assert (stage.dir / "gates.json").read_bytes() == gates
    assert not [p for p in run_dir.rglob(".*")]  # no temporary file anywhere


def test_seal_and_the_sanctioned_rewrite_leave_no_temporary(tmp_path):
    (tmp_path / "s").mkdir()
    log = evidence.write_new(tmp_path / "s" / "server.log", "token hf_x\n")
    log.chmod(0o644)
    evidence.replace_atomically(log, "token [REDACTED]\n")
    assert log.read_text() == "token [REDACTED]\n"
    assert log.stat().st_mode & 0o777 == 0o644
    evidence.seal(tmp_path)
    evidence.seal(tmp_path)  # a second seal replaces the first, as a resumed run does
    assert evidence.verify(tmp_path) == []
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["SHA256SUMS", "s", "server.log"]


# ---- the committed runs ---------------------------------------------------------------------
RUN_DIRS = sorted({p.parent for p in RESULTS.rglob("run.json")})
# Every sealed folder under results/: the runs, and the hand-sealed diagnostics folders.
SEALED = sorted({p.parent for p in RESULTS.rglob(evidence.SUMS_NAME)})
# Committed runs known not to match their seal, with exactly what is wrong, and where it is
# explained. Anything else wrong with them, or with any other run, fails the test.
KNOWN_NOT_INTACT = {
    # A lingering worker of vLLM appended DeepEP's teardown errors to this log after the stage
    # was sealed (results/gpu-2xh200-deepep-vllm-20261130b.notes.md); not in results/REPLAYED.
    "gpu-2xh200-deepep-vllm-20261130b": {("06_multicomm/vllm-eager-ep.log", "modified")},
}


def test_every_committed_run_is_sealed():
    assert RUN_DIRS and SOURCE in RUN_DIRS
    assert [r.name for r in RUN_DIRS if evidence.seal_state(r) == "unsealed"] == []


@pytest.mark.parametrize("folder", SEALED, ids=lambda p: p.relative_to(RESULTS).as_posix())
def test_a_committed_sealed_folder_is_intact(folder):
    known = KNOWN_NOT_INTACT.get(folder.relative_to(RESULTS).as_posix())
    if known is None:
        evidence.require_intact(folder)
        return
    with pytest.raises(RunTampered) as caught:
        evidence.require_intact(folder)
    assert {(p.rel, p.kind) for p in caught.value.problems} == known


def test_the_known_broken_log_only_grew_after_its_seal():
    """What its notes say: lines appended, nothing else changed. The sealed digest is the digest
    of the log's first 729 lines as `head -n` counts them (the notes say `head -n 732`: 732 when
    a progress bar's carriage returns count as line breaks; `head -n 732` does not match)."""
    run = RESULTS / "gpu-2xh200-deepep-vllm-20261130b"
    rel = "06_multicomm/vllm-eager-ep.log"
    sealed = dict(line.split("  ", 1)[::-1] for line in
                  (run / evidence.SUMS_NAME).read_text().splitlines())[rel]
    digest, lines = hashlib.sha256(), 0
    for line in (run / rel).read_bytes().split(b"\n"):
        digest.update(line + b"\n")
        lines += 1
        if digest.hexdigest() == sealed:
            break
    else:
        pytest.fail(f"{rel}: no prefix of its lines has the sealed digest")
    assert lines == 729


# ---- the book's digest cache: a rebuild hashes only what changed ------------------------------
def test_the_digest_cache_hashes_each_file_once_and_again_after_a_change(run, tmp_path):
    cache_file = tmp_path / "digests.json"
    first = evidence.DigestCache(cache_file)
    assert evidence.seal_state(run, first) == "sealed"
    assert first.hashed == len(listed_files(run)) > 0
    first.save()
    again = evidence.DigestCache(cache_file)
    assert evidence.seal_state(run, again) == "sealed" and again.hashed == 0
    changed = run / first_listed(run, STAGE, ".json")
    change_one_byte(changed)
    os.utime(changed, ns=(changed.stat().st_atime_ns, changed.stat().st_mtime_ns + 1000))
    after = evidence.DigestCache(cache_file)
    assert evidence.seal_state(run, after) == "tampered" and after.hashed == 1
    assert evidence.verify(run, after) == [f"{first_listed(run, STAGE, '.json')}: changed"]


def test_an_unreadable_digest_cache_is_rebuilt_not_trusted(run, tmp_path):
    cache_file = tmp_path / "digests.json"
    cache_file.write_text("{not json")
    cache = evidence.DigestCache(cache_file)
    assert evidence.seal_state(run, cache) == "sealed" and cache.hashed > 0
