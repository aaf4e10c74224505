"""The parallel layout and batch arithmetic of one run (small validated values every adapter reads), and where
Megatron-Core keeps each transformer layer under pipeline parallelism with virtual (interleaved) chunks."""
from __future__ import annotations

from dataclasses import dataclass

from toolkit.errors import Problem, ToolkitError


@dataclass(frozen=True)
class Layout:
    """How world_size ranks are split: dp x tp x pp x cp = world_size (Megatron rank order tp-cp-dp-pp)."""

    backend: str
    world_size: int
    dp: int
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    cp: int = 1
    sp: bool = False
    zero_stage: int = 0
    ep: int = 1
    """Expert-parallel size: routed experts split over ep ranks taken from dp x cp (Megatron-Core's rule)."""

    @property
    def model_parallel(self) -> int:
        return self.tp * self.pp * self.cp

    def describe(self) -> str:
        parts = [f"dp={self.dp}", f"tp={self.tp}", f"pp={self.pp}"]
        parts += [f"vpp={self.vpp}"] * (self.vpp > 1) + [f"cp={self.cp}"] * (self.cp > 1) + ["sp"] * self.sp
        parts += [f"ep={self.ep}"] * (self.ep > 1)
        return f"{self.backend} on {self.world_size} ranks: {' '.join(parts)}, ZeRO-{self.zero_stage}"


@dataclass(frozen=True)
class Batch:
    """global_batch = micro_batch x grad_accum x dp, in sequences."""

    global_batch: int
    micro_batch: int
    grad_accum: int
    dp: int

    def describe(self) -> str:
        return (f"global batch {self.global_batch} = micro {self.micro_batch} x accumulation {self.grad_accum}"
                f" x dp {self.dp}")


def derive_dp(world_size: int, tp: int, pp: int, cp: int, dp: int | None) -> tuple[int | None, list[Problem]]:
    """dp from world_size / (tp*pp*cp), or a problem with the arithmetic."""
    mp = tp * pp * cp
    if world_size % mp:
        return None, [Problem("parallel", f"world size {world_size} is not divisible by tp x pp x cp = "
                              f"{tp} x {pp} x {cp} = {mp}",
                              f"launch a multiple of {mp} ranks, or change tp/pp/cp so their product divides "
                              f"{world_size}")]
    derived = world_size // mp
    if dp is not None and dp != derived:
        return None, [Problem("parallel.dp", f"dp = {dp}, but world size {world_size} = dp x tp x pp x cp needs dp = "
                              f"{world_size} / ({tp} x {pp} x {cp}) = {derived}",
                              f"set parallel.dp to {derived} or null (derived), or launch "
                              f"{dp * mp} ranks")]
    return derived, []


def derive_batch(global_batch: int | None, micro: int | None, accum: int | None,
                 dp: int) -> tuple[Batch | None, list[str], list[Problem]]:
    """Fill whichever of global/micro/accumulation is unset. Returns (batch, derivation notes, problems)."""
    g, m, a = global_batch, micro, accum
    notes: list[str] = []
    if g is not None and m is not None and a is not None:
        if g != m * a * dp:
            return None, [], [Problem(
                "training.global_batch_size",
                f"{g} != micro_batch_size x grad_accum_steps x dp = {m} x {a} x {dp} = {m * a * dp}",
                f"set training.global_batch_size to {m * a * dp}, or leave one of the three null to derive it")]
        return Batch(g, m, a, dp), notes, []
    if g is None:
        m, a = m or 1, a or 1
        notes.append(f"training.global_batch_size = micro {m} x accumulation {a} x dp {dp} = {m * a * dp} (derived)")
        return Batch(m * a * dp, m, a, dp), notes, []
    if m is None and a is None:
        a = 1
        notes.append("training.grad_accum_steps = 1 (derived: neither it nor micro_batch_size was set)")
    if m is None:
        if g % (a * dp):
            return None, [], [Problem(
                "training.global_batch_size",
                f"{g} is not divisible by grad_accum_steps x dp = {a} x {dp} = {a * dp}, so micro_batch_size "
                f"cannot be derived", f"set training.global_batch_size to a multiple of {a * dp}")]
        m = g // (a * dp)
        notes.append(f"training.micro_batch_size = global {g} / (accumulation {a} x dp {dp}) = {m} (derived)")
    else:
        if g % (m * dp):
            return None, [], [Problem(
                "training.global_batch_size",
                f"{g} is not divisible by micro_batch_size x dp = {m} x {dp} = {m * dp}, so grad_accum_steps "
                f"cannot be derived", f"set training.global_batch_size to a multiple of {m * dp} "
                f"(e.g. {max(1, round(g / (m * dp))) * m * dp}), or change micro_batch_size")]
        a = g // (m * dp)
        notes.append(f"training.grad_accum_steps = global {g} / (micro {m} x dp {dp}) = {a} (derived)")
    return Batch(g, m, a, dp), notes, []


def padded_vocab_size(vocab: int, tp: int, divisible_by: int = 128) -> int:
    """Megatron's padded vocabulary: the smallest multiple of divisible_by * tp that is >= vocab."""
    if vocab < 1 or tp < 1 or divisible_by < 1:
        raise ToolkitError(f"padded_vocab_size needs positive sizes, got vocab = {vocab}, tp = {tp}, "
                           f"divisible_by = {divisible_by}")
    multiple = divisible_by * tp
    return -(-vocab // multiple) * multiple


def keeping_divisor(vocab: int, padded: int, tp: int) -> int | None:
    """The make_vocab_size_divisible_by that pads `vocab` to `padded` rows at `tp` (the largest power of two that
    does, else the largest number); None where none does."""
    fits = [d for d in range(1, padded // tp + 1) if padded % (d * tp) == 0 and padded - vocab < d * tp]
    powers = [d for d in fits if d & (d - 1) == 0]
    return max(powers or fits) if fits else None


# Megatron's interleaved schedule deals the model out in pp * vpp chunks of consecutive layers: all pipeline ranks
# take one chunk each (chunk 0), then all take a second one (chunk 1), and so on. Local layer indices restart at 0
# in every chunk, which is why a global layer number alone does not name a key in a Megatron state dict.


def check_pipeline(layers: int, pp: int, vpp: int) -> None:
    """Raise unless `layers` splits into pp * vpp equal chunks."""
    if pp < 1 or vpp < 1:
        raise ToolkitError(f"pipeline sizes must be >= 1, got pp = {pp}, vpp = {vpp}: use pp = 1, vpp = 1 for none")
    if layers % (pp * vpp):
        raise ToolkitError(f"{layers} layers cannot be split into pp x vpp = {pp} x {vpp} = {pp * vpp} equal chunks; "
                           f"choose pp and vpp whose product divides {layers}")


def layers_per_chunk(layers: int, pp: int, vpp: int) -> int:
    check_pipeline(layers, pp, vpp)
    return layers // (pp * vpp)


def layer_location(global_layer: int, layers: int, pp: int, vpp: int) -> tuple[int, int, int]:
    """(pp_rank, chunk, local_index) of a global layer number."""
    per_chunk = layers_per_chunk(layers, pp, vpp)
    if not 0 <= global_layer < layers:
        raise ToolkitError(f"layer {global_layer} does not exist in a {layers}-layer model (valid: 0..{layers - 1})")
    chunk, within = divmod(global_layer, layers // vpp)
    pp_rank, local_index = divmod(within, per_chunk)
    return pp_rank, chunk, local_index


def global_layer(pp_rank: int, chunk: int, local_index: int, layers: int, pp: int, vpp: int) -> int:
    """The global layer number at (pp_rank, chunk, local_index); the inverse of layer_location."""
    per_chunk = layers_per_chunk(layers, pp, vpp)
    if not (0 <= pp_rank < pp and 0 <= chunk < vpp and 0 <= local_index < per_chunk):
        raise ToolkitError(f"(pp_rank {pp_rank}, chunk {chunk}, local index {local_index}) is outside a layout of "
                           f"pp = {pp}, vpp = {vpp} with {per_chunk} layers per chunk")
    return chunk * (layers // vpp) + pp_rank * per_chunk + local_index


def chunk_layers(pp_rank: int, chunk: int, layers: int, pp: int, vpp: int) -> range:
    """The global layers held by one chunk of one pipeline rank, in local-index order."""
    start = global_layer(pp_rank, chunk, 0, layers, pp, vpp)
    return range(start, start + layers_per_chunk(layers, pp, vpp))


def first_stage() -> tuple[int, int]:
    """(pp_rank, chunk) holding the word embeddings."""
    return 0, 0


def last_stage(pp: int, vpp: int) -> tuple[int, int]:
    """(pp_rank, chunk) holding the final norm and the output layer."""
    return pp - 1, vpp - 1


def tied_output_is_stored(pp: int, vpp: int) -> bool:
    """Whether a tied model's Megatron checkpoint still has output_layer.weight (a copy of the embeddings)."""
    # GPTModel skips allocating the output weight only when one chunk both embeds and projects (pre_process and
    # post_process); otherwise the last stage keeps its own copy, kept equal to the embeddings during training.
    return first_stage() != last_stage(pp, vpp)
