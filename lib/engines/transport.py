"""The transport's environment contracts, defined once.

Three named contracts, and nothing else in the guide spells these variables out:

- ``efa``: DeepEP V2's ``ElasticBuffer`` over NCCL GIN type 2 (the CPU proxy) through the
  aws-ofi-nccl plugin on AWS EFA. The set is the public reproductions' common serve env
  (../shared/reference/ANCHORS.md section 1.4, "Common env (R README section 2)") minus what the
  final public review dropped as read by nothing at its pins (``DROPPED_BY_REVIEW``), plus what
  that review and the canonical benchmark added (``EP_REUSE_NCCL_COMM``, ``NCCL_SOCKET_IFNAME``).
- ``gin_type5``: the same over NCCL GIN type 5, the GPU-initiated EFA path ("EFA-GDA": the
  kernel drives the NIC, no CPU proxy), as AWS's merged DeepEP V2 benchmark runs it
  (awslabs/awsome-distributed-ai #1234, 2026-08-21; #1239; ANCHORS 7): ``efa``'s variables with
  ``NCCL_GIN_TYPE=5`` and ``NCCL_SYM_GIN_KERNELS_ENABLE=0``. It needs a stack ``efa`` does not
  (``GIN_TYPE5_FLOOR``), which the parameter model holds against the chosen pin set
  (lib.stages.rules_engines.check_pin_set, from ``floor_problems``).
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

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Mapping, get_args

# A contract's name: what the `transport` parameter allows (its model refuses any other), an
# A/B arm's (lib.stages.transport_ab, lib.stages.lever) or a place's own
Transport = Literal["efa", "gin_type5", "intranode_nvlink"]
TRANSPORTS: tuple[str, ...] = get_args(Transport)
# the contracts whose traffic crosses nodes over EFA (the provider gate, the D+C contract apply)
EFA_TRANSPORTS = ("efa", "gin_type5")

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

# --- DeepEP V2's ElasticBuffer timeouts, through this guide's vLLM patch ----------------------
# ElasticBuffer takes num_cpu_timeout_secs=300, num_gpu_timeout_secs=100 as constructor
# arguments and reads no environment variable for them (deep_ep/buffers/elastic.py at
# deepseek-ai/DeepEP 0297fc8, the version stored here; the pinned b306af06 / dd758ca are not
# stored, so this was read at 0297fc8). vLLM 0.24.0 passes neither
# (DeepEPV2All2AllManager._make_all2all_kwargs, vllm/distributed/device_communicators/all2all.py
# in the PyPI wheel, read here 2026-12-04), and the public reproduction found the 100 s GPU
# default loses to first-dispatch JIT skew across 16 ranks: it injected 600 s through a .pth hook
# (ANCHORS 1.4, 4). This guide's patch patches/0002-vllm-deepep-v2-elastic-buffer-timeouts.patch
# (pins.yaml vllm_patch_deepep_v2_timeouts) passes both from these variables and logs them once
# per rank; unset, it passes the same 600 s.
ELASTIC_TIMEOUT_S = 600
GPU_TIMEOUT_VAR = "DEEPEP_V2_GPU_TIMEOUT_S"
CPU_TIMEOUT_VAR = "DEEPEP_V2_CPU_TIMEOUT_S"
_TIMEOUTS: tuple[EnvVar, ...] = (
    EnvVar(GPU_TIMEOUT_VAR, str(ELASTIC_TIMEOUT_S),
           "ElasticBuffer's GPU-side timeout (its default 100 s loses to the first dispatch's "
           "JIT skew across 16 ranks); read by this guide's vLLM patch 0002",
           "ANCHORS 1.4 (R's .pth hook: num_gpu_timeout_secs=600), 4; DeepEP elastic.py 0297fc8"),
    EnvVar(CPU_TIMEOUT_VAR, str(ELASTIC_TIMEOUT_S),
           "ElasticBuffer's CPU-side timeout (default 300 s), raised with the GPU one as R did; "
           "read by this guide's vLLM patch 0002",
           "ANCHORS 1.4 (R's .pth hook: num_cpu_timeout_secs=600); DeepEP elastic.py 0297fc8"),
)
EFA = EFA + _TIMEOUTS

# --- EFA: GIN type 5, the GPU-initiated path ------------------------------------------------
# The two settings, from the plugin's own guide (aws/aws-ofi-nccl doc/gin-getting-started.md at
# ccf5264, "EFA-GDA ... Setup": "Enable EFA-GDA explicitly; otherwise NCCL 2.31 defaults to proxy
# for EFA" and "Disable symmetric GIN kernels ... not currently supported for EFA-GDA") and AWS's
# merged benchmark (awsome-distributed-ai #1234, 2026-08-21). Without both, a public benchmark
# measured decode 2.2x slower at 2 nodes and 5.4x at 4 (whn09/ep-benchmarks-efa, 2026-08-21,
# 2x p5en; ANCHORS 7). Not carried over from #1234: LD_PRELOAD of NCCL (this image re-pins NCCL
# where torch loads it, as for type 2), TORCHDYNAMO_DISABLE (a test_ep launcher setting, not the
# transport's), NCCL_TUNER_PLUGIN=ofi (its Kubernetes MPIJob's, set for type 2 by nothing here).
_TYPE5_CHANGES: tuple[EnvVar, ...] = (
    EnvVar("NCCL_GIN_TYPE", "5",
           "GIN type 5 = EFA-GDA, the GPU-initiated backend (the plugin's Libfabric_GDAKI); NCCL "
           "2.31 picks the CPU proxy (type 2) for EFA unless asked",
           "aws/aws-ofi-nccl doc/gin-getting-started.md @ccf5264; awsome-distributed-ai #1234"),
    EnvVar("NCCL_SYM_GIN_KERNELS_ENABLE", "0",
           "NCCL's symmetric-memory GIN kernels need strong signals, which EFA-GDA does not "
           "support; always paired with NCCL_GIN_TYPE=5",
           "aws/aws-ofi-nccl doc/gin-getting-started.md @ccf5264 ('Limitations', 'Setup'); "
           "awsome-distributed-ai #1234; whn09/ep-benchmarks-efa (2.2x / 5.4x decode without)"),
)
EFA_GIN_TYPE5: tuple[EnvVar, ...] = tuple(
    next((c for c in _TYPE5_CHANGES if c.name == v.name), v) for v in EFA) + tuple(
    c for c in _TYPE5_CHANGES if c.name not in {v.name for v in EFA})


@dataclass(frozen=True)
class Floor:
    """What a contract needs of the stack: the pin whose version must reach ``minimum``."""
    pin: str
    minimum: tuple[int, ...]
    why: str


# From the plugin's guide (doc/gin-getting-started.md @ccf5264: "NCCL 2.31.2-1 or later"; EFA-GDA
# "provided by AWS EFA installer 1.50.0 or later") and AWS's benchmark (#1234: NCCL >= 2.31, EFA
# installer >= 1.50). Below 2.31 the plugin loads and then "Cannot get backend version for invalid
# GIN type 5" (a public type-5 campaign's log, quoted in book/troubleshooting.md).
GIN_TYPE5_FLOOR: tuple[Floor, ...] = (
    Floor("nccl", (2, 31), "NCCL >= 2.31 (the first with GIN type 5 for EFA)"),
    Floor("efa_installer", (1, 50), "EFA installer >= 1.50 (libfabric 2.6.0, rdma-core 64.0amzn0, "
                                    "efa driver 3.3.0, aws-ofi-nccl 1.21)"),
)
# Node facts the pins cannot say: the efa kernel driver the host loaded and gdrdrv (00 gates
# gdrdrv >= 2.5); listed so the book and a SKIP can name them.
GIN_TYPE5_NODE_NEEDS = ("efa kernel driver >= 3.3.0 (installer 1.50 installs it on the host)",
                        "gdrdrv loaded (GDRCopy 2.5 or later)",
                        "the NVIDIA driver with PeerMappingOverride=1 "
                        "(aws-ofi-nccl doc/gin-getting-started.md)")
_FLOORS: dict[str, tuple[Floor, ...]] = {"gin_type5": GIN_TYPE5_FLOOR}


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
    # (VLLM_DEEPEP_V2_ALLOW_HYBRID_MODE is vLLM's, not the transport's: the `deepep_v2_mode`
    # parameter sets it on every transport, lib.engines.vllm_args.vllm_env)
    EnvVar("NCCL_NVLS_ENABLE", "0",
           "NVLink multicast must stay off on the project's machines",
           "TOOLCHAIN 'The H200 GPU machines'"),
)

_CONTRACTS = {"efa": EFA, "gin_type5": EFA_GIN_TYPE5, "intranode_nvlink": INTRANODE_NVLINK}


def over_efa(name: Transport) -> bool:
    """Whether contract ``name`` crosses nodes over EFA (either GIN type)."""
    return name in EFA_TRANSPORTS


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", str(text))[:3])


def floor_problems(name: Transport, pins: Mapping[str, Mapping]) -> list[str]:
    """What the pins (one set's, lib.roots.pins.set_pins) lack for contract ``name``: one line
    per floor not reached, naming the pin, its version and the minimum ([] when none). The
    parameter model refuses a contract whose floor its pin set does not reach
    (lib.stages.rules_engines.check_pin_set)."""
    problems = []
    for floor in _FLOORS.get(name, ()):
        pin = pins.get(floor.pin) or {}
        version = pin.get("version")
        if version is None or _version(version) < floor.minimum:
            problems.append(f"{floor.pin} {version or 'unpinned'} < "
                            f"{'.'.join(map(str, floor.minimum))} ({floor.why})")
    return problems


def contract(name: Transport) -> tuple[EnvVar, ...]:
    """The contract's variables with their reasons and anchors (values may hold placeholders)."""
    return _CONTRACTS[name]


def nccl_preload(nccl_site: str | Path) -> str:
    """LD_PRELOAD value for the NCCL library inside the site-packages directory ``nccl_site``."""
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
    besides (``nccl_preload``), as measured. Both folders are the stage's parameters, which its
    model asks for together (``nccl_site`` whenever ``deepep_dir`` is given).
    """
    parts = [str(nccl_site), str(deepep_dir)] + ([inherited] if inherited else [])
    return ":".join(parts)


def transport_env(name: Transport, *, nccl_site: str | Path | None = None,
                  plugin_path: str = DEFAULT_PLUGIN_PATH) -> dict[str, str]:
    """The variables to set for transport ``name`` (one of TRANSPORTS).

    ``intranode_nvlink`` takes ``nccl_site`` (its LD_PRELOAD is computed from it; without one,
    no preload: the serve then runs on torch's NCCL, which DeepEP cannot). On ``efa`` the
    image re-pins NCCL 2.30.4 where torch loads it, so no preload is needed; a given
    ``nccl_site`` adds the same LD_PRELOAD there too (a machine whose torch carries its own NCCL).
    ``plugin_path`` is the aws-ofi-nccl plugin (the EFA contracts only).
    """
    if name in EFA_TRANSPORTS:
        env = {v.name: (str(plugin_path) if v.value == _PLUGIN else v.value)
               for v in _CONTRACTS[name]}
        if nccl_site:
            env["LD_PRELOAD"] = nccl_preload(nccl_site)
        return env
    # The NCCL preload exists for DeepEP (built for 2.30.4); a serve without DeepEP
    # (allgather_reducescatter) runs on torch's own NCCL, as measured, so no site means no preload.
    # The parameter model refuses a deepep_* backend on one machine without a site.
    return {v.name: (nccl_preload(nccl_site) if v.value == _PRELOAD else v.value)
            for v in INTRANODE_NVLINK if v.value != _PRELOAD or nccl_site}


def unset_vars(name: Transport) -> tuple[str, ...]:
    """The variables that must be absent for transport ``name``.

    Always NVSHMEM_IB_ENABLE_IBGDA. For ``intranode_nvlink`` also every EFA-only variable, so an
    image whose ENV carries the EFA contract runs intranode exactly as measured (none of them set).
    """
    if name in EFA_TRANSPORTS:
        return UNSET_ALWAYS
    intranode = {v.name for v in INTRANODE_NVLINK}
    efa_only = dict.fromkeys(v.name for v in EFA + EFA_GIN_TYPE5 if v.name not in intranode)
    return UNSET_ALWAYS + tuple(efa_only)


def apply_transport(base: Mapping[str, str], name: Transport, *,
                    nccl_site: str | Path | None = None,
                    plugin_path: str = DEFAULT_PLUGIN_PATH) -> dict[str, str]:
    """``base`` without the transport's unset variables, with its contract on top."""
    drop = set(unset_vars(name))
    env = {k: v for k, v in base.items() if k not in drop}
    env.update(transport_env(name, nccl_site=nccl_site, plugin_path=plugin_path))
    return env
