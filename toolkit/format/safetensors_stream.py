"""Safetensors files read and written one tensor at a time with plain file I/O, so memory stays bounded by the
tensor in hand, never the file.

A safetensors file is an 8-byte little-endian header length, a JSON header ({name: {dtype, shape, data_offsets}},
plus an optional "__metadata__" of strings), then the raw tensor bytes. Reading uses positioned reads into a fresh
tensor (no memory map, whose touched pages would count towards the process's resident memory), or within
`mapped()` a copy-on-write map of the one tensor, unmapped when the tensor is freed; writing lays out
the header from the shapes known in advance and then writes each tensor at its offset, in any order. The files are
standard: `safetensors.safe_open` and `transformers` read them.
"""
from __future__ import annotations

import json
import mmap
import os
import struct
import threading
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from toolkit.errors import ToolkitError
from toolkit.format import manifest

if TYPE_CHECKING:
    import torch
from toolkit.format.file_copy import copy_ranges, pwrite_all, start_writeback

_SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
"""The dtypes read and written, by their safetensors names, with their element sizes. Headers are read, laid out
and checked by these names alone, without torch (the copy-only conversion never imports it,
toolkit/checkpoint/copy_only.py); torch dtypes are mapped to them where tensors are made or written."""
_BY_TORCH: dict = {}  # torch dtype -> name, filled on first use (by then torch is loaded)
_ALIGN = 8  # header padded so the data starts 8-byte aligned, as the reference writer does
_MAX_HEADER = 100 * 2**20
_MAX_TENSORS = 2**18  # per file: its header parses in about 400 MB
_mapping = threading.local()


@contextmanager
def mapped() -> Iterator[None]:
    """Within this block (on this thread), Reader.get hands out each tensor as a copy-on-write memory map of its
    bytes instead of reading them into fresh memory: no copy and no page zeroing, 3-4x less time for cached files
    here (0.22 against 0.65-0.89 s for 2 GiB, hashed). The map goes when the tensor is freed, so it is for reads
    consumed and dropped at once (the verification's); their pages count as the process's file-backed resident
    memory while they are held, not as anonymous memory."""
    before = getattr(_mapping, "on", False)
    _mapping.on = True
    try:
        yield
    finally:
        _mapping.on = before


TORCH_NAMES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
               "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}
"""Each safetensors dtype name's torch name (as config.json's torch_dtype gives it)."""


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype name."""
    import torch  # lazy: only where tensors are made; headers need no torch

    return getattr(torch, TORCH_NAMES[name])


def tensor_bytes(tensor: torch.Tensor, dtype: str | None = None):
    """A tensor's bytes (a flat uint8 numpy array over them, or over a contiguous copy), cast to `dtype` first when
    given: what a writer writes of a tensor from memory."""
    if dtype is not None:
        tensor = tensor.to(torch_dtype(dtype))
    return tensor.detach().to("cpu").contiguous().reshape(-1).view(torch_dtype("U8")).numpy()


def dtype_name(dtype: torch.dtype | str) -> str:
    """The safetensors name of a torch dtype (a name is returned as it is, once checked)."""
    if isinstance(dtype, str):
        if dtype not in _SIZES:
            raise ToolkitError(f"dtype {dtype!r} is not one this toolkit stores in safetensors ({', '.join(_SIZES)})")
        return dtype
    if not _BY_TORCH:
        _BY_TORCH.update({torch_dtype(name): name for name in _SIZES})
    if dtype in _BY_TORCH:
        return _BY_TORCH[dtype]
    raise ToolkitError(f"dtype {dtype} cannot be stored in safetensors by this toolkit (supported: "
                       f"{', '.join(str(torch_dtype(n)) for n in _SIZES)})")


def nbytes(shape: Iterable[int], dtype: torch.dtype | str) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n * _SIZES[dtype_name(dtype)]


def _repeated_key(raw: bytes) -> str | None:
    """The first key a header's top-level object repeats, or None."""
    seen: set[str] = set()
    for key, _ in json.loads(raw, object_pairs_hook=list):  # every object as its list of pairs, repeats kept
        if key in seen:
            return key
        seen.add(key)
    return None


class Reader:
    """One safetensors file, checked against its own header when opened (a truncated or padded file is refused)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            self._f = self.path.open("rb")
        except OSError as e:
            raise ToolkitError(f"cannot open {self.path}: {e.strerror}") from None
        size = os.fstat(self._f.fileno()).st_size
        raw = self._f.read(8)
        if len(raw) < 8:
            self._fail(f"has {size} bytes, too short for a safetensors header")
        (length,) = struct.unpack("<Q", raw)
        if length > min(_MAX_HEADER, size - 8):
            self._fail(f"declares a {length}-byte header in a {size}-byte file")
        raw = self._f.read(length)
        count = raw.count(b'"data_offsets"')  # before the parse, whose objects take about 1.5 KB per tensor
        if count > _MAX_TENSORS:
            self._fail(f"lists {count:,} tensors, more than the {_MAX_TENSORS:,} this toolkit reads from one file (the "
                       "largest models' files hold a few thousand)")
        try:
            header = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
            self._fail(f"has a header that is not valid JSON ({e})")
        if not isinstance(header, dict):
            self._fail(f"has a header that is a JSON {type(header).__name__}, not an object of tensors")
        if count > len(header) - ("__metadata__" in header):  # JSON keeps the last of two equal keys
            twice = _repeated_key(raw)
            if twice is not None:  # read as "longer than its header says" until 2026-12-07
                self._fail(f"names the tensor {twice} twice in its header")
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        self._base, self._info = 8 + length, header
        self._check_ranges(size - self._base)

    def _check_ranges(self, data_size: int) -> None:
        """Every tensor's data_offsets must be its own: begin <= end, as many bytes as its shape and dtype need,
        and together the tensors tile the data area exactly (no overlap, no gap, nothing past the end)."""
        spans = []
        for name, info in self._info.items():
            if not isinstance(info, dict):
                self._fail(f"describes {name} as {info!r}, not a tensor")
            if info.get("dtype") not in _SIZES:
                if str(info.get("dtype")).startswith("F8"):  # what FP8-quantized releases store
                    raise ToolkitError(f"{self.path} stores {name} as {info.get('dtype')}, an 8-bit float of a "
                                       "quantized model, which this toolkit does not read; use the model's "
                                       "unquantized (bf16 or fp32) release")
                self._fail(f"stores {name} as {info.get('dtype')!r}, a dtype this toolkit does not read")
            shape, offsets = info.get("shape"), info.get("data_offsets")
            if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
                self._fail(f"gives {name} the shape {shape!r}, not a list of sizes")
            if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
                self._fail(f"gives {name} the data_offsets {offsets!r}, not [begin, end]")
            spans.append((*offsets, name))
        end = max((stop for _, stop, _ in spans), default=0)
        if end != data_size:
            self._fail(f"has {self._base + data_size} bytes but its header describes {self._base + end}: the file is "
                       f"{'truncated' if data_size < end else 'longer than its header says'}")
        for begin, stop, name in spans:
            info = self._info[name]
            if not 0 <= begin <= stop:
                self._fail(f"gives {name} the byte range [{begin}, {stop}), which is not a range")
            if stop - begin != nbytes(info["shape"], info["dtype"]):
                self._fail(f"gives {name} {stop - begin} bytes for shape {info['shape']} {info['dtype']}")
        at, previous = 0, None
        for begin, stop, name in sorted(spans):
            if begin < at:
                self._fail(f"gives {name} the byte range [{begin}, {stop}), which overlaps {previous}'s: two tensors "
                           "would share bytes")
            if begin > at:
                self._fail(f"leaves bytes [{at}, {begin}) before {name} unclaimed by any tensor: the header does not "
                           "describe the data")
            at, previous = stop, name

    def _fail(self, what: str):
        self._f.close()
        raise ToolkitError(f"{self.path} {what}; re-copy or re-save this file")

    def keys(self) -> list[str]:
        return list(self._info)

    def rename(self, names: dict[str, str]) -> None:
        """Read the tensor stored under each key of `names` by its value instead."""
        self._info = {names.get(k, k): v for k, v in self._info.items()}

    def __contains__(self, name: str) -> bool:
        return name in self._info

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._info[name]["shape"])

    def dtype(self, name: str) -> torch.dtype:
        return torch_dtype(self._info[name]["dtype"])

    def dtype_name(self, name: str) -> str:
        """The tensor's safetensors dtype name (no torch needed)."""
        return self._info[name]["dtype"]

    def nbytes(self, name: str) -> int:
        begin, stop = self._info[name]["data_offsets"]
        return stop - begin

    def span(self, name: str) -> tuple[int, int, int]:
        """(file descriptor, absolute byte offset, byte count) of one tensor's raw little-endian bytes in the file."""
        begin, stop = self._info[name]["data_offsets"]
        return self._f.fileno(), self._base + begin, stop - begin

    def get(self, name: str) -> torch.Tensor:
        import torch  # lazy: reading a header needs no torch (the copy-only conversion never imports it)

        if name not in self._info:
            raise ToolkitError(f"{self.path} has no tensor {name!r}: the checkpoint is incomplete or of another "
                               "model or layout")
        begin, stop = self._info[name]["data_offsets"]
        at, dtype = self._base + begin, self.dtype(name)
        if mapping() and stop > begin and at % dtype.itemsize == 0:
            return self._map(name, at, stop - begin, dtype)
        out = torch.empty(stop - begin, dtype=torch.uint8)
        view, done = memoryview(out.numpy()), 0
        while done < stop - begin:  # one read returns at most ~2 GiB on Linux
            got = os.preadv(self._f.fileno(), [view[done:]], self._base + begin + done)
            if got <= 0:
                raise ToolkitError(f"{self.path}: short read of {name} ({done} of {stop - begin} bytes)")
            done += got
        return out.view(self.dtype(name)).reshape(self.shape(name))

    def _map(self, name: str, at: int, n: int, dtype: torch.dtype) -> torch.Tensor:
        return map_bytes(self._f.fileno(), at, n, dtype, self.shape(name), f"{self.path}: short read of {name}")

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def mapping() -> bool:
    """Whether this thread is inside mapped(): other readers of raw bytes (torch_dist's) map them too."""
    return getattr(_mapping, "on", False)


def map_bytes(fd: int, at: int, n: int, dtype: torch.dtype, shape, what: str) -> torch.Tensor:
    """Bytes at..at+n of the open file fd as a tensor of dtype and shape: a copy-on-write map of them (mapped())."""
    import torch  # lazy: reading a header needs no torch (the copy-only conversion never imports it)

    if os.fstat(fd).st_size < at + n:  # a map past the end would fault when touched
        raise ToolkitError(f"{what}: the file was truncated while converting")
    start = at - at % mmap.ALLOCATIONGRANULARITY
    m = mmap.mmap(fd, at + n - start, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=start)
    m.madvise(mmap.MADV_WILLNEED)  # read-ahead for pages not in the cache
    return torch.frombuffer(m, dtype=torch.uint8, count=n, offset=at - start).view(dtype).reshape(tuple(shape))


class Writer:
    """A safetensors file whose tensors (names, shapes, dtypes) are declared up front and then written at their
    offsets; close() checks every one was written and flushes the file to disk. Writing in the declared order is
    fastest: the file then grows by appends (filling a pre-sized sparse file was 10x slower on ext4 here)."""

    def __init__(self, path: str | Path, specs: Mapping[str, tuple[tuple[int, ...], torch.dtype | str]],
                 metadata: Mapping[str, str] | None = None):
        self.path = Path(path)
        header: dict = {"__metadata__": dict(metadata)} if metadata else {}
        offset = 0
        for name, (shape, dtype) in specs.items():
            size = nbytes(shape, dtype)
            header[name] = {"dtype": dtype_name(dtype), "shape": list(shape), "data_offsets": [offset, offset + size]}
            offset += size
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-(8 + len(raw)) % _ALIGN)
        self._base, self._header, self._pending, self._size = 8 + len(raw), header, set(specs), 8 + len(raw) + offset
        # write_ranges' bytes: copy_file_range, pwritev, buffer (no kernel copy), read into a buffer (file_copy)
        self.kernel_bytes = self.gathered_bytes = self.user_bytes = self.read_bytes = 0
        self._order, self._next, self._frontier = list(specs), 0, self._base  # bytes [0, _frontier) are all written
        self._lock = threading.Lock()  # writes of different tensors may come from several threads at once
        self._hash, self._hashed = None, 0
        self._f = self.path.open("w+b")  # read too: track_hash reads the written bytes back
        self._f.write(struct.pack("<Q", len(raw)) + raw)
        self._f.flush()

    def declared(self, name: str) -> tuple[tuple[int, ...], str, int]:
        """(shape, safetensors dtype name, byte count) of a declared tensor."""
        info = self._header[name]
        begin, stop = info["data_offsets"]
        return tuple(info["shape"]), info["dtype"], stop - begin

    def track_hash(self, algorithm: str = manifest.DIGEST) -> None:
        """Hash the file as it is written: catch_up() (on any one thread) hashes the bytes written so far in file
        order, read back while they are still in the page cache, so the digest is ready when the last write lands."""
        self._hash, self._hash_name = manifest.new_hash(algorithm), algorithm

    @property
    def tracks_hash(self) -> bool:
        return self._hash is not None

    def catch_up(self) -> None:
        """Hash what was written since the last call, up to the first tensor not yet written (one caller at a time)."""
        if self._hash is None or self._f.closed:
            return
        frontier = self._frontier
        if self._hashed < frontier:
            try:
                manifest.hash_range(self._f.fileno(), self._hashed, frontier, self._hash)
            except ToolkitError:
                raise ToolkitError(f"{self.path} ended before byte {frontier} while being hashed: it was truncated "
                                   "while converting") from None
            self._hashed = frontier

    def manifest_entry(self) -> dict:
        """{"bytes", algorithm: hex digest} of the finished file, as manifest.file_entry would give it (after close)."""
        if self._hash is None or self._pending or self._hashed != self._size:
            raise ToolkitError(f"{self.path}: not hashed to its end ({self._hashed} of {self._size} bytes)")
        return {"bytes": self._size, self._hash_name: self._hash.hexdigest()}

    def _advance(self, name: str, kernel: int = 0, gathered: int = 0, user: int = 0, read: int = 0) -> None:
        with self._lock:
            self.kernel_bytes, self.gathered_bytes = self.kernel_bytes + kernel, self.gathered_bytes + gathered
            self.user_bytes, self.read_bytes = self.user_bytes + user, self.read_bytes + read
            self._advance_locked(name)

    def _advance_locked(self, name: str) -> None:
        self._pending.discard(name)
        while self._next < len(self._order) and self._order[self._next] not in self._pending:
            self._frontier = self._base + self._header[self._order[self._next]]["data_offsets"][1]
            self._next += 1

    def _take(self, name: str) -> dict:
        with self._lock:
            info = self._header.get(name)
            if info is None or name not in self._pending:
                raise ToolkitError(f"{self.path}: {name!r} was {'already written' if info else 'not declared'}")
        return info

    def write(self, name: str, tensor: torch.Tensor) -> int:
        """Write one declared tensor; returns its byte count."""
        info = self._take(name)
        if list(tensor.shape) != info["shape"] or dtype_name(tensor.dtype) != info["dtype"]:
            raise ToolkitError(f"{self.path}: {name} is {tuple(tensor.shape)} {tensor.dtype}, declared "
                               f"{tuple(info['shape'])} {info['dtype']}")
        data = tensor_bytes(tensor)
        pwrite_all(self._f.fileno(), memoryview(data), self._base + info["data_offsets"][0])
        start_writeback(self._f.fileno(), self._base + info["data_offsets"][0], data.size)
        self._advance(name)
        return data.size

    def write_pieces(self, name: str, pieces: list[torch.Tensor]) -> int:
        """Write one declared tensor as the concatenation of flat `pieces` (e.g. views of memory-mapped files), each
        handed to the kernel as it is: no concatenated copy is made. Returns the byte count."""
        info = self._take(name)
        begin, stop = info["data_offsets"]
        if any(dtype_name(p.dtype) != info["dtype"] for p in pieces) or \
                sum(p.numel() * p.element_size() for p in pieces) != stop - begin:
            raise ToolkitError(f"{self.path}: {name} takes {stop - begin} bytes of {info['dtype']}, the pieces to "
                               f"write hold {sum(p.numel() * p.element_size() for p in pieces)} of "
                               f"{sorted({str(p.dtype) for p in pieces})}")
        at = self._base + begin
        for p in pieces:
            data = tensor_bytes(p)
            pwrite_all(self._f.fileno(), memoryview(data), at)
            at += data.size
        start_writeback(self._f.fileno(), self._base + begin, stop - begin)
        self._advance(name)
        return stop - begin

    def write_ranges(self, name: str, ranges: list[tuple[int | None, int, int]]) -> int:
        """Write one declared tensor as byte ranges of other files, in order: (file descriptor, offset, count), or
        (None, 0, count) for zeros. The bytes go file to file in the kernel (os.copy_file_range), never through
        this process, or through a bounded buffer where the kernel cannot copy them; returns the byte count."""
        info = self._take(name)
        begin, stop = info["data_offsets"]
        if sum(n for _, _, n in ranges) != stop - begin:
            raise ToolkitError(f"{self.path}: {name} takes {stop - begin} bytes, the ranges to copy hold "
                               f"{sum(n for _, _, n in ranges)}")
        out = self._f.fileno()
        # past the page cache only where nothing reads the bytes back (a hashed file reads them: catch_up)
        kernel, gathered, user, read = copy_ranges(out, self._base + begin, ranges, self._hash is None)
        start_writeback(out, self._base + begin, stop - begin)
        self._advance(name, kernel, gathered, user, read)
        return stop - begin

    def close(self) -> None:
        if self._f.closed:
            return
        if self._pending:
            self._f.close()
            raise ToolkitError(f"{self.path}: {len(self._pending)} declared tensors were never written, e.g. "
                               f"{sorted(self._pending)[:3]}")
        size = os.fstat(self._f.fileno()).st_size
        if size != self._size:
            self._f.close()
            raise ToolkitError(f"{self.path}: wrote {size} bytes, expected {self._size}")
        self.catch_up()
        os.fsync(self._f.fileno())
        self._f.close()


def save(tensors: Mapping[str, torch.Tensor], path: str | Path, metadata: Mapping[str, str] | None = None) -> None:
    """Write a dict of tensors (already in memory) as one file."""
    w = Writer(path, {k: (tuple(v.shape), v.dtype) for k, v in tensors.items()}, metadata)
    for k, v in tensors.items():
        w.write(k, v)
    w.close()


def load(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(every tensor, metadata) of one file, checked against its header."""
    with Reader(path) as r:
        return {k: r.get(k) for k in r.keys()}, r.metadata
