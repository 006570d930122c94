"""TensorRT-LLM through the engine protocol: the public reproduction's launch as argv (mpirun from
the leader, an sshd on every other node), and the gates its real logs earn (R's TensorRT-LLM
0.21.0 serves on 2x p5en, ../shared/fixtures/public-repro/results/trtllm-deepep-dropin-20260707/),
with their FAIL paths on copies of those logs changed one line at a time. Never run here."""
from __future__ import annotations

import pytest

from lib.core.door import REPO_ROOT
from lib.core.errors import ParameterError
from lib.engines import catalog, trtllm
from lib.engines.base import EngineSpec
from lib.stages import registry

RECORDED = REPO_ROOT.parent / "shared" / "fixtures" / "public-repro" / "results" / \
    "trtllm-deepep-dropin-20260707"
SHIM = RECORDED / "trtllm" / "provider_evidence.log"
SERVE_HEAD = RECORDED / "trtllm" / "serve_log_head.log"
SEAM = RECORDED / "trtllm-native-seam" / "seam_evidence.log"
LEADER = dict(model="Qwen/Qwen3-30B-A3B-FP8", role="leader", nodes=2, gpus_per_node=8,
              rendezvous="trtllm-0.trtllm.ns.svc", backend="deepep_v2")


def gates_of(text: str, name: str = "trtllm.log") -> dict[str, dict]:
    got = catalog.engine("trtllm").log_gates(text, {name: text}, EngineSpec(**LEADER),
                                             log_name=name, evidence=[name], api_servers=8)
    return {g["gate"]: g for g in got}


def test_the_leader_launches_every_rank_through_mpirun_and_the_workers_wait_in_sshd():
    argv, env = catalog.engine("trtllm").command(EngineSpec(**LEADER))
    assert argv[:4] == ["mpirun", "--allow-run-as-root", "-np", "16"]
    assert argv[argv.index("-H") + 1] == "trtllm-0.trtllm.ns.svc:8,trtllm-1.trtllm.ns.svc:8"
    serve = argv[argv.index("trtllm-llmapi-launch"):]
    assert serve[:4] == ["trtllm-llmapi-launch", "trtllm-serve", "serve", LEADER["model"]]
    assert serve[serve.index("--tp_size") + 1] == serve[serve.index("--ep_size") + 1] == "16"
    forwarded = {argv[i + 1] for i, a in enumerate(argv) if a == "-x"}
    assert forwarded == set(env)  # every variable reaches every rank
    assert env["TRTLLM_CAN_USE_DEEP_EP"] == "1" and env["NCCL_DEBUG"] == "INFO"
    worker, worker_env = catalog.engine("trtllm").command(EngineSpec(**{**LEADER,
                                                                       "role": "worker",
                                                                       "start_rank": 8}))
    assert worker == ["/usr/sbin/sshd", "-D", "-e", "-p", "2222"] and worker_env == env
    # a backend its lanes do not carry is refused by the stage's model, before any rendering
    # (the leader pod's address is its place's: <name>-0.<service>..., its siblings the hosts)
    with pytest.raises(ParameterError, match="'all2all_backend'.*deepep_v2 with engine trtllm"):
        registry.resolve("04_serve", {"context": "plan", "engine": "trtllm",
                                      "all2all_backend": "deepep_low_latency"})


@pytest.mark.parametrize("recorded, lane", [(SHIM, "trtllm-comm-bridge"),
                                            (SEAM, "deep-ep-v2-seam")])
def test_the_recorded_serves_pass_every_gate(recorded, lane):
    got = gates_of(recorded.read_text())
    assert {n: g["status"] for n, g in got.items()} == {
        "trtllm_alltoall_method_deepep": "PASS", "trtllm_deepep_rank_per_rank": "PASS",
        "efa_provider_per_rank": "PASS", "trtllm_no_executor_error": "PASS"}
    assert got["trtllm_deepep_rank_per_rank"]["observed"] == {
        "ranks": list(range(16)), "missing": [], "lanes": [lane]}
    assert got["efa_provider_per_rank"]["observed"]["efa_processes"] == 16


def without(text: str, needle: str) -> str:
    lines = text.splitlines(keepends=True)
    hit = next(i for i, line in enumerate(lines) if needle in line)
    return "".join(lines[:hit] + lines[hit + 1:])


@pytest.mark.parametrize("change, failing, said", [
    (lambda t: without(t, "rank=7/16"), "trtllm_deepep_rank_per_rank", "rank(s) 7 of 16"),
    (lambda t: t.replace("<AlltoallMethodType.DeepEP: 2>", "<AlltoallMethodType.NotEnabled: 0>"),
     "trtllm_alltoall_method_deepep", "AlltoallMethodType.NotEnabled"),
    (lambda t: t.replace("Selected provider is efa, fabric is efa-direct",
                         "Selected provider is tcp;ofi_rxm, fabric is tcp", 1),
     "efa_provider_per_rank", "tcp;ofi_rxm"),
    (lambda t: t.rstrip("\n") + "\n[07/07/2026-07:01:02] [TRT-LLM] [E] Executor worker returned error\n",
     "trtllm_no_executor_error", "1 executor error line(s)"),
])
def test_one_changed_line_fails_its_gate_alone(change, failing, said):
    got = gates_of(change(SHIM.read_text()))
    assert sorted(n for n, g in got.items() if g["status"] == "FAIL") == [failing]
    assert said in got[failing]["reason"], got[failing]["reason"]


def test_its_first_fatal_line_is_not_the_watcher_s_own_grep():
    engine = catalog.engine("trtllm")
    assert engine.first_fatal(SERVE_HEAD.read_text()) is None  # '+ grep ... returned error'
    text = SHIM.read_text().rstrip("\n") + "\nRuntimeError: CUDA error: an illegal memory access was encountered\n"
    assert engine.first_fatal(text).startswith("RuntimeError: CUDA error: an illegal memory")


def test_its_pin_set_is_the_public_reproduction_s_and_cited():
    p = registry.resolve("04_serve", {"context": "plan", "engine": "trtllm"})
    assert p["pin_set"] == "trtllm-0.21.0"
    assert trtllm.TrtllmEngine.level.startswith("rendered and log-gated")
    with pytest.raises(ParameterError, match="'pin_set'.*pins trtllm"):
        registry.resolve("04_serve", {"context": "plan", "engine": "trtllm",
                                      "pin_set": "current"})
