"""Copying bytes between files without holding them: file to file in the kernel (os.copy_file_range), by pwritev
from read-only maps where the ranges are small, or through a bounded buffer where the kernel cannot copy them. The
writers of `toolkit convert` (safetensors files, torch_dist items, Megatron-LM rank files, universal checkpoint files)
copy source byte ranges into their outputs with these (toolkit/checkpoint/byte_ranges.py says which bytes go where).
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import threading
from concurrent.futures import ThreadPoolExecutor, wait

from toolkit.errors import ToolkitError
from toolkit.format import row_gather

_CHUNK = 16 * 2**20  # the bounded buffer of the user-space copy (when copy_file_range cannot be used)
_NO_KERNEL_COPY = {errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.EPERM}
"""copy_file_range errors that mean "not between these files" (another file system, an old kernel, a file system
without it, a sandbox that forbids it): the copy then goes through user space. Any other error is raised."""
_COPY_CHUNK = 32 * 2**20
"""copy_ranges cuts its ranges into copies of at most this many bytes, run on COPY_THREADS threads."""
_THREADS = os.environ.get("TOOLKIT_COPY_THREADS", "").strip()
# not a number: the default, not a ValueError at import, which took every command down (a trial of 2026-12-07)
COPY_THREADS = max(1, int(_THREADS) if _THREADS.isdigit() else min(4, os.cpu_count() or 1))
"""Threads copying one tensor's byte ranges at once (TOOLKIT_COPY_THREADS; 1 copies them in order). The kernel's
copy of cached pages takes a core: one thread left a 2-core machine's second core idle (2.6 s against 1.3 s for
2.7 GiB, both with start_writeback)."""
GATHER_BELOW = 64 * 2**10
"""copy_ranges hands ranges averaging fewer bytes than this (a row-parallel shard: one range a row) to the kernel
from read-only maps of their sources, up to _IOV_MAX in one pwritev, not one copy_file_range each: still one copy,
in the kernel, with far fewer calls (docs/performance.md)."""
_IOV_MAX = 1024  # Linux's IOV_MAX (UIO_MAXIOV): pwritev refuses more buffers than this in one call
_copy_pool: ThreadPoolExecutor | None = None
_copy_pool_lock = threading.Lock()
try:
    _sync_file_range = ctypes.CDLL(None, use_errno=True).sync_file_range
    _sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
except (OSError, AttributeError):  # not Linux
    _sync_file_range = None
try:
    _pwritev = ctypes.CDLL(None, use_errno=True).pwritev  # libc's: its iovec array comes from numpy in one piece
    _pwritev.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64]
    _pwritev.restype = ctypes.c_ssize_t
except (OSError, AttributeError):  # no pwritev in this C library: range by range instead
    _pwritev = None
_SYNC_FILE_RANGE_WRITE = 2
_ALIGN = 4096
"""What a write past the page cache (O_DIRECT) is aligned to, in the file and in memory: a page, so that no page holds
both bytes written past the cache and bytes written through it (a range's unaligned ends go through the cache)."""
DIRECT_MIN = 256 * 2**10
"""Byte ranges shorter than this are always copied through the page cache."""
_DIRECT_CHUNK = 8 * 2**20  # each thread's aligned buffer for writes past the page cache
_direct = {"on": False, "bytes": 0}
_direct_lock = threading.Lock()
_direct_fds: dict[int, tuple[tuple[int, int], int]] = {}  # output fd -> ((st_dev, st_ino), its O_DIRECT fd)
_no_direct: set[int] = set()  # st_dev of file systems that refused O_DIRECT
_staging = threading.local()


@contextlib.contextmanager
def writes_past_cache(on: bool):
    """Within this block, copy_ranges writes the aligned pages of long ranges past the page cache (O_DIRECT: read
    into an aligned buffer, written to the disk from it) where the file system takes it, else through the cache. The
    conversion turns it on when asked (TOOLKIT_DIRECT_IO=1) and it will not read its output back (--no-verify): the
    kernel then neither hands out pages for the output nor evicts the machine's cache to make room, for less CPU
    but the disk's pace (docs/convert.md, "Writes past the page cache"). Leaving it closes the O_DIRECT
    descriptors."""
    with _direct_lock:
        _direct["on"] = on
    try:
        yield
    finally:
        with _direct_lock:
            _direct["on"] = False
            for _, fd in _direct_fds.values():
                os.close(fd)
            _direct_fds.clear()


def direct_total() -> int:
    """Bytes written past the page cache since the process started (the conversion reports its difference)."""
    return _direct["bytes"]


def _direct_fd(out: int) -> int | None:
    """An O_DIRECT descriptor of the file `out` has open (made once, checked by device and inode, since a closed
    descriptor's number is reused), or None: writing past the cache is off, or the file system refused it."""
    if not _direct["on"]:
        return None
    st = os.fstat(out)
    key = (st.st_dev, st.st_ino)
    with _direct_lock:
        if st.st_dev in _no_direct:
            return None
        held = _direct_fds.get(out)
        if held is not None and held[0] == key:
            return held[1]
        if held is not None:  # that number names another file now; the old one is closed, so nothing writes to it
            os.close(_direct_fds.pop(out)[1])
        try:
            fd = os.open(f"/proc/self/fd/{out}", os.O_WRONLY | os.O_DIRECT | os.O_CLOEXEC)
        except OSError:  # a file system without O_DIRECT (tmpfs), or no /proc
            _no_direct.add(st.st_dev)
            return None
        _direct_fds[out] = (key, fd)
        return fd


def _buffer() -> memoryview:
    """This thread's page-aligned buffer (an anonymous map, reused: its pages are handed out once)."""
    if not hasattr(_staging, "view"):
        _staging.view = memoryview(mmap.mmap(-1, _DIRECT_CHUNK))
    return _staging.view


def _write_past_cache(direct: int, fill, to: int, n: int, out: int) -> bool:
    """Write n bytes (a multiple of _ALIGN) at byte `to` (aligned) through the O_DIRECT descriptor `direct`, a buffer
    at a time: fill(view, done) puts bytes [done, done + len(view)) into the view. False, with nothing written, where
    the first write is refused (_direct_write); the caller then writes the range through the cache."""
    buf = _buffer()
    done = 0
    while done < n:
        k = min(len(buf), n - done)
        fill(buf[:k], done)
        if not _direct_write(direct, out, buf[:k], to + done):
            if not done:
                return False
            pwrite_all(out, buf[:k], to + done)  # refused after a first write went through: the rest by the cache
            direct = -1
        done += k
    return True


def _direct_write(direct: int, out: int, view: memoryview, to: int) -> bool:
    """pwrite of a page-aligned view (a multiple of _ALIGN) at byte `to` (aligned) through the O_DIRECT descriptor
    `direct` (-1: refused before). False, with nothing written, where the write is refused (EINVAL: a device that
    wants more than a page of alignment); the file system is then noted, and not tried again."""
    if direct < 0:
        return False
    put = 0
    while put < len(view):
        try:
            put += os.pwrite(direct, view[put:], to + put)
        except OSError as e:
            if e.errno != errno.EINVAL or put:
                raise
            with _direct_lock:
                _no_direct.add(os.fstat(out).st_dev)
            return False
        if put % _ALIGN and put < len(view):  # a short write off the alignment: the rest through the cache
            pwrite_all(out, view[put:], to + put)
            put = len(view)
    with _direct_lock:
        _direct["bytes"] += len(view)
    return True


class _Staged:
    """Bytes handed over in order (add), written from byte `at` of `out`: past the page cache a whole buffer at a
    time (this thread's, so one large write, not one per gathered megabyte), the bytes before the first page
    boundary and after the last through the cache. close() writes what is left."""

    def __init__(self, out: int, at: int, direct: int):
        self.out, self.direct, self.at, self.buf, self.fill = out, direct, at, _buffer(), 0
        self.head = -at % _ALIGN  # bytes still to go through the cache before the first page boundary

    def add(self, view: memoryview) -> None:
        if self.head:
            k = min(self.head, len(view))
            pwrite_all(self.out, view[:k], self.at)
            self.at, self.head, view = self.at + k, self.head - k, view[k:]
        while len(view):
            k = min(len(self.buf) - self.fill, len(view))
            self.buf[self.fill:self.fill + k] = view[:k]
            self.fill, view = self.fill + k, view[k:]
            if self.fill == len(self.buf):
                self._flush()

    def close(self) -> None:
        self._flush()

    def _flush(self) -> None:
        start = self.at  # where buf[0] goes (page-aligned once the head is written)
        body = self.fill // _ALIGN * _ALIGN
        if body and not _direct_write(self.direct, self.out, self.buf[:body], start):
            self.direct = -1
            pwrite_all(self.out, self.buf[:body], start)
        pwrite_all(self.out, self.buf[body:self.fill], start + body)
        self.at, self.fill = start + self.fill, 0


def _read_into(src: int, at: int):
    """fill() for _write_past_cache: positioned reads of the source file from byte `at`."""
    def fill(view: memoryview, done: int) -> None:
        got = 0
        while got < len(view):
            n = os.preadv(src, [view[got:]], at + done + got)
            if n <= 0:
                raise ToolkitError(f"the file being copied from ended {len(view) - got} bytes early (at offset "
                                   f"{at + done + got}): it was truncated while converting; re-copy it")
            got += n
    return fill


def _copy_piece(src: int, at: int, dst: int, to: int, n: int, direct: bool) -> tuple[int, int]:
    """copy_range, or past the page cache (writes_past_cache) for the aligned pages of a long range; returns the
    bytes (the kernel copied, written past the cache)."""
    direct = _direct_fd(dst) if direct and n >= DIRECT_MIN else None
    head = min(n, -to % _ALIGN)
    body = (n - head) // _ALIGN * _ALIGN
    if direct is None or not body or not _write_past_cache(direct, _read_into(src, at + head), to + head, body, dst):
        return copy_range(src, at, dst, to, n), 0
    end = head + body
    return copy_range(src, at, dst, to, head) + copy_range(src, at + end, dst, to + end, n - end), body


def copy_ranges(out: int, at: int, ranges: list[tuple[int | None, int, int]],
                direct: bool = True) -> tuple[int, int, int, int]:
    """Write byte ranges of other files ((file descriptor, offset, count), or (None, 0, count) for zeros), in order,
    into `out` from byte `at`: file to file in the kernel (os.copy_file_range), by pwritev from read-only maps where
    the ranges are small (_gather: a row-parallel shard is one range per row), or through a bounded buffer where the
    kernel cannot copy them; past the page cache the aligned pages of long ranges within writes_past_cache (and
    `direct`: False for a file that reads its bytes back, as a manifest's hash does). Returns the bytes sent each
    way: (kernel, gathered, user, read): `read` ones were read into a buffer and written past the cache; gathered
    ones may be written past it too (direct_total counts every byte written past it)."""
    pieces = []  # (src fd, src offset, dst offset, count) of the ranges from files
    for fd, offset, n in ranges:
        if fd is None:
            zeros = bytes(min(n, _CHUNK))
            for done in range(0, n, len(zeros)):
                pwrite_all(out, memoryview(zeros)[:min(len(zeros), n - done)], at + done)
        else:
            pieces.append((fd, offset, at, n))
        at += n
    total = sum(p[-1] for p in pieces)
    if len(pieces) > 1 and total < GATHER_BELOW * len(pieces) and _gather(out, pieces, direct):
        return 0, total, 0, 0
    copies = [(fd, offset + d, to + d, min(_COPY_CHUNK, n - d)) for fd, offset, to, n in pieces
              for d in range(0, n, _COPY_CHUNK)]
    done = _run_copies(out, copies, direct)
    kernel, read = sum(k for k, _ in done), sum(d for _, d in done)
    return kernel, 0, total - kernel - read, read


def start_writeback(fd: int, offset: int, n: int) -> None:
    """Ask the kernel to start writing these bytes to disk now (Linux's sync_file_range with SYNC_FILE_RANGE_WRITE,
    which does not wait for them), so the disk works while the conversion goes on and the fsync at close() finds
    little left: 0.02 s instead of 0.7-0.9 s for 2.7 GiB here. Elsewhere, or if the call fails, a no-op: close()'s
    fsync still flushes everything."""
    if _sync_file_range is not None and n > 0:
        _sync_file_range(fd, offset, n, _SYNC_FILE_RANGE_WRITE)


def _run_copies(dst: int, copies: list[tuple[int, int, int, int]],
                direct: bool = False) -> list[tuple[int, int]]:
    """_copy_piece of each (src fd, src offset, dst offset, count) into dst; returns the bytes (the kernel copied,
    written past the cache) of each. In batches of about _COPY_CHUNK bytes (a row-parallel shard is one small copy
    per row) on COPY_THREADS threads when there are several batches. Every copy has finished when this returns or
    raises."""
    batches, size = [[]], 0
    for c in copies:
        if size >= _COPY_CHUNK:
            batches.append([])
            size = 0
        batches[-1].append(c)
        size += c[-1]
    done = _in_pool([lambda b=b: [_copy_piece(src, at, dst, to, n, direct) for src, at, to, n in b] for b in batches])
    return [k for batch in done for k in batch]  # the first failure, raised once none is still writing


def _gather(dst: int, copies: list[tuple[int, int, int, int]], direct: bool = False) -> bool:
    """Write (src fd, src offset, dst offset, count) copies into dst from read-only maps of the sources. Where they
    repeat with a short period and fill one stretch of dst (a row-parallel shard: one row of a source shard after
    another), whole periods are gathered a megabyte at a time into a buffer the CPU's cache holds and written by
    pwrite (row_gather): the kernel copies one buffer instead of a thousand iovecs (2.0-2.5 against 0.5-1.1 GiB/s for
    rows of 800-1600 bytes here, with a third of the system time: docs/performance.md). Otherwise one pwritev per
    _IOV_MAX dst-contiguous copies, the iovecs built by numpy, not per copy in Python (0.3 against 1.0 s of CPU for
    160,000 copies of 2 KiB here). Either way in batches on the copy threads. False, with nothing written, where a
    source cannot be mapped or there is no pwritev to call. Sizes are checked first: a map read past a file's end
    would fault, so a source truncated after it was opened is one line."""
    import numpy as np  # lazy: only the gathering paths need it

    if _pwritev is None:
        return False
    table = np.array(copies, dtype=np.int64).reshape(-1, 4)
    fds, offsets, to, sizes = table[:, 0], table[:, 1], table[:, 2], table[:, 3]
    with row_gather.mapped_extents(fds, offsets, sizes, _truncated) as maps:
        if maps is None:  # not a regular file, or a file system that cannot map it
            return False
        runs = [0, *(np.flatnonzero(to[1:] != to[:-1] + sizes[:-1]) + 1).tolist(), len(table)]
        rows = row_gather.periodic(fds, offsets, sizes) if len(runs) == 2 else None
        if rows is not None:
            _in_pool(_row_jobs(dst, int(to[0]), rows, maps, direct))
            return True
        iov = np.empty((len(table), 2), dtype=np.uint64)  # struct iovec {void *base; size_t len;}, in order
        for fd, (base, start) in maps.items():
            mine = fds == fd
            iov[mine, 0] = base.ctypes.data + (offsets[mine] - start).astype(np.uint64)
        iov[:, 1] = sizes
        ends = np.cumsum(sizes)
        batches = []  # dst-contiguous, at most _IOV_MAX copies and about _COPY_CHUNK bytes each
        for first, stop in zip(runs, runs[1:]):
            i = first
            while i < stop:
                room = int(np.searchsorted(ends, (int(ends[i - 1]) if i else 0) + _COPY_CHUNK, side="right"))
                batches.append((i, max(i + 1, min(i + _IOV_MAX, stop, room))))
                i = batches[-1][1]
        _in_pool([lambda i=i, j=j: _pwritev_all(dst, iov[i:j], int(to[i])) for i, j in batches])
        return True


def _truncated(end: int) -> str:
    return f"the file being copied from ends before byte {end}: it was truncated while converting; re-copy it"


def _row_jobs(dst: int, at: int, rows: row_gather.Period, arrays: dict, direct: bool) -> list:
    """Jobs writing periodic rows (row_gather.periodic) into dst from byte `at`, in about _COPY_CHUNK bytes each: each
    gathers a megabyte at a time into its own buffer and pwrites it (within writes_past_cache, `direct`: collects
    them in its thread's buffer, written past the page cache when full, _Staged)."""
    count, period = rows
    width = sum(n for _, _, n, _ in period)
    per = max(1, _COPY_CHUNK // width)

    def job(first: int, stop: int) -> None:
        offset = at + first * width
        past = _direct_fd(dst) if direct and (stop - first) * width >= DIRECT_MIN else None
        staged = _Staged(dst, offset, past) if past is not None else None
        for chunk in row_gather.gathered(rows, arrays, first, stop):
            if staged is not None:
                staged.add(memoryview(chunk).cast("B"))
            else:
                pwrite_all(dst, memoryview(chunk).cast("B"), offset)
            offset += chunk.nbytes
        if staged is not None:
            staged.close()

    return [lambda i=i: job(i, min(count, i + per)) for i in range(0, count, per)]


def _pwritev_all(dst: int, iov, at: int) -> None:
    """One batch of iovecs (rows of an (n, 2) uint64 array), written by pwritev (ctypes releases the GIL) until
    every byte is."""
    import numpy as np  # lazy: only the pwritev path needs it

    left = int(iov[:, 1].sum())
    while left:
        got = _pwritev(dst, iov.ctypes.data, len(iov), at)
        if got < 0:
            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code))
        if got == 0:
            raise ToolkitError(f"writing at byte {at} of the output wrote nothing: the disk may be full")
        at, left = at + got, left - got
        if left:  # a short write: go on from the first byte not written
            ends = np.cumsum(iov[:, 1])
            whole = int(np.searchsorted(ends, got, side="right"))  # the iovecs written whole
            partial = got - (int(ends[whole - 1]) if whole else 0)  # the bytes written of the next one
            iov = iov[whole:].copy()
            iov[0, 0] += partial
            iov[0, 1] -= partial


def _in_pool(jobs: list) -> list:
    """Run the jobs on the shared copy threads (in order, here, when there is one job or one thread); every job has
    finished when this returns or raises, and the first failure is raised."""
    global _copy_pool
    if len(jobs) < 2 or COPY_THREADS == 1:
        return [job() for job in jobs]
    with _copy_pool_lock:
        if _copy_pool is None:
            _copy_pool = ThreadPoolExecutor(COPY_THREADS, thread_name_prefix="toolkit-copy")
    futures = [_copy_pool.submit(job) for job in jobs]
    wait(futures)
    return [f.result() for f in futures]


def pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


def copy_range(src: int, src_offset: int, dst: int, dst_offset: int, n: int) -> int:
    """Copy n bytes between two open files at the given offsets; returns how many of them the kernel copied
    (os.copy_file_range), the rest went through a bounded user-space buffer (no copy_file_range, or the kernel
    refused these two files: another file system, an old kernel, EXDEV / ENOSYS / EOPNOTSUPP)."""
    done = 0
    kernel_copy = getattr(os, "copy_file_range", None)
    if kernel_copy is not None:
        try:
            while done < n:
                got = kernel_copy(src, dst, n - done, src_offset + done, dst_offset + done)
                if got <= 0:
                    raise ToolkitError(f"the file being copied from ended {n - done} bytes early (at offset "
                                       f"{src_offset + done}): it was truncated while converting; re-copy it")
                done += got
        except OSError as e:
            if e.errno not in _NO_KERNEL_COPY:
                raise
    kernel = done
    if done < n:
        buf = memoryview(bytearray(min(n - done, _CHUNK)))
        while done < n:
            got = os.preadv(src, [buf[:min(len(buf), n - done)]], src_offset + done)
            if got <= 0:
                raise ToolkitError(f"the file being copied from ended {n - done} bytes early (at offset "
                                   f"{src_offset + done}): it was truncated while converting; re-copy it")
            pwrite_all(dst, buf[:got], dst_offset + done)
            done += got
    return kernel
