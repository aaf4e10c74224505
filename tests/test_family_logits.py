"""The Llama family map against the real libraries, fast: a tiny Llama 3.1-style model (grouped-query attention,
`rope_scaling` llama3 with factor 2) is loaded into Megatron-Core's own GPTModel through the family's keyword
mapping, and its logits must equal those of transformers' LlamaForCausalLM. A q/k/v or gate/up mix-up in the map
or its rules, or a RoPE scaling factor the adapter does not pass on, changes the logits far beyond the tolerance.
One process, TP = PP = 1 (the layouts are proven against this in test_megatron_parity.py)."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from conftest import REPO

from toolkit.errors import ToolkitError
from toolkit.families import QKV, GatedMLP
from toolkit.families.mapping import mapping

PROBE = REPO / "tests" / "megatron_logits_probe.py"
LOGITS_ATOL = 1e-5  # fp32; the same bound as test_megatron_parity.py
ROPE = {"rope_type": "llama3", "factor": 2.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}


def tiny_llama31(rope: dict, seed: int = 5):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    # head_dim 16 and theta 10000: the two slowest RoPE frequencies have wavelengths above 2048 and 8192 tokens,
    # so llama3 scaling changes them
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16384,
                         rope_parameters={"rope_theta": 10000.0, **rope}, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # sharper attention than a random init gives, so that positions (and RoPE) matter
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(20)
            layer.self_attn.k_proj.weight.mul_(20)
    return model


def hf_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


@pytest.fixture(scope="module")
def llama31(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama31")
    model = tiny_llama31(ROPE)
    model.save_pretrained(folder)
    return folder, model


def test_megatron_core_logits_equal_transformers_through_the_family_map(llama31, tmp_path):
    folder, model = llama31
    out = tmp_path / "logits.pt"
    proc = subprocess.run([sys.executable, str(PROBE), str(folder), "1", "1", "1", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = torch.load(out)
    want = hf_logits(model, got["ids"])
    assert got["logits"].shape == want.shape
    diff = (got["logits"] - want).abs().max().item()
    assert diff < LOGITS_ATOL, f"Megatron-Core logits differ from transformers by {diff:.2e}"


def test_the_rope_factor_is_visible_in_the_logits(llama31):
    """The logits test can see a wrong scaling factor: factor 8 (Llama 3.1's, which a hard-coded adapter would use)
    moves the logits by far more than the tolerance."""
    folder, model = llama31
    other = tiny_llama31({**ROPE, "factor": 8.0})
    other.load_state_dict(model.state_dict())
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    assert (hf_logits(model, ids) - hf_logits(other, ids)).abs().max().item() > 100 * LOGITS_ATOL


def test_keyword_mappings_name_each_part_once():
    with pytest.raises(ToolkitError, match="QKV takes the parts q, k, v"):
        mapping("linear_qkv.weight", QKV(4, 2, 16), q=("a", (64, 64)), k=("b", (32, 64)))
    with pytest.raises(ToolkitError, match="GatedMLP takes the parts gate, up"):
        mapping("linear_fc1.weight", GatedMLP(), gate=("a", (96, 64)), down=("b", (96, 64)))
    pm = mapping("linear_fc1.weight", GatedMLP(), up=("u", (96, 64)), gate=("g", (96, 64)))
    assert pm.hf_names == ("g", "u")  # the rule's order, whatever order the keywords came in


@pytest.mark.parametrize("to", ["torch_dist", "megatron_lm"])
def test_llama31_rope_scaling_travels_in_megatron_lm_args(llama31, tmp_path, to):
    """Megatron-LM's args said only rotary_base: a Llama 3.1 converted --to torch_dist or --to megatron_lm came back
    without its scaling, "verified", and transformers' logits moved. Now the args carry --use-rope-scaling and
    --rope-scaling-factor (what Megatron-LM builds its model from), and the round trip gives the same logits."""
    from transformers import AutoModelForCausalLM

    from toolkit.checkpoint.convert import convert
    from toolkit.families.mapping import rope_of
    from toolkit.format import safe_load

    folder, model = llama31
    mid = convert(folder, tmp_path / to, to, progress=False, log=lambda *_: None)
    pt = next(mid.rglob("common.pt" if to == "torch_dist" else "model_optim_rng.pt"))
    args = safe_load.load(pt, deepspeed=False)["args"]
    assert (args.use_rope_scaling, args.rope_scaling_factor, args.rotary_base) == (True, 2.0, 10000)
    back = convert(mid, tmp_path / "hf", "hf", vocab_size=256, progress=False, log=lambda *_: None)
    import json

    assert rope_of(json.loads((back / "config.json").read_text())) == (10000.0, ROPE)
    again = AutoModelForCausalLM.from_pretrained(back).eval()
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    assert torch.equal(hf_logits(again, ids), hf_logits(model, ids))


@pytest.mark.parametrize("rope", [{"rope_type": "linear", "factor": 4.0},
                                  {**ROPE, "original_max_position_embeddings": 64},
                                  {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}],
                         ids=["linear", "llama3-other-constants", "yarn"])
def test_a_rope_scaling_megatron_lm_cannot_say_is_refused_before_writing(tmp_path, rope):
    from toolkit.checkpoint.convert import convert

    tiny_llama31(rope).save_pretrained(tmp_path / "hf")
    for to in ("torch_dist", "megatron_lm"):
        with pytest.raises(ToolkitError, match="has no Megatron-LM arguments .*the output would give other logits"):
            convert(tmp_path / "hf", tmp_path / to, to, progress=False, log=lambda *_: None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_verification_sees_a_config_the_target_loses(llama31, tmp_path, monkeypatch):
    """The logit check runs the source's config on both sides' weights, so it could not see a scaling the
    output's args dropped (what happened before the args carried it): the output's config is now compared too."""
    from toolkit.checkpoint import megatron_lm_write
    from toolkit.checkpoint.convert import convert

    folder, _ = llama31
    monkeypatch.setattr(megatron_lm_write, "megatron_rope_args", lambda config, where: {"rotary_base": 10000})
    with pytest.raises(ToolkitError, match=r"verification failed: the output's config makes another model: rope "
                                           r"\(10000\.0, \{\}\) \(the source's: \(10000\.0, \{'factor': 2\.0, .*'rope_type': 'llama3'\}\)\)"):
        convert(folder, tmp_path / "td", "torch_dist", progress=False, log=lambda *_: None)
    assert not (tmp_path / "td").exists()
