"""Writing a torch.save file without torch, its tensors' bytes filled in afterwards: how a Megatron-LM legacy rank
file (one pickle of a whole pipeline stage, toolkit/checkpoint/megatron_lm_write.py) is written in bounded memory,
and by `toolkit convert --no-verify` without importing torch (toolkit/checkpoint/copy_only.py).

A torch.save file is a zip, stored uncompressed: `<archive>/data.pkl` (a pickle, protocol 2, tensors as
`torch._utils._rebuild_tensor_v2(storage, offset, size, stride, False, OrderedDict())` and each storage as the
persistent id `("storage", torch.<Type>Storage, key, "cpu", numel)`), one record `<archive>/data/<key>` per storage,
and `byteorder`, `version` and the other small records torch writes (toolkit/format/pt_zip.py reads the same).
File(path, obj) pickles obj, whose tensors are Tensor views of Storage slots (dtype and size: no bytes), and lays
the zip out with every storage record's data left as a hole, where torch's writer (miniz) puts it: 64-byte aligned
by an "FB" extra field, each record's data followed by a data descriptor (torch.load with map_location="meta"
works out the storages' offsets from that layout, without reading the headers). offset(storage) says where its
bytes go, and the caller writes them there (file to file, or from memory). The zip's own CRC-32 is that of the
small records; a storage record's is left 0, as torch.load does not check it (torch's skip_data leaves it wrong
too). Objects other than tensors are pickled as torch.save pickles them; torch's dtypes are Globals
(`torch_dtype`). ZIP64 records where a size or offset passes 4 GiB.
"""
from __future__ import annotations

import collections
import hashlib
import io
import math
import os
import pickle
import struct
import threading
import zlib
from collections.abc import Callable
from pathlib import Path

from toolkit.format.file_copy import copy_ranges, pwrite_all, start_writeback
from toolkit.format.pt_zip import ITEMSIZE, STORAGES, TORCH_DTYPES

ALIGN = 64  # torch's storage alignment in a torch.save zip
_STORAGE_CLASS = {dtype: name for name, dtype in STORAGES.items()}
_DTYPE = {dtype: name for name, dtype in TORCH_DTYPES.items()}
_LIMIT = 0xFFFFFFFF


class Global:
    """A module-level object of another library, pickled by name only (GLOBAL module name): a torch dtype, a storage
    class, torch's tensor rebuild. Not callable."""

    _made: dict[tuple[str, str], Global] = {}

    def __new__(cls, module: str, name: str):
        key = (module, name)
        if key not in cls._made:  # one object per name, so the pickle's memo refers back to it as torch's does
            self = object.__new__(cls)
            self.module, self.name = module, name
            cls._made[key] = self
        return cls._made[key]

    def __call__(self, *args):
        raise TypeError(f"{self.module}.{self.name} is a name to pickle, not a function")

    def __repr__(self) -> str:
        return f"{self.module}.{self.name}"


def torch_dtype(name: str) -> Global:
    """torch's dtype of a safetensors dtype name ("BF16" -> torch.bfloat16), as a pickle names it."""
    return Global("torch", _DTYPE[name])


_REBUILD = Global("torch._utils", "_rebuild_tensor_v2")


class Obj:
    """An instance of another library's class, pickled as Python pickles one by default: the class's __new__, then
    its state (BUILD; none when `state` is None). A dataclass of torch DCP's `.metadata`."""

    def __init__(self, cls: Global, state=None):
        self.cls, self.state = cls, state


class Call:
    """func(*args) of another library, pickled as a REDUCE: torch.Size, an enum member, a layout."""

    def __init__(self, func: Global, args: tuple):
        self.func, self.args = func, args


class Storage:
    """A storage of the file: dtype (safetensors name) and element count; its bytes are written later."""

    __slots__ = ("dtype", "numel")

    def __init__(self, dtype: str, numel: int):
        self.dtype, self.numel = dtype, numel

    @property
    def nbytes(self) -> int:
        return self.numel * ITEMSIZE[self.dtype]


class Tensor:
    """A tensor of the file: a view of a Storage (element offset, shape, stride)."""

    __slots__ = ("storage", "offset", "shape", "stride")

    def __init__(self, storage: Storage, offset: int, shape: tuple, stride: tuple):
        self.storage, self.offset, self.shape, self.stride = storage, offset, tuple(shape), tuple(stride)

    @classmethod
    def empty(cls, shape, dtype: str) -> Tensor:
        """A row-major tensor with a storage of its own."""
        shape = tuple(shape)
        stride, step = [], 1
        for n in reversed(shape):
            stride.insert(0, step)
            step *= n
        return cls(Storage(dtype, math.prod(shape)), 0, shape, tuple(stride))

    @property
    def dtype(self) -> str:
        return self.storage.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ITEMSIZE[self.storage.dtype]


class _Pickler(pickle._Pickler):
    """The pure-Python pickler (protocol 2, as torch.save), with Globals written as GLOBAL opcodes, Tensors reduced
    as torch reduces tensors and Storages as torch's persistent ids."""

    dispatch = dict(pickle._Pickler.dispatch)

    def __init__(self, f, storages: dict[int, tuple[str, Storage]]):
        super().__init__(f, protocol=2)
        self._storages = storages

    def _global(self, obj: Global) -> None:
        self.write(pickle.GLOBAL + f"{obj.module}\n{obj.name}\n".encode())
        self.memoize(obj)

    dispatch[Global] = _global

    def _obj(self, obj: Obj) -> None:
        self.save(obj.cls)
        self.write(pickle.EMPTY_TUPLE + pickle.NEWOBJ)
        self.memoize(obj)
        if obj.state is not None:
            self.save(obj.state)
            self.write(pickle.BUILD)

    dispatch[Obj] = _obj

    def persistent_id(self, obj):
        if not isinstance(obj, Storage):
            return None
        key = self._storages.setdefault(id(obj), (str(len(self._storages)), obj))[0]
        return ("storage", Global("torch", _STORAGE_CLASS[obj.dtype]), key, "cpu", obj.numel)

    def reducer_override(self, obj):
        if isinstance(obj, Tensor):
            return _REBUILD, (obj.storage, obj.offset, obj.shape, obj.stride, False, collections.OrderedDict())
        if isinstance(obj, Call):
            return obj.func, obj.args
        return NotImplemented


def dumps(obj) -> tuple[bytes, list[tuple[str, Storage]]]:
    """torch.save's pickle of obj, and its storages (record key, Storage) in key order. A plain pickle (DCP's
    `.metadata`) when obj holds no tensors."""
    storages: dict[int, tuple[str, Storage]] = {}
    buf = io.BytesIO()
    _Pickler(buf, storages).dump(obj)
    return buf.getvalue(), sorted(storages.values(), key=lambda s: int(s[0]))


def _padding(at: int, fixed: int) -> bytes:
    """An extra field ("FB", as torch's) that puts a record's data, after `fixed` header bytes from `at`, on ALIGN."""
    pad = -(at + fixed + 4) % ALIGN
    return struct.pack("<HH", 0x4246, pad) + b"Z" * pad


def layout(obj, archive: str) -> tuple[list[tuple[int, bytes]], dict[int, int], int]:
    """The zip torch.save writes of obj, with its storages' data left out: ([(offset, bytes)] to write, {id(storage):
    offset of its data}, the zip's size). `archive`: its folder (torch.save names it after the file it writes, or
    "archive" when it writes to a file object)."""
    data, storages = dumps(obj)
    serial = str(int.from_bytes(hashlib.sha1(data).digest()[:16], "big")).zfill(40)[:40]  # deterministic
    records = [("data.pkl", data), (".format_version", b"1"), (".storage_alignment", str(ALIGN).encode()),
               ("byteorder", b"little"), *[(f"data/{key}", s) for key, s in storages],
               ("version", b"3\n"), (".data/serialization_id", serial.encode())]
    chunks, offsets, central, at = [], {}, [], 0
    for name, body in records:
        name_b = f"{archive}/{name}".encode()
        size = body.nbytes if isinstance(body, Storage) else len(body)
        crc = 0 if isinstance(body, Storage) else zlib.crc32(body)
        fields = ([size, size] if size >= _LIMIT else []) + ([at] if at >= _LIMIT else [])
        extra = struct.pack(f"<HH{len(fields)}Q", 1, 8 * len(fields), *fields) if fields else b""
        pad = -(at + 30 + len(name_b) + len(extra) + 4) % ALIGN  # torch's "FB" padding, always there
        extra += struct.pack("<HH", 0x4246, pad) + b"Z" * pad
        flags = 0x08 if size else 0  # sizes and CRC-32 in a data descriptor after the data, as miniz writes them
        head = struct.pack("<IHHHHHIIIHH", 0x04034B50, 45 if fields else 20, flags, 0, 0, 0x21, 0, 0, 0,
                           len(name_b), len(extra))
        start = at + len(head) + len(name_b) + len(extra)
        chunks.append((at, head + name_b + extra + (b"" if isinstance(body, Storage) else body)))
        if isinstance(body, Storage):
            offsets[id(body)] = start  # a hole until its bytes come
        central.append((name_b, crc, size, at))
        at = start + size
        if size:
            wide = size >= _LIMIT or central[-1][3] >= _LIMIT
            descriptor = struct.pack("<IIQQ" if wide else "<IIII", 0x08074B50, crc, size, size)
            chunks.append((at, descriptor))
            at += len(descriptor)
    tail = _central(central, at)
    chunks.append((at, tail))
    return chunks, offsets, at + len(tail)


def _central(entries: list, at: int) -> bytes:
    """The central directory (and ZIP64's end records where needed) of a zip whose records end at `at`."""
    out = bytearray()
    for name_b, crc, size, offset in entries:
        fields = [v for v in (size, size, offset) if v >= _LIMIT] if size >= _LIMIT else (
            [offset] if offset >= _LIMIT else [])
        extra = struct.pack(f"<HH{len(fields)}Q", 1, 8 * len(fields), *fields) if fields else b""
        wide = size >= _LIMIT
        out += struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 45 if fields else 20, 45 if fields else 20, 0, 0, 0,
                           0x21, crc, _LIMIT if wide else size, _LIMIT if wide else size, len(name_b),
                           len(extra), 0, 0, 0, 0, _LIMIT if offset >= _LIMIT else offset)
        out += name_b + extra
    count, start, length = len(entries), at, len(out)
    if start >= _LIMIT or length >= _LIMIT or count >= 0xFFFF:
        out += struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 45, 45, 0, 0, count, count, length, start)
        out += struct.pack("<IIQI", 0x07064B50, 0, start + length, 1)
        count, start, length = min(count, 0xFFFF), min(start, _LIMIT), min(length, _LIMIT)
    out += struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, count, count, length, start, 0)
    return bytes(out)


def item_around(tensor: Tensor) -> tuple[bytes, bytes]:
    """The bytes torch.save writes to a file object before and after the data of `tensor` (a whole storage),
    alone: a torch DCP item (toolkit/checkpoint/torch_dist_write.py) is these with the tensor's bytes between."""
    chunks, offsets, size = layout(tensor, "archive")
    start = offsets[id(tensor.storage)]
    head = b"".join(c for at, c in chunks if at < start)
    tail = b"".join(c for at, c in chunks if at > start)
    if len(head) != start or start + tensor.storage.nbytes + len(tail) != size or tensor.offset:
        raise RuntimeError(f"internal: the zip of a {tensor.shape} {tensor.dtype} tensor is not head, data, tail")
    return head, tail


def zip_bytes(obj) -> bytes:
    """torch.save(obj) to a file object, for an obj without tensors (a torch DCP item of a saved object)."""
    chunks, offsets, size = layout(obj, "archive")
    if offsets:
        raise RuntimeError("internal: zip_bytes of an object with tensors")
    return b"".join(c for _, c in chunks)


class File:
    """A torch.save file of `obj` laid out with its storages' bytes still to write (the module docstring)."""

    def __init__(self, path: Path, obj):
        self.path = Path(path)
        chunks, self._offset, self.size = layout(obj, self.path.stem)  # the zip's folder: the file's name
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for at, data in chunks:
                pwrite_all(fd, memoryview(data), at)
            os.ftruncate(fd, self.size)
        finally:
            os.close(fd)

    def offset(self, tensor: Tensor) -> int:
        """The byte offset in the file of a tensor's first element."""
        return self._offset[id(tensor.storage)] + tensor.offset * ITEMSIZE[tensor.dtype]


class Skeleton:
    """A torch.save file of `obj` (File), its storages' bytes written as they come, from several threads at once.
    `later`: the tensors of obj (each a whole storage) whose bytes come through write() or write_ranges(); `fills`:
    (tensor, function giving its bytes) for the others, written by finish() (small tensors, memory-mapped optimizer
    buffers). finish() checks that every tensor meant to come did."""

    def __init__(self, path: Path, obj, later: list[Tensor], fills: list[tuple[Tensor, Callable]] = ()):
        self.file = File(path, obj)
        self.path = self.file.path
        self._later = {id(t.storage) for t in later}
        self._fills = list(fills)
        self._put: set[int] = set()
        self._fd = os.open(self.path, os.O_RDWR)
        self.kernel_bytes = self.gathered_bytes = self.user_bytes = self.read_bytes = 0  # write_ranges' bytes
        self._lock = threading.Lock()

    def declared(self, tensor: Tensor) -> tuple[tuple[int, ...], str, int]:
        """(shape, dtype, byte count) of a tensor of obj whose bytes come later (byte_ranges.plan asks)."""
        return tensor.shape, tensor.dtype, tensor.nbytes

    def _whole(self, tensor: Tensor, size: int) -> int:
        if tensor.offset or tensor.nbytes != tensor.storage.nbytes or size != tensor.nbytes:
            raise RuntimeError(f"internal: {size} bytes for a {tensor.shape} {tensor.dtype} tensor of {self.path}, "
                               "or it is not a whole storage")
        return self.file.offset(tensor)

    def write(self, tensor: Tensor, data) -> int:
        """`data` (any buffer: a numpy array, a tensor's bytes) where `tensor` of obj lies; returns the byte count."""
        view = memoryview(data).cast("B")
        at = self._whole(tensor, view.nbytes)
        pwrite_all(self._fd, view, at)
        start_writeback(self._fd, at, view.nbytes)
        with self._lock:
            self._put.add(id(tensor.storage))
        return view.nbytes

    def write_ranges(self, tensor: Tensor, ranges: list[tuple[int | None, int, int]]) -> int:
        """The bytes of `tensor` of obj copied into the file from byte ranges of other files ((fd, offset, count),
        None for zeros: file_copy.copy_ranges), in order; returns the byte count."""
        size = sum(n for _, _, n in ranges)
        at = self._whole(tensor, size)
        kernel, gathered, user, read = copy_ranges(self._fd, at, ranges)
        start_writeback(self._fd, at, size)
        with self._lock:  # the write-behind threads may fill two tensors of this file at once
            self.kernel_bytes, self.gathered_bytes = self.kernel_bytes + kernel, self.gathered_bytes + gathered
            self.user_bytes, self.read_bytes = self.user_bytes + user, self.read_bytes + read
            self._put.add(id(tensor.storage))
        return size

    def finish(self) -> None:
        """Write the fills; check every tensor meant to come did; close."""
        try:
            if self._later - self._put:
                raise RuntimeError(f"internal: {len(self._later - self._put)} tensors of {self.path} were never "
                                   "written")
            for tensor, data in self._fills:
                view = memoryview(data()).cast("B")
                if view.nbytes != tensor.storage.nbytes:
                    raise RuntimeError(f"internal: {view.nbytes} bytes for a storage of {tensor.storage.nbytes} in "
                                       f"{self.path}")
                pwrite_all(self._fd, view, self.file.offset(tensor) - tensor.offset * ITEMSIZE[tensor.dtype])
        finally:
            os.close(self._fd)
        self._fills = []
