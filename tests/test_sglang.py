"""SGLang through the engine protocol: its argv and env as SGLang 0.5.19's source reads them, the
gates its logs earn (composed from its own formats: tests/compose.py says which), the parameter
rules (its pin set, its backends), its SKIP where a place cannot run it, and its serve planned on
kube and on slurm. Never run: SGLang needs GPUs and ~1 GB of wheels beyond the image."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from lib.core.door import REPO_ROOT, Door
from lib.core.errors import ParameterError
from lib.core.stage import Stage
from lib.engines import catalog, sglang
from lib.engines.base import EngineSpec, process_regex
from lib.places import Unsupported
from lib.places.local import LocalPlace
from lib.stages import registry
from tests import compose

LEADER = dict(model="Qwen/Qwen3-30B-A3B-FP8", role="leader", nodes=2, gpus_per_node=8,
              rendezvous="sglang-0.sglang.ns.svc", rpc_port=29570, revision="d" * 40,
              backend="deepep_v2")


def spec(**given) -> EngineSpec:
    return EngineSpec(**{**LEADER, **given})


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_every_node_renders_the_same_serve_with_its_own_node_rank():
    leader, env = sglang.SglangEngine().command(spec())
    worker, worker_env = sglang.SglangEngine().command(spec(role="worker", start_rank=8))
    assert leader[:2] == ["sglang", "serve"]
    for argv in (leader, worker):
        assert [flag(argv, f) for f in ("--tp-size", "--dp-size", "--ep-size")] == ["16"] * 3
        assert "--enable-dp-attention" in argv
        assert flag(argv, "--moe-a2a-backend") == "deepep_v2"
        assert flag(argv, "--deepep-v2-mode") == "hybrid"  # across nodes
        assert flag(argv, "--moe-runner-backend") == "deep_gemm"  # the only one deepep_v2 takes
        assert flag(argv, "--dist-init-addr") == "sglang-0.sglang.ns.svc:29570"
        assert flag(argv, "--host") == "0.0.0.0" and flag(argv, "--port") == "8000"
        assert flag(argv, "--revision") == "d" * 40 and "--enable-metrics" in argv
        assert "--tp" not in argv and "--dp" not in argv  # abbreviations, not aliases
    assert (flag(leader, "--node-rank"), flag(worker, "--node-rank")) == ("0", "1")
    assert env == worker_env
    # the budget start-up checks: chunked prefill / DP ranks <= the per-rank dispatch capacity
    per_rank = int(env[sglang.DISPATCH_TOKENS_ENV])
    assert int(flag(leader, "--chunked-prefill-size")) // 16 == per_rank == 1024
    assert env["NCCL_DEBUG"] == "INFO" and env["NCCL_NET_PLUGIN"].endswith("libnccl-net-ofi.so")
    assert "--disable-cuda-graph" in leader
    assert "--disable-cuda-graph" not in sglang.sglang_argv(spec(enforce_eager=False))


def test_one_machine_serves_direct_and_the_guide_s_allgather_is_sglang_s_none():
    one = sglang.sglang_argv(spec(role="local", nodes=1, rendezvous=None))
    assert flag(one, "--deepep-v2-mode") == "direct" and "--nnodes" not in one
    # the stage's deepep_v2_mode, where it names one, is the mode asked (and gated)
    asked = spec(deepep_v2_mode="direct")
    assert flag(sglang.sglang_argv(asked), "--deepep-v2-mode") == "direct"
    assert sglang.mode_asked(asked) == "direct"
    plain = sglang.sglang_argv(spec(backend="allgather_reducescatter"))
    assert flag(plain, "--moe-a2a-backend") == "none"
    assert "--deepep-v2-mode" not in plain and "--moe-runner-backend" not in plain
    image = sglang.sglang_argv(spec(python="python3"))
    assert image[:3] == ["python3", "-m", "sglang.launch_server"]
    assert process_regex(sglang.SglangEngine().process_words(spec())) == "[s]glang serve"


@pytest.mark.parametrize("given, named", [
    ({"all2all_backend": "deepep_low_latency"}, "all2all_backend"),
    ({"ab_backends": "deepep_v2,deepep_low_latency"}, "ab_backends"),
    ({"transport": "carrier-pigeon"}, "transport"),
])
def test_a_serve_sglang_cannot_run_is_refused_naming_the_parameter(given, named):
    """Refused by the stage's model before anything is rendered (what the place decides, the
    role, start rank and rendezvous of each node, is rendered as given)."""
    stage = "05_sweep" if "ab_backends" in given else "04_serve"
    with pytest.raises(ParameterError, match=f"'{named}'"):
        registry.resolve(stage, {"context": "plan", "engine": "sglang", **given})


def logs_of(paths) -> dict[str, str]:
    return {p.name: p.read_text() for p in paths}


def gates_of(logs: dict[str, str], **given) -> dict[str, dict]:
    names = list(logs)
    got = sglang.SglangEngine().log_gates(logs[names[0]], logs, spec(**given),
                                          log_name=names[0], evidence=names, api_servers=8)
    return {g["gate"]: g for g in got}


def test_its_logs_prove_the_backend_every_rank_s_buffer_and_efa(tmp_path):
    got = gates_of(logs_of(compose.compose_sglang_pods(tmp_path)))
    assert {n: g["status"] for n, g in got.items()} == {
        "sglang_moe_a2a_backend": "PASS", "sglang_deepep_v2_mode_per_node": "PASS",
        "sglang_elastic_buffer_per_rank": "PASS", "sglang_server_fired_up": "PASS",
        "nccl_init_per_rank": "PASS", "efa_provider_per_rank": "PASS"}
    assert got["sglang_elastic_buffer_per_rank"]["observed"]["ranks"] == list(range(16))
    assert "composed-sglang-node0.log:" in got["sglang_moe_a2a_backend"]["evidence"][0]


@pytest.mark.parametrize("variant, failing, said", [
    ({"drop_buffer_rank": 11}, "sglang_elastic_buffer_per_rank", "rank(s) 11 of 16"),
    ({"drop_provider_rank": 3}, "efa_provider_per_rank", "rank(s) 3 of 16"),
    ({"mode": "direct"}, "sglang_deepep_v2_mode_per_node", "not hybrid"),
    ({"backend": "allgather_reducescatter"}, "sglang_moe_a2a_backend", "'none'"),
])
def test_a_rank_or_a_node_that_did_not_do_what_was_asked_fails_its_gate(tmp_path, variant,
                                                                        failing, said):
    got = gates_of(logs_of(compose.compose_sglang_pods(tmp_path, **variant)))
    failed = sorted(n for n, g in got.items() if g["status"] == "FAIL")
    assert failing in failed, failed
    assert said in got[failing]["reason"], got[failing]["reason"]
    if "mode" in variant:  # the buffers then say allow_hybrid_mode=False too
        assert failed == ["sglang_deepep_v2_mode_per_node", "sglang_elastic_buffer_per_rank"]
    elif "backend" not in variant:
        assert failed == [failing]


def test_a_none_serve_that_built_a_deepep_buffer_fails(tmp_path):
    logs = logs_of(compose.compose_sglang_pods(tmp_path))
    got = gates_of({n: t.replace("'moe_a2a_backend': 'deepep_v2'", "'moe_a2a_backend': 'none'")
                    for n, t in logs.items()}, backend="allgather_reducescatter")
    assert got["sglang_moe_a2a_backend"]["status"] == "PASS"
    assert got["sglang_no_deepep_buffer"]["status"] == "FAIL"
    assert "16 ElasticBuffer line(s)" in got["sglang_no_deepep_buffer"]["reason"]
    plain = gates_of(logs_of(compose.compose_sglang_pods(
        tmp_path / "none", backend="allgather_reducescatter")), backend="allgather_reducescatter")
    assert plain["sglang_no_deepep_buffer"]["status"] == "PASS"


def test_a_crashed_rank_is_its_first_fatal_line_and_nothing_is_ready(tmp_path):
    logs = logs_of(compose.compose_sglang_pods(tmp_path, crash_rank=11))
    engine = catalog.engine("sglang")
    worker = logs["composed-sglang-node1.log"]
    assert engine.first_fatal(worker).startswith(
        "[2026-12-03 10:00:31 DP11 TP11 EP11] Scheduler hit an exception")
    assert engine.first_fatal(logs["composed-sglang-node0.log"]).endswith(
        "Received sigquit from a child process. It usually means the child failed.")
    assert engine.first_fatal("[2026-12-03 10:00:01] all is well") is None
    got = gates_of(logs)
    assert got["sglang_server_fired_up"]["status"] == "FAIL"
    assert not engine.settled(logs["composed-sglang-node0.log"], 8)


def test_the_registry_picks_its_pin_set_and_refuses_what_it_cannot_serve():
    p = registry.resolve("04_serve", {"context": "plan", "engine": "sglang"})
    assert p["pin_set"] == "sglang-0.5.19" and p["all2all_backend"] == "deepep_v2"
    assert registry.resolve("04_serve", {"context": "plan"})["pin_set"] == "seed-2026-07"
    with pytest.raises(ParameterError, match="'pin_set'.*a pin set that pins sglang "
                                             r"\(sglang-0.5.19\)"):
        registry.resolve("04_serve", {"context": "plan", "engine": "sglang",
                                      "pin_set": "seed-2026-07"})
    with pytest.raises(ParameterError, match="'pin_set'.*pins vllm"):
        registry.resolve("04_serve", {"context": "kube", "engine": "vllm",
                                      "pin_set": "sglang-0.5.19"})
    with pytest.raises(ParameterError, match="'all2all_backend'.*deepep_v2, "
                                             "allgather_reducescatter with engine sglang"):
        registry.resolve("04_serve", {"context": "plan", "engine": "sglang",
                                      "all2all_backend": "deepep_high_throughput"})
    with pytest.raises(ParameterError, match="'engine'.*sglang, transformers, trtllm, vllm"):
        registry.resolve("04_serve", {"context": "plan", "engine": "trt"})


def test_the_local_place_says_it_cannot_serve_it_as_a_skip(tmp_path):
    stage = Stage("04_serve", registry.resolve("04_serve", {"context": "local",
                                                            "engine": "sglang"}),
                  tmp_path, Door(tmp_path, "04_serve"), None)
    with pytest.raises(Unsupported, match="serves with transformers, vllm, not engine 'sglang'"):
        LocalPlace(stage).model("sglang")


def _papermill(tmp_path, *given: str) -> subprocess.CompletedProcess:
    tmp_path.mkdir(parents=True, exist_ok=True)
    return subprocess.run(
        [sys.executable, "-m", "papermill", str(REPO_ROOT / "notebooks" / "04_serve.ipynb"),
         str(tmp_path / "out.ipynb"), "--cwd", str(REPO_ROOT / "notebooks"),
         "-p", "context", "plan", "-p", "nodes", "2", "-p", "engine", "sglang",
         "-p", "results_dir", str(tmp_path / "results"), *given],
        capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=300)


def test_papermill_plans_the_sglang_serve_for_kube_and_for_slurm(tmp_path):
    """The issue's commands: 04 with engine sglang, planned for kube (a StatefulSet that
    kubernetes-validate --strict passes, node ranks 0 and 1, the container named by its
    engine) and for slurm (one shellchecked step per node)."""
    done = _papermill(tmp_path / "kube", "-p", "run_id", "kube")
    assert done.returncode == 0, done.stderr[-3000:]
    stage_dir = tmp_path / "kube" / "results" / "kube" / "04_serve"
    gates = {g["gate"]: g["status"] for g in json.loads((stage_dir / "gates.json").read_text())}
    assert gates["sglang: manifests valid (kubernetes-validate --strict 1.36)"] == "PASS"
    objects = list(yaml.safe_load_all((stage_dir / "manifests" / "sglang.yaml").read_text()))
    sts = next(o for o in objects if o["kind"] == "StatefulSet")
    container = sts["spec"]["template"]["spec"]["containers"][0]
    assert container["name"] == "sglang"
    script = container["command"][2]
    assert "--node-rank 0" in script and "--node-rank 1" in script
    assert script.count("--moe-a2a-backend deepep_v2") == 2
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env[sglang.DISPATCH_TOKENS_ENV] == "1024"
    done = _papermill(tmp_path / "slurm", "-p", "run_id", "slurm", "-p", "plan_for", "slurm")
    assert done.returncode == 0, done.stderr[-3000:]
    stage_dir = tmp_path / "slurm" / "results" / "slurm" / "04_serve"
    gates = {g["gate"]: g["status"] for g in json.loads((stage_dir / "gates.json").read_text())}
    assert [s for g, s in gates.items() if "shellcheck" in g] == ["PASS"] * 3
    node1 = (stage_dir / "scripts" / "02-the-server-on-node-1.sh").read_text()
    assert "sglang.launch_server" in node1 and "--node-rank 1 --dist-init-addr node-0:" in node1
    run = json.loads((tmp_path / "slurm" / "results" / "slurm" / "run.json").read_text())
    assert run["parameters"]["pin_set"] == "sglang-0.5.19"
