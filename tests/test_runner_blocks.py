"""`make run` stops at 00: every later stage reads 00's evidence (lib.stages.registry), so a
FAIL in 00 leaves each of them not run (lib.runner.blocked_by), for every engine."""
import json

import pytest

from lib import runner
from lib.stages.registry import STAGES


@pytest.mark.parametrize("engine", ["", "vllm", "sglang", "trtllm", "transformers"])
def test_a_failed_00_blocks_every_later_stage(tmp_path, engine):
    run = tmp_path / "run"
    (run / "00_cluster").mkdir(parents=True)
    given = {"engine": engine} if engine else {}
    assert [s for s in STAGES[1:] if runner.blocked_by(s, run, "kube", given)] == []
    (run / "00_cluster" / "gates.json").write_text(json.dumps([
        {"gate": "p5en-a: Ready, no pressure", "status": "FAIL", "observed": None,
         "expected": None, "reason": "the kubelet reports: DiskPressure=True", "evidence": []}]))
    assert {s: runner.blocked_by(s, run, "kube", given) for s in STAGES[1:]} == {
        s: ["00_cluster"] for s in STAGES[1:]}
