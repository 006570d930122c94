"""What the vLLM-engine stage tests share (tests/test_vllm_stages.py, test_vllm_answers.py,
test_vllm_deepep_06.py): stages 04, 05 and 06 with engine 'vllm', end to end on this CPU
machine: real AIPerf, real HTTP, the real door and evidence, against the vLLM double of
tests/test_serve_vllm.py (a real vLLM 0.24.0 log replayed, OpenAI answers streamed, /metrics
counted). What cannot exist here is patched at its seam only: the GPU count (2) and the model
flavor (the tiny model stands in for the 1.2 B-parameter one; the double reads its expert count
from config.json). Three files, not one: pytest-xdist gives a worker a file at a time
(--dist loadfile), and these tests take one to two minutes each (AIPerf's start-up, ~9 s a cell
on an idle machine, 25 s and more beside make test's other workers: each test runs the fewest
cells its assertions need)."""
from __future__ import annotations

from pathlib import Path

import pytest

from lib.core.door import Door
from lib.core.stage import Stage
from lib.engines import transformers as serve
from lib.engines import vllm_server as serve_vllm
from lib.measure import serving
from lib.places import local as local_place
from lib.stages import lever, registry as params, serve as serve_stage
from tests.test_serve_vllm import (ALLGATHER_LOG, DEEPEP_BESIDE_DEEPEP_LOG, DEEPEP_LOG, FIXTURES,
                                   GRAPHS_LOG, NOEP_LOG, make_double, nccl_site)


NEEDS = [  # each test file's pytestmark
    pytest.mark.skipif(not FIXTURES.is_dir(), reason=f"{FIXTURES} absent"),
    pytest.mark.skipif(not Path(".venv-aiperf/bin/aiperf").exists(),
                       reason="AIPerf's venv (.venv-aiperf) is not installed: make venv"),
]


# prompt_corpus random: AIPerf tokenizes no 5 MB corpus at each cell's start (lib.measure.sweep)
SMALL = {"engine": "vllm", "concurrency": "1,2", "request_count": 3, "warmup_requests": 1,
         "input_tokens": 16, "output_tokens": 8, "server_timeout_s": 60, "ab_repeats": 2,
         "prompt_corpus": "random"}


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
