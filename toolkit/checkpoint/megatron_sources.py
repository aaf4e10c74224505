"""Megatron-LM's checkpoints as `toolkit convert` sources: the legacy layout (model_optim_rng.pt, and the
distributed optimizer's distrib_optim.pt) and Megatron-Core's torch_dist."""
from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import torch

from toolkit.checkpoint import megatron_flat, megatron_lm, megatron_plain, torch_dist, torch_dist_optim
from toolkit.checkpoint.dist_keys import is_optimizer_key, sharded_name
from toolkit.checkpoint.pickled_copy import tiling_axis
from toolkit.checkpoint.pt_ranges import FileRanges
from toolkit.checkpoint.safetensors_sources import meta_shards
from toolkit.checkpoint.source_base import NO_OPTIMIZER_STATE, WEIGHT, Source, _ShardedSource
from toolkit.errors import Problem, ToolkitError
from toolkit.families.entries import check_megatron_shards, iter_entries, raise_problems, rank_key
from toolkit.families.rules import concat
from toolkit.format import safe_load
from toolkit.format.names import chunk_key, split_key
from toolkit.format.safetensors_stream import dtype_name


def vocab_needed(where: Path, args) -> str:
    """The one line asking for --vocab-size: Megatron pads the vocabulary, and its args do not say by how much."""
    unit = getattr(args, "make_vocab_size_divisible_by", 128) * getattr(args, "tensor_model_parallel_size", 1)
    return (f"{where} stores {args.padded_vocab_size} vocabulary rows, padded by Megatron to a multiple of {unit}; "
            "pass the true vocabulary size with --vocab-size (the tokenizer's, e.g. 32000 for Llama 2; "
            f"{args.padded_vocab_size} if nothing was padded), so that the padding rows are told apart from it")


def rank_state(path: Path) -> dict:
    """A Megatron-LM rank file's contents, its tensors memory-mapped: only tensors, Megatron-LM's arguments and numpy
    RNG state are loaded; anything else is refused rather than unpickled."""
    return safe_load.load(path, mmap=True, deepspeed=False)


class MegatronLMSource(_ShardedSource):
    """Megatron-LM's legacy layout. Its files are pickles: read with weights_only=True and an allow-list, memory-
    mapped so only the tensors read are paged in."""

    kind = "Megatron-LM"

    def __init__(self, path: Path, vocab_size: int | None, weights_only: bool = False, rows: int | None = None):

        self.rows = rows
        args, self._shards, self.step, states = megatron_lm.read(path, rank_state)
        self._it_dir, self._files = megatron_lm.iteration_dir(path), {}
        self.args = args  # Megatron-LM's, for the plain optimizer's param groups (megatron_plain.wd_mult)
        optimizers = {k: v["optimizer"] for k, v in states.items()}
        self.scheduler = next(iter(states.values()))["opt_param_scheduler"]  # Megatron-LM's, layout-independent
        megatron_lm.family_of_args(args, path)
        vocab_size = vocab_size or megatron_lm.recorded_vocab(args)
        if vocab_size is None:
            raise ToolkitError(vocab_needed(path, args))
        self.config = megatron_lm.hf_config(args, vocab_size)
        self.divisible_by = getattr(args, "make_vocab_size_divisible_by", 128)
        self.layout = megatron_lm.layout_of_args(args)
        self.ep = megatron_lm.expert_parallel_size(args)
        self._index()
        if self._dims.padded_vocab != args.padded_vocab_size:
            raise ToolkitError(f"--vocab-size {vocab_size} pads to {self._dims.padded_vocab} rows at tp="
                               f"{self.layout[0]}, but the checkpoint has {args.padded_vocab_size}; check the "
                               "vocabulary size")

        problems = check_megatron_shards(self._shards, iter_entries(self._dims, *self.layout[1:], self.ep),
                                         *self.layout, self.ep)
        if not problems:  # each rank's shard has the shape its rule gives (totals that add up can still mix rows)
            tp, pp = self.layout[:2]
            for rank, shapes in meta_shards(self._dims, *self.layout, self.ep).items():
                for key, want in shapes.items():
                    chunk, name, _ = split_key(key)
                    got = tuple(self._shards[rank][chunk][name].shape)
                    if got != tuple(want):
                        file = megatron_lm.rank_file(self._it_dir, rank[1], rank[0], pp, *(rank[2:] or (0,)), self.ep)
                        problems.append(Problem(f"{file}", f"{key} is {list(got)}, but the args' layout (tp={tp}) "
                                                f"gives each rank {list(want)}", "the rank files are not one save of "
                                                "these args: re-copy the iteration folder"))
        self._optim = None
        if not weights_only and not problems:
            if all(o is None for o in optimizers.values()):
                self.optimizer_note = NO_OPTIMIZER_STATE
            elif any(o is None for o in optimizers.values()):  # not "weights only": some ranks' state went missing
                pp = self.layout[1]
                lacking = [megatron_lm.rank_file(self._it_dir, k[1], k[0], pp, *(k[2:] or (0,)), self.ep)
                           for k, o in sorted(optimizers.items()) if o is None]
                problems.append(Problem(", ".join(map(str, lacking[:4])), "holds no optimizer state, though the other "
                                        "ranks' files do", "re-copy the checkpoint, or convert with --weights-only"))
            elif not getattr(args, "use_distributed_optimizer", False):  # by position in model_optim_rng.pt
                self._optim = megatron_plain.PlainLegacyState(
                    megatron_lm.iteration_dir(path), args, self._dims, self.layout, self.dtype() != torch.float32,
                    optimizers, {k: [list(c) for c in v] for k, v in self._shards.items()}, self.ep)
            else:  # distrib_optim.pt: flat buffers, the layout recomputed, then proved
                self._optim = megatron_flat.LegacyFlatState(
                    megatron_lm.iteration_dir(path), args, self._dims, self.layout, self.dtype() != torch.float32,
                    optimizers, lambda p, t, c, name: self._shards[rank_key(p, t, 0, self.ep)][c][name],
                    rank_state, ep=self.ep)
            if self._optim is not None:
                problems += self._optim.problems
                self.optimizer_note = self._optim.note
                if self._optim.fields:
                    self.fields, self.optimizer_meta = (WEIGHT, *self._optim.fields), self._optim.meta
                    self.optimizer_groups, self.optimizer_distributed = self._optim.groups, self._optim.distributed
        raise_problems(f"{path} does not match its own arguments", problems)

    def read(self, hf_names: Sequence[str], field: str = WEIGHT) -> list[torch.Tensor]:
        weights = super().read
        return weights(hf_names) if field == WEIGHT else self._optim.read(hf_names, field, lambda: weights(hf_names))

    def _get(self, p: int, t: int, key: str, e: int = 0) -> torch.Tensor:

        chunk, name, _ = split_key(key)
        return self._shards[rank_key(p, t, e, self.ep)][chunk][name]

    def spans(self, hf_names: Sequence[str], field: str = WEIGHT):
        """The weights' bytes in the rank files (pt_ranges: the storages' offsets from a map_location="meta" load,
        checked against the mapped bytes), so that a conversion copies them file to file; None for the optimizer
        state, or where the offsets are not found or do not check out (then the weights go through memory)."""
        if field != WEIGHT:
            return None
        entry = self._entries[tuple(hf_names)]
        key = chunk_key(entry.chunk, entry.megatron_name)
        inputs = [self.shard_input(entry.pp_rank, t, key, entry.ep_rank or 0) for t in range(self.layout[0])]
        if None in inputs:
            return None
        return inputs, lambda shards: list(entry.to_hf(shards).values())

    def shard_input(self, p: int, t: int, key: str, e: int = 0):
        rank = rank_key(p, t, e, self.ep)
        if rank not in self._files:
            tp, pp, vpp = self.layout
            path = megatron_lm.rank_file(self._it_dir, t, p, pp, e, self.ep)
            self._files[rank] = _RankFile(path, self._shards[rank], vpp)
        return (self._files[rank], key) if self._files[rank].span(key) is not None else None

    def close(self) -> None:
        for f in self._files.values():
            f.ranges.close()
        self._files = {}

    def dtype(self) -> torch.dtype:
        return self._get(0, 0, chunk_key(0, "embedding.word_embeddings.weight")).dtype


class _RankFile:
    """byte_ranges' reader interface (dtype, shape, nbytes, span) over one Megatron-LM rank file's memory-mapped
    weights, keyed as the toolkit's chunk keys; span() is None for a tensor whose bytes were not found."""

    def __init__(self, path: Path, chunks: list[dict], vpp: int):
        self._chunks, self._spans = chunks, {}
        try:
            metas = megatron_lm.model_chunks(safe_load.load(path, map_location="meta"), vpp)
            pairs = [(t, m[n]) for c, m in zip(chunks, metas) for n, t in c.items()
                     if torch.is_tensor(t) and torch.is_tensor(m.get(n))]
            self.ranges = FileRanges(path, [t for t, _ in pairs], [m for _, m in pairs])
        except (ToolkitError, KeyError, TypeError):  # no offsets: this rank's weights go through memory
            self.ranges = FileRanges(path, [], [None])

    def _tensor(self, key: str) -> torch.Tensor:
        chunk, name, _ = split_key(key)
        return self._chunks[chunk][name]

    def dtype(self, key: str) -> torch.dtype:
        return self._tensor(key).dtype

    def dtype_name(self, key: str) -> str:
        return dtype_name(self._tensor(key).dtype)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._tensor(key).shape)

    def nbytes(self, key: str) -> int:
        t = self._tensor(key)
        return t.numel() * t.element_size()

    def span(self, key: str) -> tuple[int, int, int] | None:
        if key not in self._spans:  # byte_ranges asks once per range it makes (once per row of a row-parallel split)
            self._spans[key] = self.ranges.range(self._tensor(key))
        return self._spans[key]


class TorchDistSource(Source):
    """Megatron-Core's torch_dist checkpoint (toolkit/checkpoint/torch_dist.py): each parameter's full tensor (one
    layer of it for layer parameters) is read from its chunks and split into Hugging Face tensors by the family's
    rules at TP = 1, which is the layout Megatron's sharded keys hold, whatever TP x PP x VPP it was saved at."""

    kind = "Megatron torch_dist"

    def __init__(self, it_dir: Path, vocab_size: int | None, weights_only: bool = False, rows: int | None = None):
        self._r, self.rows = torch_dist.Reader(it_dir), rows
        self._slices = _ChunkSlices(self._r)
        args = self._r.common.get("args")
        if args is None or not hasattr(args, "padded_vocab_size"):
            raise ToolkitError(f"{it_dir / 'common.pt'} holds no Megatron-LM args (with padded_vocab_size), so the "
                               "model's shape is unknown; convert a checkpoint saved by Megatron-LM's save_checkpoint")
        vocab_size = vocab_size or megatron_lm.recorded_vocab(args)
        if vocab_size is None:
            raise ToolkitError(vocab_needed(it_dir, args))
        megatron_lm.family_of_args(args, it_dir / "common.pt")
        self.args = args
        self.step = self._r.common.get("iteration")
        self.scheduler = self._r.common.get("opt_param_scheduler")
        self.config = megatron_lm.hf_config(args, vocab_size)
        self.divisible_by = getattr(args, "make_vocab_size_divisible_by", 128)
        self.layout = megatron_lm.layout_of_args(args)
        dims = self.dims(self.layout[0])
        if dims.padded_vocab != args.padded_vocab_size:
            raise ToolkitError(f"--vocab-size {vocab_size} pads to {dims.padded_vocab} rows at tp={self.layout[0]}, "
                               f"but the checkpoint has {args.padded_vocab_size}; check the vocabulary size")
        self._entries = {e.hf_names: e for e in iter_entries(dims, 1, 1) if e.reads_back}
        problems, wanted = [], set()
        for e in iter_entries(dims, 1, 1):
            name, index = sharded_name(e.megatron_name)
            wanted.add(name)
            want = (dims.layers, dims.experts)[:len(index)] + tuple(e.rule.shard_shape(e.hf_shapes, 1))
            fqn = self._r.names.get(name)
            if fqn is None:
                problems.append(Problem(name, "is missing", "convert a complete checkpoint of the model its args "
                                        "describe"))
            elif self._r.shape(fqn) != want:
                problems.append(Problem(fqn, f"has shape {self._r.shape(fqn)}, its args give {want}",
                                        "the tensors and common.pt are of different models"))
        if dims.tied:  # Megatron keeps a copy of the embeddings at pp > 1: ignored, as HF has no lm_head then
            wanted.add("output_layer.weight")
        extra = sorted(fqn for n, fqn in self._r.names.items() if n not in wanted
                       and not is_optimizer_key(fqn))
        if extra:
            problems.append(Problem("tensors", f"{len(extra)} the {dims.family} map does not know: {', '.join(extra[:6])}",
                                    f"convert a {dims.family} model (local or Transformer Engine spec)"))
        if not weights_only and not problems:  # Adam's moments (and fp32 mains) by parameter name
            read = {self._r.names[sharded_name(e.megatron_name)[0]] for e in self._entries.values()}
            self._optim = torch_dist_optim.OptimizerState(self._r, {f: self._r.shape(f) for f in read},
                                                          self.dtype() != torch.float32)
            if self._optim.sharding == {"dp_reshardable"}:  # flat buffers: the layout recomputed, then proved
                self._optim = megatron_flat.FlatState(self._r, dims, self.layout, self.dtype() != torch.float32,
                                                      self._optim.scalers, megatron_lm.expert_parallel_size(args))
            problems += self._optim.problems
            self.fields, self.optimizer_meta = (WEIGHT, *self._optim.fields), self._optim.meta
            self.optimizer_note, self.optimizer_groups = self._optim.note, self._optim.groups
            self.optimizer_distributed = self._optim.distributed
        raise_problems(f"{it_dir} does not match its own arguments", problems)

    def read(self, hf_names: Sequence[str], field: str = WEIGHT) -> list[torch.Tensor]:
        if field != WEIGHT and isinstance(self._optim, megatron_flat.FlatState):
            return self._optim.read(hf_names, field, lambda: self.read(hf_names))
        entry = self._entries[tuple(hf_names)]
        name, index = sharded_name(entry.megatron_name)
        fqn = self._r.names[name] if field == WEIGHT else self._optim.key(field, self._r.names[name])
        tensor = self._r.get(fqn, index)
        return list(entry.to_hf([tensor if field == WEIGHT else tensor.float()]).values())

    def spans(self, hf_names: Sequence[str], field: str = WEIGHT):
        """The weights' bytes in the .distcp files, so that a conversion copies them file to file: the chunks that
        hold the parameter (its layer's slice of them), when they tile it along one axis (TP shards: rows or
        columns; fc1's gate and up blocks) and each is located (torch_dist.Reader.locate); None for the optimizer
        state and otherwise (then the weights go through memory)."""
        if field != WEIGHT:
            return None
        entry = self._entries[tuple(hf_names)]
        name, index = sharded_name(entry.megatron_name)
        fqn = self._r.names[name]
        pieces = self._r.chunks(fqn, index)
        dim = tiling_axis(pieces, self._r.shape(fqn)[len(index):])
        if dim is None:
            return None
        inputs = [(self._slices, (fqn, chunk, index, sizes)) for _, sizes, chunk in
                  sorted(pieces, key=lambda p: p[0][dim] if p[0] else 0)]
        if any(self._slices.span(key) is None for _, key in inputs):
            return None
        return inputs, lambda slices: list(entry.to_hf([concat(slices, dim) if len(slices) > 1 else slices[0]])
                                           .values())

    def close(self) -> None:
        self._r.close()

    def dtype(self) -> torch.dtype:
        return self._r.dtype(self._r.names["embedding.word_embeddings.weight"])


class _ChunkSlices:
    """byte_ranges' reader interface (dtype, shape, nbytes, span) over a torch_dist checkpoint's chunks, keyed
    (sharded key, chunk offsets, leading index, shape of the chunk's slice at that index)."""

    def __init__(self, reader: torch_dist.Reader):
        self._r, self._spans = reader, {}

    def dtype(self, key: tuple) -> torch.dtype:
        return self._r.dtype(key[0])

    def dtype_name(self, key: tuple) -> str:
        return dtype_name(self._r.dtype(key[0]))

    def shape(self, key: tuple) -> tuple[int, ...]:
        return key[3]

    def nbytes(self, key: tuple) -> int:
        return math.prod(key[3]) * self._r.dtype(key[0]).itemsize

    def span(self, key: tuple) -> tuple[int, int, int] | None:
        if key not in self._spans:  # byte_ranges asks once per range it makes (once per row of a row-parallel split)
            self._spans[key] = self._r.locate(key[0], key[1], key[2])
        return self._spans[key]
