"""`toolkit convert --no-verify` with TOOLKIT_DIRECT_IO=1 writes the aligned pages of long byte ranges past the page
cache (O_DIRECT, file_copy.writes_past_cache) where the file system takes it: the bytes must be those written
through the cache, at any offsets; a file system or descriptor that refuses O_DIRECT falls back to the cache; a
reused descriptor number never writes into the file it named before; files whose bytes are read back (a toolkit
checkpoint's hashed files) and verified conversions go through the cache. Tiny files; a few seconds."""
from __future__ import annotations

import errno
import os
import random
from pathlib import Path

import pytest

from tiny_hf import write_llama
from toolkit.checkpoint.convert import convert
from toolkit.format import file_copy as fc


def _takes_direct(folder: Path) -> bool:
    """Whether this file system opens files with O_DIRECT (tmpfs does not): the tests then expect the fallback."""
    probe = folder / "probe"
    probe.write_bytes(b"")
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_DIRECT))
        return True
    except OSError:
        return False
    finally:
        probe.unlink()


@pytest.fixture
def fresh(monkeypatch):
    """Every range long enough to take the path; no file system remembered as refusing it."""
    monkeypatch.setattr(fc, "DIRECT_MIN", 1)
    monkeypatch.setattr(fc, "_no_direct", set())


def _copy_all(src: Path, out: Path, pieces: list[tuple[int, int, int]]) -> int:
    """_copy_piece of (source offset, output offset, count) within writes_past_cache; the bytes written past it."""
    s, d = os.open(src, os.O_RDONLY), os.open(out, os.O_RDWR | os.O_CREAT, 0o644)
    before = fc.direct_total()
    try:
        with fc.writes_past_cache(True):
            kinds = [fc._copy_piece(s, at, d, to, n, True) for at, to, n in pieces]
    finally:
        os.close(s), os.close(d)
    assert sum(k[1] for k in kinds) == fc.direct_total() - before
    return fc.direct_total() - before


def _pieces(seed: int, size: int) -> tuple[list[tuple[int, int, int]], bytes]:
    """Ranges of a source at unaligned offsets, laid back to back in the output from an unaligned start."""
    rng = random.Random(seed)
    pieces, to = [], rng.randrange(1, 4096)
    for _ in range(12):
        n = min(size // 2, rng.choice([1, 4095, 4096, 4097, 8192 + 17, rng.randrange(1, 3 * 2**20)]))
        at = rng.randrange(0, size - n)
        pieces.append((at, to, n))
        to += n
    return pieces, bytes(to)


def _expected(data: bytes, pieces, zeros: bytes) -> bytes:
    out = bytearray(zeros)
    for at, to, n in pieces:
        out[to:to + n] = data[at:at + n]
    return bytes(out)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ranges_written_past_the_cache_are_the_bytes_at_any_offset(tmp_path, fresh, seed):
    data = random.Random(seed).randbytes(4 * 2**20)
    (tmp_path / "src").write_bytes(data)
    pieces, zeros = _pieces(seed, len(data))
    (tmp_path / "out").write_bytes(zeros)
    direct = _copy_all(tmp_path / "src", tmp_path / "out", pieces)
    assert (tmp_path / "out").read_bytes() == _expected(data, pieces, zeros)
    # every whole page inside a range went past the cache where the file system takes it, and nothing else did
    pages = sum(max(0, (to + n) // 4096 * 4096 - (-(-to // 4096) * 4096)) for _, to, n in pieces)
    assert direct == (pages if _takes_direct(tmp_path) else 0)


@pytest.mark.parametrize("seed", [3, 4])
def test_gathered_rows_are_staged_into_whole_buffers(tmp_path, fresh, monkeypatch, seed):
    """Row-parallel rows, gathered a megabyte at a time, are collected in the thread's buffer (16 KiB here) and written
    past the cache a whole buffer at a time; the bytes before the first page boundary and after the last go
    through the cache."""
    import threading

    monkeypatch.setattr(fc, "_DIRECT_CHUNK", 16384)
    monkeypatch.setattr(fc, "_staging", threading.local())  # a fresh buffer of that size for this thread
    rng = random.Random(seed)
    data = rng.randbytes(200_000)
    at = rng.randrange(1, 4096)
    (tmp_path / "out").write_bytes(bytes(at + len(data) + 100))
    out = os.open(tmp_path / "out", os.O_RDWR)
    before, writes = fc.direct_total(), []
    real = fc._direct_write
    monkeypatch.setattr(fc, "_direct_write", lambda d, o, view, to: writes.append(len(view)) or real(d, o, view, to))
    try:
        with fc.writes_past_cache(True):
            staged = fc._Staged(out, at, fc._direct_fd(out) if _takes_direct(tmp_path) else -1)
            done = 0
            while done < len(data):
                n = rng.randrange(1, 9000)
                staged.add(memoryview(data)[done:done + n])
                done += n
            staged.close()
    finally:
        os.close(out)
    assert (tmp_path / "out").read_bytes() == bytes(at) + data + bytes(100)
    if _takes_direct(tmp_path):
        body = (at + len(data)) // 4096 * 4096 - (-(-at // 4096) * 4096)
        assert fc.direct_total() - before == body and writes[:-1] == [16384] * (len(writes) - 1)


@pytest.mark.parametrize("refusal", ["open", "first write"])
def test_a_refused_o_direct_falls_back_to_the_cache(tmp_path, fresh, monkeypatch, refusal):
    data = random.Random(5).randbytes(2**20)
    (tmp_path / "src").write_bytes(data)
    pieces, zeros = _pieces(5, len(data))
    (tmp_path / "out").write_bytes(zeros)
    real_open, real_pwrite, direct_fds = os.open, os.pwrite, set()

    def no_direct_open(path, flags, *a):
        if flags & os.O_DIRECT and refusal == "open":
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        fd = real_open(path, flags, *a)
        if flags & os.O_DIRECT:
            direct_fds.add(fd)
        return fd

    def picky_pwrite(fd, data, at):  # a device that wants more than a page of alignment
        if fd in direct_fds:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real_pwrite(fd, data, at)
    monkeypatch.setattr(os, "open", no_direct_open)
    monkeypatch.setattr(os, "pwrite", picky_pwrite)
    assert _copy_all(tmp_path / "src", tmp_path / "out", pieces) == 0
    assert (tmp_path / "out").read_bytes() == _expected(data, pieces, zeros)
    assert fc._no_direct == {os.stat(tmp_path).st_dev}  # not tried again on this file system


def test_a_reused_descriptor_number_writes_into_its_new_file(tmp_path, fresh):
    data = random.Random(7).randbytes(2**20)
    (tmp_path / "src").write_bytes(data)
    for name in ("a", "b"):
        (tmp_path / name).write_bytes(bytes(len(data)))
    s = os.open(tmp_path / "src", os.O_RDONLY)
    try:
        with fc.writes_past_cache(True):
            a = os.open(tmp_path / "a", os.O_RDWR)
            fc._copy_piece(s, 0, a, 0, len(data) // 2, True)  # its O_DIRECT descriptor is kept for number `a`
            os.close(a)
            b = os.open(tmp_path / "b", os.O_RDWR)
            os.dup2(b, a) if b != a else None  # the same number, now another file
            fc._copy_piece(s, len(data) // 2, a, len(data) // 2, len(data) // 2, True)
            os.close(a), b != a and os.close(b)
    finally:
        os.close(s)
    half = len(data) // 2
    assert (tmp_path / "a").read_bytes() == data[:half] + bytes(half)
    assert (tmp_path / "b").read_bytes() == bytes(half) + data[half:]
    assert not fc._direct_fds  # leaving the block closed them


STEPS = [("hf", "tp2pp2", dict(to="megatron", tp=2, pp=2)),
         ("tp2pp2", "back", dict(to="hf")),
         ("tp2pp2", "mlm", dict(to="megatron_lm", tp=1, pp=2, vpp=2)),
         ("tp2pp2", "td", dict(to="torch_dist", tp=2, pp=1)),
         ("td", "td_mlm", dict(to="megatron_lm", tp=2, pp=1, vocab_size=500))]


@pytest.mark.parametrize("verify", [False, True])
def test_conversions_write_past_the_cache_only_what_nothing_reads_back(tmp_path, fresh, monkeypatch, verify):
    """--no-verify with TOOLKIT_DIRECT_IO=1: Hugging Face, Megatron-LM and torch_dist files past the cache, byte for
    byte what goes through it (unset: the default); a toolkit checkpoint's files (hashed as written, reading them
    back) and every verified conversion (which reads its output back) through it."""
    write_llama(tmp_path / "cached" / "hf", layers=4)
    write_llama(tmp_path / "direct" / "hf", layers=4)
    quiet = dict(progress=False, log=lambda *_: None, verify=verify)
    takes = _takes_direct(tmp_path)
    for src, dst, opts in STEPS:
        monkeypatch.delenv("TOOLKIT_DIRECT_IO", raising=False)
        before = fc.direct_total()
        convert(tmp_path / "cached" / src, tmp_path / "cached" / dst, **opts, **quiet)
        assert fc.direct_total() == before
        monkeypatch.setenv("TOOLKIT_DIRECT_IO", "1")
        convert(tmp_path / "direct" / src, tmp_path / "direct" / dst, **opts, **quiet)
        past = fc.direct_total() - before
        assert (past > 0) == (takes and not verify and opts["to"] != "megatron"), (dst, past)
        a, b = tmp_path / "cached" / dst, tmp_path / "direct" / dst
        files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
        assert files == sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
        for f in files:
            assert (a / f).read_bytes() == (b / f).read_bytes(), f"{dst}/{f}"
