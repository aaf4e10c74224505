"""Model families as data: typed split/merge rules (rules.py), keyword mappings and dims (mapping.py), one file per
family (llama.py), the registry by name and HF model_type (registry.py), and the walk over a model's parameters
that every converter shares (entries.py)."""
from toolkit.families.entries import (
                                      Entry,
                                      MegatronShards,
                                      check_hf_state,
                                      check_megatron_shards,
                                      hf_to_megatron,
                                      iter_entries,
                                      megatron_to_hf,
                                      raise_problems,
)
from toolkit.families.mapping import Dims, Family, ParamMap, check_dims, local_spec_name
from toolkit.families.registry import FAMILIES, dims_from_hf, family_named, family_of_config
from toolkit.families.rules import QKV, ColumnParallel, GatedMLP, Replicated, RowParallel, Rule, VocabParallel

__all__ = [
    "FAMILIES", "QKV", "ColumnParallel", "Dims", "Entry", "Family", "GatedMLP", "MegatronShards", "ParamMap",
    "Replicated", "RowParallel", "Rule", "VocabParallel", "check_dims", "check_hf_state", "check_megatron_shards",
    "dims_from_hf", "family_named", "family_of_config", "hf_to_megatron", "iter_entries", "local_spec_name",
    "megatron_to_hf", "raise_problems",
]
