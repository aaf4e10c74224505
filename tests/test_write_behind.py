"""convert's write-behind (toolkit/checkpoint/streaming.py WriteBehind): with two workers, parameters are written at
once, each into a file the other is not writing where its parameter has one, and a barrier (a Megatron-LM target's stage
end, which finishes the stage's files) runs only after every write before it has finished, and before any after it
starts."""
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


class _File:
    """One output file's writer: its writes are logged in the shared _Log."""

    def __init__(self, log: _Log):
        self.log = log

    def write(self, key, value) -> int:
        t0 = time.monotonic()
        if key in ("a", "b"):
            self.log.together.wait()  # one worker: BrokenBarrierError after the timeout, raised by WriteBehind
        time.sleep(0.2 if key == "slow" else 0.01)
        with self.log.lock:
            self.log.spans[key or "barrier"] = (t0, time.monotonic())
        return 1


def test_barrier_waits_for_every_write_before_it_and_holds_back_those_after():
    log = _Log()
    one, two = _File(log), _File(log)
    with WriteBehind(Progress(6, enabled=False), workers=2) as behind:
        behind.submit([(one, "a", 1)])
        behind.submit([(two, "b", 1)])
        behind.submit([(one, "slow", 1)])
        behind.submit([(two, "last of the stage", 1), (one, None, None)])
        behind.submit([(one, "next stage", 1)])
    s = log.spans
    assert s["a"][0] < s["b"][1] and s["b"][0] < s["a"][1], "two workers write two parameters at once"
    assert s["barrier"][0] >= max(s[k][1] for k in ("a", "b", "slow", "last of the stage"))
    assert s["next stage"][0] >= s["barrier"][1]


def test_megatron_lm_rank_files_take_concurrent_writes():
    """Megatron-LM targets get the same two writers as the safetensors targets (pt_skeleton writes in place)."""
    assert writers(MegatronLMTarget) == writers(type("Safetensors", (), {"concurrent_writes": True})) == 2


class _Counted:
    """A file whose writes count how many started while another write into it was running."""

    lock = threading.Lock()

    def __init__(self):
        self.now, self.clashes, self.keys = 0, 0, []

    def write(self, key, value) -> int:
        with self.lock:
            self.clashes += self.now > 0
            self.now += 1
        time.sleep(0.005)
        with self.lock:
            self.now -= 1
            self.keys.append(key)
        return 1


def test_a_worker_takes_a_write_into_a_file_no_other_worker_is_writing():
    """A buffered write holds its file's lock throughout, so a second write into that file only queues (spinning):
    each worker takes the first of its parameter's writes whose file is free, else the first."""
    one, two = _Counted(), _Counted()
    with WriteBehind(Progress(0, enabled=False), workers=2) as behind:
        behind._writing[id(one)] += 1  # another worker is writing `one`
        todo = [(one, "x", 1), (two, "y", 1)]
        assert behind._next_free(todo)[0] is two and todo == [(one, "x", 1)]
        assert behind._next_free(todo)[0] is one and not todo  # every file busy: it goes ahead (one file: HF)


def test_shards_written_in_the_same_order_by_two_workers_seldom_meet_in_a_file():
    """Each parameter writes its TP shards into four files in the same order (as a TP4 target's rank files are
    given): taken in that order, the two workers met in a file at half the writes (80 of 160 here); they take free
    files instead, every other parameter starting from the middle of its files (none met here). Every write is made
    once."""
    files = [_Counted() for _ in range(4)]
    with WriteBehind(Progress(160, enabled=False), workers=2) as behind:
        for p in range(40):
            behind.submit([(f, (p, r), 1) for r, f in enumerate(files)])
    assert all(sorted(f.keys) == [(p, r) for p in range(40)] for r, f in enumerate(files))
    assert sum(f.clashes for f in files) <= 16, [f.clashes for f in files]  # of 160 writes


def test_progress_prints_its_total_once_when_writes_go_past_it(capsys):
    """Serialized bytes may exceed the tensors' total: each write past it printed the same "0.01 / 0.01 GiB" line
    again (ten lines in a trial of 2026-12-07, not on a terminal)."""
    bar = Progress(10)
    for n in (4, 6, 1, 1, 1):
        bar.add(n)
    lines = capsys.readouterr().err.splitlines()
    # in the total's unit (it printed 0.00 / 0.00 GiB for anything under 5 MiB until 2026-12-07)
    assert len(lines) == 1 and lines[0].startswith("converting: 10 / 10 bytes"), lines
