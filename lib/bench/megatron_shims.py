"""What megatron-core needs to train on a machine without CUDA, and on a release without
Transformer Engine: each shim is a few lines with why, applied in the rank's own process only,
never written into megatron-core's files.

`apply()` is called once per rank before the model is built. On a CUDA machine only the first
shim applies (the others are left to the real CUDA calls).
"""
from __future__ import annotations

import contextlib

import torch


class _HostEvent:
    """torch.cuda.Event's surface: on the host every copy is already done."""

    def synchronize(self) -> None:
        pass

    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass


class _HostStream:
    """torch.cuda.Stream's surface the alltoall dispatcher uses for its device-to-host copies of
    the split sizes: on the host there is one stream of work, so waits and events are no-ops."""

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None) -> _HostEvent:
        return _HostEvent()

    def synchronize(self) -> None:
        pass


_HOST_STREAM = _HostStream()


def apply() -> list[str]:
    """Apply the shims this machine needs; the names of those applied (the rank logs them)."""
    applied = [_name_te_gemm()]
    if torch.cuda.is_available():
        return [a for a in applied if a]
    applied += [_host_streams(), _host_device(), _host_rng_tracker(), _host_split_sizes()]
    return [a for a in applied if a]


def _name_te_gemm() -> str | None:
    # 0.16.1's router reads moe_utils.te_general_gemm, which the module binds only when
    # Transformer Engine imports (NameError without it); 0.17.0 binds it to None. The router
    # then takes its torch path, as it does from 0.17 on.
    from megatron.core.transformer.moe import moe_utils
    if hasattr(moe_utils, "te_general_gemm"):
        return None
    moe_utils.te_general_gemm = None
    return "moe_utils.te_general_gemm = None (no Transformer Engine)"


def _host_streams() -> str:
    # The alltoall dispatcher makes a torch.cuda.Stream at construction and copies its split
    # sizes device-to-host on it; torch without CUDA refuses to make one.
    torch.cuda.Stream = lambda *args, **kwargs: _HostStream()
    torch.cuda.Event = lambda *args, **kwargs: _HostEvent()
    torch.cuda.current_stream = lambda *args, **kwargs: _HOST_STREAM
    torch.cuda.stream = lambda stream: contextlib.nullcontext()
    return "torch.cuda streams and events: host no-ops"


def _host_device() -> str:
    # megatron-core's global memory buffer (attention's matmul input) allocates on
    # torch.cuda.current_device(); on the host that device is the CPU.
    torch.cuda.current_device = lambda: "cpu"
    return "torch.cuda.current_device() = 'cpu'"


def _host_rng_tracker() -> str:
    # The model-parallel RNG tracker forks the CUDA generator around expert and tensor-parallel
    # initialisation; there is none on the host. Dropout is off in this run and weights are
    # made on the CPU generator the seed sets, so the tracker that forks nothing is exact here.
    from megatron.core.tensor_parallel import random
    random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    return "RNG tracker: the one that forks nothing (dropout off, CPU initialisation)"


def _host_split_sizes() -> str:
    # The dispatcher turns its split sizes into the host arrays all_to_all_single takes only
    # when they come from a GPU; on the host they stay tensors, which gloo's binding refuses.
    from megatron.core.transformer.moe import token_dispatcher
    to_host = token_dispatcher.maybe_move_tensor_to_cpu

    def host_arrays(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return to_host(tensor, as_numpy=as_numpy, record_stream=record_stream)

    token_dispatcher.maybe_move_tensor_to_cpu = host_arrays
    return "dispatcher split sizes as host arrays on the CPU"
