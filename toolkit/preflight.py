"""Preflight: every rank joins the process group and all-reduces a tensor of ones, failing in seconds with a
readable message instead of hanging at the first collective of training. Run it the way training runs:

    torchrun --nproc_per_node 8 --nnodes 2 --node_rank 0 --master_addr n1 --master_port 29500 \
        -m toolkit.preflight --device cuda

On success each node's local rank 0 prints one line; on failure each failing rank prints what to check and the
process exits 1. $TOOLKIT_PREFLIGHT_TIMEOUT (seconds, default 60) bounds joining and the all-reduce.
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from datetime import timedelta

from toolkit.proc import free_port


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def _hint(rank: int, world: int, backend: str, timeout: float, why: str) -> str:
    addr = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
    return (f"error: preflight on {socket.gethostname()}, rank {rank} of {world} ({backend}): {why}\n"
            f"  check that MASTER_ADDR:MASTER_PORT = {addr} is reachable from every node (firewall, port in use),\n"
            f"  that NCCL_SOCKET_IFNAME={os.environ.get('NCCL_SOCKET_IFNAME', '<unset>')} names an interface every "
            f"node has (the Slurm scripts set it from TOOLKIT_NCCL_IFNAME),\n"
            f"  and run `toolkit doctor` on this node (timeout {timeout:g} s: TOOLKIT_PREFLIGHT_TIMEOUT)")


def _check_device(device: str, local_world: int) -> str | None:
    """Why this node cannot run `device` ranks, or None."""
    import torch  # lazy: the network checks run before torch's slow import

    if device != "cuda":
        return None
    if not torch.cuda.is_available():
        return (f"no CUDA device is visible on this node (CUDA_VISIBLE_DEVICES="
                f"{os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}); request GPUs or render the job with --cpu")
    if torch.cuda.device_count() < local_world:
        return f"{local_world} ranks on this node but only {torch.cuda.device_count()} CUDA devices are visible"
    return None


def run(device: str, timeout: float) -> int:
    """Join, all-reduce ones, check the sum is the world size. Returns the exit code."""
    if "RANK" not in os.environ:  # a plain `python -m toolkit.preflight`: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    # c10d logs each failed connection with a C++ stack; the message below says the same in one paragraph
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")
    import torch  # lazy: the network checks run before torch's slow import
    import torch.distributed as dist  # lazy: the network checks run before torch's slow import

    rank, world = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    local_rank, local_world = _env_int("LOCAL_RANK", 0), _env_int("LOCAL_WORLD_SIZE", 1)
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    backend = "nccl" if device == "cuda" else "gloo"
    problem = _check_device(device, local_world)
    if problem:
        print(_hint(rank, world, backend, timeout, problem), file=sys.stderr, flush=True)
        return 1
    if device == "cuda":
        torch.cuda.set_device(local_rank)
    start = time.monotonic()
    try:
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout))
        ones = torch.ones(1, device=device)
        # wait with a timeout on the host: a hung NCCL all-reduce would otherwise end in the watchdog's abort
        dist.all_reduce(ones, async_op=True).wait(timeout=timedelta(seconds=timeout))
        total = ones.item()
    except Exception as e:  # noqa: BLE001 - any failure to join or reduce is the message, not a traceback
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(_hint(rank, world, backend, timeout, f"could not join and all-reduce: {why}"),
              file=sys.stderr, flush=True)
        return 1
    if total != world:
        print(_hint(rank, world, backend, timeout, f"all-reduce of ones gave {total:g}, expected {world}"),
              file=sys.stderr, flush=True)
        return 1
    if local_rank == 0:
        node = os.environ.get("GROUP_RANK", "0")
        print(f"preflight ok: node {node} ({socket.gethostname()}), ranks {rank}-{rank + local_world - 1} of "
              f"{world}: all-reduce sum {total:g} over {backend} in {time.monotonic() - start:.1f} s", flush=True)
    dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m toolkit.preflight", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                    help="cuda: NCCL, and every rank needs a GPU; cpu: gloo; auto: cuda when visible")
    args = ap.parse_args(argv)
    timeout = float(os.environ.get("TOOLKIT_PREFLIGHT_TIMEOUT", "60"))
    code = run(args.device, timeout)
    if code:
        # a half-joined process group can hang the interpreter's teardown; leave at once
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
