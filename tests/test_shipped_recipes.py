"""Every shipped recipe loads, validates for the world size it is written for, and renders; ds_configs/ matches
the recipes; and DeepSpeed's own config parser accepts every rendered file."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from toolkit.adapters.deepspeed import render_ds_json, shipped_deepspeed_recipes
from toolkit.cli import DS_CONFIG_DIR
from toolkit.recipe import list_recipes, load_recipe, resolve

RECIPES = list_recipes()
REAL = ["llama7b_zero3", "llama7b_zero2_offload", "llama13b_zero3_nvme", "llama3_8b_zero3", "llama70b_zero3_offload",
        "llama7b_tp2_pp2", "llama13b_tp4_pp2", "llama3_8b_tp2_cp2", "llama70b_tp8_pp4",
        "qwen2.5_7b_zero3", "qwen3_8b_tp2_pp2", "mistral_7b_tp2_pp2", "qwen3_30b_a3b_ep8_pp2"]
TINY = ["tiny_zero0", "tiny_zero1", "tiny_zero2", "tiny_zero3", "tiny_zero3_offload", "tiny_zero3_nvme",
        "tiny_tp2", "tiny_pp2", "tiny_tp2_pp2", "tiny_pp2_vpp2", "tiny_dp2_distopt",
        "tiny_mistral", "tiny_qwen2", "tiny_qwen3", "tiny_qwen3_moe"]


def test_the_promised_recipes_ship():
    assert set(REAL + TINY) <= set(RECIPES)


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_validates_for_its_world_size_and_describes_its_hardware(name):
    r = load_recipe(name)
    assert r.parallel.world_size, "a shipped recipe says how many ranks it is written for"
    assert r.description, "a shipped recipe says what it is for and what hardware it targets"
    plan = resolve(r)
    assert plan.layout.world_size == r.parallel.world_size
    assert plan.batch.global_batch == plan.batch.micro_batch * plan.batch.grad_accum * plan.layout.dp


@pytest.mark.parametrize("name", [n for n in RECIPES if n in REAL])
def test_real_recipe_header_names_target_hardware(name):
    from toolkit.recipe.loader import RECIPE_DIR

    header = (RECIPE_DIR / f"{name}.yaml").read_text().split("\nname:")[0]
    assert "Target:" in header and "GB" in header


@pytest.mark.parametrize("name", shipped_deepspeed_recipes())
def test_ds_config_file_matches_recipe(name):
    path = DS_CONFIG_DIR / f"{name}.json"
    assert path.is_file(), f"run `toolkit render ds-config --all` to write {path}"
    assert path.read_text() == render_ds_json(name), (
        f"{path} drifted from recipes/{name}.yaml; run `toolkit render ds-config --all` and commit the result")


def test_no_stray_ds_config_files():
    assert sorted(p.stem for p in DS_CONFIG_DIR.glob("*.json")) == sorted(shipped_deepspeed_recipes())


_DS_PARSE = r"""
import json, os, sys
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
import deepspeed
from deepspeed.runtime.config import DeepSpeedConfig
deepspeed.init_distributed(verbose=False)
class DataParallel:  # tells DeepSpeed the data-parallel size the file was rendered for
    def __init__(self, n): self.n = n
    def get_data_parallel_world_size(self): return self.n
for path, dp in json.loads(sys.argv[2]):
    cfg = DeepSpeedConfig(json.load(open(path)), mpu=DataParallel(dp))
    print("parsed", path, cfg.zero_optimization_stage, cfg.train_batch_size, flush=True)
"""


def test_deepspeed_accepts_every_rendered_config():
    from conftest import free_port

    jobs = [(str(DS_CONFIG_DIR / f"{n}.json"), resolve(load_recipe(n)).layout.dp) for n in shipped_deepspeed_recipes()]
    proc = subprocess.run([sys.executable, "-c", _DS_PARSE, str(free_port()), json.dumps(jobs)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    parsed = [line.split()[1] for line in proc.stdout.splitlines() if line.startswith("parsed ")]
    assert parsed == [path for path, _ in jobs]
