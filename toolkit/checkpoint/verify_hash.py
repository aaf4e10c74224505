"""The bit-exact half of `toolkit convert`'s verification (toolkit/checkpoint/verify.py): a record of each weight
(its xxh3-128 digest, shape and dtype) on each side of the check, and the records compared by name (`Hashed`).

A tensor that a side stores in pieces (a Megatron side's TP shards, a torch_dist tensor's chunks) is hashed without
being assembled (`pieces`, `hash_ranges`): its merge runs on byte_ranges' address arrays (one int64 per row block,
toolkit/checkpoint/byte_ranges.py), which list the file byte ranges that, read in order, are the merged tensor's
bytes; those are hashed from maps of the files, streaming. xxh3's streaming digest of a sequence of pieces is its
digest of the pieces joined, so the record equals the assembled tensor's, and no byte is copied. Only the side whose
weights the logit check runs needs them assembled in memory.
"""
from __future__ import annotations

import os
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Callable

import numpy as np
import torch
from xxhash import xxh3_128 as _hash

from toolkit.checkpoint import byte_ranges
from toolkit.checkpoint.source_base import WEIGHT
from toolkit.errors import ToolkitError
from toolkit.families.rules import views
from toolkit.format import row_gather

HASH_NAME = "xxh3-128"  # about 7x SHA-256's speed here
"""These digests never leave the process (a source tensor against its read-back, within one conversion), so a
fast non-cryptographic hash is enough: what they catch is a conversion or reader error, not an adversary."""


def cast(t: torch.Tensor, dtype: torch.dtype | None, field: str = WEIGHT) -> torch.Tensor:
    return t.to(dtype) if dtype is not None and field == WEIGHT else t


def digest(t: torch.Tensor) -> str:
    data = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
    return _hash(memoryview(data)).hexdigest()  # both release the GIL on large buffers


Ranges = list[tuple[int, int, int]]  # (file descriptor, byte offset, byte count), in the tensor's byte order


def pieces(inputs, merge: Callable) -> list[tuple[Ranges, tuple[int, ...], torch.dtype]] | None:
    """What `merge` (address arrays -> the merged tensors, in order) would assemble from `inputs` ((reader, key)
    with byte_ranges' reader interface), as each merged tensor's (file byte ranges, shape, dtype); None where it
    cannot be expressed so (the bytes not located, a shape no block divides, padding rows, a merge that compares
    values: replicated copies, which must then be merged to be compared)."""
    try:
        dtypes = {reader.dtype(key) for reader, key in inputs}
        if len(dtypes) != 1 or any(reader.span(key) is None for reader, key in inputs):
            return None
    except KeyError:  # a tensor the file does not hold: the side's own read names it
        return None
    dtype = dtypes.pop()
    stood_in = byte_ranges.addresses(inputs, 1)  # merges move whole rows of each input
    if stood_in is None:
        return None
    arrays, unit = stood_in
    if unit % dtype.itemsize:
        return None
    try:
        with views():
            merged = merge(arrays)
    except ToolkitError:
        return None
    out = []
    for piece in merged if isinstance(merged, (list, tuple)) else (merged,):
        ranges = byte_ranges.ranges_of(piece, inputs, unit)
        if not ranges or any(fd is None for fd, _, _ in ranges):
            return None
        out.append((ranges, (*piece.shape[:-1], piece.shape[-1] * (unit // dtype.itemsize)), dtype))
    return out


def hash_ranges(ranges: Ranges) -> str:
    """The digest of the bytes at `ranges`, in order, read from read-only maps of their files (one per file); many
    short rows of a period (a row-parallel merge) are gathered a megabyte at a time (row_gather)."""
    table = np.asarray(ranges, dtype=np.int64).reshape(-1, 3)
    fds, offsets, sizes = table[:, 0], table[:, 1], table[:, 2]
    h = _hash()
    with row_gather.mapped_extents(fds, offsets, sizes, lambda _end: _TRUNCATED) as maps:
        if maps is None:  # a file system that cannot map it: positioned reads
            return _read_ranges(ranges)
        rows = row_gather.periodic(fds, offsets, sizes)
        if rows is None:
            for fd, at, n in ranges:
                base, start = maps[fd]
                h.update(memoryview(base[at - start:at - start + n]))  # releases the GIL on large pieces
        else:
            for chunk in row_gather.gathered(rows, maps):
                h.update(memoryview(chunk).cast("B"))
    return h.hexdigest()


_TRUNCATED = "verification: a file was truncated while it was checked; nothing was written"


def _read_ranges(ranges: Ranges) -> str:
    h = _hash()
    for fd, at, n in ranges:
        while n:
            got = os.pread(fd, min(n, row_gather.GATHER), at)
            if not got:
                raise ToolkitError(_TRUNCATED)
            h.update(got)
            at, n = at + len(got), n - len(got)
    return h.hexdigest()


class Hashed:
    """The bit-exact read-back of the weights, done on the logit check's own reads: each weight the source side
    hands out is hashed (after the conversion's cast), and the output side's tensor of the same name must hash the
    same. So the source and the output are each read once for both checks. A Megatron side is read through the
    family's modules table, independent of the conversion's map: a mapping mistake fails here, naming the tensor."""

    def __init__(self, written: torch.dtype | None):
        self.written = written
        self.source: dict[str, Future] = {}
        self.proved: set[tuple[str, str]] = set()
        self.outputs: list[tuple[str, Future]] = []
        self.running: list[Future] = []
        # xxh3 releases the GIL: the tensors of a module are hashed two at a time, while the next one is merged
        self.pool = ThreadPoolExecutor(2, thread_name_prefix="verify-hash")

    @staticmethod
    def _record(t: torch.Tensor) -> tuple:
        return digest(t), tuple(t.shape), t.dtype  # equal records: the same tensor, so the same forward

    def check(self, name: str, t: torch.Tensor, output: bool) -> None:
        """Hash t in the background; settle() waits for it (and compares an output's tensor)."""
        self._submit(name, lambda: self._record(t if output else cast(t, self.written)), output)

    def takes_ranges(self, dtype: torch.dtype, output: bool) -> bool:
        """Whether a tensor of this dtype stored on this side hashes as stored (the source's, unless the
        conversion casts it)."""
        return output or self.written in (None, dtype)

    def check_ranges(self, name: str, ranges: Ranges, shape: tuple[int, ...], dtype: torch.dtype,
                     output: bool) -> None:
        """check() of the tensor whose bytes lie at `ranges` (pieces()), hashed from the files."""
        if not self.takes_ranges(dtype, output):
            raise ToolkitError(f"verification: {name} must be cast before it is hashed (please report this)")
        self._submit(name, lambda: (hash_ranges(ranges), tuple(shape), dtype), output)

    def _submit(self, name: str, record: Callable[[], tuple], output: bool) -> None:
        if not output:
            if name not in self.source:
                self.source[name] = self.pool.submit(record)
                self.running.append(self.source[name])
            return
        if name not in self.source:  # the reference's weights of a module are read first: this is a bug, not input
            raise ToolkitError(f"verification: {name} was read from the output before the source; nothing was "
                               "written (please report this)")
        if (name, WEIGHT) not in self.proved:
            self.outputs.append((name, self.pool.submit(record)))
            self.running.append(self.outputs[-1][1])

    def settle(self) -> None:
        """Every hash asked for so far is done (so the tensors it reads may be freed or overwritten), and each
        output tensor's record equals the source's of its name."""
        running, outputs, self.running, self.outputs = self.running, self.outputs, [], []
        wait(running)  # all of them, before anything is raised: none reads a buffer after this returns
        for name, future in outputs:
            if self.source[name].result() != future.result():
                raise ToolkitError(f"verification failed: {name} ({WEIGHT}) reads back different from the source's "
                                   "(each side read by the family's modules table where it is a Megatron one: a "
                                   "mapping or conversion error); nothing was written")
            self.proved.add((name, WEIGHT))
        for future in running:
            future.result()  # a hash that failed

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


def cast_note(source, cast_to: torch.dtype | None, before: str, after: str = "") -> str:
    """The dtype --dtype cast the weights to, between `before` and `after`, for the verified lines (the source
    they prove equal is the cast one); "" when nothing was cast."""
    try:
        same = cast_to is None or cast_to == source.dtype()
    except ToolkitError:  # weights of several dtypes (then --dtype was given)
        same = False
    return "" if same else before + str(cast_to).removeprefix("torch.") + after


class Digests:
    """The digest (HASH_NAME) of each (HF name, field) the conversion wrote, taken from the source's tensors as they
    are written."""

    def __init__(self):
        self.of: dict[tuple[str, str], str] = {}
        self.seconds = 0.0

    def add(self, names, field: str, tensors) -> None:
        t0 = time.monotonic()
        for name, t in zip(names, tensors):
            self.of[(name, field)] = digest(t)
        self.seconds += time.monotonic() - t0
