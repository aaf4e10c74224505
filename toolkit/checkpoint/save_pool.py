"""Many small torch.save files written from a few threads, each read back and compared, with the tensors alive at
once bounded in bytes (DeepSpeed's universal checkpoint: three files per parameter, universal.py).

torch.cat, torch.save's record writes and torch.equal release the GIL, so while one thread waits on the disk
(reading the memory-mapped source slices, writing a file, reading it back) another computes: on one core as on
several. The caller makes the tensors lazily (`make()` runs in the worker), after reserving their bytes: a job
whose bytes would pass `budget` waits for earlier ones to finish, so resident memory stays bounded whatever the
thread count. The first failure stops the pool and is raised by the next submit() or by close().
"""
from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from toolkit.errors import ToolkitError
from toolkit.format import safe_load

THREADS = max(1, int(os.environ.get("TOOLKIT_SAVE_THREADS", "4") or 4))
"""Writer threads (TOOLKIT_SAVE_THREADS; 1 writes one file after the other, in order)."""
BUDGET = 384 * 2**20
"""Bytes of tensors made and not yet written and compared, at most (one larger tensor is allowed alone)."""


def save_checked(obj, file: Path) -> None:
    """torch.save(obj, file), then read back (memory-mapped, weights only) and every tensor compared bit for bit."""
    torch.save(obj, file)
    back = safe_load.load_tensors(file)
    pairs = [(obj, back)] if torch.is_tensor(obj) else [(obj[k], back.get(k)) for k in obj if torch.is_tensor(obj[k])]
    if any(not torch.is_tensor(b) or a.dtype != b.dtype or not torch.equal(a, b) for a, b in pairs):
        raise ToolkitError(f"verification failed: {file} reads back different from what was written; nothing was "
                           "written")


def _return_freed_memory() -> None:
    """Buffers of 1 MiB and more from their own memory maps, given back to the system when freed. Otherwise glibc
    keeps freed tensors under its dynamic mmap threshold (up to 32 MiB: most per-parameter tensors) in each
    thread's malloc arena, and with several writer threads hundreds of MiB stay resident after they are freed."""
    try:
        ctypes.CDLL(None).mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD (glibc); elsewhere there is no mallopt
    except (OSError, AttributeError, TypeError):
        pass


class SavePool:
    """submit(file, make, nbytes): save_checked(make(), file) on a worker thread; close() waits for all of them."""

    def __init__(self, threads: int = THREADS, budget: int = BUDGET):
        if threads > 1:
            _return_freed_memory()
        self._pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="toolkit-save")
        self._budget, self._free = budget, budget
        self._cond = threading.Condition()
        self._error: BaseException | None = None
        self._futures: list = []

    def submit(self, file: Path, make: Callable[[], object], nbytes: int) -> None:
        take = min(max(0, nbytes), self._budget)
        with self._cond:
            self._cond.wait_for(lambda: self._free >= take or self._error is not None)
            if self._error is not None:
                raise self._error
            self._free -= take
        self._futures.append(self._pool.submit(self._run, Path(file), make, take))

    def _run(self, file: Path, make, take: int) -> None:
        try:
            if self._error is None:
                save_checked(make(), file)
        except BaseException as e:  # noqa: BLE001 - handed to the submitting thread
            with self._cond:
                self._error = self._error or e
        finally:
            with self._cond:
                self._free += take
                self._cond.notify_all()

    def close(self) -> None:
        """Wait for every file; raise the first failure."""
        self._pool.shutdown(wait=True)
        self._futures.clear()
        if self._error is not None:
            raise self._error

    def __enter__(self) -> SavePool:
        return self

    def __exit__(self, kind, *exc) -> None:
        if kind is not None:  # the caller failed: stop, drop what is queued, let its error through
            with self._cond:
                self._error = self._error or ToolkitError("stopped")
                self._cond.notify_all()
            self._pool.shutdown(wait=True, cancel_futures=True)
            return
        self.close()
