"""Reading a torch.save file without torch: where each tensor's bytes lie, and the plain objects around them.

`toolkit convert --no-verify` copies the weights of Megatron-LM's rank files and of Megatron-Core's `torch_dist`
items file to file (toolkit/checkpoint/pickled_copy.py). For that it needs only each tensor's dtype, shape and
byte offset, which lie in the file's own records: torch.save writes a zip, stored uncompressed, holding
`<archive>/data.pkl` (a pickle, protocol 2) and one record `<archive>/data/<key>` per storage. The pickle names a
tensor as `torch._utils._rebuild_tensor_v2(storage, offset, size, stride, ...)`, its storage as a persistent id
`("storage", torch.<Type>Storage, key, location, numel)`.

The pickle is read by an unpickler that knows a short allow-list and nothing else (`GLOBALS`): the tensor rebuild
(which returns a TensorRef: no torch, no bytes read), the storage types and torch dtypes (as names), plain
containers, and the records a real Megatron-LM `args` holds (toolkit/format/records.py: inert stand-ins for
Megatron's classes, argparse, signal, numpy). It is a subset of what torch.load(weights_only=True) with the
toolkit's allow-list accepts (toolkit/format/safe_load.py), and like torch's it sets the state (BUILD) only of
instances of those records, never of an allowed class or function itself (records.GuardedUnpickler). Anything
else, a compressed record, big-endian data or a record that does not match its storage, raises NotReadHere before
any object of the file is built further, and the caller hands the file to torch's loader, which then reads it or
refuses it in its own words.
"""
from __future__ import annotations

import argparse
import collections
import io
import math
import os
import pickle
import struct
import types
import zipfile
from pathlib import Path, PosixPath

import numpy as np

from toolkit.format.records import (DCP_CLASSES, DCPUnpickler, GuardedUnpickler, Record, by_name, is_dcp_metadata,
                                    megatron_lm_records, numpy_records)

STORAGES = {"BFloat16Storage": "BF16", "HalfStorage": "F16", "FloatStorage": "F32", "DoubleStorage": "F64",
            "LongStorage": "I64", "IntStorage": "I32", "ShortStorage": "I16", "CharStorage": "I8",
            "ByteStorage": "U8", "BoolStorage": "BOOL"}
"""torch's typed storage classes, by the safetensors name of their dtype."""
ITEMSIZE = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
TORCH_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", "float64": "F64", "int64": "I64",
                "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"}
"""torch's dtypes by name, and their safetensors names."""
_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")  # a zip entry's local file header (30 bytes)


class NotReadHere(Exception):
    """A file this reader does not take (the message says why): torch's own loader is to read it instead."""


class TorchName:
    """A torch dtype, layout or memory format named in a pickle (Megatron-LM's args.params_dtype, a DCP tensor's
    properties): its name, nothing of torch."""

    def __init__(self, name: str):
        self.name = name

    def __eq__(self, other) -> bool:
        return type(other) is TorchName and other.name == self.name

    def __hash__(self) -> int:
        return hash(self.name)

    def __repr__(self) -> str:
        return f"torch.{self.name}"


class _StorageType:
    """torch.<Type>Storage as a pickle names it: only its dtype. Not callable."""

    def __init__(self, dtype: str):
        self.dtype = dtype


class Storage:
    """One storage record: its dtype, element count, and the byte offset and size of its data in the file."""

    __slots__ = ("dtype", "numel", "offset", "nbytes")

    def __init__(self, dtype: str, numel: int, offset: int, nbytes: int):
        self.dtype, self.numel, self.offset, self.nbytes = dtype, numel, offset, nbytes


class TensorRef:
    """A tensor of the file, by where its bytes lie: dtype (safetensors name), shape, and its storage and offset."""

    __slots__ = ("storage", "dtype", "shape", "stride", "storage_offset")

    def __init__(self, storage: Storage, storage_offset: int, shape: tuple, stride: tuple):
        self.storage, self.dtype, self.storage_offset = storage, storage.dtype, storage_offset
        self.shape, self.stride = shape, stride

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ITEMSIZE[self.dtype]

    def span(self) -> tuple[int, int] | None:
        """(byte offset in the file, byte count) of a row-major tensor; None for another layout."""
        row_major, step = [], 1
        for n in reversed(self.shape):
            row_major.insert(0, step)
            step *= n
        if any(n > 1 and s != r for n, s, r in zip(self.shape, self.stride, row_major)):
            return None
        return self.storage.offset + self.storage_offset * ITEMSIZE[self.dtype], self.nbytes


def _is_ints(value) -> bool:
    return isinstance(value, tuple) and all(type(v) is int and v >= 0 for v in value)


def _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad=False, hooks=None, metadata=None):
    """torch._utils._rebuild_tensor_v2 as this reader takes it: a TensorRef that lies inside its storage."""
    if (not isinstance(storage, Storage) or type(storage_offset) is not int or storage_offset < 0
            or not _is_ints(size) or not _is_ints(stride) or len(size) != len(stride) or requires_grad is not False
            or hooks or metadata):
        raise pickle.UnpicklingError("a tensor rebuilt with arguments this reader does not take")
    extent = storage_offset + (1 + sum((n - 1) * s for n, s in zip(size, stride)) if all(size) else 0)
    if extent > storage.numel:
        raise pickle.UnpicklingError("a tensor that reaches past its storage")
    return TensorRef(storage, storage_offset, size, stride)


def _encode(text, encoding):
    """_codecs.encode as protocol-2 pickles use it for bytes: latin-1 text to bytes, nothing else."""
    if not isinstance(text, str) or encoding != "latin1":
        raise pickle.UnpicklingError("_codecs.encode of something other than latin-1 text")
    return text.encode("latin1")


GLOBALS: dict[str, object] = {
    "torch._utils._rebuild_tensor_v2": _rebuild_tensor_v2, "_codecs.encode": _encode,
    "collections.OrderedDict": collections.OrderedDict, "argparse.Namespace": argparse.Namespace,
    **{f"torch.{n}": _StorageType(d) for n, d in STORAGES.items()},
    **{f"torch.{n}": TorchName(n) for n in TORCH_DTYPES},
    **by_name(megatron_lm_records()), **by_name(numpy_records())}
"""Every global a pickle may name here, and what it stands for; any other is refused (NotReadHere)."""


class _Unpickler(GuardedUnpickler):
    buildable = (argparse.Namespace, types.SimpleNamespace, io.BytesIO, collections.OrderedDict, Record, np.ndarray,
                 np.dtype)  # what a Megatron-LM rank file's objects set the state of

    def __init__(self, data: bytes, storage):
        super().__init__(io.BytesIO(data))
        self._storage = storage

    def find_class(self, module: str, name: str):
        found = GLOBALS.get(f"{module}.{name}")
        if found is None:
            raise pickle.UnpicklingError(f"GLOBAL {module}.{name} is not on this reader's allow-list")
        return found

    def persistent_load(self, pid):
        if (not isinstance(pid, tuple) or len(pid) != 5 or pid[0] != "storage"
                or not isinstance(pid[1], _StorageType) or not isinstance(pid[2], str) or type(pid[4]) is not int):
            raise pickle.UnpicklingError(f"a persistent id this reader does not take: {str(pid)[:80]}")
        return self._storage(pid[1].dtype, pid[2], pid[4])


class Slice(io.RawIOBase):
    """Bytes offset..offset+length of an open file as a file of their own, read with positioned reads: one torch DCP
    item (a chunk's torch.save file), which this module or torch.load then reads (no copy of the whole item first)."""

    def __init__(self, fd: int, offset: int, length: int):
        super().__init__()
        self.fd, self.offset, self.length, self.pos = fd, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        self.pos = max(0, pos + (0 if whence == io.SEEK_SET else self.pos if whence == io.SEEK_CUR else self.length))
        return self.pos

    def readinto(self, buffer) -> int:
        view = memoryview(buffer).cast("B")
        n = max(0, min(len(view), self.length - self.pos))
        done = 0
        while done < n:
            got = os.preadv(self.fd, [view[done:n]], self.offset + self.pos + done)
            if got <= 0:
                break  # the file is shorter than its metadata says: torch.load reports the truncated record
            done += got
        self.pos += done
        return done


def load(path: Path, start: int = 0, length: int | None = None):
    """The object torch.save wrote into `path` (or into its bytes [start, start + length)), each tensor a
    TensorRef whose byte offsets are the file's. NotReadHere when this reader does not take the file."""
    if not Path(path).is_file():  # a pipe or a device would block the open or the read
        raise NotReadHere("not a regular file")
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            length = size - start if length is None else length
            if start < 0 or length < 0 or start + length > size:
                raise NotReadHere(f"bytes {start}..{start + length} lie outside the file")
            with zipfile.ZipFile(Slice(f.fileno(), start, length) if (start, length) != (0, size) else f) as z:
                infos = z.infolist()
                pickles = [i for i in infos if i.filename.endswith("/data.pkl") and i.filename.count("/") == 1]
                if len(pickles) != 1:
                    raise NotReadHere("not a torch.save zip (no single <archive>/data.pkl)")
                prefix = pickles[0].filename[: -len("data.pkl")]
                if any(i.compress_type != zipfile.ZIP_STORED for i in infos):
                    raise NotReadHere("a compressed record")
                names = {i.filename: i for i in infos}
                order = names.get(prefix + "byteorder")
                if order is not None and z.read(order) != b"little":
                    raise NotReadHere("big-endian data")
                data = z.read(pickles[0])
            storages: dict[str, Storage] = {}

            def storage(dtype: str, key: str, numel: int) -> Storage:
                if key not in storages:
                    info = names.get(f"{prefix}data/{key}")
                    if info is None or info.file_size != numel * ITEMSIZE[dtype]:
                        raise pickle.UnpicklingError(f"storage {key!r} has no record of its size")
                    f.seek(start + info.header_offset)
                    header = f.read(_LOCAL_HEADER.size)
                    if len(header) != _LOCAL_HEADER.size or header[:4] != b"PK\x03\x04":
                        raise pickle.UnpicklingError(f"storage {key!r}: no local header where the index says")
                    fields = _LOCAL_HEADER.unpack(header)
                    at = info.header_offset + _LOCAL_HEADER.size + fields[9] + fields[10]
                    if at + info.file_size > length:
                        raise pickle.UnpicklingError(f"storage {key!r} reaches past the end of the file")
                    storages[key] = Storage(dtype, numel, start + at, info.file_size)
                elif storages[key].dtype != dtype or storages[key].numel != numel:
                    raise pickle.UnpicklingError(f"storage {key!r} named with two dtypes or sizes")
                return storages[key]

            return _Unpickler(data, storage).load()
    except NotReadHere:
        raise
    except Exception as e:  # noqa: BLE001 - zipfile and pickle raise many kinds of error on input they do not take
        raise NotReadHere(f"{type(e).__name__}: {e}") from None


def _size(dims) -> tuple[int, ...]:
    """torch.Size as a pickle rebuilds it: a tuple of sizes."""
    dims = tuple(dims) if isinstance(dims, (tuple, list)) else None
    if dims is None or not _is_ints(dims):
        raise pickle.UnpicklingError("a torch.Size of something other than sizes")
    return dims


def _layout(name) -> TorchName:
    """torch.serialization._get_layout as a pickle calls it: the layout's name."""
    if name not in ("torch.strided", "torch.sparse_coo", "torch.sparse_csr", "torch._mkldnn"):
        raise pickle.UnpicklingError(f"a layout this reader does not know: {str(name)[:40]}")
    return TorchName(name.removeprefix("torch."))


DCP_GLOBALS: dict[tuple[str, str], object] = {
    **DCP_CLASSES, ("torch", "Size"): _size, ("torch.serialization", "_get_layout"): _layout,
    ("pathlib", "PosixPath"): PosixPath, **{("torch", n): TorchName(n) for n in TORCH_DTYPES},
    **{("torch", n): TorchName(n) for n in ("strided", "contiguous_format", "channels_last", "preserve_format")}}
"""What a torch DCP `.metadata` pickle may name here: DCP's records as inert stand-ins (toolkit/format/records.py),
torch's sizes, dtypes, layouts and memory formats by name."""


def load_dcp_metadata(path: Path):
    """A torch DCP `.metadata` file (a plain pickle) read without torch: DCP's records as DCPRecords, sizes as
    tuples, dtypes as TorchNames. NotReadHere when it names anything else or does not unpickle."""
    if not Path(path).is_file():  # as load()
        raise NotReadHere("not a regular file")
    try:
        with open(path, "rb") as f:
            meta = DCPUnpickler(f, DCP_GLOBALS).load()
    except Exception as e:  # noqa: BLE001 - pickle raises many kinds of error on damaged input
        raise NotReadHere(f"{type(e).__name__}: {e}") from None
    if not is_dcp_metadata(meta):
        raise NotReadHere(f"a pickled {type(meta).__name__}, not DCP metadata")
    return meta
