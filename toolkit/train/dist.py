"""Process-group setup for any launcher (deepspeed, torchrun, srun, or a plain single process)."""
from __future__ import annotations

import os
import socket
import warnings
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: str  # "cuda" or "cpu"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed() -> DistInfo:
    """Join (or create) the default process group: nccl on GPUs, gloo on CPU, as DeepSpeed's accelerator picks."""
    if "RANK" not in os.environ:  # a plain `python recipes/train.py`: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    import deepspeed
    import torch
    from deepspeed.accelerator import get_accelerator

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", 1)))
    device = "cuda" if get_accelerator().device_name() == "cuda" else "cpu"
    if device == "cuda":
        torch.cuda.set_device(local_rank)
    elif "OMP_NUM_THREADS" not in os.environ:
        # ranks on one CPU share its cores; oversubscription makes every rank slower
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    # DeepSpeed 0.19 calls torch's deprecated reduce_scatter_tensor every ZeRO step; the warning is not the user's
    warnings.filterwarnings("ignore", message=r".*reduce_scatter_tensor.* is deprecated")
    deepspeed.init_distributed(verbose=False)
    import torch.distributed as dist

    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, local_world, device)


@contextmanager
def rank_zero_first():
    """Rank 0 runs the body first (e.g. fills a cache); the others run it after."""
    import torch.distributed as dist

    if dist.get_rank() != 0:
        dist.barrier()
    yield
    if dist.get_rank() == 0:
        dist.barrier()


def shutdown() -> None:
    """Leave the process group together. Exiting with it alive lets the interpreter tear down while the
    communication threads still run, which intermittently aborts a rank ("terminate called without an active
    exception") after the work is done."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
