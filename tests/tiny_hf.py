"""A tiny random Llama as a Hugging Face folder (config.json + model.safetensors, bf16), for conversion tests."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from toolkit.families.entries import iter_entries
from toolkit.families.registry import dims_from_hf
from toolkit.format import safetensors_stream as st


def write_llama(folder: Path, layers: int = 2, tied: bool = False, seed: int = 0, tokenizer: bool = False) -> None:
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": layers, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 500, "max_position_embeddings": 64, "rms_norm_eps": 1e-5,
              "rope_theta": 10000.0, "tie_word_embeddings": tied, "hidden_act": "silu", "torch_dtype": "bfloat16"}
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    if tokenizer:
        (folder / "tokenizer_config.json").write_text("{}")
    gen = torch.Generator().manual_seed(seed)
    st.save({n: torch.randn(s, generator=gen).to(torch.bfloat16) for e in iter_entries(dims_from_hf(config), 1, 1)
             for n, s in zip(e.hf_names, e.hf_shapes)}, folder / "model.safetensors", {"format": "pt"})
