"""Named model sizes. A preset is a layer of values under the recipe's own `model:` keys."""
from __future__ import annotations

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
}

# Hugging Face config.json key -> recipe model key, for `model.hf_path`.
HF_TO_RECIPE = {
    "vocab_size": "vocab_size", "hidden_size": "hidden_size", "intermediate_size": "intermediate_size",
    "num_hidden_layers": "num_layers", "num_attention_heads": "num_attention_heads",
    "num_key_value_heads": "num_kv_heads", "max_position_embeddings": "max_position_embeddings",
    "rms_norm_eps": "rms_norm_eps", "tie_word_embeddings": "tie_word_embeddings",
    "initializer_range": "initializer_range",
}


def model_keys_from_hf_config(cfg: dict) -> dict:
    """Recipe `model:` values read from a Hugging Face Llama config.json (old and new RoPE spellings)."""
    out = {ours: cfg[theirs] for theirs, ours in HF_TO_RECIPE.items() if cfg.get(theirs) is not None}
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = rope.pop("rope_theta", None) or cfg.get("rope_theta")
    if theta:
        out["rope_theta"] = float(theta)
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        out["rope_scaling"] = rope
    return out
