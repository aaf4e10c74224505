"""Process-group setup for any launcher (deepspeed, torchrun, srun, or a plain single process)."""
from __future__ import annotations

import os
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from toolkit.proc import free_port


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: str  # "cuda" or "cpu"


def init_distributed(with_deepspeed: bool = True) -> DistInfo:
    """Join (or create) the default process group: nccl on GPUs, gloo on CPU. With DeepSpeed (its backend), through
    deepspeed.init_distributed, whose accelerator picks device and backend. Without (the Megatron backend), through
    torch alone: importing DeepSpeed (400 modules) and loading its CPU shared-memory op only to open a process group
    cost the Megatron path about 0.2 s of start-up per rank (bench/overhead.py)."""
    if "RANK" not in os.environ:  # a plain `python recipes/train.py`: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", 1)))
    if with_deepspeed:
        from deepspeed.accelerator import get_accelerator  # lazy: DeepSpeed paths only

        device = "cuda" if get_accelerator().device_name() == "cuda" else "cpu"
    else:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        torch.cuda.set_device(local_rank)
    elif "OMP_NUM_THREADS" not in os.environ:
        # ranks on one CPU share its cores; oversubscription makes every rank slower
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    if with_deepspeed:
        import deepspeed  # lazy: DeepSpeed paths only

        # DeepSpeed 0.19 calls torch's deprecated reduce_scatter_tensor and all_gather_into_tensor every ZeRO step;
        # the warnings are not the user's
        warnings.filterwarnings("ignore", message=r".*(reduce_scatter_tensor|all_gather_into_tensor).* is deprecated")
        deepspeed.init_distributed(verbose=False)
        if device == "cpu":
            _unlink_shared_buffer()
    elif not dist.is_initialized():
        # what deepspeed.init_distributed does on GPUs: bind the device (torch then splits NCCL communicators
        # for new groups instead of creating them from scratch), except in a world of one, which has no peer
        bind = device == "cuda" and int(os.environ.get("WORLD_SIZE", "1")) > 1
        dist.init_process_group("nccl" if device == "cuda" else "gloo",
                                device_id=torch.device("cuda", local_rank) if bind else None)
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, local_world, device)


def shared_buffer(rank: int) -> Path:
    """The file in /dev/shm that DeepSpeed's CPU shared-memory allreduce (deepspeed/ops/csrc/cpu/comm/shm.cpp, built
    when every rank is on one host) creates for `rank` of this run: named by user id, MASTER_ADDR and MASTER_PORT."""
    return Path("/dev/shm") / (f"deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_"
                               f"{os.environ.get('MASTER_PORT', '')}_{rank}")


def _unlink_shared_buffer() -> None:
    """DeepSpeed 0.19 never unlinks the 66 MiB buffer each rank creates in /dev/shm, so every CPU run used to leave
    them in memory until the machine rebooted (30 files, 2 GiB, after a day of tests here). Once every rank has
    mapped every other's (the barrier: DeepSpeed maps them all while initialising), each rank removes its own name;
    the maps stay valid until the process exits, so nothing is left behind, even by a run that fails later."""
    dist.barrier()
    try:
        shared_buffer(dist.get_rank()).unlink()
    except FileNotFoundError:  # no shared-memory op (ranks on several hosts, or not built)
        pass


@contextmanager
def rank_zero_first():
    """Rank 0 runs the body first (e.g. fills a cache); the others run it after."""

    if dist.get_rank() != 0:
        dist.barrier()
    yield
    if dist.get_rank() == 0:
        dist.barrier()


def shutdown() -> None:
    """Leave the process group together. Exiting with it alive lets the interpreter tear down while the
    communication threads still run, which intermittently aborts a rank ("terminate called without an active
    exception") after the work is done."""

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
