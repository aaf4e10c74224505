"""The Llama family (Llama 2 and 3): its Hugging Face names <-> Megatron-Core (local spec) names, by keyword."""
from __future__ import annotations

from typing import Any

from toolkit.errors import ToolkitError
from toolkit.families.mapping import (
    HF_LAYER,
    MEGATRON_LAYER,
    Dims,
    Family,
    ParamMap,
    config_getter,
    gated_mlp,
    qkv,
    read_dims,
    refuse_unhonoured,
    replicated,
    row_parallel,
    vocab_parallel,
)


def dims(config: Any, tp: int = 1, divisible_by: int = 128) -> Dims:
    """From a transformers LlamaConfig (or any object with its attributes) or a plain config.json dict."""
    get = config_getter(config)
    biased = [key for key in ("attention_bias", "mlp_bias") if get(key, False)]
    if biased:
        raise ToolkitError(f"Llama config sets {', '.join(biased)}; only bias-free Llama weights are mapped: "
                           "add bias entries to toolkit/families/llama.py to support them")
    # weights the map does not hold: refused, not silently dropped (what only Megatron cannot honour is refused
    # for a Megatron target: mapping.refuse_for_megatron)
    refuse_unhonoured("Llama", config)
    # LlamaConfig defaults to untied weights; a config.json that omits the key means the same
    return read_dims("llama", config, tp, divisible_by, tied_default=False)


def layer(d: Dims) -> list[ParamMap]:
    """The parameters of one transformer layer."""
    L, M = HF_LAYER, MEGATRON_LAYER
    return [
        replicated(f"{M}.input_layernorm.weight", weight=f"{L}.input_layernorm.weight", shape=(d.hidden,)),
        qkv(f"{M}.self_attention.linear_qkv.weight", d,
            q=f"{L}.self_attn.q_proj.weight", k=f"{L}.self_attn.k_proj.weight", v=f"{L}.self_attn.v_proj.weight"),
        row_parallel(f"{M}.self_attention.linear_proj.weight", weight=f"{L}.self_attn.o_proj.weight",
                     shape=(d.hidden, d.heads * d.head_dim)),
        replicated(f"{M}.pre_mlp_layernorm.weight", weight=f"{L}.post_attention_layernorm.weight", shape=(d.hidden,)),
        gated_mlp(f"{M}.mlp.linear_fc1.weight", d, gate=f"{L}.mlp.gate_proj.weight", up=f"{L}.mlp.up_proj.weight"),
        row_parallel(f"{M}.mlp.linear_fc2.weight", weight=f"{L}.mlp.down_proj.weight", shape=(d.hidden, d.ffn)),
    ]


def embedding(d: Dims) -> ParamMap:
    """The word embeddings, on the first pipeline stage."""
    return vocab_parallel("embedding.word_embeddings.weight", d, weight="model.embed_tokens.weight")


def final_norm(d: Dims) -> ParamMap:
    return replicated("decoder.final_layernorm.weight", weight="model.norm.weight", shape=(d.hidden,))


def output(d: Dims) -> ParamMap:
    """The output layer, on the last stage. Tied models take it from the embeddings (HF has no lm_head then)."""
    return vocab_parallel("output_layer.weight", d, weight="model.embed_tokens.weight" if d.tied else "lm_head.weight")


# What each part of each Megatron parameter is in transformers' LlamaForCausalLM, stated a second time and apart from
# the keyword maps above: verification (toolkit/checkpoint/verify.py) reads Megatron files through this table, so a
# mistake in one of the two (q and k swapped, gate and up swapped) fails the logit check.
MODULES = {
    "embedding.word_embeddings.weight": {"weight": "model.embed_tokens.weight"},
    "decoder.final_layernorm.weight": {"weight": "model.norm.weight"},
    "output_layer.weight": {"weight": "lm_head.weight"},
    "decoder.layers.{j}.input_layernorm.weight": {"weight": "model.layers.{i}.input_layernorm.weight"},
    "decoder.layers.{j}.self_attention.linear_qkv.weight": {
        "q": "model.layers.{i}.self_attn.q_proj.weight", "k": "model.layers.{i}.self_attn.k_proj.weight",
        "v": "model.layers.{i}.self_attn.v_proj.weight"},
    "decoder.layers.{j}.self_attention.linear_proj.weight": {"weight": "model.layers.{i}.self_attn.o_proj.weight"},
    "decoder.layers.{j}.pre_mlp_layernorm.weight": {"weight": "model.layers.{i}.post_attention_layernorm.weight"},
    "decoder.layers.{j}.mlp.linear_fc1.weight": {
        "gate": "model.layers.{i}.mlp.gate_proj.weight", "up": "model.layers.{i}.mlp.up_proj.weight"},
    "decoder.layers.{j}.mlp.linear_fc2.weight": {"weight": "model.layers.{i}.mlp.down_proj.weight"},
}

FAMILY = Family(name="llama", model_types=("llama",), hf_architecture="LlamaForCausalLM", dims=dims, layer=layer,
                embedding=embedding, final_norm=final_norm, output=output, modules=MODULES)
