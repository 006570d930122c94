"""The committed reference runs: sealed, complete, and their gates hold."""
import json
import subprocess
from pathlib import Path

import pytest

from lib import evidence, report
from lib.door import REPO_ROOT
from lib.params import STAGES

RESULTS = REPO_ROOT / "results"
REFERENCE = (RESULTS / "REFERENCE").read_text().strip()
FURTHER = sorted(report.replayed_notebooks(RESULTS))


@pytest.mark.parametrize("run_id", [REFERENCE, *FURTHER])
def test_a_reference_run_is_sealed(run_id):
    run = RESULTS / run_id
    assert evidence.verify(run) == []
    assert subprocess.run(["sha256sum", "-c", "--quiet", "SHA256SUMS"], cwd=run).returncode == 0


def test_the_cpu_reference_run_has_every_stage_and_no_fail():
    run = RESULTS / REFERENCE
    for stage in STAGES:
        gates = evidence.read_gates(run / stage)
        assert gates, f"{stage} missing from the reference run"
        assert not [g for g in gates if g["status"] == "FAIL"], stage
        assert all(g["reason"] for g in gates if g["status"] == "SKIP")
    notebooks = sorted(p.stem for p in (REPO_ROOT / "notebooks").glob("*.ipynb"))
    assert notebooks == list(STAGES)
    for stage in STAGES:  # the committed notebooks are that run's executed notebooks
        stored = json.loads((REPO_ROOT / "notebooks" / f"{stage}.ipynb").read_text())
        recorded = json.loads((run / "notebooks" / f"{stage}.ipynb").read_text())
        assert [c.get("outputs") for c in stored["cells"]] == \
               [c.get("outputs") for c in recorded["cells"]]


@pytest.mark.parametrize("run_id", FURTHER)
def test_a_gpu_reference_run_measured_nccl_with_correctness(run_id):
    run = RESULTS / run_id
    result = evidence.read_json(run / "03_kernel_test" / "result.json")
    assert result["config"]["backend"] == "nccl" and result["correct"] is True
    gates = {g["gate"]: g["status"] for g in evidence.read_gates(run / "03_kernel_test")}
    assert set(gates.values()) == {"PASS"}
