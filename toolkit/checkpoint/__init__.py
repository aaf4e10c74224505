"""Checkpoint conversion as data: typed split/merge rules, per-family name maps, and Megatron's layer placement."""
from toolkit.checkpoint.convert_llama import Entry, MegatronShards, hf_to_megatron, iter_entries, megatron_to_hf
from toolkit.checkpoint.llama import LlamaDims, ParamMap, check_dims, padded_vocab_size
from toolkit.checkpoint.megatron_layout import chunk_layers, global_layer, layer_location
from toolkit.checkpoint.rules import QKV, ColumnParallel, GatedMLP, Replicated, RowParallel, Rule, VocabParallel

__all__ = [
    "QKV", "ColumnParallel", "Entry", "GatedMLP", "LlamaDims", "MegatronShards", "ParamMap", "Replicated",
    "RowParallel", "Rule", "VocabParallel", "check_dims", "chunk_layers", "global_layer", "hf_to_megatron",
    "iter_entries", "layer_location", "megatron_to_hf", "padded_vocab_size",
]
