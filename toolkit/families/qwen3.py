"""The Qwen3 family (dense Qwen3, model_type qwen3): Llama's layout plus an RMSNorm over each query and key head
(q_norm, k_norm), which Megatron-Core calls qk_layernorm (`self_attention.q_layernorm` / `k_layernorm`, one weight
of head_dim, the same on every TP rank); no q/k/v bias; head_dim may differ from hidden_size / heads (Qwen3-8B:
4096 / 32 heads, head_dim 128 is equal, but Qwen3-0.6B has 1024 / 16 heads with head_dim 128)."""
from __future__ import annotations

from typing import Any

from toolkit.errors import ToolkitError
from toolkit.families import llama
from toolkit.families.mapping import (
    HF_LAYER,
    MEGATRON_LAYER,
    Dims,
    Family,
    ParamMap,
    config_getter,
    read_dims,
    refuse_unhonoured,
    replicated,
)


def dims(config: Any, tp: int = 1, divisible_by: int = 128) -> Dims:
    if config_getter(config)("attention_bias", False):
        raise ToolkitError("qwen3 config sets attention_bias; released Qwen3 models have none and the map has no "
                           "entries for it: add them to toolkit/families/qwen3.py to support it")
    refuse_unhonoured("qwen3", config)
    return read_dims("qwen3", config, tp, divisible_by, tied_default=False)


def layer(d: Dims) -> list[ParamMap]:
    L, M = HF_LAYER, MEGATRON_LAYER
    return [*llama.layer(d),
            replicated(f"{M}.self_attention.q_layernorm.weight", weight=f"{L}.self_attn.q_norm.weight",
                       shape=(d.head_dim,)),
            replicated(f"{M}.self_attention.k_layernorm.weight", weight=f"{L}.self_attn.k_norm.weight",
                       shape=(d.head_dim,))]


# where verification puts a Megatron checkpoint's tensors in transformers' model (toolkit/checkpoint/verify.py)
MODULES = {**llama.MODULES,
           "decoder.layers.{j}.self_attention.q_layernorm.weight": {"weight": "model.layers.{i}.self_attn.q_norm.weight"},
           "decoder.layers.{j}.self_attention.k_layernorm.weight": {"weight": "model.layers.{i}.self_attn.k_norm.weight"}}

FAMILY = Family(name="qwen3", model_types=("qwen3",), hf_architecture="Qwen3ForCausalLM", dims=dims, layer=layer,
                embedding=llama.embedding, final_norm=llama.final_norm, output=llama.output,
                hf_config_class="Qwen3Config", hf_config_fields={"use_sliding_window": False, "attention_bias": False},
                megatron_fields={"qk_layernorm": True}, modules=MODULES)
