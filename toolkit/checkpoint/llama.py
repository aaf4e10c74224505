"""The Llama family's weight map: Hugging Face names <-> Megatron-Core (local spec) names, each with its rule."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from toolkit.checkpoint.rules import QKV, GatedMLP, Replicated, RowParallel, Rule, VocabParallel
from toolkit.errors import Problem, ToolkitError
from toolkit.layout import padded_vocab_size  # noqa: F401 - re-exported: the rules and Megatron share it

HF_LAYER = "model.layers.{i}"  # {i}: global layer number
MEGATRON_LAYER = "decoder.layers.{j}"  # {j}: index of the layer within its pipeline chunk


@dataclass(frozen=True)
class LlamaDims:
    """The shapes a Llama checkpoint needs for conversion; padded_vocab is Megatron's (it depends on tp)."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    layers: int
    vocab: int
    padded_vocab: int
    tied: bool

    @classmethod
    def from_hf(cls, config: Any, tp: int = 1, divisible_by: int = 128) -> LlamaDims:
        """From a transformers LlamaConfig (or any object with its attributes) or a plain config.json dict."""
        get = config.get if isinstance(config, Mapping) else lambda key, default=None: getattr(config, key, default)
        required = ["hidden_size", "num_attention_heads", "intermediate_size", "num_hidden_layers", "vocab_size"]
        missing = [key for key in required if get(key) is None]
        if missing:
            raise ToolkitError(f"Llama config is missing {', '.join(missing)}; pass the model's config.json "
                               f"(or LlamaConfig), which names all of: {', '.join(required)}")
        biased = [key for key in ("attention_bias", "mlp_bias") if get(key, False)]
        if biased:
            raise ToolkitError(f"Llama config sets {', '.join(biased)}; only bias-free Llama weights are mapped: "
                               "add bias entries to toolkit/checkpoint/llama.py to support them")
        heads = get("num_attention_heads")
        vocab = get("vocab_size")
        return cls(hidden=get("hidden_size"), heads=heads, kv_heads=get("num_key_value_heads") or heads,
                   head_dim=get("head_dim") or get("hidden_size") // heads, ffn=get("intermediate_size"),
                   layers=get("num_hidden_layers"), vocab=vocab,
                   padded_vocab=padded_vocab_size(vocab, tp, divisible_by),
                   # LlamaConfig defaults to untied weights; a config.json that omits the key means the same
                   tied=bool(get("tie_word_embeddings", False)))


def check_dims(dims: LlamaDims, tp: int, pp: int, vpp: int) -> list[Problem]:
    """Problems splitting these dims over tp x pp x vpp, with the arithmetic."""
    if min(tp, pp, vpp) < 1:
        return [Problem("parallel", f"tp = {tp}, pp = {pp}, vpp = {vpp}; each must be >= 1", "use 1 for none")]
    rules = [
        (dims.heads % dims.kv_heads == 0, "heads",
         f"{dims.heads} heads are not a multiple of {dims.kv_heads} kv heads",
         "check num_key_value_heads in the config"),
        (dims.heads % tp == 0, "tp", f"{dims.heads} attention heads are not divisible by tp = {tp}",
         f"choose tp dividing {dims.heads}"),
        # Megatron splits query groups across ranks when tp is a multiple of them, so both directions work
        (dims.kv_heads % tp == 0 or tp % dims.kv_heads == 0, "tp",
         f"tp = {tp} is neither a divisor nor a multiple of the {dims.kv_heads} kv heads",
         f"choose tp dividing {dims.kv_heads}, or a multiple of {dims.kv_heads} dividing {dims.heads}"),
        (dims.ffn % tp == 0, "tp", f"ffn size {dims.ffn} is not divisible by tp = {tp}",
         f"choose tp dividing {dims.ffn}"),
        (dims.padded_vocab >= dims.vocab and dims.padded_vocab % tp == 0, "padded_vocab",
         f"padded vocab {dims.padded_vocab} must be >= vocab {dims.vocab} and divisible by tp = {tp}",
         "build the dims with LlamaDims.from_hf(config, tp=tp)"),
        (dims.layers % (pp * vpp) == 0, "pp x vpp", f"{dims.layers} layers do not split into pp x vpp = {pp} x {vpp} "
         f"= {pp * vpp} equal chunks", f"choose pp x vpp dividing {dims.layers}"),
    ]
    return [Problem(key, message, fix) for ok, key, message, fix in rules if not ok]


@dataclass(frozen=True)
class ParamMap:
    """One Megatron parameter and the HF tensors it is made of; names may hold {i} / {j} layer placeholders."""

    hf_names: tuple[str, ...]
    megatron_name: str
    rule: Rule
    hf_shapes: tuple[tuple[int, ...], ...]


def layer_map(dims: LlamaDims) -> list[ParamMap]:
    """The parameters of one transformer layer."""
    h, d, L, M = dims.hidden, dims.head_dim, HF_LAYER, MEGATRON_LAYER
    q_rows, kv_rows = dims.heads * d, dims.kv_heads * d
    return [
        ParamMap((f"{L}.input_layernorm.weight",), f"{M}.input_layernorm.weight", Replicated(), ((h,),)),
        ParamMap((f"{L}.self_attn.q_proj.weight", f"{L}.self_attn.k_proj.weight", f"{L}.self_attn.v_proj.weight"),
                 f"{M}.self_attention.linear_qkv.weight", QKV(dims.heads, dims.kv_heads, d),
                 ((q_rows, h), (kv_rows, h), (kv_rows, h))),
        ParamMap((f"{L}.self_attn.o_proj.weight",), f"{M}.self_attention.linear_proj.weight", RowParallel(),
                 ((h, q_rows),)),
        ParamMap((f"{L}.post_attention_layernorm.weight",), f"{M}.pre_mlp_layernorm.weight", Replicated(), ((h,),)),
        ParamMap((f"{L}.mlp.gate_proj.weight", f"{L}.mlp.up_proj.weight"), f"{M}.mlp.linear_fc1.weight",
                 GatedMLP(), ((dims.ffn, h), (dims.ffn, h))),
        ParamMap((f"{L}.mlp.down_proj.weight",), f"{M}.mlp.linear_fc2.weight", RowParallel(), ((h, dims.ffn),)),
    ]


def embedding_map(dims: LlamaDims) -> ParamMap:
    """The word embeddings, on the first pipeline stage."""
    return ParamMap(("model.embed_tokens.weight",), "embedding.word_embeddings.weight",
                    VocabParallel(dims.vocab, dims.padded_vocab), ((dims.vocab, dims.hidden),))


def final_norm_map(dims: LlamaDims) -> ParamMap:
    return ParamMap(("model.norm.weight",), "decoder.final_layernorm.weight", Replicated(), ((dims.hidden,),))


def output_map(dims: LlamaDims) -> ParamMap:
    """The output layer, on the last stage. Tied models take it from the embeddings (HF has no lm_head then)."""
    source = "model.embed_tokens.weight" if dims.tied else "lm_head.weight"
    return ParamMap((source,), "output_layer.weight", VocabParallel(dims.vocab, dims.padded_vocab),
                    ((dims.vocab, dims.hidden),))


# Megatron's Transformer Engine layer spec fuses the two norms into the linears that follow them; the local spec
# (the names above) keeps them as modules. Checkpoints and weight loading speak local names; these translate.
TE_NORM_NAMES = {".self_attention.linear_qkv.layer_norm_weight": ".input_layernorm.weight",
                 ".mlp.linear_fc1.layer_norm_weight": ".pre_mlp_layernorm.weight"}


def local_spec_name(name: str) -> str:
    """The local-spec name of a Megatron parameter that may carry a Transformer Engine spec name."""
    for te, local in TE_NORM_NAMES.items():
        if name.endswith(te):
            return name[: -len(te)] + local
    return name
