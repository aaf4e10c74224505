"""Byte ranges that repeat with a short period (a row-parallel TP shard, or a row-parallel weight merged from its
shards: one short range per row of each shard), gathered into a buffer that stays in the CPU's cache, a megabyte at
a time, by a few numpy copies instead of one call per range. The converter's writes (toolkit/format/file_copy.py)
and the verification's hashes of the weights where they lie (toolkit/checkpoint/verify_hash.py) both read them so.
"""
from __future__ import annotations

import mmap
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from toolkit.errors import ToolkitError

if TYPE_CHECKING:
    import numpy as np

GATHER = 1 << 20
"""Bytes gathered at a time: a buffer the CPU's cache holds, so the copy into it and the read of it (by the kernel's
write, or by the hash) cost little beyond reading the source."""

Period = tuple[int, list[tuple[int, int, int, int]]]
"""(count of periods, [(file descriptor, first offset, byte count, stride)] for each range of a period)."""


@contextmanager
def mapped_extents(fds, offsets, sizes, truncated: Callable[[int], str]) -> Iterator[dict | None]:
    """Read-only maps of the extent each file's ranges (equal-length sequences of file descriptor, offset and byte
    count) cover: {fd: (uint8 array over the map, the file offset of its first byte)}, the form gathered() takes; None
    where a file cannot be mapped (not a regular file, a file system without maps: read it instead). A file shorter
    than its ranges' end is a ToolkitError with the message truncated(that end): a map read past a file's end would
    fault. The maps are closed on leaving, and the dict emptied."""
    import numpy as np  # lazy: as below

    fds, offsets = np.asarray(fds, dtype=np.int64), np.asarray(offsets, dtype=np.int64)
    ends = offsets + np.asarray(sizes, dtype=np.int64)
    maps: list = []
    arrays: dict | None = {}
    try:
        for fd in np.unique(fds).tolist():
            mine = fds == fd
            lo, hi = int(offsets[mine].min()), int(ends[mine].max())
            if os.fstat(fd).st_size < hi:
                raise ToolkitError(truncated(hi))
            start = lo - lo % mmap.ALLOCATIONGRANULARITY
            try:
                m = mmap.mmap(fd, hi - start, access=mmap.ACCESS_READ, offset=start)
            except (OSError, ValueError):
                arrays = None
                break
            maps.append([m, np.frombuffer(m, dtype=np.uint8)])
            arrays[fd] = (maps[-1][1], start)
        yield arrays
    finally:
        if arrays:
            arrays.clear()
        for pair in maps:
            pair[1] = None  # the array's hold on the map, released before it is closed
            try:
                pair[0].close()
            except BufferError:  # a view still held by an exception's frames: the map goes with them
                pass


def periodic(fds, offsets, sizes, most: int = 16) -> Period | None:
    """Ranges (equal-length sequences of file descriptor, offset and byte count, in the order they are wanted) that
    repeat with a period of P < `most` ranges, each k-th range of a period `stride` bytes after the one before it, in
    the same file and with the same count; None otherwise, or where they are few (under 64) or long (an average
    over GATHER / 16 bytes: the kernel copies those well one by one)."""
    import numpy as np  # lazy: the format layer's importers (validate, plan) never need it

    if len(sizes) < 64 or int(np.sum(sizes)) > len(sizes) * (GATHER // 16):
        return None
    r = np.stack([np.asarray(fds, dtype=np.int64), np.asarray(offsets, dtype=np.int64),
                  np.asarray(sizes, dtype=np.int64)], axis=1)
    for period in range(1, most):
        if len(r) % period:
            continue
        a = r.reshape(-1, period, 3)
        step = a[1, :, 1] - a[0, :, 1]
        same = (a[:, :, 0] == a[0, :, 0]) & (a[:, :, 2] == a[0, :, 2])
        if same.all() and (np.diff(a[:, :, 1], axis=0) == step).all():
            return len(a), [(int(fd), int(at), int(n), int(s)) for (fd, at, n), s in zip(a[0], step)]
    return None


def gathered(rows: Period, maps: dict[int, tuple[np.ndarray, int]], first: int = 0, stop: int | None = None,
             limit: int = GATHER) -> Iterator[np.ndarray]:
    """The bytes of periods [first, stop) of `rows` (periodic()), in order, as successive fills of one reused buffer
    of about `limit` bytes (whole periods; consume each before asking for the next). `maps`: each file descriptor's
    bytes (a uint8 array over a read-only map) and the file offset where they start. numpy's copies release the GIL."""
    import numpy as np  # lazy: as above

    count, period = rows
    stop = count if stop is None else stop
    width = sum(n for _, _, n, _ in period)
    views = []
    for fd, at, n, stride in period:
        base, start = maps[fd]
        views.append(np.lib.stride_tricks.as_strided(base[at - start:], shape=(count, n), strides=(stride, 1),
                                                     writeable=False))
    per = max(1, limit // width)
    buffer = np.empty((min(per, max(stop - first, 1)), width), dtype=np.uint8)
    for r0 in range(first, stop, per):
        r1 = min(stop, r0 + per)
        out = buffer[:r1 - r0]
        if len(views) == 1:
            np.copyto(out, views[0][r0:r1])
        else:
            np.concatenate([v[r0:r1] for v in views], axis=1, out=out)
        yield out
