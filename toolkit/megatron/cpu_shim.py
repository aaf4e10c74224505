"""CPU rehearsal mode for Megatron-Core 0.16, which hard-codes CUDA in a few places (device="cuda" literals,
torch.cuda RNG and device calls, `param.type() == "torch.cuda.FloatTensor"` checks).

Installed only when no GPU is present (`install()` refuses otherwise), so the GPU path never runs through it.
It redirects CUDA device requests to the CPU and answers the CUDA queries Megatron makes; all the real work
(TP/PP collectives on gloo, schedules, DDP, optimizers) is still Megatron-Core's own code.
"""
from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

_installed = False


def _is_cuda(device) -> bool:
    if isinstance(device, int) and not isinstance(device, bool):
        return True  # torch.cuda.current_device() style ordinals
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, str) and device.startswith("cuda")


class _CudaToCpu(TorchFunctionMode):
    """Maps device="cuda..." to the CPU, makes .cuda() a no-op, and names CPU float tensors torch.cuda.* types."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type:
            return _tensor_type(func, args, kwargs)
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


def _tensor_type(func, args, kwargs):
    name = args[1] if len(args) > 1 else kwargs.get("dtype")
    if name is None:
        return func(args[0]).replace("torch.", "torch.cuda.", 1)
    if isinstance(name, str):
        name = name.replace("torch.cuda.", "torch.")
    return func(args[0], name)


# Factory functions also wrapped at module level: code run inside autograd backward (activation recomputation,
# sequence-parallel gradient buffers) runs where no TorchFunctionMode is active.
_FACTORIES = ("empty", "zeros", "ones", "full", "arange", "tensor", "rand", "randn", "randint", "triu", "tril")


def _cpu_factory(fn):
    def wrapper(*args, **kwargs):
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        return fn(*args, **kwargs)

    return wrapper


class _Stream:
    """Stands in for torch.cuda.Stream / Event: CPU work is already in order, so waits and records do nothing."""

    def __init__(self, *a, **k):
        pass

    def wait_stream(self, *a, **k):
        pass

    def record_event(self, *a, **k):
        return _Stream()

    def synchronize(self, *a, **k):
        pass

    def wait(self, *a, **k):
        pass


def _moe_without_cuda() -> None:
    """Megatron-Core 0.16's MoE layer: moe_utils names te_general_gemm only when Transformer Engine imports (its
    own torch.mm fallback then fails with a NameError), and the alltoall token dispatcher copies split sizes to the
    host on a side torch.cuda.Stream, as numpy arrays only when they were on the GPU (CPU tensors reach
    all_to_all_single, which takes sequences of ints). Define the missing name as None (Megatron's fallback), give it
    a stream, and hand it numpy split sizes on the CPU too."""
    from megatron.core.transformer.moe import moe_utils, token_dispatcher  # lazy: Megatron runs only

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    torch.cuda.Stream = torch.cuda.Event = _Stream
    torch.cuda.current_stream = lambda *a, **k: _CURRENT
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
    original = moe_utils.maybe_move_tensor_to_cpu

    def to_host(tensor, as_numpy: bool = False, record_stream: bool = False):
        if as_numpy and torch.is_tensor(tensor):
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    token_dispatcher.maybe_move_tensor_to_cpu = to_host
    _uneven_collectives()


def _uneven_collectives() -> None:
    """Under TP x EP the alltoall dispatcher gathers a different number of tokens from each TP rank (all_gather
    into a list of unequal tensors) and reduce-scatters them back (reduce_scatter from unequal ones), which NCCL
    does and gloo refuses ("invalid tensor size"). On the CPU: gather equal padded tensors and cut them, and
    reduce-scatter as an all_reduce of the whole followed by this rank's slice (the same sums)."""
    dist = torch.distributed
    gather = dist.all_gather

    def all_gather(tensor_list, tensor, group=None, async_op=False):
        if len({t.shape for t in tensor_list} | {tensor.shape}) == 1:
            return gather(tensor_list, tensor, group=group, async_op=async_op)
        rows = max(t.shape[0] for t in tensor_list)
        padded = tensor.new_zeros(rows, *tensor.shape[1:])
        padded[: tensor.shape[0]] = tensor
        bufs = [torch.empty_like(padded) for _ in tensor_list]
        gather(bufs, padded, group=group)
        for out, buf in zip(tensor_list, bufs):
            out.copy_(buf[: out.shape[0]])
        return None

    def reduce_scatter(output, input_list, op=dist.ReduceOp.SUM, group=None, async_op=False):
        whole = torch.cat(list(input_list))
        dist.all_reduce(whole, op=op, group=group)
        start = sum(t.shape[0] for t in input_list[:dist.get_rank(group)])
        output.copy_(whole[start:start + output.shape[0]])
        return None

    dist.all_gather, dist.reduce_scatter = all_gather, reduce_scatter


_CURRENT = _Stream()


def install() -> None:
    """Activate the shim for the rest of the process (idempotent)."""
    global _installed
    if _installed:
        return
    if torch.cuda.is_available():
        raise RuntimeError("the Megatron CPU shim must not be installed on a machine with a GPU")
    import megatron.core.tensor_parallel.random as mrandom  # lazy: Megatron runs only

    cpu_state = lambda *a, **k: torch.get_rng_state()  # noqa: E731
    set_state = lambda state, *a, **k: torch.set_rng_state(state)  # noqa: E731
    for mod in (torch.cuda, torch.cuda.random):
        mod.get_rng_state, mod.set_rng_state = cpu_state, set_state
        mod.manual_seed = lambda seed: None  # CPU init uses the CPU generator (use_cpu_initialization)
    # "cpu", not an ordinal: tensors Megatron creates inside autograd backward (sequence-parallel reduce-scatter
    # buffers) are made where no TorchFunctionMode is active, with device=torch.cuda.current_device()
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.device_count = lambda: 1
    for name in _FACTORIES:
        setattr(torch, name, _cpu_factory(getattr(torch, name)))
    mrandom._get_cuda_rng_state = cpu_state
    mrandom._set_cuda_rng_state = set_state
    _moe_without_cuda()
    _CudaToCpu().__enter__()  # stays active for the life of the process
    _installed = True
