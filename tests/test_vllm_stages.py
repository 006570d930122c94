"""Stages 04, 05 and 06 with engine 'vllm', end to end on this CPU machine: real AIPerf, real
HTTP, the real door and evidence, against the vLLM double of tests/test_serve_vllm.py (a real
vLLM 0.24.0 log replayed, OpenAI answers streamed, /metrics counted). What cannot exist here is
patched at its seam only: the GPU count (2) and the model flavor (the tiny model stands in for
the 1.2 B-parameter one; the double reads its expert count from config.json)."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from lib.measure import agreement
from lib.stages import registry as params
from lib.publish import report
from lib.engines import transformers as serve
from lib.engines import vllm_server as serve_vllm
from lib.measure import sweep as lib_sweep
from lib.core.door import Door, read_transcript
from lib.core.stage import Stage
from lib.measure import serving
from lib.places import local as local_place
from lib.stages import ab, lever, serve as serve_stage, sweep as sweep_stage
from tests.test_serve_vllm import (ALLGATHER_LOG, ANSWERS, DEEPEP_BESIDE_DEEPEP_LOG,
                                   DEEPEP_GRAPHS_UNDER_TRAFFIC_LOG, DEEPEP_LOG, FIXTURES,
                                   GRAPHS_LOG, NOEP_LOG, listening, make_double, nccl_site)

pytestmark = [
    pytest.mark.skipif(not FIXTURES.is_dir(), reason=f"{FIXTURES} absent"),
    pytest.mark.skipif(not Path(".venv-aiperf/bin/aiperf").exists(),
                       reason="AIPerf's venv (.venv-aiperf) is not installed: make venv"),
]

SMALL = {"engine": "vllm", "concurrency": "1,2", "request_count": 3, "warmup_requests": 1,
         "input_tokens": 16, "output_tokens": 8, "server_timeout_s": 60, "ab_repeats": 2}


def open_stage(run_dir: Path, name: str, replay: bool = False, extra: dict | None = None) -> Stage:
    """Stage `name` with SMALL's parameters (and `extra`'s) that the stage takes."""
    given = {k: v for k, v in {**SMALL, **(extra or {})}.items() if k in params.STAGE_PARAMS[name]}
    door = Door(run_dir, name, replay=replay)
    return Stage(name, params.resolve(name, given), run_dir, door, run_dir if replay else None)


def spy_on_the_loop(monkeypatch) -> list[tuple[str, tuple[str, ...]]]:
    """Each call of lib.measure.serving.measure, as (stage, its arms' names)."""
    calls, loop = [], serving.measure

    def spy(stage, serve, arms, *args, **kwargs):
        calls.append((stage.name, tuple(a.name for a in arms)))
        return loop(stage, serve, arms, *args, **kwargs)

    monkeypatch.setattr(serving, "measure", spy)
    return calls


def serve_with(monkeypatch, double: Path) -> None:
    """The seams patched for every test here: vLLM is `double`, the machine has 2 GPUs, and
    the tiny model stands in for the default one."""
    monkeypatch.setattr(serve_vllm, "PYTHON", str(double))
    monkeypatch.setattr(local_place, "cuda_device_count", lambda door: 2)
    monkeypatch.setattr(serve, "model_flavor", lambda engine: "tiny")


def two_gpus(tmp_path, monkeypatch, mode: str, graphs_log: Path | None = GRAPHS_LOG,
             wrong_answers: bool = False) -> Path:
    """Two GPUs and the vLLM double: each arm replays a real log of its kind (EP eager, EP with
    CUDA graphs, no EP); `graphs_log=None` replays the eager log for the graphs arm too;
    `wrong_answers`: the graphs arm answers lib.agreement's prompts wrongly."""
    double, _ = make_double(tmp_path, ALLGATHER_LOG, mode, graphs_log=graphs_log,
                            noep_log=NOEP_LOG, wrong_answers=wrong_answers)
    serve_with(monkeypatch, double)
    return tmp_path / "run"


def deepep_params(tmp_path: Path) -> dict:
    """deepep_v2 with the intranode contract: the NCCL site (a harmless real library) and a
    DeepEP folder."""
    return {"all2all_backend": "deepep_v2", "nccl_site": str(nccl_site(tmp_path)),
            "deepep_dir": str(tmp_path / "DeepEP")}


def statuses(stage) -> dict:
    return {g.gate: g.status for g in stage.gates}


def run_without_fail(run_dir: Path, name: str, run,
                     extra: dict | None = None) -> tuple[Stage, dict, dict]:
    """Stage `name` recorded through `run`, sealed; no gate FAILED (the failures are the message).
    Returns (the stage, its data, its gate statuses)."""
    stage = open_stage(run_dir, name, extra=extra)
    data = run(stage)
    stage.finish()
    got = statuses(stage)
    assert {n: s for n, s in got.items() if s == "FAIL"} == {}, \
        [(g.gate, g.reason) for g in stage.gates if g.status == "FAIL"]
    return stage, data, got


ONE_LEVEL = {"concurrency": "1"}  # one level where a test's point needs no second (AIPerf's
# start-up, ~6 s a cell, is most of these tests' time)
SWEEP_ONCE = {**ONE_LEVEL, "repeats": 1}  # 05's one cell: the loop, the gates, the counter


def test_serve_sweep_and_ab_on_vllm(tmp_path, monkeypatch):
    run_dir = two_gpus(tmp_path, monkeypatch, "serve")
    s04 = open_stage(run_dir, "04_serve")
    data = serve_stage.run(s04)
    s04.finish()
    got = statuses(s04)
    assert {n: s for n, s in got.items() if s != "PASS"} == {}, \
        [(g.gate, g.reason) for g in s04.gates if g.status != "PASS"]
    for name in serve_vllm.BACKEND_GATES + ("vllm_compile_mode", "nccl_init_per_rank",
                                            "chat request answers with content and usage"):
        assert got[name] == "PASS"
    assert data["engine"] == "vllm" and data["gpus"] == 2
    saved = json.loads((run_dir / "04_serve" / "vllm_serve.json").read_text())
    assert "--enable-expert-parallel" in saved["argv"] and "--enforce-eager" in saved["argv"]
    assert saved["argv"][saved["argv"].index("--all2all-backend") + 1] == \
        "allgather_reducescatter"

    loops = spy_on_the_loop(monkeypatch)
    s05, data, got = run_without_fail(run_dir, "05_sweep", sweep_stage.run, SWEEP_ONCE)
    counted = [g for g in s05.gates if g.gate.endswith("vLLM counted the generated tokens")]
    assert len(counted) == 1 and all(g.status == "PASS" for g in counted)
    assert all(g.observed >= 3 * 8 for g in counted)
    assert len(data["summary"]) == 1 and set(data["summary"]["arm"]) == {"vllm"}
    assert (run_dir / "05_sweep" / "metrics" / "repeat_1" / "c1.before.prom").exists()
    assert got["server resident memory under 1.5 GiB"] == "SKIP"

    s06, data, got = run_without_fail(run_dir, "06_multicomm", lever.run, ONE_LEVEL)
    assert got["eager+EP: vllm_compile_mode"] == "PASS"
    assert got["eager, no EP: vllm_expert_parallel_off"] == "PASS"
    assert got["EP_NUM_COMMS A/B (the kernel benchmark's K communicators)"] == "SKIP"
    assert got["cluster arms"] == "SKIP"
    assert got["graphs+EP: vllm_compile_mode"] == "PASS"
    frame = data["summary"]
    assert sorted(set(frame["arm"])) == ["vllm-eager-ep", "vllm-eager-noep", "vllm-graphs-ep"]
    assert len(frame) == 3 * 1 * 2  # arms x concurrency x repeats
    ratios = json.loads((run_dir / "06_multicomm" / "ratios.json").read_text())
    assert [(r["b"], r["concurrency"], r["n"]) for r in ratios] == [
        ("graphs+EP", 1, 2), ("eager, no EP", 1, 2)]
    assert all(r["low"] <= r["ratio"] <= r["high"] for r in ratios)
    # the arms were interleaved: repeat 2 ran them in reverse order
    order = [c for c in serving.cell_order(2, [1, 2], lever.ARMS)]
    assert [a.slug for r, c, a in order if (r, c) == (1, 1)] == \
        [a.slug for r, c, a in order if (r, c) == (2, 1)][::-1]
    stopped = [g for g in s06.gates if g.gate.endswith("server stopped")]
    assert len(stopped) == 3 and all(g.status == "PASS" for g in stopped)
    # each arm answered lib.agreement's prompts before its cells, as the baseline does
    assert got["graphs+EP answers as eager+EP"] == "PASS"
    assert got["eager, no EP answers as eager+EP"] == "PASS"
    assert asked(run_dir, "06_multicomm") == 3 * len(agreement.PROMPTS)
    # 05 and 06 measured through the one loop: 05 with its one arm, 06 with three
    assert loops == [("05_sweep", ("vLLM",)),
                     ("06_multicomm", ("eager+EP", "graphs+EP", "eager, no EP"))]
    saved = json.loads((run_dir / "06_multicomm" / "answers-vllm-graphs-ep.json").read_text())
    recorded = json.loads(ANSWERS.read_text())["arms"]["graphs"]["alone"]
    assert [a["choices"][0]["logprobs"] for a in saved] == \
        [a["choices"][0]["logprobs"] for a in recorded]

    # replay: the three stages re-computed from the transcript alone
    for name, runner in (("04_serve", serve_stage.run), ("05_sweep", sweep_stage.run),
                         ("06_multicomm", lever.run)):
        replay = open_stage(run_dir, name, replay=True, extra={
            "04_serve": None, "05_sweep": SWEEP_ONCE}.get(name, ONE_LEVEL))
        runner(replay)
        replay.finish()


def serve_then_06(run_dir: Path, extra: dict | None = None) -> tuple[Stage, dict]:
    """04, then 06 with `extra`'s parameters, recorded in run_dir against the double two_gpus
    set up; returns 06's sealed stage and its data."""
    s04 = open_stage(run_dir, "04_serve")
    serve_stage.run(s04)
    s04.finish()
    s06 = open_stage(run_dir, "06_multicomm", extra=extra)
    data = lever.run(s06)
    s06.finish()
    return s06, data


def asked(run_dir: Path, stage: str) -> int:
    """How many of lib.agreement's questions the stage sent (its transcript's POSTs)."""
    return sum(1 for line in (run_dir / "transcript.jsonl").read_text().splitlines()
               if f'"stage": "{stage}"' in line and '"kind": "http"' in line
               and "/v1/completions" in line)


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


def test_graphs_arm_refused_when_its_log_says_eager(tmp_path, monkeypatch):
    run_dir = two_gpus(tmp_path, monkeypatch, "serve", graphs_log=None)
    s06, data = serve_then_06(run_dir)
    gates = {g.gate: g for g in s06.gates}
    mode = gates["graphs+EP: vllm_compile_mode"]
    assert mode.status == "FAIL" and "Enforce eager set" in mode.reason
    assert "vllm-graphs-ep: its log does not prove" in data["skipped"]
    assert gates["serving A/B"].status == "SKIP"
    assert not [g for g in s06.gates if g.gate.startswith("aiperf ")]  # nothing measured
    stopped = [g for g in s06.gates if g.gate.endswith("server stopped")]
    assert len(stopped) == 3 and all(g.status == "PASS" for g in stopped)
    assert all(g.observed["port_listening"] is False for g in stopped)


def test_a_sweep_whose_vllm_dies_says_why_and_runs_no_more_cells(tmp_path, monkeypatch):
    """05 against a vLLM that dies at the first streamed request (the recorded crash of run
    gpu-2xh200-deepep-vllm-20261130d replayed, exit 1): `vLLM: server up through its cells`
    FAILs quoting the fatal line, the 5 cells left are SKIPs (not 5 more runs against a closed
    port), `every planned cell measured` FAILs with 1 of 6, and a replay says the same."""
    double, _ = make_double(tmp_path, ALLGATHER_LOG,
                            traffic_crash_log=DEEPEP_GRAPHS_UNDER_TRAFFIC_LOG,
                            traffic_crash_any=True)
    serve_with(monkeypatch, double)
    run_dir = tmp_path / "run"
    s04 = open_stage(run_dir, "04_serve")
    serve_stage.run(s04)
    s04.finish()
    s05 = open_stage(run_dir, "05_sweep")
    sweep_stage.run(s05)
    s05.finish()
    gates = {g.gate: g for g in s05.gates}
    died = gates["vLLM: server up through its cells"]
    assert died.status == "FAIL" and died.observed == {
        "exit_code": 1, "died_during": "aiperf vllm c1 repeat 1"}
    assert "IndexKernel.cu:111" in died.reason
    assert died.evidence[0].startswith("05_sweep/vllm.log:")
    # the step its engine core dumped as it died, quoted beside the fatal line
    assert died.reason.endswith("; EngineCore_DP1 was running a step of 135 scheduled tokens "
                                "(new prompts of 134 tokens; 2 running, 0 waiting)")
    assert len(died.evidence) == 2 and "[dump_input.py:79]" in died.evidence[1]
    skipped = [g for g in s05.gates if g.gate.endswith(": measured")]
    assert [g.status for g in skipped] == ["SKIP"] * 5
    assert all("not run: vLLM's server exited (code 1) during aiperf vllm c1 repeat 1" in g.reason
               for g in skipped)
    measured = gates["every planned cell measured"]
    assert measured.status == "FAIL" and (measured.observed, measured.expected) == (1, 6)
    aiperf_runs = [e for e in read_transcript(run_dir / "transcript.jsonl")
                   if e["stage"] == "05_sweep" and e["kind"] == "run" and "profile" in e["key"]]
    assert len(aiperf_runs) == 1
    replay = open_stage(run_dir, "05_sweep", replay=True)
    sweep_stage.run(replay)
    replay.finish()


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


DEEPEP_06 = (Path(__file__).resolve().parents[1] / "results" / "gpu-2xh200-deepep-vllm-20261130b"
             / "06_multicomm")


def serve_then_06_on_deepep_v2(tmp_path, monkeypatch, extra: dict | None = None, **double_logs):
    """04 then 06 on deepep_v2 (the intranode contract) against the vLLM double replaying
    `double_logs` beside the recorded eager+EP log; the two DeepEP servers crash as on 2x H200
    when started beside each other. Returns (run_dir, s04, s06, 06's data, the stage opener for
    a replay)."""
    double, _ = make_double(tmp_path, DEEPEP_LOG, deepep_crash_log=DEEPEP_BESIDE_DEEPEP_LOG,
                            **double_logs)
    serve_with(monkeypatch, double)
    run_dir = tmp_path / "run"
    deepep = {**deepep_params(tmp_path), **(extra or {})}

    def stage(name: str, replay: bool = False) -> Stage:
        return open_stage(run_dir, name, replay, extra=deepep)

    s04 = stage("04_serve")
    serve_stage.run(s04)
    s04.finish()
    s06 = stage("06_multicomm")
    data = lever.run(s06)
    s06.finish()
    return run_dir, s04, s06, data, stage


def test_serving_ab_06_on_deepep_v2_from_its_recorded_logs(tmp_path, monkeypatch):
    """06 as the cluster's backend runs it (deepep_v2, the intranode contract), each arm's
    server replaying the real log vLLM 0.24.0 wrote for that arm on 2x H200 (eager+EP from the
    shared fixture, graphs+EP and no EP from run gpu-2xh200-deepep-vllm-20261130b): every
    server gate holds, the three arms are measured, the no-EP arm carries the DeepEP
    environment without --all2all-backend."""
    run_dir, s04, s06, data, stage = serve_then_06_on_deepep_v2(
        tmp_path, monkeypatch, ONE_LEVEL, graphs_log=DEEPEP_06 / "vllm-graphs-ep.log",
        noep_log=DEEPEP_06 / "vllm-eager-noep.log")
    assert {g.status for g in s04.gates} == {"PASS"}, \
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


def test_only_a_server_that_exits_by_itself_fails_and_a_live_one_costs_no_call(tmp_path):
    """What the cells saw of a server, on real processes through the door: /metrics answered
    after a cell (no call, no gate); it did not while the process runs on (polled
    EXIT_WAIT_S times, no gate: the cell's own gates FAIL); the process gone with an exit code
    and nothing fatal in its log (FAIL, and the gate says the log names nothing)."""
    from types import SimpleNamespace

    run_dir = tmp_path / "run"
    stage = Stage("06_multicomm", params.resolve("06_multicomm", {"engine": "vllm"}), run_dir,
                  Door(run_dir, "06_multicomm"), None)
    stage.door.sleep = lambda seconds: None  # the waits for a hung server, not their seconds

    def server(argv, log):
        proc = stage.door.start(argv, log_path=stage.path(log))
        return SimpleNamespace(proc=proc, log_path=stage.path(log))

    def polls():
        return [e for e in read_transcript(run_dir / "transcript.jsonl") if e["kind"] == "poll"]

    running = server(["sleep", "60"], "vllm-eager-ep.log")
    try:
        alive = lib_sweep.ServerLife("eager+EP")
        for cell in ("c1", "c2"):
            alive.watch(stage, running, cell, {"status": 200})
        assert polls() == [] and alive.exit_gate(stage, running) is None
        hung = lib_sweep.ServerLife("graphs+EP, start 1")
        hung.watch(stage, running, "c3", {"status": None})
        assert len(polls()) == lib_sweep.EXIT_WAIT_S
        assert hung.exit_code is None and hung.exit_gate(stage, running) is None
    finally:
        stage.door.stop(running.proc)
    gone = server(["sh", "-c", "echo loading; exit 3"], "vllm-graphs-ep-2.log")
    for _ in range(100):  # the shell is quick; the watch below must see its exit
        if stage.door.poll(gone.proc) is not None:
            break
        time.sleep(0.05)
    dead = lib_sweep.ServerLife("graphs+EP, start 2")
    dead.watch(stage, gone, "c4", {"status": None})
    gate = dead.exit_gate(stage, gone)
    assert gate.status == "FAIL" and gate.observed == {"exit_code": 3, "died_during": "c4"}
    assert gate.gate == "graphs+EP, start 2: server up through its cells"
    assert "its log names no fatal error" in gate.reason
    assert gate.evidence == ["06_multicomm/vllm-graphs-ep-2.log"]


def test_deepep_arms_are_served_one_at_a_time_and_the_repeats_alternate_them():
    eager, graphs, noep = lever.ARMS
    assert serving.exclusive_arms(lever.ARMS, "deepep_v2") == (eager, graphs)
    assert serving.exclusive_arms(lever.ARMS, "allgather_reducescatter") == ()
    # 05's backend A/B: one DeepEP server beside an allgather one, side by side as before
    backends = ab.backend_arms(["allgather_reducescatter", "deepep_v2"])
    assert serving.exclusive_arms(backends, "allgather_reducescatter") == ()
    order = serving.cell_order(2, [4, 32], lever.ARMS, by_arm=True)
    assert [(r, c, arm.name) for r, c, arm in order] == [
        (1, 4, "eager+EP"), (1, 32, "eager+EP"), (1, 4, "graphs+EP"), (1, 32, "graphs+EP"),
        (1, 4, "eager, no EP"), (1, 32, "eager, no EP"),
        (2, 4, "eager, no EP"), (2, 32, "eager, no EP"), (2, 4, "graphs+EP"),
        (2, 32, "graphs+EP"), (2, 4, "eager+EP"), (2, 32, "eager+EP")]
    side_by_side = serving.cell_order(2, [4, 32], lever.ARMS)
    assert [(r, c, arm.name) for r, c, arm in side_by_side][:4] == [
        (1, 4, "eager+EP"), (1, 4, "graphs+EP"), (1, 4, "eager, no EP"), (1, 32, "eager+EP")]
    assert sorted(map(str, order)) == sorted(map(str, side_by_side))  # the same cells
