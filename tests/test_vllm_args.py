"""lib.vllm_args: the one builder of vLLM's argv and env (leader, worker, local).

It checks nothing it is given: a person's value (the backend, the communicators, the transport,
the model's divisibility over the EP size, the NCCL site DeepEP needs) is refused by the stage's
parameter model before any effect (lib.stages.registry.resolve, tested here through it), and
what a place decides (the role, ports, DP sizes, start ranks, the rendezvous) is rendered as it
is given."""

from pathlib import Path

import pytest

from lib.roots import pins
from lib.core.errors import ParameterError
from lib.engines.transport import transport_env
from lib.engines.vllm_args import (BACKENDS, HYBRID_MODE_VAR, REMOVED_BACKENDS, vllm_serve,
                                    worker_start_rank)
from lib.stages import registry

MODEL = "Qwen/Qwen3-30B-A3B-FP8"
SITE = "/opt/venv/lib/python3.12/site-packages"
CLUSTER = dict(model=MODEL, served_model_name="qwen3", backend="deepep_v2", dp_size=16,
               dp_size_local=8, dp_address="vllm-0.vllm-rdzv", dp_rpc_port=29570, port=8000,
               enforce_eager=True, max_model_len=2048, gpu_memory_utilization=0.7,
               ep_num_comms=8, transport="efa")

COMMON = ["--served-model-name", "qwen3", "--enable-expert-parallel",
          "--tensor-parallel-size", "1", "--data-parallel-size", "16",
          "--data-parallel-size-local", "8", "--all2all-backend", "deepep_v2",
          "--enforce-eager", "--max-model-len", "2048", "--gpu-memory-utilization", "0.7"]


def test_leader_argv_exact():
    argv, _ = vllm_serve("leader", **CLUSTER)
    assert argv == ["vllm", "serve", MODEL, *COMMON,
                    "--data-parallel-address", "vllm-0.vllm-rdzv",
                    "--data-parallel-rpc-port", "29570", "--data-parallel-start-rank", "0",
                    "--port", "8000"]


def test_worker_argv_exact():
    argv, _ = vllm_serve("worker", **CLUSTER, dp_start_rank=worker_start_rank(1, 8))
    assert argv == ["vllm", "serve", MODEL, *COMMON, "--headless",
                    "--data-parallel-address", "vllm-0.vllm-rdzv",
                    "--data-parallel-rpc-port", "29570", "--data-parallel-start-rank", "8"]
    assert "--port" not in argv


def test_local_argv_exact_with_python_module_form():
    # The measured form on two H200s (TOOLCHAIN "vLLM 0.24.0 on two H200s").
    argv, env = vllm_serve("local", model="/models/moe", served_model_name="moe",
                           backend="allgather_reducescatter", dp_size=2, dp_size_local=2,
                           port=8000, enforce_eager=True, max_model_len=2048,
                           gpu_memory_utilization=0.25, ep_num_comms=1,
                           transport="intranode_nvlink", nccl_site=SITE,
                           python="python3")
    assert argv == ["python3", "-m", "vllm.entrypoints.cli.main", "serve", "/models/moe",
                    "--served-model-name", "moe", "--enable-expert-parallel",
                    "--tensor-parallel-size", "1", "--data-parallel-size", "2",
                    "--data-parallel-size-local", "2", "--all2all-backend",
                    "allgather_reducescatter", "--enforce-eager", "--max-model-len", "2048",
                    "--gpu-memory-utilization", "0.25", "--port", "8000"]
    assert env["LD_PRELOAD"] == f"{SITE}/nvidia/nccl/lib/libnccl.so.2"
    assert env["EP_DISABLE_GIN"] == "1"


def test_env_carries_the_transport_contract_and_the_vllm_settings():
    _, env = vllm_serve("leader", **CLUSTER)
    for k, v in transport_env("efa").items():
        assert env[k] == v
    assert env["VLLM_USE_DEEP_GEMM"] == "0"
    assert env["VLLM_USE_FLASHINFER_SAMPLER"] == "0"
    assert env["EP_NUM_COMMS"] == "8"
    assert env["NCCL_DEBUG"] == "INFO"
    assert env["NCCL_DEBUG_SUBSYS"] == "INIT,NET,ENV"
    assert env["VLLM_DEEPEP_V2_ALLOW_HYBRID_MODE"] == "1"
    # vLLM 0.24.0 reads nothing by this name (its own log says "Unknown vLLM environment
    # variable detected"): not set.
    assert "VLLM_USE_FLASHINFER_MOE_FP8" not in env
    assert "NVSHMEM_IB_ENABLE_IBGDA" not in env


def test_the_deepep_v2_mode_is_always_set_through_vllm_s_variable():
    """vLLM's default for it moved under the same argv (#54281, #57991): set either way."""
    _, hybrid = vllm_serve("leader", **{**CLUSTER, "backend": "deepep_v2"})
    _, direct = vllm_serve("leader", **{**CLUSTER, "backend": "deepep_v2"},
                           deepep_v2_mode="direct")
    assert (hybrid[HYBRID_MODE_VAR], direct[HYBRID_MODE_VAR]) == ("1", "0")
    _, other = vllm_serve("leader", **{**CLUSTER, "backend": "allgather_reducescatter"},
                          deepep_v2_mode="direct")
    assert HYBRID_MODE_VAR not in other  # no DeepEP-V2, no mode
    # on one machine too: the transport contract sets no vLLM variable of its own
    _, one = vllm_serve("local", **{**CLUSTER, "backend": "deepep_v2", "dp_address": None,
                                    "dp_rpc_port": None, "dp_size_local": 16,
                                    "transport": "intranode_nvlink"},
                        nccl_site="/w/site", deepep_v2_mode="direct")
    assert one[HYBRID_MODE_VAR] == "0"


def test_extra_env_is_set_over_the_contract():
    _, env = vllm_serve("leader", **CLUSTER, extra_env={"VLLM_ENGINE_READY_TIMEOUT_S": "1800"})
    assert env["VLLM_ENGINE_READY_TIMEOUT_S"] == "1800"


@pytest.mark.parametrize("removed", REMOVED_BACKENDS)
@pytest.mark.parametrize("stage, name, given", [
    ("04_serve", "all2all_backend", "{}"),
    ("05_sweep", "ab_backends", "allgather_reducescatter,{}"),
    ("06_multicomm", "all2all_backend", "{}")])
def test_removed_backends_refused_by_the_stage_s_model_naming_the_parameter(removed, stage, name,
                                                                            given):
    """vLLM 0.24.0 serves allgather_reducescatter under 'naive' and 'pplx' (its log says it
    falls back): BACKENDS leaves them out, so the parameter refuses them before any effect."""
    assert removed not in BACKENDS
    with pytest.raises(ParameterError) as err:
        registry.resolve(stage, {"engine": "vllm", name: given.format(removed)})
    assert err.value.name == name and "allgather_reducescatter" in err.value.allowed
    assert removed not in err.value.allowed.replace("allgather_reducescatter", "")


def test_an_unknown_backend_is_refused_naming_the_allowed_values():
    with pytest.raises(ParameterError, match="'all2all_backend'.*deepep_v2") as err:
        registry.resolve("04_serve", {"all2all_backend": "nccl_a2a"})
    assert "naive" not in str(err.value).split("allowed:")[1]
    assert "naive" not in BACKENDS and "pplx" not in BACKENDS
    assert "allgather_reducescatter" in BACKENDS and "deepep_v2" in BACKENDS


def test_the_ep_size_must_divide_the_model_s_experts_before_any_effect():
    """What the leader's --data-parallel-size would split: 3 nodes x 8 GPUs = 24 ranks over the
    pinned model's 128 experts, refused by the model, naming the node counts that divide them."""
    with pytest.raises(ParameterError, match="'nodes' = 3.*128 routed experts.*1, 2, 4, 8, 16"):
        registry.resolve("04_serve", {"context": "kube", "nodes": 3})
    assert registry.resolve("04_serve", {"context": "kube", "nodes": 2})["nodes"] == 2


def test_worker_start_rank_is_its_ordinal_over_the_gpus_per_node():
    assert [worker_start_rank(k, 8) for k in range(1, 4)] == [8, 16, 24]


@pytest.mark.parametrize("stage, given, name, words", [
    ("04_serve", {"num_comms": 17}, "num_comms", "<= 16"),
    ("06_multicomm", {"arm_b_comms": 17}, "arm_b_comms", "<= 16"),
    ("04_serve", {"transport": "ib"}, "transport", "efa, gin_type5, intranode_nvlink"),
])
def test_communicators_and_transport_are_refused_by_the_stage_s_model(stage, given, name, words):
    with pytest.raises(ParameterError) as err:
        registry.resolve(stage, given)
    assert err.value.name == name and words in str(err.value)


def _requirements_gpu() -> dict[str, str]:
    path = Path(__file__).resolve().parents[1] / "requirements-gpu.txt"
    assert path.is_file(), f"missing: {path}"
    pins = {}
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, version = line.partition("==")
        assert sep and version and not any(c in version for c in "<>=~*,"), \
            f"requirements-gpu.txt: not an exact pin: {raw!r}"
        assert name not in pins, f"requirements-gpu.txt: {name} twice"
        pins[name] = version
    return pins


def test_requirements_gpu_exact_and_agrees_with_pins_yaml():
    req = _requirements_gpu()
    data = pins.load()["pins"]
    assert req["vllm"] == str(data["vllm"]["version"]) == "0.24.0"
    assert req[data["nccl"]["package"]] == str(data["nccl"]["version"]) == "2.30.4"
    assert req[data["nvshmem"]["package"]] == str(data["nvshmem"]["version"]) == "3.6.5"
    # The machine's CUDA torch stays: never pulled in by this file.
    assert "torch" not in req and "flashinfer-python" not in req
    # TOOLCHAIN's measured set: vLLM plus 24 wheels, plus jiter (openai's; the notebook wheels
    # carried it when TOOLCHAIN measured), plus DeepEP's NCCL and NVSHMEM.
    assert len(req) == 25 + 1 + 2


def test_without_expert_parallelism_no_backend_is_named():
    """The local A/B arm without EP (lib.stages.lever.ARMS, the one arm that asks for none)."""
    argv, _ = vllm_serve("local", model="/m", dp_size=2, dp_size_local=2,
                         transport="intranode_nvlink", expert_parallel=False)
    assert "--enable-expert-parallel" not in argv and "--all2all-backend" not in argv
    assert argv[argv.index("--data-parallel-size") + 1] == "2"


def test_an_in_place_deepep_build_goes_on_pythonpath_behind_its_site_only_locally():
    _, env = vllm_serve("local", model="/m", backend="deepep_v2", dp_size=2, dp_size_local=2,
                        transport="intranode_nvlink", nccl_site="/w/site", deepep_dir="/w/DeepEP",
                        inherited_pythonpath="/w/vllm-site:/w/repo")
    assert env["PYTHONPATH"] == "/w/site:/w/DeepEP:/w/vllm-site:/w/repo"
    assert env["LD_PRELOAD"] == "/w/site/nvidia/nccl/lib/libnccl.so.2"
    _, plain = vllm_serve("local", model="/m", dp_size=2, dp_size_local=2,
                          transport="intranode_nvlink")
    assert "PYTHONPATH" not in plain  # nothing built here: the inherited path stays as it is
    # a DeepEP built here without the site it was built against: the stage's model refuses it
    with pytest.raises(ParameterError, match="'nccl_site'.*whenever deepep_dir is given"):
        registry.resolve("04_serve", {"deepep_dir": "/w/DeepEP"})


def test_params_all2all_backends_are_vllm_args_backends():
    assert registry.ALL2ALL_BACKENDS == BACKENDS
    with pytest.raises(ParameterError, match="all2all_backend"):
        registry.resolve("04_serve", {"all2all_backend": "naive"})


def test_04_shows_the_mode_as_each_rank_was_given_it():
    from lib.stages import serve as serve_stage  # noqa: PLC0415

    _, env = vllm_serve("leader", **CLUSTER, deepep_v2_mode="direct")
    vllm = {"engine": "vllm", "backend": "deepep_v2", "deepep_v2_mode": "direct", "env": env}
    assert serve_stage.mode_given(vllm) == f"direct ({HYBRID_MODE_VAR}=0)"
    table = serve_stage.facts(vllm)
    assert table.set_index("fact").loc["DeepEP-V2 mode given to every rank", "value"] == (
        f"direct ({HYBRID_MODE_VAR}=0)")
    sglang = {"deepep_v2_mode": "hybrid", "env": {},
              "argv": ["sglang", "serve", "--deepep-v2-mode", "hybrid"]}
    assert serve_stage.mode_given(sglang) == "hybrid (--deepep-v2-mode hybrid)"
    plain = serve_stage.facts({"engine": "vllm", "backend": "allgather_reducescatter"})
    assert "DeepEP-V2 mode given to every rank" not in set(plain["fact"])
