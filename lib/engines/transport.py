"""The transport's environment contracts, defined once.

Two named contracts, and nothing else in the guide spells these variables out:

- ``efa``: DeepEP V2's ``ElasticBuffer`` over NCCL GIN type 2 (the CPU proxy) through the
  aws-ofi-nccl plugin on AWS EFA. The set is the public reproductions' common serve env
  (../shared/reference/ANCHORS.md section 1.4, "Common env (R README section 2)") minus what the
  final public review dropped as read by nothing at its pins (``DROPPED_BY_REVIEW``), plus what
  that review and the canonical benchmark added (``EP_REUSE_NCCL_COMM``, ``NCCL_SOCKET_IFNAME``).
- ``intranode_nvlink``: the same software on one machine's NVLink with GIN off, as measured on
  two H200s (../shared/reference/TOOLCHAIN.md, "DeepEP V2 itself on two H200s, and vLLM's
  deepep_v2 backend"). The transport is the only difference between the two.

Each variable carries why it is there and the anchor that says so (``EnvVar.why`` /
``EnvVar.anchor``), so the book can print the contract from this module.

Anchors named below: R = antonai-work/deepep-v2-efa-repro, V = antonai-work/vllm-deepep-v2-efa,
"the review" = the awslabs/awsome-distributed-ai review of examples/inference/vllm/deepep-v2-efa
(all three as summarised in ANCHORS.md).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from lib.core.errors import ParameterError

TRANSPORTS = ("efa", "intranode_nvlink")

# Where the EFA installer (1.50.0, bundling aws-ofi-nccl 1.21.1) puts the GIN-capable plugin;
# docker/Dockerfile checks this file exports ncclGinPlugin_v14 (ANCHORS 1.2, the review).
DEFAULT_PLUGIN_PATH = "/opt/amazon/ofi-nccl/lib/libnccl-net-ofi.so"

# The NCCL library inside a site-packages directory holding nvidia-nccl-cu13 (2.30.4, pins.yaml).
NCCL_LIB_IN_SITE = Path("nvidia") / "nccl" / "lib" / "libnccl.so.2"


@dataclass(frozen=True)
class EnvVar:
    name: str
    value: str
    why: str
    anchor: str


# --- EFA: GIN type 2 through the aws-ofi-nccl plugin ------------------------------------------
# NCCL_NET_PLUGIN's value is the plugin path (a parameter); the placeholder is replaced by
# transport_env().
_PLUGIN = "<plugin_path>"

EFA: tuple[EnvVar, ...] = (
    EnvVar("NCCL_NET_PLUGIN", _PLUGIN,
           "load the aws-ofi-nccl plugin, whose ncclGinPlugin export is the GIN network NCCL "
           "uses for EFA (without it NCCL falls back to its socket transport)",
           "ANCHORS 1.4 common env; 1.2 (the review: installer-bundled 1.21.1, ncclGinPlugin_v14)"),
    EnvVar("NCCL_GIN_TYPE", "2",
           "GIN type 2 = the CPU-proxy GIN backend, the one ElasticBuffer uses over EFA",
           "ANCHORS 1.4 common env; DESIGN 'What the product is'"),
    EnvVar("NCCL_GIN_ENABLE", "1",
           "turn NCCL's GPU-initiated networking on (DeepEP V2 needs it across nodes)",
           "ANCHORS 1.4 common env"),
    EnvVar("NCCL_CUMEM_ENABLE", "1",
           "cuMem-based NCCL allocations, as every public run of this stack set it",
           "ANCHORS 1.4 common env"),
    EnvVar("NCCL_NVLS_ENABLE", "0",
           "NVLink SHARP / multicast off: set by the public runs, and NVLink multicast must stay "
           "off on the project's machines",
           "ANCHORS 1.4 common env; TOOLCHAIN 'The H200 GPU machines'"),
    EnvVar("NCCL_IGNORE_DISABLED_P2P", "1",
           "do not fail when a P2P path is reported disabled; as the public runs set it",
           "ANCHORS 1.4 common env"),
    EnvVar("FI_PROVIDER", "efa",
           "libfabric may pick only the EFA provider, so there is no silent tcp;ofi_rxm fallback",
           "ANCHORS 1.4 common env; 1.3 (the review's provider regex rejects tcp;ofi_rxm)"),
    EnvVar("FI_EFA_USE_DEVICE_RDMA", "1",
           "GPUDirect RDMA on the EFA device (GPU memory registered directly with the NIC)",
           "ANCHORS 1.4 common env"),
    EnvVar("FI_EFA_ENABLE_SHM_TRANSFER", "0",
           "no libfabric shared-memory path inside a node; intranode traffic stays on NVLink",
           "ANCHORS 1.4 common env"),
    EnvVar("OFI_NCCL_PROTOCOL", "RDMA",
           "the plugin's RDMA protocol (V expects 'Using transport protocol RDMA' in the log)",
           "ANCHORS 1.4 common env; 2 (V's expected lines)"),
    EnvVar("EP_EFA_MAX_QPS", "2",
           "DeepEP's queue-pair cap on EFA (V expects '[DeepEP] EFA detected: capping "
           "num_allocated_qps 129 -> 2')",
           "ANCHORS 1.4 common env; 2 (V's expected lines)"),
    EnvVar("EP_EFA_RDMA_GBS", "25.0",
           "DeepEP's per-NIC RDMA bandwidth figure for EFA, as the published runs recorded it",
           "ANCHORS 1.4 common env; 2 (t2 microbench config)"),
    EnvVar("EP_REUSE_NCCL_COMM", "0",
           "DeepEP builds its own NCCL communicator: reusing vLLM's lazily created one "
           "null-derefs ncclTeamWorld",
           "ANCHORS 4 (the review: EP_REUSE_NCCL_COMM=0); 1.4 (its manifest)"),
    EnvVar("NCCL_SOCKET_IFNAME", "^docker,lo,veth",
           "NCCL's bootstrap sockets avoid docker, loopback and veth interfaces",
           "ANCHORS 4 (align with the canonical deepep-v2-benchmark); 1.3 (the review sets it)"),
)

# Read by nothing at the review's pins, so the review dropped them; never set here.
DROPPED_BY_REVIEW: dict[str, str] = {
    "OFI_NCCL_GIN_GDAKI": "R set 0; read by nothing at the review's pins (ANCHORS 1.4)",
    "OFI_NCCL_GIN_MAX_REQUESTS": "R set 512; read by nothing at the review's pins (ANCHORS 1.4)",
    "DEEP_EP_BACKEND": "read by nothing at the review's pins (ANCHORS 1.4)",
}

# Must be absent from the environment: R unsets it, and its L3 check fails the run when it is 1
# (NVSHMEM's IBGDA transport is not the path DeepEP V2 takes over EFA) (ANCHORS 1.4, 2).
UNSET_ALWAYS = ("NVSHMEM_IB_ENABLE_IBGDA",)

# --- intranode NVLink: GIN off ----------------------------------------------------------------
_PRELOAD = "<nccl_site>/nvidia/nccl/lib/libnccl.so.2"

INTRANODE_NVLINK: tuple[EnvVar, ...] = (
    EnvVar("EP_DISABLE_GIN", "1",
           "no RDMA NIC here: ElasticBuffer asserts 'NCCL GIN is unavailable' unless GIN is "
           "off, and then serves over the intranode NVLink path",
           "TOOLCHAIN 'DeepEP V2 itself on two H200s'"),
    EnvVar("LD_PRELOAD", _PRELOAD,
           "torch loads its own NCCL (2.28.9 on the H200 image); DeepEP built for 2.30.4 "
           "segfaults unless the 2.30.4 library is loaded first",
           "TOOLCHAIN 'DeepEP V2 itself on two H200s'"),
    EnvVar("EP_REUSE_NCCL_COMM", "0",
           "as on EFA: DeepEP builds its own communicator (measured this way on two H200s)",
           "ANCHORS 4 (the review); TOOLCHAIN 'vLLM 0.24.0 with --all2all-backend deepep_v2'"),
    EnvVar("VLLM_DEEPEP_V2_ALLOW_HYBRID_MODE", "1",
           "vLLM's deepep_v2 manager in hybrid mode, as measured serving on two H200s",
           "TOOLCHAIN 'vLLM 0.24.0 with --all2all-backend deepep_v2'; ANCHORS 1.4 (R's serve)"),
    EnvVar("NCCL_NVLS_ENABLE", "0",
           "NVLink multicast must stay off on the project's machines",
           "TOOLCHAIN 'The H200 GPU machines'"),
)

_CONTRACTS = {"efa": EFA, "intranode_nvlink": INTRANODE_NVLINK}


def _check_name(name: str) -> str:
    if name not in _CONTRACTS:
        raise ParameterError("transport", name, ", ".join(TRANSPORTS))
    return name


def contract(name: str) -> tuple[EnvVar, ...]:
    """The contract's variables with their reasons and anchors (values may hold placeholders)."""
    return _CONTRACTS[_check_name(name)]


def nccl_preload(nccl_site: str | Path) -> str:
    """LD_PRELOAD value for the NCCL library inside the site-packages directory ``nccl_site``."""
    if nccl_site is None or str(nccl_site).strip() == "":
        raise ParameterError("nccl_site", nccl_site,
                             "a site-packages directory holding nvidia/nccl/lib/libnccl.so.2 "
                             "(nvidia-nccl-cu13 2.30.4)")
    return str(Path(nccl_site) / NCCL_LIB_IN_SITE)


def deepep_pythonpath(nccl_site: str | Path, deepep_dir: str | Path,
                      inherited: str | None = None) -> str:
    """PYTHONPATH of a process that imports a DeepEP built in place (docker/build_deepep.sh) at
    ``deepep_dir`` against the wheels installed in ``nccl_site``, on a machine whose torch brings
    its own NCCL and NVSHMEM: the site first, then the checkout, then ``inherited``.

    The site comes first because the NVSHMEM library is found through the ``nvidia`` packages on
    sys.path: with the machine's nvidia-nvshmem-cu13 3.4.5 found first, importing deep_ep fails
    with "undefined symbol: nvshmem_selected_device_transport" (DeepEP built for 3.6.5; measured
    on the H200 machine 2026-11-30, results/gpu-2xh200-deepep-20261130b.notes.md). The checkout
    is on the path because an in-place build installs nothing. The NCCL library is preloaded
    besides (``nccl_preload``), as measured.
    """
    needs = (("nccl_site", nccl_site, "the site DeepEP at deepep_dir was built against "
                                      "(nvidia-nccl-cu13 2.30.4, nvidia-nvshmem-cu13 3.6.5)"),
             ("deepep_dir", deepep_dir, "a folder path (see lib.params)"))
    for name, value, allowed in needs:
        if value is None or str(value).strip() == "":
            raise ParameterError(name, value, allowed)
    parts = [str(nccl_site), str(deepep_dir)] + ([inherited] if inherited else [])
    return ":".join(parts)


def transport_env(name: str, *, nccl_site: str | Path | None = None,
                  plugin_path: str = DEFAULT_PLUGIN_PATH) -> dict[str, str]:
    """The variables to set for transport ``name`` ('efa' or 'intranode_nvlink').

    ``intranode_nvlink`` takes ``nccl_site`` (its LD_PRELOAD is computed from it; without one,
    no preload: the serve then runs on torch's NCCL, which DeepEP cannot). On ``efa`` the
    image re-pins NCCL 2.30.4 where torch loads it, so no preload is needed; a given
    ``nccl_site`` adds the same LD_PRELOAD there too (a machine whose torch carries its own NCCL).
    ``plugin_path`` is the aws-ofi-nccl plugin (efa only).
    """
    _check_name(name)
    if name == "efa":
        if not plugin_path or not str(plugin_path).strip():
            raise ParameterError("plugin_path", plugin_path,
                                 "the path of the aws-ofi-nccl plugin (libnccl-net-ofi.so)")
        env = {v.name: (str(plugin_path) if v.value == _PLUGIN else v.value) for v in EFA}
        if nccl_site is not None:
            env["LD_PRELOAD"] = nccl_preload(nccl_site)
        return env
    # The NCCL preload exists for DeepEP (built for 2.30.4); a serve without DeepEP
    # (allgather_reducescatter) runs on torch's own NCCL, as measured, so no site means no preload.
    # lib.vllm_args refuses a deepep_* backend without a site.
    return {v.name: (nccl_preload(nccl_site) if v.value == _PRELOAD else v.value)
            for v in INTRANODE_NVLINK if v.value != _PRELOAD or nccl_site}


def unset_vars(name: str) -> tuple[str, ...]:
    """The variables that must be absent for transport ``name``.

    Always NVSHMEM_IB_ENABLE_IBGDA. For ``intranode_nvlink`` also every EFA-only variable, so an
    image whose ENV carries the EFA contract runs intranode exactly as measured (none of them set).
    """
    _check_name(name)
    if name == "efa":
        return UNSET_ALWAYS
    intranode = {v.name for v in INTRANODE_NVLINK}
    efa_only = tuple(v.name for v in EFA if v.name not in intranode)
    return UNSET_ALWAYS + efa_only


def apply_transport(base: Mapping[str, str], name: str, *, nccl_site: str | Path | None = None,
                    plugin_path: str = DEFAULT_PLUGIN_PATH) -> dict[str, str]:
    """``base`` without the transport's unset variables, with its contract on top."""
    drop = set(unset_vars(name))
    env = {k: v for k, v in base.items() if k not in drop}
    env.update(transport_env(name, nccl_site=nccl_site, plugin_path=plugin_path))
    return env
