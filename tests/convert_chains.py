"""The converted models test_convert_layouts checks and the session's Megatron logits probes load: a tiny Llama
(GQA 8 heads / 4 kv heads, vocabulary 500, divisible neither by 128 nor by any TP size, so every Megatron layout
pads it), untied and tied, converted HF -> TP2xPP2 -> TP4xPP1 -> TP1xPP2xVPP2 -> HF once per session."""
from __future__ import annotations

import torch

from toolkit.checkpoint.convert import convert

VOCAB = 500
CHAIN = [(2, 2, 1), (4, 1, 1), (1, 2, 2)]  # HF -> TP2xPP2 -> TP4xPP1 -> TP1xPP2 (2 virtual chunks) -> HF


def hf_model(tied: bool, seed: int = 5):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256,
                         rms_norm_eps=1e-5, tie_word_embeddings=tied)
    return LlamaForCausalLM(config)


CHAINS: dict = {}


def chain(tied: bool, tmp_path_factory) -> dict:
    """An HF model converted along CHAIN and back: {"hf": folder, (tp, pp, vpp): checkpoint dir, "back": folder};
    built once per session for each of tied and untied."""
    if tied not in CHAINS:
        CHAINS[tied] = build_chain(tied, tmp_path_factory)
    return CHAINS[tied]


def build_chain(tied: bool, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("tied" if tied else "untied")
    model = hf_model(tied)
    model.save_pretrained(root / "hf")
    out, src = {"hf": root / "hf", "model": model, "tied": tied}, root / "hf"
    for layout in CHAIN:
        src = out[layout] = convert(src, root / "tp{}_pp{}_vpp{}".format(*layout), "megatron", *layout,
                                    progress=False, log=lambda *_: None)
    out["back"] = convert(src, root / "back", "hf", progress=False, log=lambda *_: None)
    return out
