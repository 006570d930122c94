"""The one builder of vLLM's argv and environment, for every context and role.

Roles:
- ``leader``: node 0 of a multi-node serve. Serves HTTP (``--port``), DP ranks 0..L-1
  (``--data-parallel-start-rank 0``), and is the rendezvous (``--data-parallel-address``,
  ``--data-parallel-rpc-port``).
- ``worker``: node k > 0, ``--headless`` (no HTTP), DP ranks k*L..k*L+L-1
  (``--data-parallel-start-rank k*L``), pointed at the leader's address and rpc port.
- ``local``: one machine (e.g. two GPUs), DP = its GPUs, no address flags; serves HTTP.

The layout is TP1 x DP = EP, as the public reproduction served it (ANCHORS.md 1.4:
``vllm serve MODEL --enable-expert-parallel --tensor-parallel-size 1 --data-parallel-size 16
--data-parallel-size-local 8 --all2all-backend deepep_v2 ...``).

The environment is the transport contract from lib.transport plus the vLLM/DeepEP settings the
public runs and the H200 measurements used (each one commented below).
"""
from __future__ import annotations

from pathlib import Path
from typing import Literal, Mapping

from lib.engines.transport import DEFAULT_PLUGIN_PATH, Transport, deepep_pythonpath, transport_env
from lib.engines.deepep import DEFAULT_MODE

# A vLLM process's role (lib.engines.base.Role without 'task': vLLM runs one process per node)
VllmRole = Literal["leader", "worker", "local"]

# vLLM 0.24.0's --all2all-backend values (TOOLCHAIN.md "vLLM 0.24.0 on two H200s"; the names
# of the mori_* and flashinfer_* members are from vLLM's ParallelConfig source).
VLLM_0_24_BACKENDS = (
    "naive", "pplx", "deepep_high_throughput", "deepep_low_latency", "deepep_v2",
    "mori_high_throughput", "mori_low_latency", "nixl_ep", "allgather_reducescatter",
    "flashinfer_all2allv", "flashinfer_nvlink_two_sided", "flashinfer_nvlink_one_sided",
)
# vLLM 0.24.0 accepts these names but serves allgather_reducescatter instead (its log:
# "The 'naive' all2all backend has been removed. Falling back to 'allgather_reducescatter'.",
# ../shared/fixtures/vllm-0.24.0-2xh200/vllm-naive.log). A run asking for them would measure
# something else under their name, so BACKENDS leaves them out: the `all2all_backend` and
# `ab_backends` parameters (lib.stages.registry) allow BACKENDS only, refused before anything
# runs.
REMOVED_BACKENDS = ("naive", "pplx")
BACKENDS = tuple(b for b in VLLM_0_24_BACKENDS if b not in REMOVED_BACKENDS)

# DeepEP-V2's mode (lib.engines.deepep.MODES, the `deepep_v2_mode` parameter). vLLM reads the choice
# from VLLM_DEEPEP_V2_ALLOW_HYBRID_MODE (vLLM #41183 added it: DeepEPV2All2AllManager passes it
# as ElasticBuffer's allow_hybrid_mode); its default changed under the same argv (declared True
# but ran as 0: vLLM #54281; "auto select hybrid mode by default": #57991, 2026-10), so the guide
# always sets it. vLLM 0.24.0 says the value only at DEBUG ("DeepEP v2 all2all args ..."): the
# serve's recorded env is the record of what each rank was given.
HYBRID_MODE_VAR = "VLLM_DEEPEP_V2_ALLOW_HYBRID_MODE"

# EP_NUM_COMMS: the multicomm overlay's GinDevCommArray holds at most kMaxNumComms = 16
# (ANCHORS 1.6).
MAX_EP_NUM_COMMS = 16

# The measured form on the H200 machine: with `pip install --target DIR` there is no `vllm`
# console script on PATH, so the CLI module is run (TOOLCHAIN "vLLM 0.24.0 on two H200s").
CLI_MODULE = "vllm.entrypoints.cli.main"

# Left out on purpose: VLLM_USE_FLASHINFER_MOE_FP8. The public runs set it (ANCHORS 1.4), but
# vLLM 0.24.0 reads nothing by that name; every process logs
# "Unknown vLLM environment variable detected: VLLM_USE_FLASHINFER_MOE_FP8"
# (../shared/fixtures/vllm-0.24.0-2xh200/vllm-allgather_reducescatter.log, line 10).
NOT_READ_BY_VLLM_0_24 = ("VLLM_USE_FLASHINFER_MOE_FP8",)


def worker_start_rank(ordinal: int, dp_size_local: int) -> int:
    """``--data-parallel-start-rank`` of the node with ordinal ``ordinal`` (0 = the leader)."""
    return ordinal * dp_size_local


def vllm_env(*, backend: str, ep_num_comms: int, transport: Transport,
             nccl_site: str | Path | None = None, plugin_path: str = DEFAULT_PLUGIN_PATH,
             extra_env: Mapping[str, str] | None = None,
             deepep_v2_mode: str = DEFAULT_MODE) -> dict[str, str]:
    """The environment for one vLLM serve process (any role). `backend` is one of BACKENDS and
    `ep_num_comms` 1..MAX_EP_NUM_COMMS, as the stage's parameters allow; a deepep_* backend on
    one machine comes with `nccl_site` (its model asks for both together); `deepep_v2_mode`
    one of lib.engines.deepep.MODES (deepep_v2 only)."""
    env = {
        # DeepGEMM kernels off: the public runs served with triton MoE (ANCHORS 1.4), and the
        # H200 machine has no deep_gemm.
        "VLLM_USE_DEEP_GEMM": "0",
        # Without flashinfer installed the sampler imports it and every worker dies; vLLM 0.24.0
        # logs "FlashInfer top-p/top-k sampling disabled via VLLM_USE_FLASHINFER_SAMPLER=0"
        # (TOOLCHAIN "vLLM 0.24.0 on two H200s"; ANCHORS 4: flashinfer JIT kills a worker).
        "VLLM_USE_FLASHINFER_SAMPLER": "0",
        # The multicomm lever: K NCCL communicators in the DeepEP overlay; 1 = stock (ANCHORS 1.6).
        "EP_NUM_COMMS": str(ep_num_comms),
        # Per-rank evidence: NCCL prints each rank's communicator init ("comm 0x.. rank R nranks N
        # ... Init COMPLETE") and, on EFA, the plugin's "Selected provider is efa" per process.
        "NCCL_DEBUG": "INFO",
        "NCCL_DEBUG_SUBSYS": "INIT,NET,ENV",
    }
    if backend == "deepep_v2":
        # hybrid as the public serve ran it (ANCHORS 1.4, R's extra env) and as measured on two
        # H200s; always set, whichever mode (the comment above HYBRID_MODE_VAR says why)
        env[HYBRID_MODE_VAR] = "1" if deepep_v2_mode == "hybrid" else "0"
    env.update(transport_env(transport, nccl_site=nccl_site, plugin_path=plugin_path))
    if extra_env:  # set over the contract (lib.engines.base.EngineSpec.extra_env)
        env.update({str(k): str(v) for k, v in extra_env.items()})
    return env


def vllm_serve(role: VllmRole, *, model: str, served_model_name: str | None = None,
               backend: str = "allgather_reducescatter", dp_size: int, dp_size_local: int,
               dp_start_rank: int = 0, dp_address: str | None = None,
               dp_rpc_port: int | None = None, port: int = 8000, enforce_eager: bool = True,
               max_model_len: int | None = None, gpu_memory_utilization: float | None = None,
               ep_num_comms: int = 1, transport: Transport = "efa",
               nccl_site: str | Path | None = None, extra_env: Mapping[str, str] | None = None,
               python: str | None = None, plugin_path: str = DEFAULT_PLUGIN_PATH,
               expert_parallel: bool = True, deepep_dir: str | Path | None = None,
               inherited_pythonpath: str | None = None,
               deepep_v2_mode: str = DEFAULT_MODE) -> tuple[list[str], dict[str, str]]:
    """argv and env (variables to set) for one vLLM serve process.

    What the place decided comes as it decided it: the role (``leader`` on node 0 with the
    rendezvous ``dp_address``/``dp_rpc_port`` and HTTP ``port``; ``worker`` on node k with
    ``dp_start_rank`` = ``worker_start_rank(k, dp_size_local)``; ``local`` on one machine,
    ``dp_size`` = ``dp_size_local``, no rendezvous), DP over every GPU. Without expert
    parallelism (the local A/B arm) no backend is named. The stage's values (backend, eager,
    communicators, transport) are what its parameter model accepted.

    ``deepep_dir`` (role 'local' only, the local place's; the image has deep_ep installed): a
    DeepEP built in place on this machine, put on PYTHONPATH behind ``nccl_site`` and before
    ``inherited_pythonpath`` (``lib.transport.deepep_pythonpath``).

    The variables to unset are ``lib.transport.unset_vars(transport)``; ``apply_transport``
    applies both to a base environment.
    """
    env = vllm_env(backend=backend, ep_num_comms=ep_num_comms, transport=transport,
                   nccl_site=nccl_site, plugin_path=plugin_path, extra_env=extra_env,
                   deepep_v2_mode=deepep_v2_mode)
    if deepep_dir is not None:
        env["PYTHONPATH"] = deepep_pythonpath(nccl_site, deepep_dir, inherited_pythonpath)

    program = [python, "-m", CLI_MODULE, "serve"] if python else ["vllm", "serve"]
    argv = program + [model]
    if served_model_name:
        argv += ["--served-model-name", served_model_name]
    # Without EP (the local A/B arm) vLLM shards every expert by tensor parallelism over the DP
    # ranks and moves tokens with its own AllGather+ReduceScatter fallback, whatever backend is
    # named: --all2all-backend would choose nothing, so it is left out.
    argv += ["--enable-expert-parallel"] if expert_parallel else []
    argv += [
        "--tensor-parallel-size", "1",
        "--data-parallel-size", str(dp_size),
        "--data-parallel-size-local", str(dp_size_local),
    ]
    argv += ["--all2all-backend", backend] if expert_parallel else []
    if enforce_eager:
        argv.append("--enforce-eager")
    if max_model_len is not None:
        argv += ["--max-model-len", str(max_model_len)]
    if gpu_memory_utilization is not None:
        argv += ["--gpu-memory-utilization", str(gpu_memory_utilization)]
    if role == "leader":
        argv += ["--data-parallel-address", dp_address, "--data-parallel-rpc-port",
                 str(dp_rpc_port), "--data-parallel-start-rank", "0", "--port", str(port)]
    elif role == "worker":
        argv += ["--headless", "--data-parallel-address", dp_address, "--data-parallel-rpc-port",
                 str(dp_rpc_port), "--data-parallel-start-rank", str(dp_start_rank)]
    else:
        argv += ["--port", str(port)]
    return argv, env
