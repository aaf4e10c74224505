"""The Megatron adapter as plain data: recipe + layout -> Megatron-Core's configuration."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from toolkit.adapters import megatron as mcfg
from toolkit.recipe import load_recipe, resolve


def plan(recipe: str, *sets: str, world: int | None = None):
    return resolve(load_recipe(recipe, list(sets)), world)


def test_parallel_kwargs():
    p = plan("llama70b_tp8_pp4")
    assert mcfg.to_parallel_kwargs(p.layout) == {
        "tensor_model_parallel_size": 8, "pipeline_model_parallel_size": 4,
        "virtual_pipeline_model_parallel_size": 5, "context_parallel_size": 1, "order": "tp-cp-ep-dp-pp"}
    assert mcfg.to_parallel_kwargs(plan("tiny_tp2").layout)["virtual_pipeline_model_parallel_size"] is None


def test_transformer_config_is_the_llama_architecture():
    p = plan("llama3_8b_tp2_cp2")
    k = mcfg.to_transformer_config_kwargs(p.recipe, p.layout, on_gpu=True)
    assert (k["num_layers"], k["hidden_size"], k["ffn_hidden_size"]) == (32, 4096, 14336)
    assert (k["num_attention_heads"], k["num_query_groups"], k["kv_channels"]) == (32, 8, 128)
    assert k["normalization"] == "RMSNorm" and k["layernorm_epsilon"] == 1e-5
    assert k["gated_linear_unit"] and k["activation_func"] is F.silu
    assert not k["add_bias_linear"] and not k["add_qkv_bias"]
    assert k["bf16"] and k["params_dtype"] is torch.bfloat16 and k["sequence_parallel"]
    assert k["context_parallel_size"] == 2 and k["tensor_model_parallel_size"] == 2
    assert k["recompute_granularity"] == "full" and k["recompute_method"] == "uniform"
    cpu = mcfg.to_transformer_config_kwargs(p.recipe, p.layout, on_gpu=False)
    assert cpu["use_cpu_initialization"] and not cpu["bias_activation_fusion"] and not cpu["masked_softmax_fusion"]


def test_selective_recompute_and_none():
    p = plan("llama7b_tp2_pp2")
    assert mcfg.to_transformer_config_kwargs(p.recipe, p.layout, True)["recompute_granularity"] == "selective"
    p = plan("tiny_tp2")
    assert "recompute_granularity" not in mcfg.to_transformer_config_kwargs(p.recipe, p.layout, False)


def test_gpt_model_kwargs_pad_vocab_and_rope():
    p = plan("llama3_8b_tp2_cp2")
    k = mcfg.to_gpt_model_kwargs(p.recipe, p.layout)
    assert k["vocab_size"] == 128256  # already a multiple of 128 x 2
    assert k["rotary_base"] == 500000 and k["rope_scaling"] and k["rope_scaling_factor"] == 8.0
    assert k["position_embedding_type"] == "rope" and not k["share_embeddings_and_output_weights"]
    p = plan("tiny_tp2", "model.vocab_size=500")
    assert mcfg.to_gpt_model_kwargs(p.recipe, p.layout)["vocab_size"] == 512  # next multiple of 128 x tp 2
    assert mcfg.padded_vocab_size(32001, 2) == 32256


def test_zero1_intent_is_the_distributed_optimizer():
    p = plan("tiny_dp2_distopt")
    assert mcfg.to_optimizer_config_kwargs(p.recipe, p.layout)["use_distributed_optimizer"] is True
    ddp = mcfg.to_ddp_config_kwargs(p.recipe, p.layout)
    assert ddp["use_distributed_optimizer"] and ddp["overlap_param_gather"] and ddp["overlap_grad_reduce"]
    p = plan("tiny_tp2")
    assert not mcfg.to_optimizer_config_kwargs(p.recipe, p.layout)["use_distributed_optimizer"]
    assert not mcfg.to_ddp_config_kwargs(p.recipe, p.layout)["overlap_param_gather"]


def test_optimizer_config_carries_adamw_hyperparameters():
    p = plan("llama70b_tp8_pp4")
    k = mcfg.to_optimizer_config_kwargs(p.recipe, p.layout)
    assert (k["lr"], k["min_lr"], k["weight_decay"], k["adam_beta1"], k["adam_beta2"], k["adam_eps"]) == \
        (1.5e-4, 1.5e-5, 0.1, 0.9, 0.95, 1e-5)
    assert k["decoupled_weight_decay"] and k["clip_grad"] == 1.0 and k["bf16"]


def test_cp_needs_transformer_engine_but_sp_does_not():
    r = load_recipe("llama3_8b_tp2_cp2")
    (problem,) = mcfg.check_megatron(r, te_available=False)
    assert problem.key == "parallel.cp"
    assert problem.message.startswith("context parallelism needs Transformer Engine's attention on GPUs")
    assert "transformer-engine" in problem.fix
    assert mcfg.check_megatron(r, te_available=True) == []
    assert mcfg.check_megatron(load_recipe("llama13b_tp4_pp2"), te_available=False) == []  # SP: local spec


def test_unsupported_rope_scaling_is_refused():
    r = load_recipe("tiny_tp2", ["model.rope_scaling={rope_type: yarn, factor: 4.0}"])
    (problem,) = mcfg.check_megatron(r, te_available=False)
    assert problem.key == "model.rope_scaling" and "cannot be expressed in Megatron-Core" in problem.message


def test_transformer_engine_norm_names_map_to_local_spec_names():
    from toolkit.families.mapping import local_spec_name

    assert local_spec_name("decoder.layers.3.self_attention.linear_qkv.layer_norm_weight") == \
        "decoder.layers.3.input_layernorm.weight"
    assert local_spec_name("decoder.layers.0.mlp.linear_fc1.layer_norm_weight") == "decoder.layers.0.pre_mlp_layernorm.weight"
    assert local_spec_name("decoder.layers.0.mlp.linear_fc1.weight") == "decoder.layers.0.mlp.linear_fc1.weight"
