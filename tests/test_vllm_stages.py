"""Stages 04, 05 and 06 with engine 'vllm' against the vLLM double (tests/vllm_stage_kit.py
says how): the allgather serve, sweep and A/B with their replay, its graphs arm answering
otherwise than the baseline; a graphs arm whose log says eager; a sweep whose server dies; what a
cell sees of a server; the DeepEP arms' order."""
from __future__ import annotations

import json
import time

from lib.core.door import Door, read_transcript
from lib.core.stage import Stage
from lib.engines import vllm_server as serve_vllm
from lib.measure import agreement, sweep as lib_sweep, serving
from lib.publish import report
from lib.stages import ab, lever, registry as params, serve as serve_stage, sweep as sweep_stage
from tests.test_serve_vllm import (
    ALLGATHER_LOG, ANSWERS, DEEPEP_GRAPHS_UNDER_TRAFFIC_LOG, make_double)
from tests.vllm_stage_kit import (
    NEEDS, open_stage, spy_on_the_loop, serve_with, two_gpus, statuses, run_without_fail,
    ONE_LEVEL, SWEEP_ONCE, serve_then_06, asked)

pytestmark = NEEDS


def test_serve_sweep_and_ab_on_vllm(tmp_path, monkeypatch):
    """04, 05 and 06 on allgather_reducescatter, each gate as it should be, and their replay.
    06's graphs arm answers each of lib.agreement's prompts with the recorded answer to the next
    one (as a serve whose MoE computes something else would): `graphs+EP answers as eager+EP`
    FAILs naming the prompts and positions, the only FAIL; the no-EP arm PASSes; the throughput
    is measured and gated as before, so the FAIL stands beside its numbers; the replay gives the
    same gates. (One 06 for both: its six AIPerf cells are most of this test's time; the graphs
    arm's answer gate PASSing is tests/test_vllm_deepep_06.py's.)"""
    run_dir = two_gpus(tmp_path, monkeypatch, "serve", wrong_answers=True)
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

    s06 = open_stage(run_dir, "06_multicomm", extra=ONE_LEVEL)
    data = lever.run(s06)
    s06.finish()
    got = statuses(s06)
    assert {n: s for n, s in got.items() if s == "FAIL"} == {
        "graphs+EP answers as eager+EP": "FAIL"}, \
        [(g.gate, g.reason) for g in s06.gates if g.status == "FAIL"]
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
    # each arm answered lib.agreement's prompts before its cells, as the baseline does; the
    # graphs arm otherwise, and its gate says where
    gates = {g.gate: g for g in s06.gates}
    wrong = gates["graphs+EP answers as eager+EP"]
    assert wrong.reason.startswith("prompt 0: position 0: only ")
    assert wrong.observed["agree"] < wrong.observed["prompts"] == len(agreement.PROMPTS)
    assert wrong.evidence == ["06_multicomm/answers-vllm-eager-ep.json",
                              "06_multicomm/answers-vllm-graphs-ep.json"]
    assert got["eager, no EP answers as eager+EP"] == "PASS"
    assert asked(run_dir, "06_multicomm") == 3 * len(agreement.PROMPTS)
    # answer_prompts 0 (nothing asked, no answer gate) is what the runs recorded before the
    # check replay with (gpu-2xh200-vllm-20261201's 06, in make nbval): not run again here
    book = "\n".join(report.vllm_sections(run_dir))
    assert "graphs+EP answers as eager+EP: **FAIL** (" in book
    assert "eager, no EP answers as eager+EP: **PASS** (8 of 8 prompts" in book
    # 05 and 06 measured through the one loop: 05 with its one arm, 06 with three
    assert loops == [("05_sweep", ("vLLM",)),
                     ("06_multicomm", ("eager+EP", "graphs+EP", "eager, no EP"))]
    # what each arm answered is saved as it came: the eager one as recorded, the graphs one
    # each prompt's next recorded answer
    recorded = json.loads(ANSWERS.read_text())["arms"]
    for slug, arm, shift in (("eager-ep", "eager", 0), ("graphs-ep", "graphs", 1)):
        saved = json.loads((run_dir / "06_multicomm" / f"answers-vllm-{slug}.json").read_text())
        want = recorded[arm]["alone"][shift:] + recorded[arm]["alone"][:shift]
        assert [a["choices"][0]["logprobs"] for a in saved] == \
            [a["choices"][0]["logprobs"] for a in want]

    # replay: the three stages re-computed from the transcript alone, 06 with the same gates
    for name, runner in (("04_serve", serve_stage.run), ("05_sweep", sweep_stage.run),
                         ("06_multicomm", lever.run)):
        replay = open_stage(run_dir, name, replay=True, extra={
            "04_serve": None, "05_sweep": SWEEP_ONCE}.get(name, ONE_LEVEL))
        runner(replay)
        replay.finish()
    assert {g.gate: g.status for g in replay.gates} == {g.gate: g.status for g in s06.gates}


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
