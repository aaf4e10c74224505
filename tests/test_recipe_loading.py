"""Loading: precedence (--set > file > base > preset > field defaults), unknown keys, presets, hf_path configs."""
from __future__ import annotations

import json

import pytest

from toolkit.errors import RecipeError
from toolkit.recipe import load_recipe, resolve
from toolkit.recipe.loader import parse_overrides
from toolkit.recipe.schema import Recipe


def _write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_precedence_set_over_file_over_base_over_preset_over_default(tmp_path):
    _write(tmp_path, "base.yaml", "model: {preset: tiny, hidden_size: 96, num_layers: 3}\n"
                                  "training: {steps: 7, seed: 5, grad_clip: 0.5}\n")
    child = _write(tmp_path, "child.yaml", "base: base.yaml\nmodel: {num_layers: 6}\ntraining: {steps: 8, seed: 6}\n")
    r = load_recipe(str(child), ["training.steps=9"])
    assert r.training.steps == 9                  # --set beats the file
    assert r.training.seed == 6                   # the file beats its base
    assert r.training.grad_clip == 0.5            # the base beats the field default (1.0)
    assert r.model.num_layers == 6                # the file beats base and preset
    assert r.model.hidden_size == 96              # the base beats the preset (64)
    assert r.model.intermediate_size == 176       # the preset beats the field default (11008)
    assert r.training.optimizer.lr == Recipe().training.optimizer.lr  # field default when nobody sets it


def test_set_parses_yaml_values_and_nested_keys():
    assert parse_overrides(["a.b=3", "a.c=true", "d=[1, 2]", "e=null", "f=x=y"], "t") == {
        "a": {"b": 3, "c": True}, "d": [1, 2], "e": None, "f": "x=y"}


def test_a_leading_zero_is_refused_not_read_as_octal():
    """YAML 1.1 reads 010 as 8 (until 2026-12-07 `--set training.steps=010` trained 8 steps); 0, 0x10, 10 and a
    quoted '010' are what they look like."""
    with pytest.raises(RecipeError) as err:
        parse_overrides(["training.steps=010"], "t")
    (p,) = err.value.problems
    assert "has 010 with a leading zero, which YAML reads as an octal number: 8" in p.message
    assert "write 10 for the number, or quote it ('010') for text" in p.fix
    assert parse_overrides(["a=0", "b=0x10", "c=10", "d='010'", "e=-0"], "t") == {"a": 0, "b": 16, "c": 10,
                                                                                 "d": "010", "e": 0}


@pytest.mark.parametrize("bad", ["nodot", "=3", "a..b=1"])
def test_set_rejects_malformed_items(bad):
    with pytest.raises(RecipeError, match="expected KEY.PATH=VALUE"):
        parse_overrides([bad], "t")


def test_set_unknown_key_lists_valid_keys_and_suggests():
    with pytest.raises(RecipeError) as err:
        load_recipe("tiny_zero0", ["training.step=3"])
    (p,) = err.value.problems
    assert p.key == "training.step" and "did you mean `steps`?" in p.fix and "global_batch_size" in p.fix


def test_recipe_by_name_and_by_path_are_the_same(tmp_path):
    from toolkit.recipe.loader import RECIPE_DIR

    assert load_recipe("tiny_zero3") == load_recipe(str(RECIPE_DIR / "tiny_zero3.yaml"))


def test_missing_recipe_lists_shipped_ones():
    with pytest.raises(RecipeError) as err:
        load_recipe("no_such_recipe")
    assert "tiny_zero3" in err.value.problems[0].fix


def test_hf_path_config_gives_architecture(tmp_path):
    cfg = {"vocab_size": 1000, "hidden_size": 48, "intermediate_size": 100, "num_hidden_layers": 3,
           "num_attention_heads": 6, "num_key_value_heads": 2, "max_position_embeddings": 512,
           "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 256}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    r = load_recipe("tiny_zero0", ["model.preset=null", f"model.hf_path={tmp_path}"])
    assert (r.model.vocab_size, r.model.hidden_size, r.model.num_layers, r.model.num_kv_heads) == (1000, 48, 3, 2)
    assert r.model.rope_theta == 500000.0 and r.model.rope_scaling["rope_type"] == "llama3"


def test_preset_with_mismatching_hf_config_is_caught_before_the_run(tmp_path):
    from toolkit.recipe import check_paths

    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 4096, "num_hidden_layers": 32}))
    r = load_recipe("tiny_zero0", [f"model.hf_path={tmp_path}"])
    msgs = [p.message for p in check_paths(r) if p.key == "model.preset"]
    assert msgs and "hidden_size: 128 in the recipe, 4096 in config.json" in msgs[0]


@pytest.mark.parametrize("given,expect", [
    ({"global_batch_size": 64, "micro_batch_size": 4}, (64, 4, 2)),
    ({"global_batch_size": 64, "grad_accum_steps": 4}, (64, 2, 4)),
    ({"micro_batch_size": 4, "grad_accum_steps": 3}, (96, 4, 3)),
    ({"global_batch_size": 64}, (64, 8, 1)),
    ({}, (8, 1, 1)),
])
def test_batch_derivation(given, expect):
    sets = [f"training.{k}={v}" for k, v in given.items()]
    sets += [f"training.{k}=null" for k in ("global_batch_size", "micro_batch_size", "grad_accum_steps")
             if k not in given]
    plan = resolve(load_recipe("tiny_zero0", sets), world_size=8)
    assert (plan.batch.global_batch, plan.batch.micro_batch, plan.batch.grad_accum) == expect
    assert plan.batch.global_batch == plan.batch.micro_batch * plan.batch.grad_accum * plan.layout.dp
    if len(given) < 3:
        assert plan.notes and "(derived)" in plan.notes[-1]


def test_nvme_path_must_exist_unless_inside_the_run_folder(tmp_path):
    """DeepSpeed would create a mistyped nvme_path on whatever disk holds it; the run refuses a missing one, except a
    scratch folder inside its own output folder (tiny_zero3_nvme's), which the run creates."""
    from toolkit.recipe import check_paths

    fresh = load_recipe("tiny_zero3_nvme", [f"parallel.nvme_path={tmp_path}/not/yet/there"])
    assert [p.message for p in check_paths(fresh) if p.key == "parallel.nvme_path"] == [
        f"{tmp_path}/not/yet/there does not exist on this machine"]
    inside = load_recipe("tiny_zero3_nvme", [f"output_dir={tmp_path}/run", f"parallel.nvme_path={tmp_path}/run/swap"])
    assert not [p for p in check_paths(inside) if p.key == "parallel.nvme_path"]
    (tmp_path / "file").write_text("x")
    blocked = load_recipe("tiny_zero3_nvme", [f"output_dir={tmp_path}/file", f"parallel.nvme_path={tmp_path}/file/swap"])
    assert [p.key for p in check_paths(blocked)] == ["parallel.nvme_path", "output_dir", "checkpoint.dir"]


def test_a_key_config_json_leaves_out_is_transformers_default_not_the_schemas(tmp_path):
    """Until 2026-12-07 a missing key took the recipe schema's default: a Qwen3-MoE config without norm_topk_prob
    trained renormalised top-k weights (transformers: off), and any family without rms_norm_eps 1e-5 (1e-6)."""
    import transformers

    from toolkit.recipe.presets import HF_DEFAULTS

    classes = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config",
               "qwen3_moe": "Qwen3MoeConfig"}
    assert set(HF_DEFAULTS) == set(classes)
    for family, defaults in HF_DEFAULTS.items():
        theirs = getattr(transformers, classes[family])(hidden_size=64, num_attention_heads=4)
        assert {k: getattr(theirs, k) for k in defaults} == defaults, family
    cfg = {"model_type": "qwen3_moe", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 96,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
           "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    m = load_recipe("tiny_zero0", ["model.preset=null", f"model.hf_path={tmp_path}"]).model
    assert (m.norm_topk_prob, m.rms_norm_eps, m.head_dim) == (False, 1e-6, 16)


def test_rope_scaling_in_the_older_type_spelling_is_trained_as_transformers_reads_it(tmp_path):
    """`rope_scaling: {"type": "linear", ...}` (configs before transformers 4.45) was dropped on the way into training
    until 2026-12-07: the run trained without the scaling, and the exported config named both kinds."""
    import torch
    import transformers

    from toolkit.model import to_hf_config

    cfg = {"model_type": "llama", "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64,
           "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "rope_theta": 100.0,
           "rope_scaling": {"type": "linear", "factor": 4.0}, "max_position_embeddings": 64}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    m = load_recipe("tiny_zero0", ["model.preset=null", f"model.hf_path={tmp_path}"]).model
    assert m.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    torch.manual_seed(0)
    theirs = transformers.LlamaForCausalLM(transformers.AutoConfig.from_pretrained(tmp_path))
    ours = transformers.LlamaForCausalLM(to_hf_config(m))
    ours.load_state_dict(theirs.state_dict())
    ids = torch.arange(40).unsqueeze(0)
    plain = transformers.LlamaForCausalLM(to_hf_config(m.model_copy(update={"rope_scaling": None})))
    plain.load_state_dict(theirs.state_dict())
    with torch.no_grad():
        want, got, unscaled = (x(ids).logits for x in (theirs, ours, plain))
    assert torch.equal(got, want) and not torch.allclose(unscaled, want)
