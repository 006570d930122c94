"""Stage 06 on deepep_v2 as the 2x H200 runs went, each arm's server replaying its recorded
vLLM log: every gate holding, and graphs+EP dying under traffic (tests/vllm_stage_kit.py
says how the double stands in)."""
from __future__ import annotations

import json
from pathlib import Path

from lib.measure import agreement
from lib.publish import report
from lib.stages import lever
from tests.test_serve_vllm import DEEPEP_GRAPHS_UNDER_TRAFFIC_LOG
from tests.vllm_stage_kit import (
    NEEDS, statuses, ONE_LEVEL, asked, DEEPEP_06, serve_then_06_on_deepep_v2)

pytestmark = NEEDS


def test_serving_ab_06_on_deepep_v2_from_its_recorded_logs(tmp_path, monkeypatch):
    """06 as the cluster's backend runs it (deepep_v2, the intranode contract), each arm's
    server replaying the real log vLLM 0.24.0 wrote for that arm on 2x H200 (eager+EP from the
    shared fixture, graphs+EP and no EP from run gpu-2xh200-deepep-vllm-20261130b): every
    server gate holds, the three arms are measured, the no-EP arm carries the DeepEP
    environment without --all2all-backend."""
    run_dir, s04, s06, data, stage = serve_then_06_on_deepep_v2(
        tmp_path, monkeypatch, ONE_LEVEL, graphs_log=DEEPEP_06 / "vllm-graphs-ep.log",
        noep_log=DEEPEP_06 / "vllm-eager-noep.log")
    # the recorded logs were served before patch 0002 (no run.json records it): its gate SKIPs
    assert {g.gate: g.status for g in s04.gates if g.status != "PASS"} == {
        "elastic_buffer_timeouts_per_rank": "SKIP"}, \
        [(g.gate, g.reason) for g in s04.gates if g.status != "PASS"]
    got = statuses(s06)
    assert {n: s for n, s in got.items() if s == "FAIL"} == {}, \
        [(g.gate, g.reason) for g in s06.gates if g.status == "FAIL"]
    # the two DeepEP arms one at a time, each started for its block (beside each other the
    # double dies as vLLM did on 2x H200; graphs+EP's blocks of repeats 1 and 2 are adjacent:
    # one server); the no-EP arm up throughout
    starts = [json.loads(line) for line in (run_dir / "transcript.jsonl").read_text().splitlines()
              if '"kind": "start"' in line and '"stage": "06_multicomm"' in line]
    assert [Path(e["log"]).name for e in starts] == [
        "vllm-eager-noep.log", "vllm-eager-ep-1.log", "vllm-graphs-ep-1.log",
        "vllm-eager-ep-2.log"]
    for arm, starts_of_arm in (("eager+EP", (1, 2)), ("graphs+EP", (1,))):
        for start in starts_of_arm:
            managers = {g.gate: g for g in s06.gates}[f"{arm}, start {start}: vllm_all2all_manager"]
            assert managers.observed["constructed"] == ["DeepEPV2All2AllManager"]
            assert got[f"{arm}, start {start}: server stopped"] == "PASS"
            assert got[f"{arm}, start {start}: vllm_compile_mode"] == "PASS"
    assert data["ready_s"]["graphs+EP"] == data["ready_s_each"]["graphs+EP"][0]
    servers = json.loads((run_dir / "06_multicomm" / "servers.json").read_text())
    assert [s["log"] for s in servers["arms"]["eager+EP"]] == [
        "06_multicomm/vllm-eager-ep-1.log", "06_multicomm/vllm-eager-ep-2.log"]
    assert [s["ready_s"] for s in servers["arms"]["graphs+EP"]] == data["ready_s_each"]["graphs+EP"]
    book = "\n".join(report.vllm_sections(run_dir))
    assert "Servers: eager+EP, graphs+EP one at a time (DeepEP)" in book
    assert "per start: eager+EP " in book and "; eager, no EP " in book
    assert len(data["ready_s_each"]["eager+EP"]) == 2 and data["layout"].startswith(
        "eager+EP, graphs+EP one at a time")
    assert got["eager, no EP: vllm_expert_parallel_off"] == "PASS"
    assert sorted(set(data["summary"]["arm"])) == ["vllm-eager-ep", "vllm-eager-noep",
                                                   "vllm-graphs-ep"]
    assert len(data["ratios"]) == 2 and all(r["n"] == 2 for r in data["ratios"])
    # asked once per arm: eager+EP's second start is not asked again
    assert got["graphs+EP answers as eager+EP"] == "PASS"
    assert asked(run_dir, "06_multicomm") == 3 * len(agreement.PROMPTS)
    noep = next(e for e in starts if "--enable-expert-parallel" not in e["key"])
    assert "--all2all-backend" not in noep["key"] and noep["env"]["EP_DISABLE_GIN"] == "1"
    replay = stage("06_multicomm", replay=True)
    lever.run(replay)
    replay.finish()


def test_a_server_that_dies_under_traffic_fails_its_gate_and_its_arm_is_measured_no_more(
        tmp_path, monkeypatch):
    """06 on deepep_v2 as it went on 2x H200 (run gpu-2xh200-deepep-vllm-20261130d): graphs+EP
    passes every startup gate, then vLLM dies on the first batched step of AIPerf's traffic (its
    recorded log replayed) and exits 1. Its gate `server up through its cells` FAILs quoting the
    log's first fatal line; its later cells are SKIPs, its server is not started again; the
    other arms are measured and gated as usual; the graphs ratios FAIL with no paired repeat; a
    replay computes the same gates."""
    run_dir, _, s06, data, stage = serve_then_06_on_deepep_v2(
        tmp_path, monkeypatch, ONE_LEVEL, noep_log=DEEPEP_06 / "vllm-eager-noep.log",
        traffic_crash_log=DEEPEP_GRAPHS_UNDER_TRAFFIC_LOG)
    gates = {g.gate: g for g in s06.gates}
    died = gates["graphs+EP, start 1: server up through its cells"]
    assert died.status == "FAIL"
    assert died.observed == {"exit_code": 1, "died_during": "aiperf vllm-graphs-ep c1 repeat 1"}
    assert "IndexKernel.cu:111" in died.reason and "index out of bounds" in died.reason
    assert died.evidence[0].startswith("06_multicomm/vllm-graphs-ep-1.log:")
    assert "EngineCore_DP1 was running a step of 135 scheduled tokens" in died.reason
    assert died.evidence[1].startswith("06_multicomm/vllm-graphs-ep-1.log:")
    # the servers that lived have no such gate: their token-count gates read /metrics after
    # every cell (so a run recorded before this gate replays)
    assert [g for g in gates if g.endswith("server up through its cells")] == [died.gate]
    assert gates["aiperf vllm-eager-ep c1 repeat 2: vLLM counted the generated tokens"].status \
        == "PASS"
    # the crash's own cell FAILs; every later graphs+EP cell is a SKIP, never a FAIL
    assert gates["aiperf vllm-graphs-ep c1 repeat 1: AIPerf exit 0"].status == "FAIL"
    later = [g for g in s06.gates if g.gate.startswith("aiperf vllm-graphs-ep")
             and g.gate.endswith(": measured")]
    assert [(g.gate, g.status) for g in later] == [
        ("aiperf vllm-graphs-ep c1 repeat 2: measured", "SKIP")]
    assert all(g.reason == "not run: graphs+EP, start 1's server exited (code 1) during aiperf "
               "vllm-graphs-ep c1 repeat 1" for g in later)
    starts = [json.loads(line) for line in (run_dir / "transcript.jsonl").read_text().splitlines()
              if '"kind": "start"' in line and '"stage": "06_multicomm"' in line]
    assert [Path(e["log"]).name for e in starts] == [
        "vllm-eager-noep.log", "vllm-eager-ep-1.log", "vllm-graphs-ep-1.log",
        "vllm-eager-ep-2.log"]
    summary = data["summary"]
    assert len(summary[summary.arm == "vllm-graphs-ep"]) == 1  # the one cell that ran
    assert len(summary[summary.arm == "vllm-eager-ep"]) == 2
    fails = {g.gate for g in s06.gates if g.status == "FAIL"}
    assert all("graphs" in name for name in fails), sorted(fails)
    ratios = {(r["b"], r["concurrency"]): r for r in data["ratios"]}
    assert ratios[("graphs+EP", 1)]["n"] == 0 and ratios[("eager, no EP", 1)]["n"] == 2
    replay = stage("06_multicomm", replay=True)
    lever.run(replay)
    replay.finish()
    assert [(g.gate, g.status) for g in replay.gates] == [(g.gate, g.status) for g in s06.gates]
