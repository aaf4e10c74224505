"""The GPU fast paths docs/performance.md names are what the recipes render by default: checked as
data (the configs and the model the toolkit builds), since no GPU runs here."""
from __future__ import annotations

from toolkit.adapters.deepspeed import build_ds_config
from toolkit.adapters import megatron as mcfg
from toolkit.recipe import load_recipe, resolve


def test_deepspeed_on_gpus_uses_fused_adam_overlap_and_the_recipes_buckets():
    plan = resolve(load_recipe("llama7b_zero3"))
    cfg = build_ds_config(plan, "cuda")
    assert "torch_adam" not in cfg["optimizer"]["params"]  # DeepSpeed's FusedAdam on GPUs
    zero = cfg["zero_optimization"]
    assert zero["overlap_comm"] and zero["contiguous_gradients"]
    assert zero["reduce_bucket_size"] == 4096**2 and zero["stage3_prefetch_bucket_size"] == int(0.9 * 4096**2)
    assert build_ds_config(plan, "cpu")["optimizer"]["params"]["torch_adam"]  # the CPU rehearsal's equivalent


def test_megatron_on_gpus_fuses_kernels_and_overlaps_communication():
    plan = resolve(load_recipe("llama70b_tp8_pp4"))
    t = mcfg.to_transformer_config_kwargs(plan.recipe, plan.layout, on_gpu=True)
    assert t["bias_activation_fusion"] and t["masked_softmax_fusion"] and t["deallocate_pipeline_outputs"]
    ddp = mcfg.to_ddp_config_kwargs(plan.recipe, plan.layout)
    assert ddp["overlap_grad_reduce"] and ddp["overlap_param_gather"] and ddp["use_distributed_optimizer"]


def test_hugging_face_model_uses_sdpa_attention():
    """SDPA dispatches to the flash / memory-efficient kernels on GPUs (no s x s scores kept)."""
    from toolkit.model import build_model

    assert build_model(load_recipe("tiny_zero0").model, seed=1).config._attn_implementation == "sdpa"
