"""Megatron-Core's local layer spec with an RMSNorm that also works under sequence parallelism.

Megatron's local spec wraps torch's norms and refuses sequence parallelism, because under SP each tensor-parallel
rank normalises only its slice of the sequence and the norm weights' gradients are partial sums. Megatron's own
mechanism for that is a `sequence_parallel` attribute on those parameters, which finalize_model_grads all-reduces
across the TP group. This norm sets it, so SP runs with the local spec (on CPU too); no collective is ours.
"""
from __future__ import annotations

import torch


class RMSNorm(torch.nn.RMSNorm):
    """torch.nn.RMSNorm built the way Megatron builds norms, with weights marked for SP gradient reduction."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5):
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        for p in self.parameters():
            p.sequence_parallel = config.sequence_parallel


def local_block_spec(config, vp_stage: int | None):
    """TransformerBlockSubmodules: the local layer spec with RMSNorm above for the two per-layer norms, the final
    norm (Megatron's default block would use its torch-norm wrapper for the final one) and, when the config has
    qk_layernorm (Qwen3), the per-head query and key norms."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # lazy: Megatron runs only

    # lazy: Megatron runs only
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    # mixture of experts (num_moe_experts): Megatron's local MoE layer, a SequentialMLP of per-expert MLPs
    layer = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=config.qk_layernorm,
                                     num_experts=config.num_moe_experts, moe_grouped_gemm=False)
    layer.submodules.input_layernorm = RMSNorm
    layer.submodules.pre_mlp_layernorm = RMSNorm
    if config.qk_layernorm:  # built by Megatron with hidden_size = head_dim; never sequence-split, like HF's
        layer.submodules.self_attention.submodules.q_layernorm = RMSNorm
        layer.submodules.self_attention.submodules.k_layernorm = RMSNorm
    return TransformerBlockSubmodules(layer_specs=[layer] * get_num_layers_to_build(config, vp_stage=vp_stage),
                                      layer_norm=RMSNorm)
