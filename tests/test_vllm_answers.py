"""05's backend A/B (allgather against deepep_v2, both traffic shapes) against the vLLM double
(tests/vllm_stage_kit.py says how). An arm that answers otherwise than the baseline is 06's
graphs arm in tests/test_vllm_stages.py's test_serve_sweep_and_ab_on_vllm (one 06 for both)."""
from __future__ import annotations

import json

from lib.core.door import Door
from lib.core.stage import Stage
from lib.stages import registry as params, serve as serve_stage, sweep as sweep_stage
from tests.test_serve_vllm import ALLGATHER_LOG, DEEPEP_LOG, make_double, nccl_site
from tests.vllm_stage_kit import NEEDS, SMALL, open_stage, serve_with

pytestmark = NEEDS


def test_backend_ab_in_05_both_shapes_and_its_log_gates(tmp_path, monkeypatch):
    """05 with ab_backends: allgather_reducescatter and deepep_v2 side by side (each double
    replays the real log of its backend), both traffic shapes, a ratio per shape. One repeat:
    each ratio's interval gate FAILs saying so, and only they (two paired repeats, the loop's
    own, are 06's: tests/test_vllm_deepep_06.py; four AIPerf cells here, not eight)."""
    double, _ = make_double(tmp_path, {"allgather_reducescatter": ALLGATHER_LOG,
                                       "deepep_v2": DEEPEP_LOG})
    serve_with(monkeypatch, double)
    run_dir, site = tmp_path / "run", str(nccl_site(tmp_path))
    s04 = open_stage(run_dir, "04_serve")
    serve_stage.run(s04)
    s04.finish()
    door = Door(run_dir, "05_sweep")
    given = {k: v for k, v in SMALL.items() if k in params.STAGE_PARAMS["05_sweep"]}
    deepep_dir = str(tmp_path / "DeepEP")
    given.update(ab_backends="allgather_reducescatter,deepep_v2", nccl_site=site, repeats=1,
                 deepep_dir=deepep_dir,
                 concurrency="2", prefill_input_tokens=64, prefill_output_tokens=4)
    s05 = Stage("05_sweep", params.resolve("05_sweep", given), run_dir, door, None)
    data = sweep_stage.run(s05)
    s05.finish()
    gates = {g.gate: g for g in s05.gates}
    assert sorted((g.gate, g.reason) for g in s05.gates if g.status == "FAIL") == [
        (f"output tok/s deepep_v2 / allgather_reducescatter at c2, {shape} with its interval",
         "only 1 paired repeat(s) measured") for shape in ("decode", "prefill")]
    assert gates["deepep_v2: vllm_all2all_manager"].observed["constructed"] == \
        ["DeepEPV2All2AllManager"]
    assert gates["allgather_reducescatter: vllm_all2all_manager"].observed["constructed"] == \
        ["AgRsAll2AllManager"]
    assert gates["deepep_v2 answers as allgather_reducescatter"].status == "PASS"
    # both arms' servers start with the same libraries: the site, then the DeepEP build
    starts = [json.loads(line) for line in (run_dir / "transcript.jsonl").read_text().splitlines()
              if '"kind": "start"' in line and '"stage": "05_sweep"' in line]
    assert len(starts) == 2
    assert all(e["env"]["PYTHONPATH"].split(":")[:2] == [site, deepep_dir] for e in starts)
    frame = data["summary"]
    assert sorted(set(frame["arm"])) == [
        "vllm-allgather-reducescatter-decode", "vllm-allgather-reducescatter-prefill",
        "vllm-deepep-v2-decode", "vllm-deepep-v2-prefill"]
    ratios = data["ratios"]
    assert [(r["shape"], r["b"], r["a"], r["n"]) for r in ratios] == [
        ("decode", "deepep_v2", "allgather_reducescatter", 1),
        ("prefill", "deepep_v2", "allgather_reducescatter", 1)]
    # the prefill cells asked for the prefill shape's output length, and vLLM's counter agrees;
    # 3 requests asked, at least 5 per slot at concurrency 2: 10 measured
    prefill = [g for n, g in gates.items()
               if "prefill" in n and n.endswith("vLLM counted the generated tokens")]
    assert prefill and all(g.expected == f">= {10 * 4}" for g in prefill)
    replay = Stage("05_sweep", params.resolve("05_sweep", given), run_dir,
                   Door(run_dir, "05_sweep", replay=True), run_dir)
    sweep_stage.run(replay)
    replay.finish()
