"""Model families as data: typed split/merge rules (rules.py), keyword mappings and dims (mapping.py), one file per
family (llama.py, mistral.py, qwen2.py, qwen3.py, qwen3_moe.py), the registry by name and HF model_type
(registry.py), and the walk over a model's parameters that every converter shares (entries.py).

Importing the package loads no torch (the planner and `toolkit validate` read the families); the converters' walk in
entries.py, which needs torch, loads on first use of one of its names."""
import importlib

from toolkit.families.mapping import Dims, Family, ParamMap, check_dims, local_spec_name
from toolkit.families.registry import FAMILIES, dims_from_hf, family_named, family_of_config
from toolkit.families.rules import QKV, ColumnParallel, GatedMLP, Replicated, RowParallel, Rule, VocabParallel

_ENTRIES = ("Entry", "MegatronShards", "check_hf_state", "check_megatron_shards", "hf_to_megatron", "iter_entries",
            "megatron_to_hf", "raise_problems")


def __getattr__(name: str):
    if name in _ENTRIES:  # PEP 562: entries.py (and torch) load on first use
        return getattr(importlib.import_module("toolkit.families.entries"), name)
    raise AttributeError(f"module 'toolkit.families' has no attribute {name!r}")


__all__ = [
    "FAMILIES", "QKV", "ColumnParallel", "Dims", "Entry", "Family", "GatedMLP", "MegatronShards", "ParamMap",
    "Replicated", "RowParallel", "Rule", "VocabParallel", "check_dims", "check_hf_state", "check_megatron_shards",
    "dims_from_hf", "family_named", "family_of_config", "hf_to_megatron", "iter_entries", "local_spec_name",
    "megatron_to_hf", "raise_problems",
]
