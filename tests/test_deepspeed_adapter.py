"""The DeepSpeed adapter as plain data: recipe + layout in, DeepSpeed JSON out; a user's own JSON merged over it."""
from __future__ import annotations

import json

import pytest

from toolkit.adapters.deepspeed import build_ds_config, merge_user_config, to_ds_config
from toolkit.errors import RecipeError
from toolkit.recipe import load_recipe, resolve


def ds(recipe: str, *sets: str, device: str = "cuda", world: int | None = None) -> dict:
    return to_ds_config(resolve(load_recipe(recipe, list(sets)), world), device)


def test_batch_fields_follow_the_derived_arithmetic():
    cfg = ds("llama7b_zero3", world=64)
    assert (cfg["train_batch_size"], cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"]) == \
        (512, 1, 8)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_sections_per_stage(stage):
    z = ds("tiny_zero0", f"parallel.zero_stage={stage}")["zero_optimization"]
    assert z["stage"] == stage
    if stage == 0:
        assert z == {"stage": 0}
    elif stage < 3:
        assert z["allgather_bucket_size"] == 500_000_000 and z["overlap_comm"] and z["reduce_scatter"]
        assert not any(k.startswith("stage3_") for k in z)
    else:
        assert z["stage3_prefetch_bucket_size"] == 50_000_000
        assert z["stage3_param_persistence_threshold"] == 100_000
        assert z["stage3_max_live_parameters"] == 1_000_000_000
        assert z["stage3_gather_16bit_weights_on_model_save"] is True
        assert "allgather_bucket_size" not in z


def test_cpu_offload_pins_memory_only_on_gpus():
    gpu = ds("tiny_zero3_offload")["zero_optimization"]
    cpu = ds("tiny_zero3_offload", device="cpu")["zero_optimization"]
    assert gpu["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert gpu["offload_param"] == {"device": "cpu", "pin_memory": True}
    assert cpu["offload_optimizer"]["pin_memory"] is False


def test_nvme_offload_has_paths_buffers_and_aio():
    cfg = ds("llama13b_zero3_nvme")
    z = cfg["zero_optimization"]
    assert z["offload_optimizer"] == {"device": "nvme", "pin_memory": True, "nvme_path": "/local_nvme/ds_offload",
                                      "buffer_count": 5}
    assert z["offload_param"]["buffer_size"] == 200_000_000 and z["offload_param"]["nvme_path"]
    assert cfg["aio"] == {"block_size": 1048576, "queue_depth": 16, "intra_op_parallelism": 2,
                          "single_submit": False, "overlap_events": True}
    assert "aio" not in ds("tiny_zero3_offload")


@pytest.mark.parametrize("precision", ["bf16", "fp16", "fp32"])
def test_precision_sections(precision):
    cfg = ds("tiny_zero0", f"training.precision={precision}")
    assert cfg["bf16"]["enabled"] is (precision == "bf16")
    assert cfg["fp16"]["enabled"] is (precision == "fp16")
    if precision == "fp16":
        assert cfg["fp16"]["loss_scale"] == 0 and cfg["fp16"]["initial_scale_power"] == 16


def test_optimizer_and_clipping():
    cfg = ds("llama7b_zero3")
    assert cfg["optimizer"] == {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-5,
                                                            "weight_decay": 0.1}}
    assert cfg["gradient_clipping"] == 1.0 and "scheduler" not in cfg
    # on CPU without optimizer offload, torch's AdamW replaces the GPU-only fused kernel
    assert ds("tiny_zero0", device="cpu")["optimizer"]["params"]["torch_adam"] is True
    assert "torch_adam" not in ds("tiny_zero3_offload", device="cpu")["optimizer"]["params"]


def test_user_json_auto_values_are_filled_and_tuning_kept():
    ours = ds("llama7b_zero3", world=32)
    user = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "zero_optimization": {"stage": 3, "overlap_comm": "auto", "sub_group_size": 1e9},
            "bf16": {"enabled": "auto"}, "flops_profiler": {"enabled": True}}
    merged, problems = merge_user_config(user, ours)
    assert problems == []
    assert merged["train_batch_size"] == 512 and merged["gradient_accumulation_steps"] == 16
    assert merged["zero_optimization"]["overlap_comm"] is True
    assert merged["zero_optimization"]["sub_group_size"] == 1e9       # the user's own tuning stays
    assert merged["flops_profiler"] == {"enabled": True}
    assert merged["optimizer"] == ours["optimizer"]                    # what the user left out comes from the recipe


def test_user_json_conflicts_are_all_reported_with_fixes():
    ours = ds("llama7b_zero3", world=32)
    user = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
            "fp16": {"enabled": True}, "bf16": {"enabled": True}, "optimizer": {"type": "Lamb", "params": {"lr": 0.1}},
            "scheduler": {"type": "WarmupLR"}}
    _, problems = merge_user_config(user, ours, source="mine.json")
    lines = [f"{p.key}: {p.message}" for p in problems]
    assert "mine.json: train_micro_batch_size_per_gpu: 4 contradicts the recipe, which gives 1 (from " \
           "training.micro_batch_size)" in lines
    assert "mine.json: zero_optimization.stage: 2 contradicts the recipe, which gives 3 (from parallel.zero_stage)" \
        in lines
    assert "mine.json: zero_optimization.offload_optimizer.device: 'cpu' contradicts the recipe, which gives " \
           "nothing (not enabled) (from parallel.offload_optimizer)" in lines
    assert "mine.json: fp16.enabled: True contradicts the recipe, which gives False (from training.precision)" in lines
    assert "mine.json: bf16/fp16: both bf16.enabled and fp16.enabled are true" in lines
    assert "mine.json: optimizer.params.lr: 0.1 contradicts the recipe, which gives 0.0003 (from " \
           "training.optimizer.lr)" in lines
    assert any(line.startswith("mine.json: scheduler:") for line in lines)
    assert "mine.json: optimizer.type: 'Lamb', but the recipe's optimizer is adamw" in lines
    assert all('"auto"' in p.fix or "recipe" in p.fix or "enable one" in p.fix for p in problems)


def test_user_json_from_recipe_raises_once_with_every_problem(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 3, "gradient_clipping": 5.0}))
    plan = resolve(load_recipe("tiny_zero3", [f"parallel.deepspeed.config={path}"]))
    with pytest.raises(RecipeError) as err:
        build_ds_config(plan)
    assert len(err.value.problems) == 2


def test_validate_checks_the_user_json_as_training_does(tmp_path, capsys):
    """`toolkit validate` said "ok" for a user JSON that training then refused, or that did not exist (trial K,
    2026-12-08): it never read the file."""
    from toolkit import cli

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 3, "gradient_clipping": 5.0}))
    for config, phrase in ((path, "ds.json: train_batch_size: 3 contradicts the recipe"),
                           (tmp_path / "none.json", "parallel.deepspeed.config: cannot read")):
        assert cli.main(["validate", "--recipe", "tiny_zero3", "--set", f"parallel.deepspeed.config={config}"]) == 2
        out, err = capsys.readouterr()
        assert "ok:" not in out and phrase in err
    path.write_text(json.dumps({"train_batch_size": "auto", "wall_clock_breakdown": True}))
    assert cli.main(["validate", "--recipe", "tiny_zero3", "--set", f"parallel.deepspeed.config={path}"]) == 0


def test_user_json_unreadable(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text("{not json")
    plan = resolve(load_recipe("tiny_zero3", [f"parallel.deepspeed.config={path}"]))
    with pytest.raises(RecipeError, match="cannot read"):
        build_ds_config(plan)


def test_nvme_buffer_counts_are_each_sections_own():
    z = ds("tiny_zero3_nvme", "parallel.deepspeed.buffer_count=3", "parallel.deepspeed.param_buffer_count=7",
           "parallel.deepspeed.param_buffer_size=2000000")["zero_optimization"]
    assert z["offload_optimizer"]["buffer_count"] == 3
    assert z["offload_param"]["buffer_count"] == 7 and z["offload_param"]["buffer_size"] == 2_000_000
    assert "buffer_size" not in z["offload_optimizer"]


@pytest.mark.parametrize("optimizer", ["none", "cpu", "nvme"])
def test_aio_is_rendered_whenever_anything_goes_to_nvme(optimizer):
    cfg = ds("tiny_zero3", "parallel.offload_params=nvme", f"parallel.offload_optimizer={optimizer}",
             "parallel.nvme_path=/local_nvme/x", "parallel.deepspeed.aio_queue_depth=32")
    assert cfg["zero_optimization"]["offload_param"]["device"] == "nvme"
    assert cfg["aio"]["queue_depth"] == 32
    # and only then: optimizer on NVMe with parameters on CPU also needs it, CPU-only offload does not
    assert "aio" in ds("tiny_zero3", "parallel.offload_optimizer=nvme", "parallel.offload_params=cpu",
                       "parallel.nvme_path=/local_nvme/x")
    assert "aio" not in ds("tiny_zero3", f"parallel.offload_optimizer={'cpu' if optimizer == 'nvme' else optimizer}",
                           "parallel.offload_params=cpu")


@pytest.mark.parametrize("recipe", ["tiny_zero3_offload", "tiny_zero3_nvme"])
@pytest.mark.parametrize("pin", [True, False])
def test_pin_memory_rule_holds_for_both_offload_sections(recipe, pin):
    """pin_memory = parallel.deepspeed.pin_memory on GPUs, always False on CPU, for optimizer and parameters."""
    for device in ("cuda", "cpu"):
        z = ds(recipe, f"parallel.deepspeed.pin_memory={str(pin).lower()}", device=device)["zero_optimization"]
        expected = pin and device == "cuda"
        assert z["offload_optimizer"]["pin_memory"] is expected, (device, pin)
        assert z["offload_param"]["pin_memory"] is expected, (device, pin)


@pytest.mark.parametrize("gather", [True, False])
def test_gather_16bit_weights_on_save_follows_the_recipe(gather):
    z = ds("tiny_zero3", f"parallel.deepspeed.gather_16bit_weights_on_save={str(gather).lower()}")
    assert z["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is gather
    assert "stage3_gather_16bit_weights_on_model_save" not in ds(
        "tiny_zero2", f"parallel.deepspeed.gather_16bit_weights_on_save={str(gather).lower()}")["zero_optimization"]
