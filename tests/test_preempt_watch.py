"""PreemptionWatch on 2 real gloo ranks: a signal on one rank reaches every rank at the same step boundary, one
boundary after the one where it was posted, and a boundary never waits for a slower rank."""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import torch.multiprocessing as mp

from toolkit.proc import free_port


def _ranks(rank: int, world: int, port: int, out: str, scenario: str) -> None:
    import torch.distributed as dist

    from toolkit.train.preempt import PreemptionWatch

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    watch = PreemptionWatch()
    record: dict = {"answers": [], "seconds": []}
    try:
        for boundary in range(1, 6):
            if scenario == "signal" and rank == 1 and boundary == 3:
                os.kill(os.getpid(), signal.SIGUSR1)  # the real handler notes it, as under Slurm
            if scenario == "slow" and rank == 1 and boundary == 1:
                time.sleep(3)  # a straggler: rank 0 reaches the boundary 3 s earlier
            t0 = time.perf_counter()
            stop = watch.agreed()
            record["seconds"].append(time.perf_counter() - t0)
            record["answers"].append(stop)
            if stop:
                break
        record["pending_before_settle"] = watch._pending is not None
        watch.settle()
        record["pending_after_settle"] = watch._pending is not None
        record["name"] = watch.name
    finally:
        watch.close()
    Path(out, f"rank{rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


def _run(tmp_path: Path, scenario: str) -> list[dict]:
    mp.spawn(_ranks, args=(2, free_port(), str(tmp_path), scenario), nprocs=2, join=True)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


def test_a_signal_on_one_rank_stops_every_rank_at_the_same_boundary(tmp_path):
    ranks = _run(tmp_path, "signal")
    # posted at boundary 3 (rank 1 was signalled just before it), read at boundary 4, on both ranks
    assert [r["answers"] for r in ranks] == [[False, False, False, True]] * 2
    assert ranks[1]["name"] == "SIGUSR1" and ranks[0]["name"] == "a signal on another rank"
    assert not any(r["pending_before_settle"] for r in ranks)  # once agreed, nothing more is posted


def test_a_boundary_does_not_wait_for_a_slower_rank_and_settle_finishes_the_last_check(tmp_path):
    ranks = _run(tmp_path, "slow")
    assert [r["answers"] for r in ranks] == [[False] * 5] * 2
    # rank 0's first boundary only posts its flag; the wait for rank 1 moves to its second boundary
    assert ranks[0]["seconds"][0] < 1.0 and ranks[0]["seconds"][1] > 1.5, ranks[0]["seconds"]
    assert all(r["pending_before_settle"] and not r["pending_after_settle"] for r in ranks)


# A library that waits in a system call while the signal lands: read() on a pipe through ctypes, as a C or C++
# reader calls it (Python's own calls retry EINTR; most libraries' do not). The signal goes to the reading thread.
_READ_THROUGH_A_SIGNAL = """
import ctypes, os, signal, sys, threading, time
from toolkit.train import preempt
watch = preempt.watch_early() if sys.argv[1] == "early" else preempt.PreemptionWatch()
r, w = os.pipe()
reader = threading.get_ident()
def later():
    time.sleep(0.3)
    signal.pthread_kill(reader, signal.SIGUSR1)
    time.sleep(0.3)
    os.write(w, b"x")
threading.Thread(target=later).start()
libc = ctypes.CDLL(None, use_errno=True)
got = libc.read(r, ctypes.create_string_buffer(1), 1)
noted = len(preempt._EARLY) if watch is None else watch.count
print(got, ctypes.get_errno(), noted)
"""


def test_a_noted_signal_does_not_fail_a_librarys_system_call():
    """The handlers are installed with SA_RESTART: the read finishes with its byte (Python's default handler makes
    it fail with EINTR, errno 4) and the signal is still noted."""
    import subprocess
    import sys

    for which in ("early", "watch"):
        out = subprocess.run([sys.executable, "-c", _READ_THROUGH_A_SIGNAL, which], capture_output=True, text=True,
                             timeout=120, cwd=Path(__file__).resolve().parents[1])
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.split() == ["1", "0", "1"], (which, out.stdout)
