"""An arm that answers otherwise than the baseline, and 05's backend A/B (allgather against
deepep_v2, both traffic shapes), against the vLLM double (tests/vllm_stage_kit.py says how)."""
from __future__ import annotations

import json

from lib.core.door import Door
from lib.core.stage import Stage
from lib.measure import agreement
from lib.publish import report
from lib.stages import lever, registry as params, serve as serve_stage, sweep as sweep_stage
from tests.test_serve_vllm import ALLGATHER_LOG, DEEPEP_LOG, make_double, nccl_site
from tests.vllm_stage_kit import (
    NEEDS, SMALL, open_stage, serve_with, two_gpus, ONE_LEVEL, serve_then_06)

pytestmark = NEEDS


def test_an_arm_that_answers_otherwise_fails_its_answer_gate_and_is_still_measured(
        tmp_path, monkeypatch):
    """The graphs arm answers each prompt with the recorded answer to the next one (as a serve
    whose MoE computes something else would): `graphs+EP answers as eager+EP` FAILs naming the
    prompts and positions; the no-EP arm still PASSes; the throughput is measured and gated as
    before, so the FAIL stands beside its numbers; a replay gives the same gates."""
    run_dir = two_gpus(tmp_path, monkeypatch, "serve", wrong_answers=True)
    s06, data = serve_then_06(run_dir, ONE_LEVEL)
    gates = {g.gate: g for g in s06.gates}
    wrong = gates["graphs+EP answers as eager+EP"]
    assert wrong.status == "FAIL" and wrong.reason.startswith("prompt 0: position 0: only ")
    assert wrong.observed["agree"] < wrong.observed["prompts"] == len(agreement.PROMPTS)
    assert wrong.evidence == ["06_multicomm/answers-vllm-eager-ep.json",
                              "06_multicomm/answers-vllm-graphs-ep.json"]
    assert gates["eager, no EP answers as eager+EP"].status == "PASS"
    assert len(data["ratios"]) == 2 and all(r["n"] == 2 for r in data["ratios"])
    book = "\n".join(report.vllm_sections(run_dir))
    assert "graphs+EP answers as eager+EP: **FAIL** (" in book
    assert "eager, no EP answers as eager+EP: **PASS** (8 of 8 prompts" in book
    replay = open_stage(run_dir, "06_multicomm", replay=True, extra=ONE_LEVEL)
    lever.run(replay)
    replay.finish()
    assert {g.gate: g.status for g in replay.gates} == {g.gate: g.status for g in s06.gates}

    # answer_prompts 0 (nothing asked, no answer gate) is what the runs recorded before the
    # check replay with (gpu-2xh200-vllm-20261201's 06, in make nbval): not run again here


def test_backend_ab_in_05_both_shapes_and_its_log_gates(tmp_path, monkeypatch):
    """05 with ab_backends: allgather_reducescatter and deepep_v2 side by side (each double
    replays the real log of its backend), both traffic shapes, ratios per shape."""
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
    given.update(ab_backends="allgather_reducescatter,deepep_v2", nccl_site=site, repeats=2,
                 deepep_dir=deepep_dir,
                 concurrency="2", prefill_input_tokens=64, prefill_output_tokens=4)
    s05 = Stage("05_sweep", params.resolve("05_sweep", given), run_dir, door, None)
    data = sweep_stage.run(s05)
    s05.finish()
    gates = {g.gate: g for g in s05.gates}
    assert not [g for g in s05.gates if g.status == "FAIL"], \
        [(g.gate, g.reason) for g in s05.gates if g.status == "FAIL"]
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
        ("decode", "deepep_v2", "allgather_reducescatter", 2),
        ("prefill", "deepep_v2", "allgather_reducescatter", 2)]
    # the prefill cells asked for the prefill shape's output length, and vLLM's counter agrees;
    # 3 requests asked, at least 5 per slot at concurrency 2: 10 measured
    prefill = [g for n, g in gates.items()
               if "prefill" in n and n.endswith("vLLM counted the generated tokens")]
    assert prefill and all(g.expected == f">= {10 * 4}" for g in prefill)
    replay = Stage("05_sweep", params.resolve("05_sweep", given), run_dir,
                   Door(run_dir, "05_sweep", replay=True), run_dir)
    sweep_stage.run(replay)
    replay.finish()
