"""Megatron's pickled checkpoints as sources of the torch-free copy path (toolkit/checkpoint/copy_only.py): the
weights of a Megatron-LM legacy checkpoint and of a Megatron-Core torch_dist one, read without torch.

A Megatron-LM rank file, and each tensor item of a torch_dist `.distcp` file, is a torch.save zip whose tensors'
bytes lie uncompressed at offsets its own records give; toolkit/format/pt_zip.py reads the pickle with a short
allow-list and hands out each weight as a TensorRef (dtype, shape, byte range). torch_dist's `.metadata` (which
item holds which chunk, where) and `common.pt` (Megatron-LM's args) are read by the same module. That is all
byte_ranges.plan needs to copy the weights file to file. The checks are the full path's
(toolkit/checkpoint/megatron_sources.py: the family from the args, the vocabulary padding, every tensor present
with the shape its rule gives, the files where the metadata says), but a source that fails one, or that pt_zip does
not take, is not reported here: open_megatron() returns None and the full path opens it, and converts it or says
what is wrong in its own words.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

from toolkit.checkpoint import megatron_lm
from toolkit.checkpoint.dist_keys import is_optimizer_key, known_backend, sharded_name, tiling_problem
from toolkit.checkpoint.safetensors_sources import meta_shards
from toolkit.checkpoint.source_base import NO_OPTIMIZER_STATE, WEIGHT, Source, _ShardedSource
from toolkit.errors import ToolkitError
from toolkit.families.entries import check_megatron_shards, iter_entries, rank_key
from toolkit.families.mapping import local_spec_name
from toolkit.families.rules import concat
from toolkit.format import paths, pt_zip
from toolkit.format.names import chunk_key, split_key


class _Declined(Exception):
    """The source is one the copy path does not take (the full path opens it)."""


class _RankRefs:
    """byte_ranges' reader interface (dtype_name, shape, nbytes, span) over one rank file's TensorRefs, keyed by the
    toolkit's chunk keys."""

    def __init__(self, path: Path, chunks: list[dict]):
        self.path, self._chunks, self._fd = path, chunks, None

    def _ref(self, key: str) -> pt_zip.TensorRef:
        chunk, name, _ = split_key(key)
        return self._chunks[chunk][name]

    def dtype_name(self, key: str) -> str:
        return self._ref(key).dtype

    def shape(self, key: str) -> tuple[int, ...]:
        return self._ref(key).shape

    def nbytes(self, key: str) -> int:
        return self._ref(key).nbytes

    def span(self, key: str) -> tuple[int, int, int] | None:
        where = self._ref(key).span()
        if where is None:
            return None
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY)
        return self._fd, *where

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class LegacyWeights(_ShardedSource):
    """A Megatron-LM legacy checkpoint's weights, read without torch (the module docstring). `has_optimizer`: its
    files carry optimizer state (which only the full path converts)."""

    kind = "Megatron-LM"

    def __init__(self, path: Path, vocab_size: int | None, rows: int | None = None):
        self.rows = rows
        args, shards, self.step, states = megatron_lm.read(path, pt_zip.load)
        it_dir = megatron_lm.iteration_dir(path)
        megatron_lm.family_of_args(args, path)
        vocab_size = vocab_size or megatron_lm.recorded_vocab(args)
        if vocab_size is None:
            raise _Declined("no vocabulary size")  # the full path asks for it
        self.args, self.config = args, megatron_lm.hf_config(args, vocab_size)
        self.scheduler = next(iter(states.values()))["opt_param_scheduler"]
        self.divisible_by = getattr(args, "make_vocab_size_divisible_by", 128)
        self.layout = megatron_lm.layout_of_args(args)
        pp = self.layout[1]
        self.ep = megatron_lm.expert_parallel_size(args)
        self._index()
        if self._dims.padded_vocab != args.padded_vocab_size:
            raise _Declined("the vocabulary size does not pad to the checkpoint's rows")
        if check_megatron_shards(shards, iter_entries(self._dims, *self.layout[1:], self.ep), *self.layout, self.ep):
            raise _Declined("the shards are not the model's")
        for rank, shapes in meta_shards(self._dims, *self.layout, self.ep).items():
            for key, shape in shapes.items():
                chunk, name, _ = split_key(key)
                ref = shards[rank][chunk][name]
                if not isinstance(ref, pt_zip.TensorRef) or ref.shape != tuple(shape) or ref.span() is None:
                    raise _Declined(f"{key} is not a row-major tensor of the shape its rule gives")
        self.has_optimizer = (any(s["optimizer"] is not None for s in states.values())
                              or any(it_dir.glob("mp_rank_*/distrib_optim.pt")))
        if not self.has_optimizer:
            self.optimizer_note = NO_OPTIMIZER_STATE
        self._ranks = {k: _RankRefs(megatron_lm.rank_file(it_dir, k[1], k[0], pp, *(k[2:] or (0,)), self.ep), v)
                       for k, v in shards.items()}
        dtypes = {ref.dtype for chunks in shards.values() for chunk in chunks for ref in chunk.values()}
        if len(dtypes) != 1:
            raise _Declined(f"weights of several dtypes ({sorted(dtypes)})")
        self._dtype = dtypes.pop()

    def spans(self, hf_names, field: str = WEIGHT):
        if field != WEIGHT:
            return None
        entry = self._entries[tuple(hf_names)]
        key = chunk_key(entry.chunk, entry.megatron_name)
        ranks = [rank_key(entry.pp_rank, t, entry.ep_rank or 0, self.ep) for t in range(self.layout[0])]
        return [(self._ranks[r], key) for r in ranks], lambda shards: list(entry.to_hf(shards).values())

    def dtype_name(self) -> str:
        return self._dtype

    def close(self) -> None:
        for r in self._ranks.values():
            r.close()


def tiling_axis(pieces: list, shape: tuple[int, ...]) -> int | None:
    """The axis along which these (offsets, sizes, _) pieces tile a tensor of `shape` end to end, each whole on every
    other axis (0 for a single piece that is the whole tensor); None when they do not."""
    for dim in range(max(1, len(shape))):
        if not shape or any(o[e] or s[e] != shape[e] for o, s, _ in pieces for e in range(len(shape)) if e != dim):
            continue
        at = 0
        for o, s, _ in sorted(pieces, key=lambda p: p[0][dim]):
            if o[dim] != at:
                break
            at += s[dim]
        else:
            if at == shape[dim]:
                return dim
    return None


class TorchDistWeights(Source):
    """A Megatron-Core torch_dist checkpoint's weights, read without torch (the module docstring): each parameter is
    its chunks' bytes in the `.distcp` items (its layer's slice of them), as TorchDistSource.spans finds them with
    torch. `has_optimizer`: it holds optimizer state (which only the full path converts)."""

    kind = "Megatron torch_dist"

    def __init__(self, it_dir: Path, vocab_size: int | None, rows: int | None = None):
        self.dir, where, self.rows = it_dir, str(it_dir), rows
        meta = json.loads(paths.inside(it_dir, "metadata.json", where).read_text())
        if meta.get("sharded_backend") != "torch_dist" or not known_backend(meta):
            raise _Declined(f"sharded backend {meta.get('sharded_backend')!r}")  # the full path says why
        common = pt_zip.load(paths.inside(it_dir, "common.pt", where))
        metadata = pt_zip.load_dcp_metadata(paths.inside(it_dir, ".metadata", where))
        sizes: dict[str, int] = {}
        self._where, self._fds, self._items = {}, {}, {}
        for index, info in metadata.storage_data.items():
            if info.relative_path not in sizes:
                sizes[info.relative_path] = paths.inside(it_dir, info.relative_path, where).stat().st_size
            if (getattr(info, "transform_descriptors", None) or info.offset < 0 or info.length < 0
                    or info.offset + info.length > sizes[info.relative_path]):
                raise _Declined(f"{index.fqn} is not where the metadata says, or is transformed")
            self._where[(index.fqn, tuple(index.offset) if index.offset is not None else None)] = info
        self._tensors = {fqn: m for fqn, m in metadata.state_dict_metadata.items()
                         if hasattr(m, "chunks") and hasattr(m, "size")}
        if any(tiling_problem(tuple(m.size), m.chunks) for m in self._tensors.values()):
            raise _Declined("chunks that do not tile their tensor")  # the full path says which, in one line
        names = {local_spec_name(fqn): fqn for fqn in self._tensors if not fqn.endswith("_extra_state")}
        args = common["args"]
        megatron_lm.family_of_args(args, it_dir / "common.pt")
        vocab_size = vocab_size or megatron_lm.recorded_vocab(args)
        if vocab_size is None:
            raise _Declined("no vocabulary size")  # the full path asks for it
        self.args, self.step, self.scheduler = args, common.get("iteration"), common.get("opt_param_scheduler")
        self.config = megatron_lm.hf_config(args, vocab_size)
        self.divisible_by = getattr(args, "make_vocab_size_divisible_by", 128)
        self.layout = megatron_lm.layout_of_args(args)
        dims = self.dims(self.layout[0])
        if dims.padded_vocab != args.padded_vocab_size:
            raise _Declined("the vocabulary size does not pad to the checkpoint's rows")
        self._entries = {e.hf_names: e for e in iter_entries(dims, 1, 1) if e.reads_back}
        self._fqn, wanted = {}, {"output_layer.weight"} if dims.tied else set()
        for e in iter_entries(dims, 1, 1):
            name, index = sharded_name(e.megatron_name)
            want = (dims.layers, dims.experts)[:len(index)] + tuple(e.rule.shard_shape(e.hf_shapes, 1))
            if name not in names or tuple(self._tensors[names[name]].size) != want:
                raise _Declined(f"{name} is missing or misshapen")
            wanted.add(name)
            self._fqn[e.megatron_name] = names[name], index
        extra = [fqn for n, fqn in names.items() if n not in wanted]
        if not all(is_optimizer_key(fqn) for fqn in extra):
            raise _Declined("tensors the family's map does not know")
        self.has_optimizer = bool(extra)
        if not self.has_optimizer:
            self.optimizer_note = NO_OPTIMIZER_STATE
        self._dtype = self._dtype_of(names["embedding.word_embeddings.weight"])

    def _dtype_of(self, fqn: str) -> str:
        dtype = self._tensors[fqn].properties.dtype
        if not isinstance(dtype, pt_zip.TorchName) or dtype.name not in pt_zip.TORCH_DTYPES:
            raise _Declined(f"{fqn} has dtype {dtype!r}")
        return pt_zip.TORCH_DTYPES[dtype.name]

    def spans(self, hf_names, field: str = WEIGHT):
        if field != WEIGHT:
            return None
        entry = self._entries[tuple(hf_names)]
        fqn, index = self._fqn[entry.megatron_name]
        n = len(index)
        pieces = [(tuple(c.offsets[n:]), tuple(c.sizes[n:]), tuple(c.offsets)) for c in self._tensors[fqn].chunks
                  if all(c.offsets[d] <= index[d] < c.offsets[d] + c.sizes[d] for d in range(n))]
        dim = tiling_axis(pieces, tuple(self._tensors[fqn].size)[n:])
        if dim is None:
            return None
        slices = _Slices(self, fqn, index)
        ordered = sorted(pieces, key=lambda p: p[0][dim] if p[0] else 0)
        inputs = [(slices, (chunk, sizes)) for _, sizes, chunk in ordered]
        if any(slices.span(key) is None for _, key in inputs):
            return None
        return inputs, lambda got: list(entry.to_hf([concat(got, dim) if len(got) > 1 else got[0]]).values())

    def item(self, fqn: str, offsets: tuple) -> tuple[int, pt_zip.TensorRef] | None:
        """(open file descriptor, TensorRef) of the chunk of fqn saved at `offsets`, when its torch.save item holds
        one row-major tensor of the metadata's shape and dtype; None otherwise."""
        key = (fqn, offsets)
        if key not in self._items:
            self._items[key] = None
            info = self._where.get(key)
            chunk = next((c for c in self._tensors[fqn].chunks if tuple(c.offsets) == offsets), None)
            if info is not None and chunk is not None:
                path = self.dir / info.relative_path
                try:
                    ref = pt_zip.load(path, info.offset, info.length)
                except pt_zip.NotReadHere:
                    ref = None
                if (isinstance(ref, pt_zip.TensorRef) and ref.shape == tuple(chunk.sizes)
                        and ref.dtype == self._dtype_of(fqn) and ref.span() is not None):
                    if info.relative_path not in self._fds:
                        self._fds[info.relative_path] = os.open(path, os.O_RDONLY)
                    self._items[key] = self._fds[info.relative_path], ref
        return self._items[key]

    def dtype_name(self) -> str:
        return self._dtype

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds, self._items = {}, {}


class _Slices:
    """byte_ranges' reader interface over one parameter's chunks in a TorchDistWeights, keyed (chunk offsets, shape
    of the chunk's slice at `index` on the leading axes)."""

    def __init__(self, source: TorchDistWeights, fqn: str, index: tuple[int, ...]):
        self._source, self._fqn, self._index = source, fqn, index

    def dtype_name(self, key: tuple) -> str:
        return self._source._dtype_of(self._fqn)

    def shape(self, key: tuple) -> tuple[int, ...]:
        return key[1]

    def nbytes(self, key: tuple) -> int:
        return math.prod(key[1]) * pt_zip.ITEMSIZE[self.dtype_name(key)]

    def span(self, key: tuple) -> tuple[int, int, int] | None:
        found = self._source.item(self._fqn, key[0])
        if found is None:
            return None
        fd, ref = found
        at, _ = ref.span()
        skip = sum((i - o) * s for i, o, s in zip(self._index, key[0], ref.stride))
        return fd, at + skip * pt_zip.ITEMSIZE[ref.dtype], self.nbytes(key)


def open_megatron(src: Path, vocab_size: int | None, weights_only: bool, rows: int | None = None) -> Source | None:
    """The torch-free source of a Megatron-LM legacy or torch_dist checkpoint, or None for the full path to open it:
    one whose files pt_zip does not take, one that fails a check, or one with optimizer state to carry."""
    try:
        it_dir = megatron_lm.iteration_dir(src)
        torch_dist = megatron_lm.is_torch_dist(it_dir)
        source = TorchDistWeights(it_dir, vocab_size, rows) if torch_dist else LegacyWeights(src, vocab_size, rows)
    except (pt_zip.NotReadHere, _Declined, ToolkitError, KeyError, TypeError, AttributeError, ValueError,
            IndexError, OSError):
        return None
    if source.has_optimizer and not weights_only:
        source.close()
        return None
    return source
