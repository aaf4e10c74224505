"""convert's write-behind (toolkit/checkpoint/streaming.py WriteBehind): with two workers, parameters are written at
once, and a barrier (a Megatron-LM target's stage end, which finishes the stage's files) runs only after every write
before it has finished, and before any after it starts."""
from __future__ import annotations

import threading
import time

from toolkit.checkpoint.megatron_lm_write import MegatronLMTarget
from toolkit.checkpoint.streaming import Progress, WriteBehind, writers


class _Log:
    def __init__(self):
        self.spans: dict[str, tuple[float, float]] = {}
        self.lock = threading.Lock()
        self.together = threading.Barrier(2, timeout=30)  # "a" and "b" pass it only if both are being written at once

    def write(self, key, value) -> int:
        t0 = time.monotonic()
        if key in ("a", "b"):
            self.together.wait()  # one worker: BrokenBarrierError after the timeout, raised by WriteBehind
        time.sleep(0.2 if key == "slow" else 0.01)
        with self.lock:
            self.spans[key or "barrier"] = (t0, time.monotonic())
        return 1


def test_barrier_waits_for_every_write_before_it_and_holds_back_those_after():
    log = _Log()
    with WriteBehind(Progress(6, enabled=False), workers=2) as behind:
        behind.submit([(log, "a", 1)])
        behind.submit([(log, "b", 1)])
        behind.submit([(log, "slow", 1)])
        behind.submit([(log, "last of the stage", 1), (log, None, None)])
        behind.submit([(log, "next stage", 1)])
    s = log.spans
    assert s["a"][0] < s["b"][1] and s["b"][0] < s["a"][1], "two workers write two parameters at once"
    assert s["barrier"][0] >= max(s[k][1] for k in ("a", "b", "slow", "last of the stage"))
    assert s["next stage"][0] >= s["barrier"][1]


def test_megatron_lm_rank_files_take_concurrent_writes():
    """Megatron-LM targets get the same two writers as the safetensors targets (pt_skeleton writes in place)."""
    assert writers(MegatronLMTarget) == writers(type("Safetensors", (), {"concurrent_writes": True})) == 2
