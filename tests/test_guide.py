"""The guide as a person runs it: papermill on the real notebooks, into a results dir of the test.

Stage 00 is used throughout: it is fast and makes real calls (host files, kubectl, docker).
"""
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lib.core import evidence
from lib.core.door import REPO_ROOT, Door

TOKEN = "hf_plantedSECRET0123456789"
NOTEBOOK = REPO_ROOT / "notebooks" / "00_cluster.ipynb"


def papermill(out: Path, *params: str, env: dict | None = None, notebook: Path = NOTEBOOK):
    argv = [sys.executable, "-m", "papermill", str(notebook), str(out), "--cwd",
            str(REPO_ROOT / "notebooks"), "--kernel", "python3", "--no-progress-bar"]
    for pair in zip(params[::2], params[1::2]):
        argv += ["-p", *pair]
    return subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL,
                          env={**os.environ, **(env or {})}, timeout=300)


def tree_digest(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """One real recorded run of stage 00, with a planted secret in the environment."""
    results = tmp_path_factory.mktemp("results")
    done = papermill(results / "00.ipynb", "results_dir", str(results), "run_id", "first",
                     env={"HF_TOKEN": TOKEN})
    assert done.returncode == 0, done.stderr[-3000:]
    evidence.seal(results / "first")  # papermill alone never seals; replay opens sealed runs
    return results


def test_a_stage_records_its_evidence(recorded):
    run = recorded / "first"
    gates = json.loads((run / "00_cluster" / "gates.json").read_text())
    assert {g["status"] for g in gates} <= {"PASS", "FAIL", "SKIP"}
    assert all(g["reason"] for g in gates if g["status"] == "SKIP")
    run_json = json.loads((run / "run.json").read_text())
    assert run_json["run_id"] == "first" and run_json["context"] == "local"
    assert (run / "transcript.jsonl").read_text().count('"stage": "00_cluster"') >= 5


@pytest.mark.parametrize("name, value, allowed", [
    ("context", "nowhere", "local, plan, kube"),
    ("nodes", "0", ">= 1"),
    ("run_id", "../../etc", "letters, digits"),
])
def test_bad_parameters_fail_in_the_first_cell_and_change_nothing(recorded, tmp_path, name,
                                                                  value, allowed):
    before = tree_digest(recorded)
    params = ["results_dir", str(recorded), "run_id", "first", name, value]
    done = papermill(tmp_path / "bad.ipynb", *params)
    assert done.returncode != 0
    assert f"parameter '{name}'" in done.stderr and allowed in done.stderr
    out = json.loads((tmp_path / "bad.ipynb").read_text())
    failing = [c for c in out["cells"] if any(o.get("output_type") == "error"
                                                for o in c.get("outputs", []))]
    assert len(failing) == 1 and "open_stage" in "".join(failing[0]["source"])
    assert tree_digest(recorded) == before


def test_a_stage_already_recorded_is_refused(recorded, tmp_path):
    before = tree_digest(recorded)
    done = papermill(tmp_path / "again.ipynb", "results_dir", str(recorded), "run_id", "first")
    assert done.returncode != 0 and "append-only" in done.stderr
    assert tree_digest(recorded) == before


def test_two_runs_make_two_run_directories(recorded, tmp_path):
    before = tree_digest(recorded / "first")
    done = papermill(tmp_path / "second.ipynb", "results_dir", str(recorded))
    assert done.returncode == 0, done.stderr[-2000:]
    runs = sorted(p.name for p in recorded.iterdir() if p.is_dir())
    assert len(runs) == 2 and "first" in runs
    assert tree_digest(recorded / "first") == before


def test_replay_reproduces_the_notebook_and_writes_nothing(recorded, tmp_path):
    run = recorded / "first"
    before = tree_digest(run)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbval",
         str(recorded / "00.ipynb")], capture_output=True, text=True, cwd=tmp_path,
        env={**os.environ, "REPRO_REPLAY": str(run)}, stdin=subprocess.DEVNULL, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:]
    assert "passed" in done.stdout
    assert tree_digest(run) == before


def test_replay_names_a_changed_recorded_argv(recorded, tmp_path):
    import shutil

    run = tmp_path / "edited"
    shutil.copytree(recorded / "first", run)
    transcript = run / "transcript.jsonl"
    lines = [json.loads(x) for x in transcript.read_text().splitlines()]
    kubectl = next(e for e in lines if e["kind"] == "run" and e["key"][0] == "kubectl")
    kubectl["key"] = ["kubectl", "version", "--client", "-o", "yaml"]
    transcript.write_text("".join(json.dumps(e, sort_keys=True) + "\n" for e in lines))
    evidence.seal(run)  # sealed anew: the door, not the seal check, must name the changed call
    done = papermill(tmp_path / "replayed.ipynb", "results_dir", str(recorded), "run_id", "edited",
                     env={"REPRO_REPLAY": str(run)})
    assert done.returncode != 0
    assert "ReplayMismatch" in done.stderr and "'yaml'" in done.stderr and "'json'" in done.stderr
    assert "call #" in done.stderr


def test_a_planted_secret_reaches_no_evidence_notebook_or_book(recorded, tmp_path):
    from lib.publish import book
    from lib.core import evidence

    run = recorded / "first"
    # The secret as an argument of a recorded command, in the same run.
    Door(run, "99_secret_probe").run(["echo", "--hf-token", TOKEN, f"Bearer {TOKEN}"], timeout=10)
    (run / "notebooks").mkdir(exist_ok=True)
    (run / "notebooks" / "00_cluster.ipynb").write_bytes((recorded / "00.ipynb").read_bytes())
    evidence.seal(run)
    book.build(run, out_root=tmp_path)
    for root in (recorded, tmp_path / "_build"):
        for path in root.rglob("*"):
            if path.is_file():
                assert TOKEN.encode() not in path.read_bytes(), path
                assert b"plantedSECRET" not in path.read_bytes(), path
    html = tmp_path / "_build" / "html"
    assert (html / "index.html").exists()
    stage_page = (html / "book" / "stages" / "00_cluster.html").read_text()
    assert "Verification level" in stage_page and "measured here end-to-end" in stage_page
    assert "first" in (html / "book" / "runs" / "first.html").read_text()  # the run it shows


def test_engine_vllm_on_a_cpu_machine_is_refused_in_the_first_cell(tmp_path):
    import torch

    if torch.cuda.device_count() >= 2:
        pytest.skip("this machine has 2+ GPUs: the refusal is for CPU machines")
    notebook = REPO_ROOT / "notebooks" / "04_serve.ipynb"
    done = papermill(tmp_path / "vllm.ipynb", "results_dir", str(tmp_path / "results"),
                     "engine", "vllm", notebook=notebook)
    assert done.returncode != 0
    assert "parameter 'engine' = 'vllm' is not allowed" in done.stderr
    assert "needs 2 or more GPUs and vllm importable" in done.stderr
    assert not (tmp_path / "results").exists()  # refused before anything was written


def test_papermill_without_parameters_starts_a_new_run_and_leaves_the_reference_alone(tmp_path):
    """A newcomer's first call, exactly: `papermill notebooks/00_cluster.ipynb OUT` with no -p.
    The committed notebook carries no injected-parameters cell naming the reference run, so the
    call records a new run under results/ (removed again here) and the reference still
    verifies against its SHA256SUMS."""
    import shutil

    from lib.core import evidence

    results = REPO_ROOT / "results"
    reference = results / (results / "REFERENCE").read_text().strip()
    before = {p.name for p in results.iterdir()}
    done = papermill(tmp_path / "x.ipynb")
    made = sorted({p.name for p in results.iterdir()} - before)
    try:
        assert done.returncode == 0, done.stderr[-3000:]
        assert len(made) == 1 and made[0].startswith("local-"), made
        assert json.loads((results / made[0] / "00_cluster" / "gates.json").read_text())
    finally:
        for name in made:
            shutil.rmtree(results / name)
    assert evidence.verify(reference) == []
