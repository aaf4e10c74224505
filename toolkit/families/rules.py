"""Typed split/merge rules: how Hugging Face tensors become per-TP-rank Megatron-Core shards, and back, exactly."""
from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, Sequence

from toolkit.errors import ToolkitError

if TYPE_CHECKING:
    from torch import Tensor

    HFTensors = Tensor | tuple[Tensor, ...]  # one HF tensor, or several fused into one Megatron parameter


def _torch():
    import torch  # lazy: the families load torch-free, so `toolkit plan` and `validate` can read them

    return torch


class _NumpyOps:
    """torch's functions that the rules use, for numpy arrays: the byte planner runs the rules on arrays of byte
    addresses (toolkit/checkpoint/byte_ranges.py), so a conversion that only copies bytes never loads torch."""

    @staticmethod
    def cat(parts, dim):
        import numpy  # lazy: only the byte planner's arrays come here

        return numpy.concatenate(parts, axis=dim)

    @staticmethod
    def chunk(t, n, dim):  # the rules check n divides the dim first: equal pieces, as torch.chunk gives them
        import numpy  # lazy: only the byte planner's arrays come here

        return numpy.split(t, n, axis=dim)

    @staticmethod
    def split(t, sizes, dim):
        import numpy  # lazy: only the byte planner's arrays come here

        return numpy.split(t, numpy.cumsum(sizes)[:-1], axis=dim)

    @staticmethod
    def equal(a, b) -> bool:
        import numpy  # lazy: only the byte planner's arrays come here

        return a.shape == b.shape and bool(numpy.array_equal(a, b))

    @staticmethod
    def zeros(like, *shape):
        import numpy  # lazy: only the byte planner's arrays come here

        return numpy.zeros(shape, dtype=like.dtype)


def _ops(t):
    """The array functions for t: torch's, or _NumpyOps for the byte planner's numpy address arrays."""
    return _NumpyOps if type(t).__module__ == "numpy" else _torch()


def concat(parts: Sequence, dim: int):
    """torch.cat of tensors, or numpy's concatenate of the byte planner's address arrays (a source's own merge of
    its chunks, torch_dist's, runs on both)."""
    return _ops(parts[0]).cat(list(parts), dim)


class Rule(Protocol):
    """split(full, tp) gives one shard per TP rank; merge(shards) is its exact inverse. A rule that fuses several HF
    tensors names them in `parts`: split takes and merge gives them in that order, and the keyword mappings
    (toolkit/families/mapping.py) order a family's names by it, so no family file lists them by position."""

    parts: tuple[str, ...]

    def split(self, full: HFTensors, tp: int) -> list[Tensor]: ...

    def merge(self, shards: Sequence[Tensor]) -> HFTensors: ...

    def shard_shape(self, hf_shapes: Sequence[tuple[int, ...]], tp: int) -> tuple[int, ...]:
        """The shape of every rank's shard, without any tensor (what split would give)."""
        ...


def _divided(shape: tuple[int, ...], dim: int, tp: int, what: str) -> tuple[int, ...]:
    if tp < 1 or shape[dim] % tp:
        raise ToolkitError(f"{what}: cannot split dim {dim} of shape {tuple(shape)} into tp = {tp} equal shards "
                           f"({shape[dim]} is not divisible by {tp}); choose a tensor-parallel size that divides it")
    return (*shape[:dim], shape[dim] // tp, *shape[dim + 1:])


_COMPACT = contextvars.ContextVar("toolkit_rules_compact", default=True)


@contextlib.contextmanager
def views():
    """Inside this block the rules may hand out views of their inputs instead of compact copies: for consumers
    that write the bytes out at once (the streaming converter), this saves one memory copy per tensor."""
    token = _COMPACT.set(False)
    try:
        yield
    finally:
        _COMPACT.reset(token)


def _own(t: Tensor) -> Tensor:
    # Slices are views of the whole tensor, and torch.save writes a view's entire storage, so by default every
    # shard or merged tensor we hand out gets its own compact storage.
    if not _COMPACT.get():
        return t
    return t.copy() if _ops(t) is _NumpyOps else t.clone(memory_format=_torch().contiguous_format)


_INTO = contextvars.ContextVar("toolkit_rules_into", default=None)


@contextlib.contextmanager
def merged_into(buffers):
    """Inside this block a merge of several torch shards is written into `buffers(shape, dtype)` (a tensor that
    the caller reuses, e.g. for each decoder layer in turn) instead of fresh memory. On a machine where a fresh
    page costs more than the copy into it, that is most of a merge's time."""
    token = _INTO.set(buffers)
    try:
        yield
    finally:
        _INTO.reset(token)


def buffer(shape: tuple[int, ...], dtype):
    """Fresh memory for a tensor assembled from pieces (torch.empty), or within merged_into the caller's buffer."""
    buffers = _INTO.get()
    return _torch().empty(shape, dtype=dtype) if buffers is None else buffers(tuple(shape), dtype)


def _cat(parts: Sequence[Tensor], dim: int) -> Tensor:
    """torch.cat of a merge's shards (into a reused buffer within merged_into); of one shard (a TP = 1 source:
    torch_dist, a TP1 layout) that shard itself (owned, _own, unless views() are allowed), not a copy of it."""
    parts = list(parts)
    if len(parts) == 1:
        return _own(parts[0])
    ops, buffers = _ops(parts[0]), _INTO.get()
    if buffers is None or ops is _NumpyOps:
        return ops.cat(parts, dim)
    shape = list(parts[0].shape)
    shape[dim] = sum(p.shape[dim] for p in parts)
    return ops.cat(parts, dim, out=buffers(tuple(shape), parts[0].dtype))


def _reshaped(t: Tensor, shape: tuple[int, ...]) -> Tensor:
    """t.reshape(shape); where that copies (a part of each kv group, q's heads), into a buffer within merged_into."""
    buffers = _INTO.get()
    if buffers is None or _ops(t) is _NumpyOps or t.is_contiguous():
        return t.reshape(shape)
    out = buffers(tuple(shape), t.dtype)
    out.view(t.shape).copy_(t)
    return out


def _split_dim(full: Tensor, tp: int, dim: int, what: str) -> list[Tensor]:
    if tp < 1 or full.shape[dim] % tp:
        raise ToolkitError(f"{what}: cannot split dim {dim} of a tensor of shape {tuple(full.shape)} into tp = {tp} "
                           f"equal shards ({full.shape[dim]} is not divisible by {tp}); "
                           f"choose a tensor-parallel size that divides {full.shape[dim]}")
    return [_own(piece) for piece in _ops(full).chunk(full, tp, dim)]


@dataclass(frozen=True)
class Replicated:
    """Every rank holds the full tensor (norms); merge checks the copies agree."""

    parts = ("weight",)

    def split(self, full: Tensor, tp: int) -> list[Tensor]:
        return [_own(full) for _ in range(tp)]

    def shard_shape(self, hf_shapes, tp: int) -> tuple[int, ...]:
        return tuple(hf_shapes[0])

    def merge(self, shards: Sequence[Tensor]) -> Tensor:
        for rank, shard in enumerate(shards[1:], 1):
            if not _ops(shard).equal(shard, shards[0]):
                raise ToolkitError(f"replicated tensor differs between tp rank 0 and tp rank {rank}; the ranks of "
                                   "this checkpoint are out of sync: check it was saved from one consistent step")
        return shards[0]


@dataclass(frozen=True)
class ColumnParallel:
    """Output features (dim 0) are split across TP ranks."""

    parts = ("weight",)

    def split(self, full: Tensor, tp: int) -> list[Tensor]:
        return _split_dim(full, tp, 0, "column-parallel weight")

    def shard_shape(self, hf_shapes, tp: int) -> tuple[int, ...]:
        return _divided(tuple(hf_shapes[0]), 0, tp, "column-parallel weight")

    def merge(self, shards: Sequence[Tensor]) -> Tensor:
        return _cat(shards, 0)


@dataclass(frozen=True)
class RowParallel:
    """Input features (dim 1) are split across TP ranks."""

    parts = ("weight",)

    def split(self, full: Tensor, tp: int) -> list[Tensor]:
        return _split_dim(full, tp, 1, "row-parallel weight")

    def shard_shape(self, hf_shapes, tp: int) -> tuple[int, ...]:
        return _divided(tuple(hf_shapes[0]), 1, tp, "row-parallel weight")

    def merge(self, shards: Sequence[Tensor]) -> Tensor:
        return _cat(shards, 1)


@dataclass(frozen=True)
class VocabParallel:
    """Vocabulary rows padded with zeros to padded_vocab, then split on dim 0; merge drops the padding."""

    parts = ("weight",)

    true_vocab: int
    padded_vocab: int

    def split(self, full: Tensor, tp: int) -> list[Tensor]:
        if full.shape[0] != self.true_vocab or self.padded_vocab < self.true_vocab:
            raise ToolkitError(f"vocab-parallel weight has {full.shape[0]} rows; expected vocab {self.true_vocab} "
                               f"padded to {self.padded_vocab}: make the model's vocab_size match the checkpoint")
        ops = _ops(full)
        padding = (ops.zeros(full, self.padded_vocab - self.true_vocab, *full.shape[1:]) if ops is _NumpyOps
                   else full.new_zeros(self.padded_vocab - self.true_vocab, *full.shape[1:]))
        return _split_dim(ops.cat([full, padding], 0), tp, 0, "vocab-parallel weight")

    def shard_shape(self, hf_shapes, tp: int) -> tuple[int, ...]:
        return _divided((self.padded_vocab, *hf_shapes[0][1:]), 0, tp, "vocab-parallel weight")

    def merge(self, shards: Sequence[Tensor]) -> Tensor:
        full = _cat(shards, 0)
        if full.shape[0] != self.padded_vocab:
            raise ToolkitError(f"vocab-parallel shards add up to {full.shape[0]} rows, expected padded vocab "
                               f"{self.padded_vocab}: the checkpoint was saved with another vocab padding "
                               "(make_vocab_size_divisible_by x tp); pass the dims it was saved with")
        return _own(full[: self.true_vocab])


@dataclass(frozen=True)
class QKV:
    """HF (q, k, v) <-> Megatron linear_qkv: per kv group g, rows [q heads of g, k_g, v_g]; TP-split in blocks."""

    parts = ("q", "k", "v")

    num_heads: int
    num_kv_heads: int
    head_dim: int

    def _check(self, tp: int) -> None:
        # Megatron takes tp dividing the kv heads (whole groups per rank) or a multiple of them (each group spread
        # over tp / kv ranks, gathered in the forward); either way a rank stores a contiguous block of the full
        # grouped tensor, so both split the same way here.
        g = self.num_kv_heads
        if self.num_heads % g or self.num_heads % tp or (g % tp and tp % g):
            raise ToolkitError(f"attention with {self.num_heads} heads and {g} kv heads cannot be split over tp = "
                               f"{tp}: heads must be a multiple of kv heads and of tp, and tp a divisor or multiple "
                               f"of the kv heads (Megatron's rule); choose tp dividing {g} or a multiple of {g} "
                               f"dividing {self.num_heads}")

    def split(self, full: tuple[Tensor, Tensor, Tensor], tp: int) -> list[Tensor]:
        self._check(tp)
        q, k, v = full
        g, d = self.num_kv_heads, self.head_dim
        expected = [(self.num_heads * d,), (g * d,), (g * d,)]
        if [tuple(t.shape[:1]) for t in full] != expected:
            raise ToolkitError(f"q/k/v have {[t.shape[0] for t in full]} rows, expected {[e[0] for e in expected]} "
                               f"for {self.num_heads} heads, {g} kv heads of size {d}: check the model config")
        tail = q.shape[1:]
        grouped = _ops(q).cat([q.reshape(g, -1, *tail), k.reshape(g, d, *tail), v.reshape(g, d, *tail)], 1)
        return _split_dim(grouped.reshape(-1, *tail), tp, 0, "linear_qkv weight")

    def shard_shape(self, hf_shapes, tp: int) -> tuple[int, ...]:
        self._check(tp)
        rows = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        return _divided((rows, *hf_shapes[0][1:]), 0, tp, "linear_qkv weight")

    def merge(self, shards: Sequence[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        self._check(len(shards))
        g, d, per_group = self.num_kv_heads, self.head_dim, self.num_heads // self.num_kv_heads
        rows = sum(s.shape[0] for s in shards)
        if rows != (per_group + 2) * g * d:
            raise ToolkitError(f"linear_qkv shards add up to {rows} rows, expected "
                               f"({self.num_heads} + 2 x {g}) x {d} = {(per_group + 2) * g * d}: check the dims")
        if len(shards) > 1 and _INTO.get() is not None and _ops(shards[0]) is not _NumpyOps and all(
                s.shape[0] % ((per_group + 2) * d) == 0 for s in shards):
            return self._merge_into(shards)
        full = _cat(shards, 0)
        tail = full.shape[1:]
        q, k, v = _ops(full).split(full.reshape(g, (per_group + 2) * d, *tail), [per_group * d, d, d], 1)
        return tuple(_own(_reshaped(t, (t.shape[0] * t.shape[1], *tail))) for t in (q, k, v))

    def _merge_into(self, shards: Sequence[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        """merge() within merged_into, of shards holding whole kv groups: each shard's q, k and v rows copied once,
        straight into the caller's q, k and v buffers (not joined into one tensor first and then copied apart)."""
        g, d, per_group = self.num_kv_heads, self.head_dim, self.num_heads // self.num_kv_heads
        tail, dtype = tuple(shards[0].shape[1:]), shards[0].dtype
        parts = {"q": per_group * d, "k": d, "v": d}
        out = {name: buffer((g * rows, *tail), dtype) for name, rows in parts.items()}
        at = 0
        for shard in shards:
            n = shard.shape[0] // ((per_group + 2) * d)  # the kv groups this rank holds
            for name, piece in zip(parts, shard.reshape(n, -1, *tail).split(list(parts.values()), 1)):
                out[name].view(g, -1, *tail)[at:at + n].copy_(piece)
            at += n
        return tuple(_own(out[name]) for name in ("q", "k", "v"))


@dataclass(frozen=True)
class GatedMLP:
    """HF (gate, up) <-> Megatron linear_fc1: each rank holds cat(gate shard r, up shard r), not a split of cat."""

    parts = ("gate", "up")

    def split(self, full: tuple[Tensor, Tensor], tp: int) -> list[Tensor]:
        gate, up = full
        gates, ups = _split_dim(gate, tp, 0, "gate_proj weight"), _split_dim(up, tp, 0, "up_proj weight")
        return [_ops(g).cat([g, u], 0) for g, u in zip(gates, ups)]

    def shard_shape(self, hf_shapes, tp: int) -> tuple[int, ...]:
        gate = _divided(tuple(hf_shapes[0]), 0, tp, "gate_proj weight")
        return (2 * gate[0], *gate[1:])

    def merge(self, shards: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
        if any(shard.shape[0] % 2 for shard in shards):
            raise ToolkitError(f"linear_fc1 shards have {[s.shape[0] for s in shards]} rows; each must hold equal "
                               "gate and up halves: this is not a gated-MLP (SwiGLU) checkpoint")
        halves = [_ops(shard).chunk(shard, 2, 0) for shard in shards]
        return _cat([h[0] for h in halves], 0), _cat([h[1] for h in halves], 0)
