"""Where the tensors of a torch.save file lie in it, so that their bytes can be copied file to file
(safetensors_stream.Writer.write_ranges: os.copy_file_range, in the kernel, with the file system's readahead)
instead of being faulted in through a memory map.

torch.save stores each storage uncompressed in its zip; loading with map_location="meta" reads only the pickle and
records each storage's byte offset in the file (`_checkpoint_offset`, what torch's own meta loading keeps). Those
offsets are trusted only after the bytes at them are read and found equal to the memory-mapped tensors' (the first
and last 4 KiB of each); otherwise, or without them, there are no ranges and callers write through memory.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from toolkit.checkpoint.byte_ranges import ENABLED
from toolkit.errors import ToolkitError
from toolkit.format import safe_load

_CHECK = 4096


class FileRanges:
    """Byte ranges in `path` of views of its memory-mapped tensors `mapped`; `meta` are the same tensors loaded with
    map_location="meta" (in the same order)."""

    def __init__(self, path: Path, mapped: list[torch.Tensor], meta: list[torch.Tensor]):
        self.path, self.fd, self._base = Path(path), None, {}
        if not ENABLED or len(mapped) != len(meta):
            return
        bases = {}
        for t, m in zip(mapped, meta):
            off = getattr(m.untyped_storage(), "_checkpoint_offset", None)
            if not isinstance(off, int) or t.dtype != m.dtype or t.shape != m.shape or not t.is_contiguous():
                return
            bases[t.untyped_storage().data_ptr()] = off
        fd = os.open(self.path, os.O_RDONLY)
        self.fd, self._base = fd, bases
        for t in mapped:  # the bytes at the offsets are the tensors' own, at both ends
            flat = t.reshape(-1).view(torch.uint8)
            for lo in {0, max(0, flat.numel() - _CHECK)}:
                want = flat[lo:lo + _CHECK].numpy().tobytes()
                fd_, at, _ = self.range(t.reshape(-1)) or (None, 0, 0)
                if fd_ is None or os.pread(fd, len(want), at + lo) != want:
                    self.close()
                    return

    def range(self, view: torch.Tensor) -> tuple[int, int, int] | None:
        """(file descriptor, byte offset, byte count) of a contiguous view of one of the tensors, or None."""
        base = self._base.get(view.untyped_storage().data_ptr()) if self.fd is not None else None
        if base is None or not view.is_contiguous():
            return None
        return self.fd, base + view.storage_offset() * view.element_size(), view.numel() * view.element_size()

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
        self.fd, self._base = None, {}


def optimizer_ranges(path: Path, mapped: list[torch.Tensor], key: str, inner: str) -> FileRanges:
    """FileRanges of the tensors file[inner][key] (a list) of a DeepSpeed optimizer file, already memory-mapped as
    `mapped`; without ranges when its offsets cannot be found or do not check out."""
    try:
        meta = safe_load.load(path, deepspeed=True, map_location="meta")[inner][key]
    except (ToolkitError, KeyError, TypeError):
        meta = []
    return FileRanges(path, mapped, list(meta))


def ranges_of(pieces: list[torch.Tensor], files: list[FileRanges]) -> list[tuple[int, int, int]] | None:
    """The byte ranges of `pieces` (views of the tensors of `files`), in order; None when any has none."""
    out = []
    for p in pieces:
        r = next((r for f in files if (r := f.range(p)) is not None), None)
        if r is None:
            return None
        out.append(r)
    return out
