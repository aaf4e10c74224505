"""Where Megatron-Core keeps each transformer layer under pipeline parallelism with virtual (interleaved) chunks."""
from __future__ import annotations

from toolkit.errors import ToolkitError

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
