"""lib.transport: the EFA and intranode NVLink env contracts, defined once."""

import pytest

from lib.core.errors import ParameterError
from lib.stages import registry
from lib.engines.transport import (DEFAULT_PLUGIN_PATH, DROPPED_BY_REVIEW, EFA, INTRANODE_NVLINK,
                           TRANSPORTS, apply_transport, nccl_preload, transport_env,
                           unset_vars)

SITE = "/opt/venv/lib/python3.12/site-packages"

EFA_EXACT = {
    "NCCL_NET_PLUGIN": DEFAULT_PLUGIN_PATH,
    "NCCL_GIN_TYPE": "2",
    "NCCL_GIN_ENABLE": "1",
    "NCCL_CUMEM_ENABLE": "1",
    "NCCL_NVLS_ENABLE": "0",
    "NCCL_IGNORE_DISABLED_P2P": "1",
    "FI_PROVIDER": "efa",
    "FI_EFA_USE_DEVICE_RDMA": "1",
    "FI_EFA_ENABLE_SHM_TRANSFER": "0",
    "OFI_NCCL_PROTOCOL": "RDMA",
    "EP_EFA_MAX_QPS": "2",
    "EP_EFA_RDMA_GBS": "25.0",
    "EP_REUSE_NCCL_COMM": "0",
    "NCCL_SOCKET_IFNAME": "^docker,lo,veth",
    # ElasticBuffer's timeouts, read by the guide's vLLM patch 0002 (600 s, as R injected)
    "DEEPEP_V2_GPU_TIMEOUT_S": "600",
    "DEEPEP_V2_CPU_TIMEOUT_S": "600",
}


def test_efa_contract_exact():
    assert transport_env("efa") == EFA_EXACT


def test_efa_plugin_path_is_an_argument():
    """Its callers give the default or a place's own plugin path (never an empty one)."""
    env = transport_env("efa", plugin_path="/opt/aws-ofi-nccl/lib/libnccl-net-ofi.so")
    assert env["NCCL_NET_PLUGIN"] == "/opt/aws-ofi-nccl/lib/libnccl-net-ofi.so"


def test_review_dropped_variables_are_never_set():
    assert set(DROPPED_BY_REVIEW) == {"OFI_NCCL_GIN_GDAKI", "OFI_NCCL_GIN_MAX_REQUESTS",
                                      "DEEP_EP_BACKEND"}
    for name in TRANSPORTS:
        env = transport_env(name, nccl_site=SITE)
        assert not set(DROPPED_BY_REVIEW) & set(env)


def test_intranode_contract_exact_and_preload_from_site():
    env = transport_env("intranode_nvlink", nccl_site=SITE)
    assert env == {
        "EP_DISABLE_GIN": "1",
        "LD_PRELOAD": f"{SITE}/nvidia/nccl/lib/libnccl.so.2",
        "EP_REUSE_NCCL_COMM": "0",
        "NCCL_NVLS_ENABLE": "0",
    }
    assert nccl_preload("/x/site-packages/") == "/x/site-packages/nvidia/nccl/lib/libnccl.so.2"


def test_intranode_without_a_site_has_no_preload_and_deepep_refuses_it():
    bare = transport_env("intranode_nvlink")
    assert "LD_PRELOAD" not in bare
    assert set(transport_env("intranode_nvlink", nccl_site=SITE)) - set(bare) == {"LD_PRELOAD"}
    from lib.engines.vllm_args import vllm_env
    # a deepep_* backend on one machine without the site: the stage's model refuses it
    with pytest.raises(ParameterError, match="'nccl_site'.*2.30.4.*'deepep_v2'"):
        registry.resolve("04_serve", {"engine": "vllm", "all2all_backend": "deepep_v2"})
    env = vllm_env(backend="allgather_reducescatter", ep_num_comms=1,
                   transport="intranode_nvlink")
    assert "LD_PRELOAD" not in env and env["EP_DISABLE_GIN"] == "1"


def test_efa_and_intranode_differ_exactly_where_they_should():
    efa = transport_env("efa", nccl_site=SITE)
    intra = transport_env("intranode_nvlink", nccl_site=SITE)
    # Same value in both: the NCCL preload (when given), DeepEP's own communicator, NVLS off.
    shared = {k for k in efa if k in intra and efa[k] == intra[k]}
    assert shared == {"LD_PRELOAD", "EP_REUSE_NCCL_COMM", "NCCL_NVLS_ENABLE"}
    # GIN on over the plugin vs GIN off.
    assert set(efa) - set(intra) == set(EFA_EXACT) - {"EP_REUSE_NCCL_COMM", "NCCL_NVLS_ENABLE"}
    assert set(intra) - set(efa) == {"EP_DISABLE_GIN"}
    # Nothing set in both with different values.
    assert all(efa[k] == intra[k] for k in set(efa) & set(intra))


def test_unset_vars():
    assert unset_vars("efa") == ("NVSHMEM_IB_ENABLE_IBGDA",)
    intra = unset_vars("intranode_nvlink")
    assert intra[0] == "NVSHMEM_IB_ENABLE_IBGDA"
    # Every EFA-only variable is removed, so an image ENV cannot leak GIN/plugin settings in.
    # (the type-5 contract's one variable of its own too)
    assert set(intra[1:]) == (set(EFA_EXACT) | {"NCCL_SYM_GIN_KERNELS_ENABLE"}) - {
        "EP_REUSE_NCCL_COMM", "NCCL_NVLS_ENABLE"}
    for name in TRANSPORTS:
        assert not set(unset_vars(name)) & set(transport_env(name, nccl_site=SITE))


def test_apply_transport_removes_and_sets():
    base = {"PATH": "/usr/bin", "NVSHMEM_IB_ENABLE_IBGDA": "1", "NCCL_GIN_TYPE": "2",
            "NCCL_NET_PLUGIN": "/stale/plugin.so"}
    intra = apply_transport(base, "intranode_nvlink", nccl_site=SITE)
    assert intra["PATH"] == "/usr/bin"
    assert "NVSHMEM_IB_ENABLE_IBGDA" not in intra
    assert "NCCL_GIN_TYPE" not in intra and "NCCL_NET_PLUGIN" not in intra
    assert intra["EP_DISABLE_GIN"] == "1"
    efa = apply_transport(base, "efa")
    assert "NVSHMEM_IB_ENABLE_IBGDA" not in efa
    assert efa["NCCL_NET_PLUGIN"] == DEFAULT_PLUGIN_PATH


@pytest.mark.parametrize("stage", ["03_kernel_test", "04_serve", "07_train"])
def test_an_unknown_transport_is_refused_by_the_stage_s_model_naming_the_allowed_values(stage):
    with pytest.raises(ParameterError,
                       match="'transport' = 'ib'.*efa, gin_type5, intranode_nvlink"):
        registry.resolve(stage, {"transport": "ib"})
    assert TRANSPORTS == ("efa", "gin_type5", "intranode_nvlink") == registry.PARAMS[
        "transport"].rule.options


def test_every_variable_says_why_and_where():
    for var in EFA + INTRANODE_NVLINK:
        assert var.why.strip() and var.anchor.strip(), var.name
    assert len({v.name for v in EFA}) == len(EFA)
    assert len({v.name for v in INTRANODE_NVLINK}) == len(INTRANODE_NVLINK)


def test_deepep_pythonpath_orders_site_checkout_inherited_and_names_what_is_missing():
    from lib.engines.transport import deepep_pythonpath

    assert deepep_pythonpath("/s", "/d", "/a:/b") == "/s:/d:/a:/b"
    assert deepep_pythonpath("/s", "/d") == "/s:/d"
    # deepep_dir without the site it was built against: the stage's model refuses it
    for stage in ("03_kernel_test", "04_serve"):
        with pytest.raises(ParameterError, match="'nccl_site'.*2.30.4.*deepep_dir"):
            registry.resolve(stage, {"deepep_dir": "/d"})
