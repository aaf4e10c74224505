"""Periodic byte ranges (a row-parallel shard's rows) gathered in user space a megabyte at a time: what the writes
(file_copy) and the verification's hashes (verify_hash) read must be the ranges' bytes, joined in order."""
from __future__ import annotations

import os

import numpy as np
import pytest

from toolkit.format import file_copy as fc
from toolkit.format import row_gather


def _files(tmp_path, count: int, size: int) -> list[int]:
    rng = np.random.default_rng(0)
    fds = []
    for i in range(count):
        path = tmp_path / f"src{i}.bin"
        path.write_bytes(rng.integers(0, 256, size, dtype=np.uint8).tobytes())
        fds.append(os.open(path, os.O_RDONLY))
    return fds


def _joined(ranges) -> bytes:
    return b"".join(os.pread(fd, n, at) for fd, at, n in ranges)


def _merge_rows(fds, rows: int, widths, strides, starts):
    """Row r of each file in turn (a row-parallel merge of len(fds) shards)."""
    return [(fd, start + r * stride, n) for r in range(rows) for fd, n, stride, start in zip(fds, widths, strides,
                                                                                             starts)]


@pytest.fixture
def fds(tmp_path):
    opened = _files(tmp_path, 3, 1 << 20)
    yield opened
    for fd in opened:
        os.close(fd)


def test_periodic_ranges_are_recognised_and_others_are_not(fds):
    merge = _merge_rows(fds, 200, (700, 300, 5), (1400, 900, 11), (64, 4096, 3))
    count, period = row_gather.periodic(*zip(*merge))
    assert count == 200 and period == [(fds[0], 64, 700, 1400), (fds[1], 4096, 300, 900), (fds[2], 3, 5, 11)]
    assert row_gather.periodic(*zip(*merge[:-1])) is None  # not whole periods
    bent = list(merge)
    bent[300] = (bent[300][0], bent[300][1] + 1, bent[300][2])  # one row out of step
    assert row_gather.periodic(*zip(*bent)) is None
    assert row_gather.periodic(*zip(*merge[:63])) is None  # few: one call each costs little
    long = [(fds[0], r * 70_000, 65_600) for r in range(64)]  # long rows: the kernel copies those one by one
    assert row_gather.periodic(*zip(*long)) is None


@pytest.mark.parametrize("limit", [1 << 20, 4000, 1])
def test_gathered_chunks_are_the_ranges_bytes_in_order(fds, limit):
    merge = _merge_rows(fds, 300, (700, 300, 5), (1400, 900, 11), (64, 4096, 3))
    rows = row_gather.periodic(*zip(*merge))
    maps = {fd: (np.fromfile(f"/proc/self/fd/{fd}", dtype=np.uint8), 0) for fd in fds}
    got = b"".join(c.tobytes() for c in row_gather.gathered(rows, maps, limit=limit))
    assert got == _joined(merge)
    part = b"".join(c.tobytes() for c in row_gather.gathered(rows, maps, 7, 19, limit=limit))
    assert part == _joined(merge[7 * 3:19 * 3])


@pytest.mark.parametrize("chunk", [None, 10_000])
def test_copied_rows_are_written_by_gathering_and_match_the_ranges(fds, tmp_path, monkeypatch, chunk):
    """copy_ranges of a row-parallel merge goes through row_gather (in several jobs when _COPY_CHUNK is small) and
    writes the ranges' bytes at the offset asked; a merge that is not periodic goes by pwritev, as before."""
    if chunk:
        monkeypatch.setattr(fc, "_COPY_CHUNK", chunk)
    jobs = []
    real = fc._row_jobs
    monkeypatch.setattr(fc, "_row_jobs", lambda *a: jobs.append(len(got := real(*a))) or got)
    merge = _merge_rows(fds, 500, (700, 300), (1400, 900), (64, 4096))
    out = os.open(tmp_path / "out.bin", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        assert fc.copy_ranges(out, 123, merge) == (0, 500_000, 0, 0)
        assert jobs == [50 if chunk else 1]
        assert os.pread(out, 500_000, 123) == _joined(merge) and os.pread(out, 123, 0) == bytes(123)
        uneven = merge[:-1] + [(fds[2], 17, 9)]  # the last range breaks the period
        assert fc.copy_ranges(out, 0, uneven) == (0, sum(n for _, _, n in uneven), 0, 0)
        assert len(jobs) == 1  # by pwritev
        assert os.pread(out, 500_000 - 300 + 9, 0) == _joined(uneven)
    finally:
        os.close(out)
