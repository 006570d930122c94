"""SGLang and TensorRT-LLM on the real two-node Slurm (tests/slurmlocal.py), 04 and 05 end to end.

The nodes declare 8 GPUs and 8 CPUs each (Gres=gpu:8 over stand-in devices; slurmd takes the
configured CPUs), so the allocation, the steps and their `--gres` are Slurm's own answers. What
no node here can run is the engine: each step's program is tests/engine_double.py, which prints
the argv the engine would have run and the log it would have printed (SGLang: composed from its
0.5.19 source's formats, tests/compose.py; TensorRT-LLM: the public reproduction's recorded
mpirun output of its 16 ranks, printed by task 0), and rank 0 answers the OpenAI API (the
recorded bodies of a vLLM serve; streamed chat as OpenAI's events) for the readiness probe, 04's
request and 05's real AIPerf, which runs as a step of the allocation as on a cluster. The model
is the pinned hub model; its cache holds its config and, as its tokenizer, one trained here
(lib.engines.models.train_tokenizer: the hub is unreachable), at the pinned revision.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from lib.core import evidence
from lib.core.door import REPO_ROOT, read_transcript
from lib.engines.sglang import SglangEngine
from lib.engines.trtllm import TrtllmEngine
from lib.stages import serve as stage04
from lib.stages import sweep as stage05
from tests import compose
from tests.kube_env import RECORDED_RUN, model_config
from tests.test_slurm_place import (VENV, _calls, assert_nothing_left, gres_cluster, needs_gres,
                                    needs_slurm, slurm_stage)

DOUBLE = REPO_ROOT / "tests" / "engine_double.py"
PYTHON = REPO_ROOT / ".venv" / "bin" / "python"
TRTLLM_RECORDED = compose.TRTLLM_RECORDED
SWEEP = {"concurrency": "1", "repeats": 1, "request_count": 4, "requests_per_slot": 0,
         "warmup_requests": 1, "warmup_full_batch": False, "input_tokens": 16,
         "output_tokens": 8}

pytestmark = [needs_slurm, needs_gres]


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        with gres_cluster(tmp_path_factory, mp, 8, cpus=8) as cluster:
            yield cluster


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory):
    """The nodes' model cache (HF_HOME): the pinned model's snapshot, its config (the recorded
    serve's, 128 experts top-8) and a tokenizer trained here in place of the hub's."""
    from lib.engines.models import train_tokenizer

    cache = tmp_path_factory.mktemp("hf")
    p = slurm_stage(tmp_path_factory.mktemp("probe"), "04_serve", {"venv": VENV, "engine": "sglang"}).params
    snapshot = (cache / "hub" / f"models--{p['model'].replace('/', '--')}" / "snapshots"
                / p["model_revision"])
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(
        model_config(RECORDED_RUN / "model_config.json", experts=128, top_k=8)))
    train_tokenizer(p["seed"], 512).save_pretrained(snapshot)
    return cache


def stand_in(monkeypatch, engine_class, logs: Path) -> None:
    """The engine's rendered command, run by tests/engine_double.py printing `logs`' files."""
    real = engine_class.command

    def command(self, spec):
        argv, env = real(self, spec)
        return [str(PYTHON), str(DOUBLE), str(logs), str(RECORDED_RUN), "--", *argv], env

    monkeypatch.setattr(engine_class, "command", command)


def trtllm_logs(dest: Path, drop=lambda line: False) -> Path:
    """Task 0's log: the recorded mpirun output of all 16 ranks, less the lines `drop` names."""
    dest.mkdir(parents=True)
    kept = [l for l in TRTLLM_RECORDED.read_text().splitlines(keepends=True) if not drop(l)]
    (dest / "recorded-trtllm-provider_evidence-task0.log").write_text("".join(kept))
    return dest


def given(engine: str, cache: Path, **more) -> dict:
    return {"venv": VENV, "engine": engine, "server_timeout_s": 60.0,
            "model_cache_dir": str(cache), "slurm_mpi": "none", **more}


def run(run_dir: Path, name: str, params: dict):
    stage = slurm_stage(run_dir, name, params)
    data = (stage04 if name == "04_serve" else stage05).run(stage)
    stage.finish()
    return stage, data


def failing(stage) -> dict[str, str]:
    return {g.gate: g.reason for g in stage.gates if g.status == "FAIL"}


def test_04_trtllm_is_one_mpi_world_step_its_recorded_log_gated(nodes, hub_cache, tmp_path,
                                                                 monkeypatch):
    """-p engine trtllm: one step over both nodes, a task per GPU (--ntasks-per-node=8, 16
    tasks, the --mpi plugin `slurm_mpi`: 'none' here, where no rank talks MPI), every line
    labelled with its task; the recorded log passes every gate. The same log without rank 7's
    rank line, or without rank 0's DeepEP choice, FAILs that gate alone; nothing left."""
    stand_in(monkeypatch, TrtllmEngine, trtllm_logs(tmp_path / "logs"))
    stage, data = run(tmp_path / "run", "04_serve", given("trtllm", hub_cache))
    assert failing(stage) == {}
    got = {g.gate for g in stage.gates}
    assert {"trtllm_alltoall_method_deepep", "trtllm_deepep_rank_per_rank",
            "efa_provider_per_rank", "trtllm_no_executor_error", "server stopped",
            "chat request answers with content and usage"} <= got
    (step,) = _calls(tmp_path / "run", "04_serve", "start")
    for word in ("--nodes=2", "--ntasks-per-node=8", "--ntasks=16", "--gres=gpu:8",
                 "--mpi=none", "--label", "trtllm-llmapi-launch"):
        assert word in step, word
    log = (stage.dir / "trtllm.log").read_text()
    assert log.count("engine-double: would run:") == 16  # one per task, each labelled
    assert "15: engine-double: would run:" in log and "--tp_size 16" in log
    assert data["gpus"] == 16
    assert_nothing_left(nodes)

    for tag, drop, gate_name, said in (
            ("rank7", lambda l: "rank=7/16" in l, "trtllm_deepep_rank_per_rank",
             "rank(s) 7 of 16"),
            ("method", lambda l: "CutlassFusedMoE selects" in l,
             "trtllm_alltoall_method_deepep", "no 'CutlassFusedMoE selects")):
        stand_in(monkeypatch, TrtllmEngine, trtllm_logs(tmp_path / f"logs-{tag}", drop))
        stage, _ = run(tmp_path / f"run-{tag}", "04_serve", given("trtllm", hub_cache))
        assert list(failing(stage)) == [gate_name] and said in failing(stage)[gate_name]
        assert_nothing_left(nodes)


@pytest.mark.parametrize("engine", ["sglang", "trtllm"])
def test_05_sweeps_through_aiperf_as_a_step_beside_the_engine(engine, nodes, hub_cache,
                                                              tmp_path, monkeypatch):
    """04 then 05: the engine's steps, then real AIPerf as a step of the same kind of
    allocation on node 0 against node 0's address, streaming, its tokenizer the pinned
    revision's from the engine's cache alone (HF_HOME, --tokenizer-revision, HF_HUB_OFFLINE);
    every cell measured by the same reader and gates; the serve's logs gated again; nothing
    left."""
    if engine == "sglang":
        stand_in(monkeypatch, SglangEngine,
                 compose.compose_sglang_pods(tmp_path / "logs")[0].parent)
    else:
        stand_in(monkeypatch, TrtllmEngine, trtllm_logs(tmp_path / "logs"))
    run_dir = tmp_path / "run"
    s04, _ = run(run_dir, "04_serve", given(engine, hub_cache))
    assert failing(s04) == {}
    stage, data = run(run_dir, "05_sweep", given(engine, hub_cache, **SWEEP))
    assert failing(stage) == {}
    gates = {g["gate"]: g for g in evidence.read_gates(stage.dir)}
    assert gates[f"aiperf {engine} c1 repeat 1: AIPerf exit 0"]["status"] == "PASS"
    assert gates["the same model 04_serve served"]["status"] == "PASS"
    assert list(data["summary"]["requests_completed"]) == [4]
    aiperf = [c for c in _calls(run_dir, "05_sweep") if c[0] == "srun"]
    assert len(aiperf) == 1 and all("--tokenizer-revision" in a for a in aiperf)
    assert all(any(a.startswith("HF_HOME=") for a in argv) for argv in aiperf)
    assert all("HF_HUB_OFFLINE=1" in argv for argv in aiperf)  # the cache alone, never the hub
    assert '{"ignore_eos": true}' in aiperf[0]
    pids = [e["pid"] for e in read_transcript(run_dir / "transcript.jsonl")
            if e["stage"] == "05_sweep" and e["kind"] == "start"]
    assert_nothing_left(nodes, pids)
