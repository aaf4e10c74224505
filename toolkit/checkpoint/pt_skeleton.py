"""A torch.save file written before the bytes of its tensors exist, then filled in place: how a Megatron-LM legacy
rank file (one pickle of a whole pipeline stage, toolkit/checkpoint/megatron_lm_write.py) is written in bounded
memory.

Skeleton(path, obj) runs torch.save(obj, path) under torch.serialization.skip_data: every storage gets its zip record,
of its size, with nothing written in it. obj's tensors may be unwritten torch.empty ones, which take address space but
no resident memory. The file is then loaded back with map_location="meta", which gives each storage's offset in the
file, paired with obj's tensors in the order both walks visit them. put(tensor, data) writes data's bytes where that
tensor of obj lies in the file; finish() writes the bytes of every storage not put, from the storage itself (small
tensors, memory-mapped optimizer buffers), and checks that each tensor meant to be put was. torch.load does not check
the records' CRC-32, which skip_data leaves those of the empty records (as in save_pool.save_ranges).
"""
from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

import torch

from toolkit.format import safe_load
from toolkit.format.file_copy import copy_ranges, pwrite_all, start_writeback


def tensors(obj, path: tuple = ()) -> Iterator[tuple[tuple, torch.Tensor]]:
    """(path, tensor) of every tensor in nested dicts, lists and tuples, in pickling order."""
    if torch.is_tensor(obj):
        yield path, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from tensors(v, (*path, k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from tensors(v, (*path, i))


def bytes_around(template, file: Path, through_object: bool = False) -> tuple[bytes, bytes, torch.Tensor | None]:
    """(the bytes torch.save writes before the data of `template`'s one tensor, those after it, that tensor as a
    map_location="meta" load gives it back; None when it holds not exactly one). `template` is saved under skip_data
    into `file` (a hole where the data goes: no memory, unlike an in-memory buffer), by its path (the zip's folder is
    then the file's name, as in a universal checkpoint's files) or through a file object (the folder is "archive",
    as in a torch DCP item)."""
    with torch.serialization.skip_data():
        if through_object:
            with open(file, "wb") as f:
                torch.save(template, f)
        else:
            torch.save(template, file)
    found = [t for _, t in tensors(safe_load.load(file, deepspeed=False, map_location="meta"))]
    at = getattr(found[0].untyped_storage(), "_checkpoint_offset", None) if len(found) == 1 else None
    if not isinstance(at, int):
        return b"", b"", None
    with open(file, "rb") as f:
        head = f.read(at)
        f.seek(at + found[0].numel() * found[0].element_size())
        tail = f.read()
    return head, tail, found[0] if len(head) == at else None


def _key(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


class Skeleton:
    """One torch.save file of `obj`, its tensors' bytes written later (see the module docstring). `later`: the tensors
    of obj whose bytes come through put(); the others' are written by finish() from their own storage."""

    def __init__(self, path: Path, obj, later: list[torch.Tensor]):
        self.path, self.obj = Path(path), obj
        with torch.serialization.skip_data():
            torch.save(obj, self.path)
        meta = safe_load.load(self.path, deepspeed=False, map_location="meta")
        self._offset: dict[tuple[int, int], int] = {}
        mine, theirs = list(tensors(obj)), list(tensors(meta))
        if [p for p, _ in mine] != [p for p, _ in theirs]:
            raise RuntimeError(f"internal: {self.path} reads back with other tensors than were saved")
        for (_, t), (_, m) in zip(mine, theirs):
            at = getattr(m.untyped_storage(), "_checkpoint_offset", None)
            if not isinstance(at, int) or m.untyped_storage().nbytes() != t.untyped_storage().nbytes():
                raise RuntimeError(f"internal: no record offset for a tensor of {self.path}")
            self._offset.setdefault(_key(t), at)
        self._later = {_key(t) for t in later if t.untyped_storage().nbytes()}
        self._put: set[tuple[int, int]] = set()
        self._fd = os.open(self.path, os.O_RDWR)
        self.kernel_bytes = self.gathered_bytes = self.user_bytes = 0  # how write_ranges' bytes went
        self._lock = threading.Lock()

    def write(self, tensor: torch.Tensor, data: torch.Tensor) -> int:
        """put(tensor, data); returns the byte count (a write of convert's write-behind thread: `w.write(k, t)`)."""
        self.put(tensor, data)
        return data.numel() * data.element_size()

    def declared(self, tensor: torch.Tensor) -> tuple[tuple[int, ...], torch.dtype, int]:
        """(shape, dtype, byte count) of a tensor of obj whose bytes come later (byte_ranges.plan asks)."""
        return tuple(tensor.shape), tensor.dtype, tensor.numel() * tensor.element_size()

    def write_ranges(self, tensor: torch.Tensor, ranges: list[tuple[int | None, int, int]]) -> int:
        """The bytes of `tensor` of obj (a whole storage) copied into the file from byte ranges of other files
        ((fd, offset, count), None for zeros: file_copy.copy_ranges), in order; returns the byte count."""
        key, size = self._whole(tensor), tensor.numel() * tensor.element_size()
        if sum(n for _, _, n in ranges) != size:
            raise RuntimeError(f"internal: {size} bytes for a tensor of {self.path}, {sum(n for _, _, n in ranges)} "
                               "in the ranges")
        kernel, gathered, user = copy_ranges(self._fd, self._offset[key], ranges)
        with self._lock:  # the write-behind threads may fill two tensors of this file at once
            self.kernel_bytes, self.gathered_bytes = self.kernel_bytes + kernel, self.gathered_bytes + gathered
            self.user_bytes += user
        start_writeback(self._fd, self._offset[key], size)
        self._put.add(key)
        return size

    def _whole(self, tensor: torch.Tensor) -> tuple[int, int]:
        if tensor.storage_offset() or tensor.numel() * tensor.element_size() != tensor.untyped_storage().nbytes():
            raise RuntimeError(f"internal: a {tuple(tensor.shape)} {tensor.dtype} tensor of {self.path} is not a "
                               "whole storage")
        return _key(tensor)

    def put(self, tensor: torch.Tensor, data: torch.Tensor) -> None:
        """The bytes of `data` (same shape and dtype) where `tensor` of obj (a whole storage) lies in the file."""
        if data.shape != tensor.shape or data.dtype != tensor.dtype:
            raise RuntimeError(f"internal: {tuple(data.shape)} {data.dtype} put for a {tuple(tensor.shape)} "
                               f"{tensor.dtype} tensor of {self.path}")
        key = self._whole(tensor)
        raw = data.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        pwrite_all(self._fd, memoryview(raw), self._offset[key])
        start_writeback(self._fd, self._offset[key], raw.size)
        self._put.add(key)

    def finish(self) -> None:
        """Write every storage not put from its own bytes; check every tensor meant for put() came; close."""
        try:
            if self._later - self._put:
                raise RuntimeError(f"internal: {len(self._later - self._put)} tensors of {self.path} were never "
                                   "written")
            done = set(self._put)
            for _, t in tensors(self.obj):
                key = _key(t)
                if key in done or not key[1]:
                    continue
                raw = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage()).numpy()
                pwrite_all(self._fd, memoryview(raw), self._offset[key])
                done.add(key)
        finally:
            os.close(self._fd)
        self.obj = None
