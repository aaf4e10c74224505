"""Conversion between a Hugging Face state dict and Megatron-Core per-(pp rank, tp rank, chunk) state dicts.

The unit of work is an Entry (one Megatron parameter, its HF tensors, its rule and where it lives), so a streaming
converter can walk iter_entries() and load one entry's tensors at a time; the full-dict functions below do just that
with everything in memory.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from toolkit.errors import Problem, ToolkitError
from toolkit.families.mapping import Dims, ParamMap, check_dims
from toolkit.families.registry import family_named
from toolkit.families.rules import Rule
from toolkit.layout import first_stage, last_stage, layer_location, tied_output_is_stored

if TYPE_CHECKING:
    from torch import Tensor

# Older transformers saved the RoPE frequencies as a buffer; it is derived from the config, never a weight.
_DERIVED_HF_SUFFIXES = ("rotary_emb.inv_freq",)
_MEGATRON_EXTRA_STATE = "._extra_state"  # Megatron's per-module metadata (None or BytesIO), not a tensor
MegatronShards = dict[tuple[int, int], list[dict[str, "Tensor"]]]  # (pp_rank, tp_rank) -> one state dict per chunk


@dataclass(frozen=True)
class Entry:
    """One Megatron parameter with concrete names, its rule, and the (pp_rank, chunk) holding it on every TP rank."""

    hf_names: tuple[str, ...]
    megatron_name: str
    rule: Rule
    hf_shapes: tuple[tuple[int, ...], ...]
    pp_rank: int
    chunk: int
    reads_back: bool = True
    """False for the tied output layer: a copy of the embeddings, so HF gets nothing back from it."""
    ep_rank: int | None = None
    """The expert-parallel rank holding this routed expert's parameter; None: every expert-parallel rank holds it."""

    def to_megatron(self, tensors: Sequence[Tensor], tp: int) -> list[Tensor]:
        """This parameter's shard for each TP rank, from its HF tensors (in hf_names order)."""
        return self.rule.split(tuple(tensors) if len(tensors) > 1 else tensors[0], tp)

    def to_hf(self, shards: Sequence[Tensor]) -> dict[str, Tensor]:
        """The HF tensors, by name, rebuilt from one shard per TP rank."""
        merged = self.rule.merge(shards)
        return dict(zip(self.hf_names, merged if isinstance(merged, tuple) else (merged,)))


def _place(pm: ParamMap, pp_rank: int, chunk: int, i: int = 0, j: int = 0, reads_back: bool = True,
           per_rank: int = 0) -> Entry:
    ep_rank, x = divmod(pm.expert, per_rank) if pm.expert is not None else (None, 0)
    return Entry(tuple(n.format(i=i) for n in pm.hf_names), pm.megatron_name.format(j=j, x=x), pm.rule, pm.hf_shapes,
                 pp_rank, chunk, reads_back, ep_rank)


def iter_entries(dims: Dims, pp: int, vpp: int, ep: int = 1) -> Iterator[Entry]:
    """Every Megatron parameter of the model, in HF order: embeddings, layers 0..L-1, final norm, output layer.
    A routed expert's parameters carry the expert-parallel rank holding them, under its local index there."""
    family = family_named(dims.family)
    yield _place(family.embedding(dims), *first_stage())
    per_layer = family.layer(dims)
    per_rank = dims.experts // ep if dims.experts else 0
    for i in range(dims.layers):
        pp_rank, chunk, j = layer_location(i, dims.layers, pp, vpp)
        yield from (_place(pm, pp_rank, chunk, i=i, j=j, per_rank=per_rank) for pm in per_layer)
    yield _place(family.final_norm(dims), *last_stage(pp, vpp))
    if not dims.tied or tied_output_is_stored(pp, vpp):
        yield _place(family.output(dims), *last_stage(pp, vpp), reads_back=not dims.tied)


def rank_key(pp_rank: int, tp_rank: int, ep_rank: int, ep: int) -> tuple[int, ...]:
    """The key of one rank's state dicts in MegatronShards: (pp_rank, tp_rank), and ep_rank when ep > 1."""
    return (pp_rank, tp_rank, ep_rank) if ep > 1 else (pp_rank, tp_rank)


def holders(entry: Entry, ep: int) -> range:
    """The expert-parallel ranks holding this entry."""
    return range(ep) if entry.ep_rank is None else range(entry.ep_rank, entry.ep_rank + 1)


def hf_to_megatron(hf_state: Mapping[str, Tensor], dims: Dims, tp: int, pp: int, vpp: int = 1,
                   ep: int = 1) -> MegatronShards:
    """Split an HF state dict into Megatron state dicts: {(pp_rank, tp_rank): [chunk 0 dict, chunk 1 ...]}, keyed
    (pp_rank, tp_rank, ep_rank) when ep > 1 (each expert-parallel rank holds its experts and a copy of the rest)."""
    raise_problems("cannot convert to Megatron", check_dims(dims, tp, pp, vpp, ep))
    entries = list(iter_entries(dims, pp, vpp, ep))
    raise_problems(f"the Hugging Face state dict does not match the {dims.family} dims", check_hf_state(hf_state, entries, dims))
    shards: MegatronShards = {rank_key(p, r, e, ep): [{} for _ in range(vpp)]
                              for p in range(pp) for r in range(tp) for e in range(ep)}
    for entry in entries:
        pieces = entry.to_megatron([hf_state[name] for name in entry.hf_names], tp)
        for tp_rank, piece in enumerate(pieces):
            for e in holders(entry, ep):
                shards[rank_key(entry.pp_rank, tp_rank, e, ep)][entry.chunk][entry.megatron_name] = piece
    return shards


def megatron_to_hf(shards: Mapping[tuple[int, ...], Sequence[Mapping[str, Tensor]]], dims: Dims, tp: int,
                   pp: int, vpp: int = 1, ep: int = 1) -> dict[str, Tensor]:
    """Merge Megatron state dicts ({(pp_rank, tp_rank[, ep_rank]): [one per chunk]}) into one HF state dict.
    Parameters every expert-parallel rank holds are taken from ep rank 0 and must be equal on the others."""
    raise_problems("cannot convert from Megatron", check_dims(dims, tp, pp, vpp, ep))
    entries = list(iter_entries(dims, pp, vpp, ep))
    raise_problems(f"the Megatron shards do not match the {dims.family} dims and layout",
                   check_megatron_shards(shards, entries, tp, pp, vpp, ep))
    import torch  # lazy: the entries load torch-free (the byte planner walks them); whole state dicts need it

    hf_state: dict[str, Tensor] = {}
    for entry in (e for e in entries if e.reads_back):
        where = list(holders(entry, ep))
        got = [[shards[rank_key(entry.pp_rank, r, e, ep)][entry.chunk][entry.megatron_name] for r in range(tp)]
               for e in where]
        if any(not all(torch.equal(a, b) for a, b in zip(got[0], other)) for other in got[1:]):
            raise ToolkitError(f"{entry.megatron_name} differs between expert-parallel ranks, which must hold the same "
                               "copy: check the checkpoint was saved from one consistent step")
        hf_state.update(entry.to_hf(got[0]))
    return hf_state


def raise_problems(heading: str, problems: Sequence[Problem]) -> None:
    """Raise one ToolkitError listing every problem, or return if there are none."""
    if problems:
        body = "\n".join(f"  {n}. {p.render()}" for n, p in enumerate(problems, 1))
        raise ToolkitError(f"{heading}: {len(problems)} problem{'s' * (len(problems) != 1)}\n{body}")


def check_hf_state(hf_state: Mapping[str, Tensor], entries: Iterable[Entry], dims: Dims) -> list[Problem]:
    """Missing, misshapen and unexpected HF tensors."""
    problems, expected = _check_tied_lm_head(hf_state, dims), {"lm_head.weight"} if dims.tied else set()
    for entry in entries:
        for name, shape in zip(entry.hf_names, entry.hf_shapes):
            expected.add(name)
            if name not in hf_state:
                problems.append(Problem(name, "missing from the Hugging Face state dict",
                                        f"check the checkpoint is a complete {dims.family} model and dims.tied is right"))
            elif tuple(hf_state[name].shape) != shape:
                problems.append(Problem(name, f"has shape {tuple(hf_state[name].shape)}, the dims give {shape}",
                                        "build the dims from this checkpoint's own config.json"))
    unexpected = sorted(n for n in hf_state if n not in expected and not n.endswith(_DERIVED_HF_SUFFIXES))
    if unexpected:
        problems.append(Problem("hf_state", f"{len(unexpected)} tensors the {dims.family} map does not know: "
                                f"{', '.join(unexpected[:8])}{' ...' * (len(unexpected) > 8)}",
                                f"add them to toolkit/families/{dims.family}.py, or convert with the right model family"))
    return problems


def _check_tied_lm_head(hf_state: Mapping[str, Tensor], dims: Dims) -> list[Problem]:
    # state_dict() of a tied model lists the shared tensor under both names; save_pretrained drops lm_head.
    # Accept it, but only if it really is the embedding matrix: otherwise the conversion would lose it.
    lm_head, embed = hf_state.get("lm_head.weight"), hf_state.get("model.embed_tokens.weight")
    if not dims.tied or lm_head is None or embed is None or lm_head is embed:
        return []
    import torch  # lazy: the entries load torch-free (the byte planner walks them); whole state dicts need it

    if lm_head.shape == embed.shape and torch.equal(lm_head, embed):
        return []
    return [Problem("lm_head.weight", "differs from model.embed_tokens.weight, yet dims.tied is true",
                    "set tie_word_embeddings to false in the config the dims come from")]


def check_megatron_shards(shards: Mapping, entries: Iterable[Entry], tp: int, pp: int, vpp: int,
                          ep: int = 1) -> list[Problem]:
    """Missing ranks, chunks and tensors, and tensors the map does not know (ignoring ._extra_state)."""
    ranks = {rank_key(p, r, e, ep) for p in range(pp) for r in range(tp) for e in range(ep)}
    if set(shards) != ranks or any(len(shards[k]) != vpp for k in ranks):
        got = {k: len(v) for k, v in shards.items()}
        what = "(pp_rank, tp_rank, ep_rank)" if ep > 1 else "(pp_rank, tp_rank)"
        return [Problem("shards", f"expected {what} keys for pp = {pp}, tp = {tp}, ep = {ep}, each with {vpp} chunk "
                        f"dicts; got chunk counts {got}", "pass the tp, pp, vpp and ep the checkpoint was saved with")]
    expected = {(k, c): set() for k in ranks for c in range(vpp)}
    for entry in entries:
        for r in range(tp):
            for e in holders(entry, ep):
                expected[(rank_key(entry.pp_rank, r, e, ep), entry.chunk)].add(entry.megatron_name)
    return [problem for (k, c), names in sorted(expected.items())
            for problem in _check_chunk_names(_where(k, c), shards[k][c], names)]


def _where(key: tuple[int, ...], chunk: int) -> str:
    return ", ".join(f"{n}_rank {v}" for n, v in zip(("pp", "tp", "ep"), key)) + f", chunk {chunk}"


def _check_chunk_names(where: str, state: Mapping[str, object], names: set[str]) -> list[Problem]:
    present = {n for n in state if not n.endswith(_MEGATRON_EXTRA_STATE)}
    problems = []
    if names - present:
        problems.append(Problem(where, f"missing {', '.join(sorted(names - present)[:8])}",
                                "check the layout (tp, pp, vpp) and dims.tied match the checkpoint"))
    if present - names:
        problems.append(Problem(where, f"has tensors the model family's map does not know: "
                                f"{', '.join(sorted(present - names)[:8])}",
                                "check the model family and the layer spec (local spec names are expected)"))
    return problems
