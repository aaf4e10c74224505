"""Named model sizes. A preset is a layer of values under the recipe's own `model:` keys."""
from __future__ import annotations

import json
import typing
from pathlib import Path

from toolkit.errors import Problem, quantized
from toolkit.recipe.schema import ModelConfig

_LLAMA2 = dict(vocab_size=32000, max_position_embeddings=4096, rope_theta=10000.0, rms_norm_eps=1e-5)
_LLAMA3 = dict(vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5)
_LLAMA31_ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                     original_max_position_embeddings=8192)

PRESETS: dict[str, dict] = {
    # Tiny sizes for CPU tests and demos; vocab matches the shipped demo tokenizer (512 ids).
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=176, num_layers=2,
                 num_attention_heads=4, num_kv_heads=2, max_position_embeddings=256, rope_theta=10000.0),
    "tiny-4l": dict(vocab_size=512, hidden_size=128, intermediate_size=352, num_layers=4,
                    num_attention_heads=8, num_kv_heads=4, max_position_embeddings=256, rope_theta=10000.0),
    "llama2-7b": dict(_LLAMA2, hidden_size=4096, intermediate_size=11008, num_layers=32,
                      num_attention_heads=32, num_kv_heads=32),
    "llama2-13b": dict(_LLAMA2, hidden_size=5120, intermediate_size=13824, num_layers=40,
                       num_attention_heads=40, num_kv_heads=40),
    "llama2-70b": dict(_LLAMA2, hidden_size=8192, intermediate_size=28672, num_layers=80,
                       num_attention_heads=64, num_kv_heads=8),
    "llama3-8b": dict(_LLAMA3, hidden_size=4096, intermediate_size=14336, num_layers=32,
                      num_attention_heads=32, num_kv_heads=8),
    "llama3-70b": dict(_LLAMA3, hidden_size=8192, intermediate_size=28672, num_layers=80,
                       num_attention_heads=64, num_kv_heads=8),
    "llama3.1-8b": dict(_LLAMA3, hidden_size=4096, intermediate_size=14336, num_layers=32,
                        num_attention_heads=32, num_kv_heads=8, max_position_embeddings=131072,
                        rope_scaling=_LLAMA31_ROPE),
    # Other families, at their published config.json numbers (Hugging Face, model cards of the same names).
    "mistral-7b-v0.3": dict(family="mistral", vocab_size=32768, hidden_size=4096, intermediate_size=14336,
                            num_layers=32, num_attention_heads=32, num_kv_heads=8, max_position_embeddings=32768,
                            rope_theta=1000000.0, rms_norm_eps=1e-5),
    "qwen2.5-7b": dict(family="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28,
                       num_attention_heads=28, num_kv_heads=4, max_position_embeddings=131072,
                       rope_theta=1000000.0, rms_norm_eps=1e-6),
    # Qwen3-30B-A3B (config.json): 48 layers, 128 experts of width 768, 8 per token: 30.5B total, 3.3B active
    "qwen3-30b-a3b": dict(family="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                          num_layers=48, num_attention_heads=32, num_kv_heads=4, head_dim=128,
                          max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6, num_experts=128,
                          num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
                          router_aux_loss_coef=0.001),
    "qwen3-8b": dict(family="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36,
                     num_attention_heads=32, num_kv_heads=8, head_dim=128, max_position_embeddings=40960,
                     rope_theta=1000000.0, rms_norm_eps=1e-6),
}

# Hugging Face config.json key -> recipe model key, for `model.hf_path`.
HF_TO_RECIPE = {
    "vocab_size": "vocab_size", "hidden_size": "hidden_size", "intermediate_size": "intermediate_size",
    "num_hidden_layers": "num_layers", "num_attention_heads": "num_attention_heads",
    "num_key_value_heads": "num_kv_heads", "max_position_embeddings": "max_position_embeddings",
    "rms_norm_eps": "rms_norm_eps", "tie_word_embeddings": "tie_word_embeddings",
    "initializer_range": "initializer_range", "head_dim": "head_dim", "model_type": "family",
    "num_experts": "num_experts", "num_local_experts": "num_experts", "num_experts_per_tok": "num_experts_per_tok",
    "moe_intermediate_size": "moe_intermediate_size", "norm_topk_prob": "norm_topk_prob",
    "router_aux_loss_coef": "router_aux_loss_coef",
}


HF_DEFAULTS: dict[str, dict] = {
    "llama": {"rms_norm_eps": 1e-6}, "mistral": {"rms_norm_eps": 1e-6}, "qwen2": {"rms_norm_eps": 1e-6},
    "qwen3": {"rms_norm_eps": 1e-6, "head_dim": 128},
    "qwen3_moe": {"rms_norm_eps": 1e-6, "norm_topk_prob": False},
}
"""What transformers' config class of each model_type takes for a key that config.json leaves out, where that changes
the logits and the recipe schema's default differs (tests/test_families.py checks it against transformers). Until
2026-12-07 a missing key took the schema's default: a Qwen3-MoE without norm_topk_prob trained renormalised top-k
weights, and one without rms_norm_eps an epsilon of 1e-5."""


def normal_rope(rope: dict) -> dict:
    """RoPE scaling with its kind under `rope_type`: configs before transformers 4.45 spell it `type` (rope_type wins
    where both are given). Until 2026-12-07 a `type` was dropped on the way into training, which ran unscaled."""
    rope = dict(rope)
    kind = rope.pop("type", None)
    rope.setdefault("rope_type", kind or "default")
    return rope


def model_keys_from_hf_config(cfg: dict) -> dict:
    """Recipe `model:` values read from a Hugging Face config.json (old and new RoPE spellings; a key it leaves out
    as transformers' config class takes it: HF_DEFAULTS)."""
    out = {ours: cfg[theirs] for theirs, ours in HF_TO_RECIPE.items() if cfg.get(theirs) is not None}
    for key, value in HF_DEFAULTS.get(cfg.get("model_type") or "llama", {}).items():
        out.setdefault(key, value)
    theta, scaling = hf_rope(cfg)
    rope = normal_rope(scaling)
    if theta:
        out["rope_theta"] = theta
    if rope["rope_type"] != "default":
        out["rope_scaling"] = rope
    return out


def hf_rope(cfg: dict) -> tuple[float | None, dict]:
    """(rope_theta, the RoPE scaling as the config spells it, without rope_theta) of a Hugging Face config.json, in
    either spelling: transformers 5's rope_parameters (theta inside) or the older rope_scaling and rope_theta.
    Recipes and `toolkit inspect` read a config alike through it."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta = rope.get("rope_theta") or cfg.get("rope_theta")
    return (float(theta) if theta else None), {k: v for k, v in rope.items() if k != "rope_theta"}


# The model types the recipe schema's model.family accepts (each is a file in toolkit/families/, whose tests
# check this list against the families' registry).
MODEL_TYPES = typing.get_args(ModelConfig.model_fields["family"].annotation)

# Hugging Face config.json fields whose non-default values change the architecture in ways no family the toolkit
# knows implements: (field, the value the families have, what the other value would need). Family-specific fields
# (Qwen2's q/k/v biases, Qwen3's q/k norms) are the families' own and need no entry here.
_UNSUPPORTED = (
    ("attention_bias", False, "biases on the q/k/v/o projections"),
    ("mlp_bias", False, "biases on the MLP projections"),
    ("hidden_act", "silu", "a SwiGLU MLP with another activation"),
    ("qk_norm", False, "normalised queries and keys"),
)


def unsupported_hf_config(cfg: dict, where: str) -> list[Problem]:
    """What in a Hugging Face config.json the toolkit cannot honour: a model_type of no known family, or a config
    with a field (an active sliding window, attention biases, another activation, ...) that changes the maths."""
    fix = f"use a checkpoint of a supported family (model_type: {', '.join(MODEL_TYPES)})"
    kind = cfg.get("model_type", "llama")  # absent in hand-written test configs; every saved HF config has it
    if kind not in MODEL_TYPES:
        return [Problem("model.hf_path", f"{where} has model_type {kind!r}; supported: {', '.join(MODEL_TYPES)}",
                        fix)]
    out = [p for p in [quantized(cfg, where)] if p]
    # Qwen configs keep a window size that is off unless use_sliding_window is true
    window = cfg.get("sliding_window")
    if window is not None and cfg.get("use_sliding_window", True):
        out.append(Problem("model.hf_path", f"{where} sets sliding_window: {json.dumps(window)}, which needs "
                           "sliding-window attention; the toolkit's models attend to the whole sequence", fix))
    if kind == "qwen3_moe" and (cfg.get("decoder_sparse_step", 1) != 1 or cfg.get("mlp_only_layers")):
        out.append(Problem("model.hf_path", f"{where} has dense layers among the experts (decoder_sparse_step, "
                           "mlp_only_layers); the toolkit's qwen3_moe has experts in every layer, as the released "
                           "models", fix))
    for key, plain, needs in _UNSUPPORTED:
        if key == "attention_bias" and kind == "qwen2":
            continue  # Qwen2's q/k/v biases are always there (the family maps them); the key is not Qwen2's
        value = cfg.get(key, plain)
        if value is not None and value != plain and not (key == "hidden_act" and value == "swish"):  # silu's alias
            out.append(Problem("model.hf_path", f"{where} sets {key}: {json.dumps(value)}, which needs {needs}; "
                               f"the toolkit's {kind} has {key}: {json.dumps(plain)}",
                               "no family the toolkit maps has it: train or convert this model with a tool that "
                               "implements it"))
    return out


def read_hf_config(path: Path) -> tuple[dict, list[Problem]]:
    """A config.json read for a recipe, with every problem that stops the toolkit from honouring it."""
    try:
        cfg = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        return {}, [Problem("model.hf_path", f"{path} is not a JSON config ({type(e).__name__}: "
                            f"{str(e)[:80]})", "point hf_path at a Hugging Face model folder")]
    if not isinstance(cfg, dict):
        return {}, [Problem("model.hf_path", f"{path} holds a {type(cfg).__name__}, not a JSON object",
                            "point hf_path at a Hugging Face model folder")]
    return cfg, unsupported_hf_config(cfg, str(path))
