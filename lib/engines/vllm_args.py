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
from typing import Mapping

from lib.core.errors import ParameterError
from lib.engines.transport import (DEFAULT_PLUGIN_PATH, TRANSPORTS, deepep_pythonpath, transport_env,
                           unset_vars)

ROLES = ("leader", "worker", "local")

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
# something else under their name, so they are refused before anything runs.
REMOVED_BACKENDS = ("naive", "pplx")
BACKENDS = tuple(b for b in VLLM_0_24_BACKENDS if b not in REMOVED_BACKENDS)

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


def _port(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
        raise ParameterError(name, value, "an integer port in 1..65535")
    return value


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ParameterError(name, value, "an integer >= 1")
    return value


def check_backend(backend: str) -> str:
    """The backend if vLLM 0.24.0 serves it as asked; otherwise a ParameterError saying why."""
    if backend in REMOVED_BACKENDS:
        raise ParameterError(
            "backend", backend,
            f"{', '.join(BACKENDS)} (vLLM 0.24.0 removed {backend!r}: it logs \"The "
            f"'{backend}' all2all backend has been removed. Falling back to "
            "'allgather_reducescatter'\" and silently serves allgather_reducescatter)")
    if backend not in BACKENDS:
        raise ParameterError("backend", backend, ", ".join(BACKENDS))
    return backend


def worker_start_rank(ordinal: int, dp_size_local: int) -> int:
    """``--data-parallel-start-rank`` of the node with ordinal ``ordinal`` (0 = the leader)."""
    if isinstance(ordinal, bool) or not isinstance(ordinal, int) or ordinal < 0:
        raise ParameterError("ordinal", ordinal, "an integer >= 0")
    return ordinal * _positive_int("dp_size_local", dp_size_local)


def vllm_env(*, backend: str, ep_num_comms: int, transport: str,
             nccl_site: str | Path | None = None, plugin_path: str = DEFAULT_PLUGIN_PATH,
             extra_env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for one vLLM serve process (any role)."""
    check_backend(backend)
    if (isinstance(ep_num_comms, bool) or not isinstance(ep_num_comms, int)
            or not 1 <= ep_num_comms <= MAX_EP_NUM_COMMS):
        raise ParameterError("ep_num_comms", ep_num_comms, f"an integer in 1..{MAX_EP_NUM_COMMS}")
    if transport not in TRANSPORTS:
        raise ParameterError("transport", transport, ", ".join(TRANSPORTS))
    if transport == "intranode_nvlink" and backend.startswith("deepep") and not nccl_site:
        raise ParameterError("nccl_site", nccl_site,
                             f"a site-packages directory holding nvidia-nccl-cu13 2.30.4: the "
                             f"{backend} backend runs DeepEP, built for it, which segfaults on "
                             "torch's own NCCL unless 2.30.4 is preloaded")
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
        # As the public serve ran it (ANCHORS 1.4, R's extra env) and as measured on two H200s.
        env["VLLM_DEEPEP_V2_ALLOW_HYBRID_MODE"] = "1"
    env.update(transport_env(transport, nccl_site=nccl_site, plugin_path=plugin_path))
    if extra_env:
        clash = sorted(set(extra_env) & set(unset_vars(transport)))
        if clash:
            raise ParameterError("extra_env", dict(extra_env),
                                 f"variables other than {', '.join(clash)} (the {transport} "
                                 "transport requires them unset)")
        env.update({str(k): str(v) for k, v in extra_env.items()})
    return env


def check_serve_request(role: str, *, model: str, backend: str, dp_size: int,
                        dp_size_local: int, dp_start_rank: int, dp_address: str | None,
                        dp_rpc_port: int | None, port: int, enforce_eager: bool,
                        max_model_len: int | None, gpu_memory_utilization: float | None,
                        num_experts: int | None, expert_parallel: bool) -> int | None:
    """Every rule of one vLLM serve process's request, before anything is built: a
    ParameterError names the first value refused. Returns the rpc port (checked) of a leader or
    worker, None on role 'local'."""
    if role not in ROLES:
        raise ParameterError("role", role, ", ".join(ROLES))
    if not isinstance(model, str) or not model.strip():
        raise ParameterError("model", model, "a model path or Hugging Face id")
    check_backend(backend)
    dp_size = _positive_int("dp_size", dp_size)
    dp_size_local = _positive_int("dp_size_local", dp_size_local)
    if dp_size % dp_size_local:
        raise ParameterError("dp_size", dp_size,
                             f"a multiple of dp_size_local={dp_size_local} (GPUs per node)")
    if num_experts is not None:
        num_experts = _positive_int("num_experts", num_experts)
        if num_experts % dp_size:
            raise ParameterError(
                "num_experts", num_experts,
                f"a multiple of the EP size = dp_size = {dp_size} (TP1 x DP: each rank holds "
                f"num_experts/{dp_size} experts)")
    _port("port", port)
    if max_model_len is not None:
        _positive_int("max_model_len", max_model_len)
    if gpu_memory_utilization is not None and (
            isinstance(gpu_memory_utilization, bool)
            or not isinstance(gpu_memory_utilization, (int, float))
            or not 0 < gpu_memory_utilization <= 1):
        raise ParameterError("gpu_memory_utilization", gpu_memory_utilization,
                             "a fraction in (0, 1]")
    if not isinstance(enforce_eager, bool):
        raise ParameterError("enforce_eager", enforce_eager, "True or False")
    if not isinstance(expert_parallel, bool):
        raise ParameterError("expert_parallel", expert_parallel, "True or False")
    if not expert_parallel and role != "local":
        raise ParameterError("expert_parallel", expert_parallel,
                             "True on a cluster (the guide serves TP1 x DP = EP there); False only "
                             "on role 'local', the A/B arm without expert parallelism")

    nodes = dp_size // dp_size_local
    if role == "local":
        if dp_size != dp_size_local:
            raise ParameterError("dp_size_local", dp_size_local,
                                 f"dp_size ({dp_size}) on role 'local' (one machine)")
        if dp_start_rank not in (0, None):
            raise ParameterError("dp_start_rank", dp_start_rank, "0 on role 'local'")
        if dp_address is not None or dp_rpc_port is not None:
            raise ParameterError("dp_address", dp_address,
                                 "None (with dp_rpc_port None) on role 'local': no rendezvous")
    else:
        if not isinstance(dp_address, str) or not dp_address.strip():
            raise ParameterError("dp_address", dp_address,
                                 f"the leader's address (host or IP) on role {role!r}")
        dp_rpc_port = _port("dp_rpc_port", dp_rpc_port)
        if role == "leader" and dp_rpc_port == port:
            raise ParameterError("dp_rpc_port", dp_rpc_port, f"a port other than port={port}")
        if role == "leader" and dp_start_rank != 0:
            raise ParameterError("dp_start_rank", dp_start_rank, "0 on role 'leader'")
        if role == "worker":
            allowed = [worker_start_rank(k, dp_size_local) for k in range(1, nodes)]
            if dp_start_rank not in allowed:
                raise ParameterError(
                    "dp_start_rank", dp_start_rank,
                    (", ".join(map(str, allowed)) + f" (ordinal x dp_size_local={dp_size_local})")
                    if allowed else f"none: dp_size={dp_size} fits on the leader alone")

    return dp_rpc_port


def vllm_serve(role: str, *, model: str, served_model_name: str | None = None,
               backend: str = "allgather_reducescatter", dp_size: int, dp_size_local: int,
               dp_start_rank: int = 0, dp_address: str | None = None,
               dp_rpc_port: int | None = None, port: int = 8000, enforce_eager: bool = True,
               max_model_len: int | None = None, gpu_memory_utilization: float | None = None,
               ep_num_comms: int = 1, transport: str = "efa", nccl_site: str | Path | None = None,
               extra_env: Mapping[str, str] | None = None, num_experts: int | None = None,
               python: str | None = None, plugin_path: str = DEFAULT_PLUGIN_PATH,
               expert_parallel: bool = True, deepep_dir: str | Path | None = None,
               inherited_pythonpath: str | None = None) -> tuple[list[str], dict[str, str]]:
    """argv and env (variables to set) for one vLLM serve process.

    ``deepep_dir`` (role 'local' only; the image has deep_ep installed): a DeepEP built in place
    on this machine, put on PYTHONPATH behind ``nccl_site`` and before ``inherited_pythonpath``
    (``lib.transport.deepep_pythonpath``).

    The variables to unset are ``lib.transport.unset_vars(transport)``; ``apply_transport``
    applies both to a base environment.
    """
    dp_rpc_port = check_serve_request(
        role, model=model, backend=backend, dp_size=dp_size, dp_size_local=dp_size_local,
        dp_start_rank=dp_start_rank, dp_address=dp_address, dp_rpc_port=dp_rpc_port, port=port,
        enforce_eager=enforce_eager, max_model_len=max_model_len,
        gpu_memory_utilization=gpu_memory_utilization, num_experts=num_experts,
        expert_parallel=expert_parallel)
    env = vllm_env(backend=backend, ep_num_comms=ep_num_comms, transport=transport,
                   nccl_site=nccl_site, plugin_path=plugin_path, extra_env=extra_env)
    if deepep_dir is not None:
        if role != "local":
            raise ParameterError("deepep_dir", deepep_dir,
                                 f"None on role {role!r}: the image has deep_ep installed")
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
