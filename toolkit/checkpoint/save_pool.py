"""Many small torch.save files written from a few threads, each read back and compared, with the tensors alive at
once bounded in bytes (DeepSpeed's universal checkpoint: three files per parameter, universal.py). A file whose
tensor lies in other files as byte ranges is written around a hole that the kernel then fills (save_ranges).

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

from toolkit.checkpoint.pt_skeleton import bytes_around
from toolkit.errors import ToolkitError
from toolkit.format import safe_load
from toolkit.format.file_copy import copy_range, pwrite_all

THREADS = max(1, int(os.environ.get("TOOLKIT_SAVE_THREADS", "4") or 4))
"""Writer threads (TOOLKIT_SAVE_THREADS; 1 writes one file after the other, in order)."""
_BLOCK = 8 * 2**20  # save_ranges' read-back compares this many bytes at a time
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


_LOCAL = threading.local()


def _buffer() -> bytearray:
    """This thread's read-back buffer of _BLOCK bytes (allocated once: a fresh 8 MiB buffer per read would be mapped
    and zeroed by the kernel each time)."""
    if not hasattr(_LOCAL, "buffer"):
        _LOCAL.buffer = bytearray(_BLOCK)
    return _LOCAL.buffer


_AROUND: dict = {}
"""(file name, template signature) -> (the torch.save bytes before the tensor's, those after it)."""


def _signature(obj):
    """What torch.save's bytes of `obj` depend on (tensors by shape, dtype, strides and storage size), or None for
    an object this does not describe (that file is then saved on its own)."""
    if torch.is_tensor(obj):
        return ("tensor", tuple(obj.shape), str(obj.dtype), obj.stride(), obj.storage_offset(),
                obj.untyped_storage().nbytes())
    if obj is None or type(obj) in (bool, int, float, str):
        return (type(obj).__name__, obj)
    if type(obj) is dict:
        items = tuple((_signature(k), _signature(v)) for k, v in obj.items())
        return None if any(a is None or b is None for a, b in items) else ("dict", items)
    return None


def _first(template, file: Path, pieces: list[torch.Tensor]) -> tuple[bytes, bytes]:
    """torch.save(template, file) with the tensor's bytes skipped, checked to hold one tensor of the pieces' size and
    dtype; returns the file's bytes before and after that tensor's (pt_skeleton.bytes_around)."""
    head, tail, flat = bytes_around(template, file)
    if flat is None or flat.numel() != sum(p.numel() for p in pieces) or any(p.dtype != flat.dtype for p in pieces):
        raise ToolkitError(f"internal: {file} does not hold one tensor of its pieces' size and dtype")
    return head, tail


def save_ranges(template, file: Path, ranges: list[tuple[int, int, int]], pieces: list[torch.Tensor]) -> None:
    """torch.save(template, file) with its one tensor's bytes left out (torch's skip_data: a hole in the file), then
    those bytes copied into it file to file, in the kernel, from `ranges` ((fd, offset, count) in the source files,
    whose tensors are `pieces`, in order), at the offset its map_location="meta" load gives (a file holding one
    tensor of their size and dtype); read back and compared with `pieces` (the memory-mapped tensors themselves, not
    the ranges) bit for bit. No tensor is copied in this process but through the read-back's 8 MiB buffer.
    torch.load does not check the zip records' CRC-32, which skip_data leaves that of the hole.

    torch.save's bytes depend only on the object and the file's name (the zip's folder), so the bytes around the
    tensor are kept per (name, template) after the first such file: the next ones are written as those bytes, the
    copied tensor bytes and the rest, in file order, with no torch.save and no load (most of the time they took)."""
    key = _signature(template)
    key = key and (file.name, key)
    around = _AROUND.get(key) if key else None
    if around is None:
        around = _first(template, file, pieces)
        if key:
            _AROUND[key] = around
    head, tail = around
    fd = os.open(file, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        pwrite_all(fd, memoryview(head), 0)
        at = start = len(head)
        for src, offset, n in ranges:
            copy_range(src, offset, fd, at, n)
            at += n
        pwrite_all(fd, memoryview(tail), at)
        os.ftruncate(fd, at + len(tail))
        at = start  # read back through a reused buffer, against the pieces' own (memory-mapped) bytes
        mine = _buffer()
        for piece in pieces:
            flat = piece.reshape(-1).view(torch.uint8)
            for done in range(0, flat.numel(), _BLOCK):
                k = min(_BLOCK, flat.numel() - done)
                got = os.preadv(fd, [memoryview(mine)[:k]], at + done)
                if got != k or not _same(mine, flat.data_ptr() + done, k):
                    raise ToolkitError(f"verification failed: {file} reads back different from what was copied into "
                                       "it; nothing was written")
            at += flat.numel()
    finally:
        os.close(fd)


_MEMCMP = ctypes.CDLL(None).memcmp
_MEMCMP.argtypes, _MEMCMP.restype = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t), ctypes.c_int


def _same(buffer: bytearray, address: int, n: int) -> bool:
    """The first n bytes of buffer equal the n at address: libc's memcmp, in place (slicing the buffer would copy
    it into freshly mapped memory for every block that is not a whole one) and without the GIL (ctypes drops it)."""
    return _MEMCMP(ctypes.addressof(ctypes.c_char.from_buffer(buffer)), address, n) == 0


def _return_freed_memory() -> None:
    """Buffers of 1 MiB and more from their own memory maps, given back to the system when freed. Otherwise glibc
    keeps freed tensors under its dynamic mmap threshold (up to 32 MiB: most per-parameter tensors) in each
    thread's malloc arena, and with several writer threads hundreds of MiB stay resident after they are freed."""
    try:
        ctypes.CDLL(None).mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD (glibc); elsewhere there is no mallopt
    except (OSError, AttributeError, TypeError):
        pass


class SavePool:
    """submit(file, make, nbytes): save_checked(make(), file) on a worker thread; submit_ranges: save_ranges; close()
    waits for all of them."""

    def __init__(self, threads: int = THREADS, budget: int = BUDGET):
        if threads > 1:
            _return_freed_memory()
        self._pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="toolkit-save")
        self._budget, self._free = budget, budget
        self._cond = threading.Condition()
        self._error: BaseException | None = None
        self._futures: list = []

    def submit_ranges(self, file: Path, template: Callable[[], object], ranges: list, pieces: list) -> None:
        """save_ranges(template(), file, ranges, pieces) on a worker thread: the bytes go file to file, so no
        memory is reserved (the template's tensor is never touched)."""
        self._queue(lambda: save_ranges(template(), Path(file), ranges, pieces), 0)

    def submit(self, file: Path, make: Callable[[], object], nbytes: int) -> None:
        self._queue(lambda: save_checked(make(), Path(file)), nbytes)

    def _queue(self, job: Callable[[], None], nbytes: int) -> None:
        take = min(max(0, nbytes), self._budget)
        with self._cond:
            self._cond.wait_for(lambda: self._free >= take or self._error is not None)
            if self._error is not None:
                raise self._error
            self._free -= take
        self._futures.append(self._pool.submit(self._run, job, take))

    def _run(self, job: Callable[[], None], take: int) -> None:
        try:
            if self._error is None:
                job()
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
