"""Reading Megatron-Core's `torch_dist` checkpoints (Megatron-LM's default `--ckpt-format`, and Megatron-Bridge's)
without a process group, one tensor at a time, and without running code hidden in them.

Layout: <root>/latest_checkpointed_iteration.txt and <root>/iter_XXXXXXX/ holding metadata.json (the backend),
common.pt (Megatron-LM's args, iteration, ...: a torch.save pickle, read weights-only with the allow-list), the torch
DCP `.metadata` (a plain pickle, read with only DCP's own record classes allowed) and `__R_I.distcp` files. The
`.metadata` names every tensor with its global shape and, for every saved chunk, the file, byte offset and length of
that chunk, which is itself a small torch.save file (read weights-only).

Tensor names are Megatron-Core's sharded keys: layers are stacked on a leading axis (`decoder.layers.X` has shape
[num_layers, ...], global over pipeline stages and virtual chunks), TP shards are assembled into the full tensor, and
the two per-layer norms carry Transformer Engine names (`linear_qkv.layer_norm_weight`). The full tensor of each
parameter is Megatron's TP = 1 layout of it (TP splits whole query groups; fc1 is saved as cat(gate, up)). A mixture
of experts' routed experts (SequentialMLP's `local_experts.{x}`, and Transformer Engine's grouped GEMM, whose weights
Megatron-Core saves under the same keys) are stacked on a second axis by global expert index:
`decoder.layers.mlp.experts.experts.linear_fc1.weight` has shape [num_layers, num_experts, ...], whatever the
expert-parallel size.
"""
from __future__ import annotations

import json
import os
import resource
from pathlib import Path

import torch

from toolkit.checkpoint.dist_keys import known_backend, tiling_problem
from toolkit.errors import ToolkitError
from toolkit.families.mapping import local_spec_name
from toolkit.families.rules import buffer
from toolkit.format import paths, safe_load
from toolkit.format.pt_zip import Slice
from toolkit.format import safetensors_stream as st

_SKIP = ("_extra_state",)  # Transformer Engine / Megatron module metadata (bytes), not weights
_DTYPES = {getattr(torch, name) for name in st.TORCH_NAMES.values()}  # what models are saved in (safetensors' too)


def _descriptors(files: int, where: Path) -> None:
    """Room to hold every .distcp file open at once (locate() keeps them, a thousand for a 512-rank save): the soft
    limit on open files raised towards the hard one, or one line saying what to raise."""
    want = files + 256
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= want:
        return
    if hard == resource.RLIM_INFINITY or hard >= want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        return
    raise ToolkitError(f"{where} holds {files} .distcp files, more than this process may open (ulimit -n: hard limit "
                       f"{hard}); raise it to at least {want} (ulimit -Hn as root, or the job's limits) and rerun")


class Reader:
    """One iter_* folder of a torch_dist checkpoint: its common state, and any tensor (or one layer of it) on
    request, assembled from its chunks' byte ranges."""

    def __init__(self, it_dir: Path):
        self.dir = it_dir
        meta_json = paths.inside(it_dir, "metadata.json", str(it_dir))
        if not meta_json.is_file():
            raise ToolkitError(f"{it_dir} has no metadata.json: not a complete torch_dist checkpoint (the save did "
                               "not finish); use another iteration")
        try:
            meta = json.loads(meta_json.read_text())
            backend = meta.get("sharded_backend")
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError, AttributeError) as e:
            raise ToolkitError(f"{meta_json} is not Megatron's checkpoint metadata ({e}); re-copy it") from None
        if backend != "torch_dist":
            raise ToolkitError(f"{meta_json} names sharded backend {backend!r}; only torch_dist checkpoints are read "
                               "(re-save with --ckpt-format torch_dist, or convert from the legacy torch format)")
        if not known_backend(meta):
            raise ToolkitError(f"{meta_json} gives sharded_backend_version {meta.get('sharded_backend_version')!r} "
                               f"and common_backend {meta.get('common_backend')!r}; this reader knows version 1 "
                               "with torch's common.pt, what Megatron-Core 0.16 writes: re-save the checkpoint with it")
        self.common = safe_load.load(paths.inside(it_dir, "common.pt", str(it_dir)), deepspeed=False)
        if not isinstance(self.common, dict):
            raise ToolkitError(f"{it_dir / 'common.pt'} holds a {type(self.common).__name__}, not Megatron's common "
                               "state dict; re-copy the checkpoint")
        self.metadata = safe_load.load_dcp_metadata(paths.inside(it_dir, ".metadata", str(it_dir)))
        self._check_files()
        self._tensors = {fqn: m for fqn, m in self.metadata.state_dict_metadata.items()
                         if hasattr(m, "chunks") and hasattr(m, "size")}
        for fqn, m in self._tensors.items():
            problem = tiling_problem(tuple(m.size), m.chunks)
            if problem:
                raise ToolkitError(f"{self.dir / '.metadata'} disagrees with itself: {fqn} {problem}; the checkpoint "
                                   "is damaged: re-copy it")
        self._where = {}
        self._fds: dict[str, int] = {}  # .distcp file -> open descriptor, for locate()
        self._located: dict[tuple, tuple | None] = {}  # (fqn, chunk offsets) -> (fd, byte offset, meta tensor)
        for index, info in self.metadata.storage_data.items():
            self._where[(index.fqn, tuple(index.offset) if index.offset is not None else None)] = info
        self._check_records()
        # local-spec name (layers without their index) -> sharded key
        self.names = {local_spec_name(fqn): fqn for fqn in self._tensors if not fqn.endswith(_SKIP)}

    def _check_files(self) -> None:
        """Every chunk the metadata names lies inside an existing .distcp file of this folder: one line otherwise."""
        sizes: dict[str, int] = {}
        for index, info in self.metadata.storage_data.items():
            name = info.relative_path
            if name not in sizes:
                f = paths.inside(self.dir, name, f"{self.dir / '.metadata'}")
                if not f.is_file():
                    raise ToolkitError(f"{f} is missing: the torch_dist checkpoint is incomplete (a rank's file was "
                                       "not saved or not copied); re-copy the whole iter folder")
                sizes[name] = f.stat().st_size
            if getattr(info, "transform_descriptors", None):
                raise ToolkitError(f"{self.dir / name} holds {index.fqn} with stream transforms "
                                   f"{list(info.transform_descriptors)}, which this reader does not decode")
            if info.offset < 0 or info.length < 0 or info.offset + info.length > sizes[name]:
                raise ToolkitError(f"{self.dir / '.metadata'} disagrees with the files: it places {index.fqn} at bytes "
                                   f"{info.offset}..{info.offset + info.length} of {name}, which has {sizes[name]}; "
                                   "the checkpoint is damaged or mixes two saves: re-copy it")
        _descriptors(len(sizes), self.dir)

    def _check_records(self) -> None:
        """Before anything is written: every chunk the metadata lists has a storage entry, a dtype a model is saved
        in, and a record (read to its pickle only: locate(), whose answers are kept for the conversion) holding a
        tensor of the chunk's shape and dtype. So `toolkit inspect` calls complete only what convert reads whole."""
        metadata = self.dir / ".metadata"
        for fqn, m in self._tensors.items():
            if m.properties.dtype not in _DTYPES:
                raise ToolkitError(f"{metadata} gives {fqn} the dtype {m.properties.dtype}, which no Megatron model "
                                   "is saved in; the checkpoint is damaged or not a model's: re-copy it")
            for chunk in m.chunks:
                if (fqn, tuple(chunk.offsets)) not in self._where:
                    raise ToolkitError(f"{metadata} lists a chunk of {fqn} at {list(chunk.offsets)} but no file holds "
                                       "it; the checkpoint is damaged: re-copy it")
                self.locate(fqn, tuple(chunk.offsets))

    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def shape(self, fqn: str) -> tuple[int, ...]:
        return tuple(self._tensors[fqn].size)

    def dtype(self, fqn: str) -> torch.dtype:
        return self._tensors[fqn].properties.dtype

    def get(self, fqn: str, index: tuple[int, ...] = ()) -> torch.Tensor:
        """The full tensor `fqn`, or only its slice at `index` on the leading axes (a layer; a layer and an expert),
        read chunk by chunk: only the chunks that overlap it. A slice that one chunk holds whole is that chunk's
        tensor, not a copy of it."""
        meta = self._tensors[fqn]
        shape, n = tuple(meta.size), len(index)
        hits = [c for c in meta.chunks if all(c.offsets[d] <= index[d] < c.offsets[d] + c.sizes[d] for d in range(n))]
        if len(hits) == 1 and tuple(hits[0].sizes) == (1,) * n + shape[n:] and not any(hits[0].offsets[n:]):
            off = tuple(hits[0].offsets)
            piece = self._chunk(fqn, off, tuple(hits[0].sizes), meta.properties.dtype)
            for d in range(n):
                piece = piece[index[d] - off[d]]
            return piece
        out = buffer(shape[n:], meta.properties.dtype)
        covered = 0
        for chunk in hits:
            off, size = tuple(chunk.offsets), tuple(chunk.sizes)
            piece = self._chunk(fqn, off, size, meta.properties.dtype)
            for d in range(n):
                piece = piece[index[d] - off[d]]
            region = out
            for d in range(n, len(shape)):
                region = region.narrow(d - n, off[d], size[d])
            region.copy_(piece)
            covered += piece.numel()
        if covered != out.numel():
            raise ToolkitError(f"{self.dir / '.metadata'} disagrees with itself: the chunks of {fqn} cover {covered} of "
                               f"its {out.numel()} values{f' at {list(index)}' if index else ''}; re-copy the "
                               "checkpoint")
        return out

    def chunk_bounds(self, fqn: str) -> list[tuple[int, int]]:
        """(start, end) of every saved chunk of the 1-D tensor `fqn`, by start."""
        return sorted((c.offsets[0], c.offsets[0] + c.sizes[0]) for c in self._tensors[fqn].chunks)

    def get_range(self, fqn: str, start: int, end: int) -> torch.Tensor:
        """Elements start..end of the 1-D tensor `fqn`, read from only the chunks that overlap them."""
        meta = self._tensors[fqn]
        out, covered = torch.empty(end - start, dtype=meta.properties.dtype), 0
        for chunk in meta.chunks:
            lo, hi = chunk.offsets[0], chunk.offsets[0] + chunk.sizes[0]
            if hi <= start or lo >= end:
                continue
            piece = self._chunk(fqn, tuple(chunk.offsets), tuple(chunk.sizes), meta.properties.dtype)
            a, b = max(lo, start), min(hi, end)
            out[a - start:b - start].copy_(piece[a - lo:b - lo])
            covered += b - a
        if covered != end - start:
            raise ToolkitError(f"{self.dir / '.metadata'} disagrees with itself: the chunks of {fqn} cover {covered} "
                               f"of its values {start}..{end}; re-copy the checkpoint")
        return out

    def chunks(self, fqn: str, index: tuple[int, ...] = ()) -> list[tuple[tuple[int, ...], tuple[int, ...], tuple]]:
        """(offsets, sizes, chunk offsets) of the saved chunks that hold fqn's slice at `index` on the leading axes,
        offsets and sizes of that slice without those axes; the last item names the chunk for locate()."""
        n = len(index)
        return [(tuple(c.offsets[n:]), tuple(c.sizes[n:]), tuple(c.offsets)) for c in self._tensors[fqn].chunks
                if all(c.offsets[d] <= index[d] < c.offsets[d] + c.sizes[d] for d in range(n))]

    def locate(self, fqn: str, offsets: tuple, index: tuple[int, ...] = ()) -> tuple[int, int, int] | None:
        """(open file descriptor, byte offset, byte count) of the raw bytes of the chunk of fqn saved at `offsets`,
        or of only its slice at `index` on the leading axes (contiguous: the chunk is row-major), for copying them
        file to file (toolkit/checkpoint/byte_ranges.py); None where they cannot be located. The offset is the one
        torch.load itself reads the chunk's storage from: a map_location="meta" load of the chunk's torch.save record
        gives it from the zip's local header (only the pickle is read, weights-only with the allow-list), and the
        chunk's shape and dtype must be the metadata's, its bytes inside the chunk's record."""
        key = (fqn, tuple(offsets))
        if key not in self._located:
            self._located[key] = self._find(fqn, key)
        found = self._located[key]
        if found is None:
            return None
        fd, at, meta = found
        skip = sum((i - o) * s for i, o, s in zip(index, offsets, meta.stride()))
        count = meta[tuple(i - o for i, o in zip(index, offsets))].numel() if index else meta.numel()
        return fd, at + skip * meta.element_size(), count * meta.element_size()

    def _find(self, fqn: str, key: tuple):
        info, want = self._where[key], self._tensors[fqn]  # every chunk has its entry (_check_records)
        if info.relative_path not in self._fds:
            self._fds[info.relative_path] = os.open(self.dir / info.relative_path, os.O_RDONLY)
        fd = self._fds[info.relative_path]
        where = f"{self.dir / info.relative_path} (bytes {info.offset}..{info.offset + info.length}, {fqn})"
        meta = safe_load.load_buffer(Slice(fd, info.offset, info.length), where, map_location="meta")
        sizes = next((tuple(c.sizes) for c in want.chunks if tuple(c.offsets) == key[1]), None)
        if not torch.is_tensor(meta) or tuple(meta.shape) != sizes or meta.dtype != want.properties.dtype:
            got = (tuple(meta.shape), meta.dtype) if torch.is_tensor(meta) else type(meta).__name__
            raise ToolkitError(f"{where} holds {got}, but {self.dir / '.metadata'} says {sizes} "
                               f"{want.properties.dtype}: the metadata disagrees with the files; re-copy the "
                               "checkpoint")
        at = getattr(meta.untyped_storage(), "_checkpoint_offset", None)
        if not isinstance(at, int) or not meta.is_contiguous() or at < 0 or \
                at + (meta.storage_offset() + meta.numel()) * meta.element_size() > info.length:
            return None
        return fd, info.offset + at + meta.storage_offset() * meta.element_size(), meta

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds, self._located = {}, {}

    def objects(self) -> list[str]:
        """The names of the saved objects (Megatron's ShardedObjects: bytes, not tensors)."""
        return sorted({index.fqn for index in self.metadata.storage_data if index.offset is None})

    def get_object(self, fqn: str):
        """A saved object (a small torch.save file), read weights-only with the allow-list."""
        info = self._where[(fqn, None)]
        with open(self.dir / info.relative_path, "rb") as f:
            f.seek(info.offset)
            data = f.read(info.length)
        return safe_load.load_buffer(data, f"{self.dir / info.relative_path} (bytes {info.offset}.."
                                           f"{info.offset + info.length}, {fqn})")

    def _chunk(self, fqn: str, offsets: tuple, sizes: tuple, dtype: torch.dtype) -> torch.Tensor:
        info = self._where[(fqn, offsets)]  # every chunk has its entry (_check_records)
        where = f"{self.dir / info.relative_path} (bytes {info.offset}..{info.offset + info.length}, {fqn})"
        located = self.locate(fqn, offsets) if st.mapping() else None
        if located is not None and located[2]:  # within mapped() (the verification's reads): the bytes torch.load
            fd, at, count = located             # reads, mapped
            if at % dtype.itemsize == 0:
                return st.map_bytes(fd, at, count, dtype, sizes, f"{where}: short read")
            # records are written back to back, so after one of odd length a tensor's bytes start at an offset its
            # dtype cannot be viewed at (half of them in a checkpoint of ours here): copied to a buffer
            out = buffer(sizes, dtype)
            out.reshape(-1).view(torch.uint8).copy_(st.map_bytes(fd, at, count, torch.uint8, (count,),
                                                                 f"{where}: short read"))
            return out
        with open(self.dir / info.relative_path, "rb", buffering=0) as f:
            tensor = safe_load.load_buffer(Slice(f.fileno(), info.offset, info.length), where)
        if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != sizes or tensor.dtype != dtype:
            got = (tuple(tensor.shape), tensor.dtype) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise ToolkitError(f"{where} holds {got}, but {self.dir / '.metadata'} says {sizes} {dtype}: the metadata "
                               "disagrees with the files; re-copy the checkpoint")
        return tensor
