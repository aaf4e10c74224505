"""What every checkpoint source of `toolkit convert` offers (toolkit/checkpoint/sources.py), and the Megatron
layouts' shared shard merging."""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from toolkit.families.entries import iter_entries
from toolkit.families.mapping import Dims, refuse_for_megatron
from toolkit.families.registry import dims_from_hf
from toolkit.layout import keeping_divisor
from toolkit.format.names import OUTPUT_MARK, chunk_key
from toolkit.format.safetensors_stream import dtype_name

if TYPE_CHECKING:
    import torch

WEIGHT = "weight"
NO_OPTIMIZER_STATE = "it holds no optimizer state (saved with --no-save-optim?): weights only"
"""The note of a Megatron source without optimizer state, whichever reader opened it."""


def converted(folder: Path) -> bool:
    """Whether `toolkit convert` wrote this checkpoint (its OUTPUT_MARK beside it: in the folder or, for an iteration
    or step folder, in its parent)."""
    return any((f / OUTPUT_MARK).is_file() for f in (folder, folder.parent))


def optimizer_note(note: str | None, folder: Path) -> str | None:
    """The note to print for a source at `folder`: NO_OPTIMIZER_STATE's guess at a Megatron-LM flag is wrong for a
    folder that `toolkit convert` wrote, which says so instead."""
    if note == NO_OPTIMIZER_STATE and converted(folder):
        return "it holds no optimizer state (toolkit convert wrote it without any): weights only"
    return note


class Source:
    """What every source offers; see toolkit/checkpoint/sources.py's docstring."""

    kind = "?"
    config: dict
    fields: tuple[str, ...] = (WEIGHT,)
    step: int | None = None
    meta: dict | None = None  # the toolkit's checkpoint metadata, when the source is a toolkit checkpoint
    divisible_by: int = 128
    layout: tuple[int, int, int] | None = None  # (tp, pp, vpp) of sharded sources
    ep: int = 1  # expert-parallel size of a sharded source (mixture-of-experts families)
    unchecked: Path | None = None  # a toolkit checkpoint folder whose checksums are still to check (open_source)
    optimizer_groups: list[dict] | None = None  # a Megatron optimizer's param groups (torch_dist_optim.param_groups)
    scheduler: dict | None = None  # Megatron-LM's opt_param_scheduler state, for a Megatron-LM target
    optimizer_distributed: bool = False  # the optimizer state is Megatron's distributed optimizer's
    args = None  # Megatron-LM's arguments (an argparse.Namespace), of a Megatron-LM source
    rows: int | None = None
    """The vocabulary rows read, where a conversion between Megatron layouts carries padding rows (carried_rows):
    more than the model's vocabulary (config["vocab_size"], which stays the model's); None reads the vocabulary."""

    out_divisible_by: int | None = None
    """The make_vocab_size_divisible_by of a Megatron target (convert --make-vocab-size-divisible-by); None: the
    source's own."""

    def dims(self, tp: int = 1, divisible_by: int | None = None) -> Dims:
        """The shapes read at `tp`, the vocabulary padded by `divisible_by` (default: the source's own) x tp."""
        return dims_from_hf(self.config if self.rows is None else {**self.config, "vocab_size": self.rows}, tp,
                            divisible_by or self.divisible_by)

    @property
    def out_divisor(self) -> int:
        """The make_vocab_size_divisible_by a Megatron target writes with."""
        return self.out_divisible_by or self.divisible_by

    def out_dims(self, tp: int) -> Dims:
        """The dims a Megatron target at `tp` writes: padded with out_divisor."""
        return self.dims(tp, self.out_divisor)

    def read(self, hf_names: Sequence[str], field: str = WEIGHT) -> list[torch.Tensor]:
        raise NotImplementedError

    def dtype(self) -> torch.dtype:
        raise NotImplementedError

    def dtype_name(self) -> str:
        """dtype() by its safetensors name (the sources of safetensors files answer without torch)."""
        return dtype_name(self.dtype())

    def spans(self, hf_names: Sequence[str], field: str = WEIGHT):
        """Where the raw bytes behind read(hf_names, field) lie, for copying them file to file
        (toolkit/checkpoint/byte_ranges.py): ([(safetensors reader, key), ...], merge), where merge turns tensors shaped
        like those keys into the Hugging Face tensors read() gives; None for a source whose files are not raw
        tensor bytes at known offsets (pickles, DCP)."""
        return None

    def close(self) -> None:
        pass

    def describe(self) -> str:
        lay = f" tp={self.layout[0]} pp={self.layout[1]} vpp={self.layout[2]}" if self.layout else ""
        lay += f" ep={self.ep}" if self.ep > 1 else ""
        return f"{self.kind}{lay}"



MEGATRON_TARGETS = ("megatron", "torch_dist", "megatron_lm")


def carried_rows(source: Source, to: str, tp: int) -> int | None:
    """The vocabulary rows a conversion of `source` --to `to` at `tp` carries: a Megatron source's padding rows
    (Megatron pads the vocabulary to a multiple of make_vocab_size_divisible_by x tp, and trains those rows: their
    logits are in the loss's softmax) that the target's padding holds too, as Megatron-LM's own converter keeps them.
    None where there are none: a source without padding, a Hugging Face or DeepSpeed target."""
    if to not in MEGATRON_TARGETS or source.layout is None:
        return None
    rows = min(source.dims(source.layout[0]).padded_vocab, source.out_dims(tp).padded_vocab)
    return rows if rows > source.config["vocab_size"] else None


def read_for(source: Source, to: str, tp: int, divisible_by: int | None, reopen) -> Source | None:
    """`source` as a conversion --to `to` at `tp` reads it: with its target's divisor (None: the source's), and,
    where it carries padding rows (carried_rows), opened again by `reopen(rows)` to read them (what a source derives
    from its dims is made when it opens). The source returned may be None where `reopen` gives none. A Megatron
    target is refused (the source closed) for a model whose maths its layers do not follow (refuse_for_megatron)."""
    if to in MEGATRON_TARGETS:
        try:
            refuse_for_megatron(source.config)
        except Exception:
            source.close()
            raise
    source.out_divisible_by = divisible_by
    rows = carried_rows(source, to, tp)
    if rows is None:
        return source
    source.close()
    source = reopen(rows)
    if source is not None:
        source.out_divisible_by = divisible_by
    return source


def layout_notes(source: Source, to: str, tp: int) -> list[str]:
    """The lines a conversion to a Megatron target prints about its layout: the vocabulary's padding (padding_note),
    and a tp above the key/value heads, which Megatron-Core takes but the toolkit's own training does not."""
    notes = [note] if (note := padding_note(source, to, tp)) else []
    kv = source.out_dims(tp).kv_heads if to in MEGATRON_TARGETS else tp
    if tp > kv:
        notes.append(f"tensor parallelism: tp={tp} is more than the model's {kv} key/value heads, so each query "
                     f"group's q, k and v rows are split over {tp // kv} ranks, as Megatron-Core lays them out when "
                     f"the groups are fewer than the ranks (its attention gathers them); the toolkit's own training "
                     f"takes a tp that divides {kv}")
    return notes


def padding_note(source: Source, to: str, tp: int) -> str | None:
    """What a conversion to a Megatron target does with the vocabulary's padding, in one line; None where nothing is
    padded (docs/convert.md, "Vocabulary padding")."""
    if to not in MEGATRON_TARGETS:
        return None
    vocab, new = source.config["vocab_size"], source.out_dims(tp).padded_vocab
    at = f"tp={tp} (by {source.out_divisor})"
    if source.layout is None:  # a Hugging Face or DeepSpeed source: the model's vocabulary, no padding rows
        return f"vocabulary padding: {vocab} pads to {new} rows at {at}: {new - vocab} zero rows" if new > vocab \
            else None
    old = source.dims(source.layout[0]).padded_vocab
    if new == old == vocab:
        return None
    line = f"vocabulary padding: {old - vocab} padding rows at tp={source.layout[0]} (by {source.divisible_by})"
    keep = keeping_divisor(vocab, old, tp)
    hint = f" (--make-vocab-size-divisible-by {keep} keeps {old})" if keep else ""
    if old == vocab:  # none to carry; the target adds some
        return (f"vocabulary padding: none at tp={source.layout[0]} (by {source.divisible_by}); {new - vocab} zero "
                f"rows added: {vocab} pads to {new} rows at {at}; a run resumed from it trains a softmax over {new} "
                f"rows, not {old}{hint}")
    if new == old:
        return f"{line}, all carried: the vocabulary pads to {old} rows at {at} too"
    if new > old:
        return (f"{line}, carried, and {new - old} zero rows added: {vocab} pads to {new} rows at {at}, not {old}; a "
                f"run resumed from it trains a softmax over {new} rows{hint}")
    return (f"{line}: {old - new} dropped, {new - vocab} carried ({vocab} pads to {new} rows at {at}); a run "
            f"resumed from it trains a softmax over {new} rows, not {old}{hint}")


class _ShardedSource(Source):
    """A Megatron layout: merges the TP shards of one parameter on request."""

    _get: callable  # (pp_rank, tp_rank, key, ep_rank) -> tensor

    def shard_input(self, p: int, t: int, key: str, e: int = 0):
        """The shard _get(p, t, key, e) would give, as (reader, key) with byte_ranges' reader interface (dtype,
        shape, nbytes, span), so its bytes can be hashed in place; None where its bytes are not located."""
        return None

    def _index(self) -> None:
        tp, pp, vpp = self.layout
        self._dims = self.dims(tp)
        self._entries = {e.hf_names: e for e in iter_entries(self._dims, pp, vpp, self.ep) if e.reads_back}

    def read(self, hf_names: Sequence[str], field: str = WEIGHT) -> list[torch.Tensor]:

        entry = self._entries[tuple(hf_names)]
        key = chunk_key(entry.chunk, entry.megatron_name, None if field == WEIGHT else field)
        shards = [self._get(entry.pp_rank, t, key, entry.ep_rank or 0) for t in range(self.layout[0])]
        return list(entry.to_hf(shards).values())


