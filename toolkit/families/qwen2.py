"""The Qwen2 family (Qwen2 and Qwen2.5, model_type qwen2): Llama's layout plus biases on q, k and v, which
Megatron-Core holds as `linear_qkv.bias` (add_qkv_bias), grouped per query group exactly like the weight. Small
sizes tie the embeddings (tie_word_embeddings in config.json). Sliding-window attention is off in every released
Qwen2/2.5 (use_sliding_window: false); a config that turns it on is refused for a Megatron target and for training
(a Hugging Face target keeps it)."""
from __future__ import annotations

from typing import Any

from toolkit.families import llama
from toolkit.families.mapping import (
    HF_LAYER,
    MEGATRON_LAYER,
    Dims,
    Family,
    ParamMap,
    qkv_bias,
    read_dims,
    refuse_unhonoured,
)


def dims(config: Any, tp: int = 1, divisible_by: int = 128) -> Dims:
    refuse_unhonoured("qwen2", config)
    return read_dims("qwen2", config, tp, divisible_by, tied_default=False)


def layer(d: Dims) -> list[ParamMap]:
    L, M = HF_LAYER, MEGATRON_LAYER
    return [*llama.layer(d),
            qkv_bias(f"{M}.self_attention.linear_qkv.bias", d,
                     q=f"{L}.self_attn.q_proj.bias", k=f"{L}.self_attn.k_proj.bias", v=f"{L}.self_attn.v_proj.bias")]


# where verification puts a Megatron checkpoint's tensors in transformers' model (toolkit/checkpoint/verify.py)
MODULES = {**llama.MODULES, "decoder.layers.{j}.self_attention.linear_qkv.bias": {
    "q": "model.layers.{i}.self_attn.q_proj.bias", "k": "model.layers.{i}.self_attn.k_proj.bias",
    "v": "model.layers.{i}.self_attn.v_proj.bias"}}

FAMILY = Family(name="qwen2", model_types=("qwen2",), hf_architecture="Qwen2ForCausalLM", dims=dims, layer=layer,
                embedding=llama.embedding, final_norm=llama.final_norm, output=llama.output,
                hf_config_class="Qwen2Config", hf_config_fields={"use_sliding_window": False},
                megatron_fields={"add_qkv_bias": True}, modules=MODULES)
