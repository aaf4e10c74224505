"""Megatron-LM's arguments name the model family (toolkit/checkpoint/megatron_lm.py family_of_args): --add-qkv-bias is
Qwen2, --qk-layernorm is Qwen3, a Mistral tokenizer is Mistral, the rest of the dense shape is Llama's; anything else
is refused in one line. The toolkit's own Megatron-LM legacy and torch_dist outputs carry those arguments, so a Qwen2
or Qwen3 model goes HF -> megatron_lm / torch_dist -> HF bit for bit and comes back as its own family. (Files written
by Megatron-Core's own save functions: tests/test_megatron_native.py.)"""
from __future__ import annotations

import argparse
import json
import re

import pytest
import torch
from safetensors.torch import load_file
from test_families import CONFIGS, tiny_model

from toolkit.checkpoint.convert import convert, convert_to_hf
from toolkit.checkpoint.inspect import inspect
from toolkit.checkpoint.megatron_lm import family_of_args, hf_config
from toolkit.errors import ToolkitError

LLAMA = dict(normalization="RMSNorm", swiglu=True, position_embedding_type="rope", add_bias_linear=False,
             hidden_size=64, num_attention_heads=4, kv_channels=16, num_layers=2, ffn_hidden_size=96,
             group_query_attention=True, num_query_groups=2, max_position_embeddings=256, norm_epsilon=1e-6,
             untie_embeddings_and_output_weights=True)


@pytest.mark.parametrize("change,family", [
    ({}, "llama"),
    ({"tokenizer_model": "/models/Mistral-7B-v0.3"}, "mistral"),
    ({"add_qkv_bias": True, "untie_embeddings_and_output_weights": False}, "qwen2"),
    ({"qk_layernorm": True, "kv_channels": 32}, "qwen3"),
    ({"kv_channels": 32}, "llama"),  # a head size of its own: head_dim in any family's config (it was refused)
])
def test_args_name_the_family(change, family):
    args = argparse.Namespace(**{**LLAMA, **change})
    assert family_of_args(args) == family
    config = hf_config(args, 500)
    architecture = CONFIGS[family][1] if family in CONFIGS else "LlamaForCausalLM"
    assert config["model_type"] == family and config["architectures"] == [architecture]
    assert config["tie_word_embeddings"] == (not args.untie_embeddings_and_output_weights)
    assert config.get("head_dim", 16) == args.kv_channels


@pytest.mark.parametrize("change,needle", [
    ({"add_qkv_bias": True, "qk_layernorm": True}, "add_qkv_bias=True with qk_layernorm=True"),
    ({"add_bias_linear": True}, "add_bias_linear=True"),
    ({"window_size": (4096, 0)}, "window_size=(4096, 0)"),
    ({"rotary_interleaved": True}, "rotary_interleaved=True"),
    ({"rotary_seq_len_interpolation_factor": 2}, "rotary_seq_len_interpolation_factor=2"),
    ({"num_experts": 8}, "num_experts=8"),
])
def test_args_no_family_converts_are_refused_in_one_line(change, needle):
    with pytest.raises(ToolkitError, match=r"none of the families \(.*" + re.escape(needle)) as e:
        family_of_args(argparse.Namespace(**{**LLAMA, **change}), "ckpt/common.pt")
    assert "\n" not in str(e.value) and str(e.value).startswith("ckpt/common.pt: ")


@pytest.mark.parametrize("family,to,layout", [("qwen2", "megatron_lm", dict(tp=2)),
                                              ("qwen3", "torch_dist", dict(tp=1, pp=2)),
                                              ("mistral", "megatron_lm", dict(tp=2)),  # came back as Llama
                                              ("mistral", "torch_dist", dict(tp=1, pp=2))])
def test_toolkit_megatron_lm_outputs_keep_the_family(family, to, layout, tmp_path):
    model = tiny_model(family)
    model.save_pretrained(tmp_path / "hf")
    said = []
    out = convert(tmp_path / "hf", tmp_path / to, to, vocab_size=500, progress=False, log=said.append, **layout)
    assert said[-1] == f"to continue in Megatron-LM: --load {out} " + (  # the table in docs/convert.md
        "--ckpt-format torch_dist --no-load-optim" if to == "torch_dist"
        else "--ckpt-format torch --transformer-impl local --no-load-optim --no-load-rng"), said
    back = convert_to_hf(out, tmp_path / "back")  # the true vocabulary is recorded (--vocab-size until 2026-12-07)
    assert json.loads((back / "config.json").read_text())["vocab_size"] == 500
    got, want = load_file(str(back / "model.safetensors")), load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    config = json.loads((back / "config.json").read_text())
    assert config["model_type"] == family and config["architectures"] == [CONFIGS[family][1]]
    source = json.loads((tmp_path / "hf" / "config.json").read_text())  # no Megatron-LM argument holds the ids
    assert [config.get(k) for k in ("bos_token_id", "eos_token_id")] == [source.get(k) for k in ("bos_token_id",
                                                                                              "eos_token_id")]
    assert family != "mistral" or source["bos_token_id"] == 1  # (Qwen's transformers 5 configs leave them unset)
    # inspect names the shape alike in the three formats (Qwen3's head_dim 32 included: it was left out)
    shapes = [{k: v for k, v in inspect(p)["architecture"].items() if k != "vocab_size"}
              for p in (tmp_path / "hf", out, back)]
    assert shapes[0] == shapes[1] == shapes[2] and shapes[0].get("head_dim") == (32 if family == "qwen3" else None)
    # weights only: the args say so as Megatron-LM's do after --no-save-optim --no-save-rng, so its load_checkpoint
    # asks a torch_dist checkpoint for neither; torch_dist's content metadata is what Megatron-LM's save stores
    from toolkit.format import safe_load

    saved = safe_load.load(next(out.glob("iter_*/common.pt" if to == "torch_dist" else "iter_*/mp_rank_*/*.pt")))
    assert (saved["args"].no_save_optim, saved["args"].no_save_rng) == (True, True)
    assert saved.get("content_metadata") == ({"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
                                             if to == "torch_dist" else None)
    # a folder toolkit convert wrote from weights: its note does not guess at Megatron-LM's --no-save-optim
    lines = []
    convert(out, tmp_path / "mg", "megatron", vocab_size=500, progress=False, log=lines.append)
    assert "optimizer state: it holds no optimizer state (toolkit convert wrote it without any): weights only" \
        in lines, lines
    assert inspect(out)["optimizer_state"] == {"megatron_lm": "none (toolkit convert wrote it without any)",
                                               "torch_dist": "none (weights only)"}[to]


def test_a_megatron_lm_runs_own_args_travel_so_its_script_continues(tmp_path):
    """What Megatron-LM's load_checkpoint compares with the new run's arguments (add_position_embedding; tokenizer_type
    with a --vocab-file) and where it restarts the data (consumed_train_samples) are the source run's, carried through
    a relayout into both Megatron-LM formats; from a Hugging Face folder they are a fresh rope run's (add_position_embedding
    was written False, which a run with --position-embedding-type rope alone refuses)."""
    from toolkit.format import safe_load

    tiny_model("qwen2").save_pretrained(tmp_path / "hf")
    quiet = dict(progress=False, log=lambda *_: None, vocab_size=500)
    lm = convert(tmp_path / "hf", tmp_path / "lm", "megatron_lm", tp=2, **quiet)
    run = {"add_position_embedding": False, "tokenizer_type": "GPT2BPETokenizer", "consumed_train_samples": 1234,
           "skipped_train_samples": 2, "consumed_valid_samples": 56, "seq_length": 128, "attention_dropout": 0.0,
           "hidden_dropout": 0.0}
    for f in lm.glob("iter_*/mp_rank_*/model_optim_rng.pt"):
        fresh = safe_load.load(f)["args"]
        assert {k: getattr(fresh, k) for k in run} == {
            "add_position_embedding": True, "tokenizer_type": None, "consumed_train_samples": 0,
            "skipped_train_samples": 0, "consumed_valid_samples": 0, "seq_length": None, "attention_dropout": None,
            "hidden_dropout": None}
        state = torch.load(f, weights_only=False)  # our own output: its args become those of a Megatron-LM run
        vars(state["args"]).update(run)
        torch.save(state, f)
    for to, name in (("megatron_lm", "iter_*/mp_rank_*/model_optim_rng.pt"), ("torch_dist", "iter_*/common.pt")):
        out = convert(lm, tmp_path / to, to, tp=1, pp=2, **quiet)
        for f in out.glob(name):
            args = safe_load.load(f)["args"]
            assert {k: getattr(args, k) for k in run} == run, (to, f)
