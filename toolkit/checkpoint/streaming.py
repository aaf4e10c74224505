"""The write side of `toolkit convert`'s stream, shared by its two paths (toolkit/checkpoint/convert.py, and the
torch-free toolkit/checkpoint/copy_only.py): the progress line, the write-behind thread, and the source's checksums
checked in the background."""
from __future__ import annotations

import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from toolkit.checkpoint.output import size_text
from toolkit.errors import ToolkitError
from toolkit.format import file_copy, manifest


class Progress:
    """Bytes written, rate and ETA on stderr: one updating line on a terminal, a line every 10 s otherwise."""

    def __init__(self, total: int, enabled: bool = True):
        self.total, self.done, self.enabled = total, 0, enabled
        self.start = self.last = time.monotonic()
        self.tty = sys.stderr.isatty()
        self.ended = False  # the total's line is printed once (writes past the total printed it again each)

    def add(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if self.enabled and not self.ended and (now - self.last > (0.5 if self.tty else 10)
                                                or self.done >= self.total):
            self.last, self.ended = now, self.done >= self.total
            rate = self.done / max(now - self.start, 1e-9)
            eta = max(self.total - self.done, 0) / rate if rate else 0  # serialized bytes may exceed the tensors
            done, total = size_text(self.done, self.total).split(" ")[0], size_text(self.total)
            line = (f"converting: {done} / {total}, "
                    f"{rate / 2**20:.0f} MiB/s, ETA {eta:.0f} s")
            print(("\r" + line) if self.tty else line, end="" if self.tty and self.done < self.total else "\n",
                  file=sys.stderr, flush=True)


WRITERS = 2
"""Parameters written at once into a target whose files take concurrent writes (`concurrent_writes`: the
safetensors targets, Megatron-LM's rank files and torch_dist's item files). With one, copying HF -> TP2 x PP2 at
1.1B left a core idle on the 2-core test machine (a tensor of one byte range is one copy_file_range call): 2.7 s
against 2.2 s with two (docs/performance.md)."""


def writers(target) -> int:
    """WriteBehind's workers for this target."""
    return WRITERS if getattr(target, "concurrent_writes", False) else 1


class WriteBehind:
    """Writes run on `workers` background threads (pwrite and copy_file_range release the GIL) while the next
    parameter is read and split. At most `depth` parameters wait to be written, so memory stays a few parameters'
    worth. More than one worker needs writers that take concurrent writes (`concurrent_writes`). A write whose key
    and value are None is a barrier (a Megatron-LM target's stage end, which finishes the stage's files): the
    parameter holding it is written on the calling thread once every write before it has finished, and nothing
    after it starts before it is done. `seconds` is the time from the
    first write's start to the last one's end. Files that hash themselves as they are written (Writer.track_hash) are
    caught up on another thread after each write, overlapped with the next ones."""

    def __init__(self, bar: Progress, depth: int = 2, workers: int = 1):
        self.pool, self.pending, self.bar, self.depth = ThreadPoolExecutor(workers), [], bar, max(depth, workers + 1)
        self.workers = workers
        self.hasher, self.hashing, self._lock = ThreadPoolExecutor(1), [], threading.Lock()
        self._writing: Counter[int] = Counter()  # id() of a file writer -> its writes running now (_next_free)
        self._submitted = 0
        self.seconds = self.hash_seconds = 0.0
        self._first = self._last = None
        self.direct_from = file_copy.direct_total()  # report() takes what is written past the page cache from here

    def submit(self, writes: list) -> None:
        barrier = any(k is None and t is None for _, k, t in writes)
        while self.pending and (barrier or len(self.pending) >= self.depth):
            self.bar.add(self.pending.pop(0).result())
        if barrier:
            self.bar.add(self._run(writes))
        else:
            # every other parameter from the middle of its files, so that two workers start apart (_next_free)
            turn = self._submitted % self.workers * len(writes) // self.workers
            self._submitted += 1
            self.pending.append(self.pool.submit(self._run, writes[turn:] + writes[:turn]))

    def _run(self, writes: list) -> int:
        t0 = time.monotonic()
        n, todo = 0, list(writes)
        while todo:
            w, k, t = self._next_free(todo)
            try:
                n += w.write_ranges(k, t) if isinstance(t, list) else w.write(k, t)
            finally:
                with self._lock:
                    self._writing[id(w)] -= 1
        touched = list({id(w): w for w, _, _ in writes if getattr(w, "tracks_hash", False)}.values())
        with self._lock:
            self._first = t0 if self._first is None else min(self._first, t0)
            self._last = time.monotonic()
            self.seconds = self._last - self._first
            if touched:
                self.hashing = [f for f in self.hashing if not f.done() or f.result()]  # result() raises its error
                self.hashing.append(self.hasher.submit(self._catch_up, touched))
        return n

    def _next_free(self, todo: list) -> tuple:
        """Take from `todo` (one parameter's writes, a file each) the first write into a file that no other worker is
        writing, else the first. A buffered write holds its file's inode lock throughout (ext4's), so two writes
        into one file queue on it, the second one's core spinning, while two threads writing two files take half
        the time of one (docs/performance.md, 2026-12-06 17:00 UTC). The shards of a TP target's parameter go into as
        many files, which the workers would otherwise take in the same order. Where all its files are busy (a
        Hugging Face target's one file) the write goes ahead: waiting for the file was slower there."""
        with self._lock:
            i = next((i for i, (w, _, _) in enumerate(todo) if not self._writing[id(w)]), 0)
            w, k, t = todo.pop(i)
            self._writing[id(w)] += 1
        return w, k, t

    def _catch_up(self, writers: list) -> None:
        t0 = time.monotonic()
        for w in writers:
            w.catch_up()
        self.hash_seconds += time.monotonic() - t0

    def __enter__(self) -> WriteBehind:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        try:
            while self.pending and exc_type is None:
                self.bar.add(self.pending.pop(0).result())
        finally:
            self.pool.shutdown(wait=True, cancel_futures=True)
            self.hasher.shutdown(wait=True, cancel_futures=exc_type is not None)
        if exc_type is None:
            for f in self.hashing:
                f.result()


class SourceCheck:
    """A toolkit checkpoint source's checksums, checked on a background thread while the conversion reads it
    (open_source checked its manifest's sizes). wait() raises what the manifest check found; so does leaving the
    block on any error: a damaged source is reported as damaged, whatever failed first, and nothing is written."""

    def __init__(self, folder: Path | None):
        self.folder, self.pool = folder, ThreadPoolExecutor(1) if folder is not None else None
        self.future = self.pool.submit(manifest.verify, folder) if self.pool else None

    def wait(self) -> None:
        problems = self.future.result() if self.future else []
        if problems:
            raise ToolkitError(f"{self.folder} is not a complete checkpoint: {'; '.join(problems)}")

    def __enter__(self) -> SourceCheck:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        try:
            if exc_type is not None and issubclass(exc_type, Exception):
                self.wait()
        finally:
            if self.pool:
                self.pool.shutdown(wait=True, cancel_futures=True)


def report(target, behind: WriteBehind, t0: float, read_s: float, split_s: float, hash_s: float, log,
           verbose: bool) -> None:
    """Close the target (its files flushed, its manifest made) and log what was written, and with `verbose` where
    the time went (read/hash/split on the main thread; write and manifest-hash overlapped) and how the bytes went
    (bench/convert.py reads these lines)."""
    t3 = time.monotonic()
    writers = getattr(target, "writers", [])
    writers = list(writers.values() if isinstance(writers, dict) else writers)
    kernel, gathered, user, read = (sum(getattr(w, attr, 0) for w in writers)
                                    for attr in ("kernel_bytes", "gathered_bytes", "user_bytes", "read_bytes"))
    target.close()
    log(f"wrote {size_text(target.total)} in {time.monotonic() - t0:.1f} s")
    if verbose:
        threads = "writer thread" if behind.workers == 1 else f"{behind.workers} writer threads"
        log(f"phases: read {read_s - hash_s:.1f} s, hash {hash_s:.1f} s, split {split_s:.1f} s (main thread); write "
            f"{behind.seconds:.1f} s ({threads}, overlapped); manifest-hash {behind.hash_seconds:.1f} s (hash "
            f"thread, overlapped); close/fsync/manifest {time.monotonic() - t3:.1f} s")
        direct = file_copy.direct_total() - behind.direct_from
        log(f"copied file to file: {kernel / 2**20:.1f} MiB by copy_file_range, {gathered / 2**20:.1f} MiB by "
            f"gathering from the mapped source (small ranges), {read / 2**20:.1f} MiB by reads into a buffer, "
            f"{user / 2**20:.1f} MiB through a buffer where the kernel would not copy (of {size_text(target.total)}); "
            f"{direct / 2**20:.1f} MiB of them written past the page cache (O_DIRECT)")

