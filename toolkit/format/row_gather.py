"""Byte ranges that repeat with a short period (a row-parallel TP shard, or a row-parallel weight merged from its
shards: one short range per row of each shard), gathered into a buffer that stays in the CPU's cache, a megabyte at
a time, by a few numpy copies instead of one call per range. The converter's writes (toolkit/format/file_copy.py)
and the verification's hashes of the weights where they lie (toolkit/checkpoint/verify_hash.py) both read them so.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

GATHER = 1 << 20
"""Bytes gathered at a time: a buffer the CPU's cache holds, so the copy into it and the read of it (by the kernel's
write, or by the hash) cost little beyond reading the source."""

Period = tuple[int, list[tuple[int, int, int, int]]]
"""(count of periods, [(file descriptor, first offset, byte count, stride)] for each range of a period)."""


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
