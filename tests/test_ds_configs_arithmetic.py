"""The shipped ds_configs/*.json are the adapter's own output copied back, so comparing them with a fresh render
(test_shipped_recipes.py) cannot catch a wrong rule. Here the values that matter are recomputed from the recipe
YAML alone (its `base:` chain merged by hand, nothing resolved by the toolkit) and public model shapes."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from toolkit.recipe.schema import DeepSpeedConfig

REPO = Path(__file__).resolve().parents[1]
FILES = sorted((REPO / "ds_configs").glob("*.json"))

# Published shapes (Hugging Face config.json of each model): hidden size, vocabulary, MLP width.
SHAPES = {"llama2-7b": (4096, 32000, 11008), "llama2-13b": (5120, 32000, 13824), "llama2-70b": (8192, 32000, 28672),
          "llama3-8b": (4096, 128256, 14336), "qwen2.5-7b": (3584, 152064, 18944), "tiny-4l": (128, 512, 352)}
# The DeepSpeed recipes for 7B-70B models; every one follows the hidden-size bucket rule below.
LARGE = ["llama13b_zero3_nvme", "llama3_8b_zero3", "llama70b_zero3_offload", "llama7b_zero2_offload", "llama7b_zero3",
         "qwen2.5_7b_zero3"]


def _merge(base: dict, top: dict) -> dict:
    out = dict(base)
    for k, v in top.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def raw_recipe(name: str) -> dict:
    data = yaml.safe_load((REPO / "recipes" / f"{name}.yaml").read_text())
    base = data.pop("base", None)
    return _merge(raw_recipe(base), data) if base else data


def knob(r: dict, key: str):
    """parallel.deepspeed.<key> as written in the recipe, else the documented default of the knob."""
    return r.get("parallel", {}).get("deepspeed", {}).get(key, DeepSpeedConfig.model_fields[key].default)


def test_every_shipped_ds_config_has_its_recipe():
    assert FILES and all((REPO / "recipes" / f"{f.stem}.yaml").is_file() for f in FILES)
    assert {f.stem for f in FILES} >= set(LARGE)


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_ds_config_values_match_arithmetic_on_the_recipe(path):
    cfg, r = json.loads(path.read_text()), raw_recipe(path.stem)
    t, p = r["training"], r["parallel"]
    assert p.get("backend", "deepspeed") == "deepspeed"

    # batch: DeepSpeed checks train_batch = micro x accumulation x dp; dp = world / (tp x pp x cp)
    dp = p["world_size"] // (p.get("tp", 1) * p.get("pp", 1) * p.get("cp", 1))
    global_batch, micro = t["global_batch_size"], t["micro_batch_size"]
    assert global_batch % (micro * dp) == 0
    assert cfg["train_batch_size"] == global_batch
    assert cfg["train_micro_batch_size_per_gpu"] == micro
    assert cfg["gradient_accumulation_steps"] == global_batch // (micro * dp)
    assert cfg["train_batch_size"] == cfg["train_micro_batch_size_per_gpu"] * cfg["gradient_accumulation_steps"] * dp
    assert cfg["gradient_clipping"] == t.get("grad_clip", 1.0)

    # optimizer (no scheduler block: the toolkit drives the schedule)
    o = t["optimizer"]
    assert cfg["optimizer"]["type"] == "AdamW" and "scheduler" not in cfg
    assert cfg["optimizer"]["params"] == {"lr": o["lr"], "betas": list(o["betas"]), "eps": o.get("eps", 1e-8),
                                          "weight_decay": o["weight_decay"]}

    # precision: exactly one of bf16/fp16, or neither for fp32
    precision = t.get("precision", "bf16")
    assert cfg["bf16"]["enabled"] is (precision == "bf16")
    assert cfg["fp16"]["enabled"] is (precision == "fp16")

    # ZeRO stage and its stage-specific keys
    z, stage = cfg["zero_optimization"], p.get("zero_stage", 0)
    assert z["stage"] == stage
    if stage == 0:
        assert z == {"stage": 0}
        return
    assert z["reduce_bucket_size"] == knob(r, "reduce_bucket_size")
    assert (z["overlap_comm"], z["contiguous_gradients"]) == (knob(r, "overlap_comm"), knob(r, "contiguous_gradients"))
    if stage < 3:
        assert z["allgather_bucket_size"] == knob(r, "allgather_bucket_size") and z["reduce_scatter"] is True
        assert not any(k.startswith("stage3_") for k in z)
    else:
        assert "allgather_bucket_size" not in z
        for key in ("stage3_prefetch_bucket_size", "stage3_param_persistence_threshold", "stage3_max_live_parameters",
                    "stage3_max_reuse_distance"):
            assert z[key] == knob(r, key), key
        assert z["stage3_gather_16bit_weights_on_model_save"] is knob(r, "gather_16bit_weights_on_save")

    # offload: devices, pinned memory (the files are rendered for GPUs), NVMe paths and buffers, aio
    opt_dev, param_dev = p.get("offload_optimizer", "none"), p.get("offload_params", "none")
    for section, dev in (("offload_optimizer", opt_dev), ("offload_param", param_dev)):
        if dev == "none":
            assert section not in z
            continue
        expected = {"device": dev, "pin_memory": knob(r, "pin_memory")}
        if dev == "nvme" and section == "offload_optimizer":
            expected.update(nvme_path=p["nvme_path"], buffer_count=knob(r, "buffer_count"))
        elif dev == "nvme":
            expected.update(nvme_path=p["nvme_path"], buffer_count=knob(r, "param_buffer_count"),
                            buffer_size=knob(r, "param_buffer_size"))
            # DeepSpeed swaps whole tensors through these buffers: one must hold the largest parameter
            hidden, vocab, ffn = SHAPES[r["model"]["preset"]]
            assert z[section]["buffer_size"] >= max(vocab * hidden, ffn * hidden)
        assert z[section] == expected, section
    assert ("aio" in cfg) is ("nvme" in (opt_dev, param_dev))
    if "aio" in cfg:
        assert (cfg["aio"]["block_size"], cfg["aio"]["queue_depth"], cfg["aio"]["intra_op_parallelism"]) == \
            (knob(r, "aio_block_size"), knob(r, "aio_queue_depth"), knob(r, "aio_intra_op_parallelism"))


@pytest.mark.parametrize("name", LARGE)
def test_large_deepspeed_recipes_size_buckets_from_hidden(name):
    """The rule Hugging Face's "auto" applies: reduce bucket = hidden², and for ZeRO-3 prefetch bucket =
    int(0.9 x hidden²) and persistence threshold = 10 x hidden (every stage has a reduce bucket)."""
    r, z = raw_recipe(name), json.loads((REPO / "ds_configs" / f"{name}.json").read_text())["zero_optimization"]
    hidden = SHAPES[r["model"]["preset"]][0]
    assert z["reduce_bucket_size"] == hidden * hidden
    if z["stage"] == 3:
        assert z["stage3_prefetch_bucket_size"] == int(0.9 * hidden * hidden)
        assert z["stage3_param_persistence_threshold"] == 10 * hidden


def test_large_list_is_every_large_deepspeed_recipe():
    from toolkit.adapters.deepspeed import shipped_deepspeed_recipes

    large = [n for n in shipped_deepspeed_recipes() if not raw_recipe(n)["model"]["preset"].startswith("tiny")]
    assert sorted(large) == sorted(LARGE)
