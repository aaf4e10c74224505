"""Exact resume: N steps in one go equal N/2 steps, a restart from the checkpoint, and N/2 more."""
from __future__ import annotations

import json

import pytest

from conftest import launch, read_metrics
from reference import assert_blend_val_loss

STEPS = 8
COMMON = [f"training.steps={STEPS}", "training.schedule.warmup_steps=2", "logging.interval=1",
          "checkpoint.interval=1000"]


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["blend", "tiny_zero3"])
def test_resume_reproduces_uninterrupted_run(recipe, uninterrupted, tmp_path, request):
    if recipe == "blend":  # ZeRO-2 (tiny_zero2) on the tiny model, reading a 0.7/0.3 data.blend of prepared data
        recipe = request.getfixturevalue("prepared_blend")["recipe"]
    straight = uninterrupted(recipe, STEPS)

    launch(recipe, [*COMMON, "training.stop_at_step=4"], nproc=2, out_dir=tmp_path / "split")
    ckpt = tmp_path / "split" / "checkpoints"
    assert (ckpt / "latest_complete").read_text() == "step_00000004"
    meta = json.loads((ckpt / "step_00000004" / "toolkit_meta.json").read_text())
    assert meta["step"] == 4 and meta["layout"]["world_size"] == 2
    proc = launch(recipe, COMMON, nproc=2, out_dir=tmp_path / "split")
    assert "resumed from" in proc.stdout and "step 4" in proc.stdout
    assert ("from a blend of 2 prepared datasets" in proc.stdout) == recipe.endswith("_blend.yaml")
    split = read_metrics(tmp_path / "split")

    assert [m["step"] for m in split] == list(range(1, STEPS + 1))
    # bit-identical on CPU: same layout, same data position, same RNG, optimizer and scheduler state
    assert [m["loss"] for m in split] == [m["loss"] for m in straight]
    assert [m["lr"] for m in split] == [m["lr"] for m in straight]
    if recipe.endswith("_blend.yaml"):  # eval.split 0.1 of each source's documents, one global batch every 4 steps
        assert "eval: every 4 steps and at the end, 16 of 16 held-out sequences (eval.split 0.1)" in proc.stdout
        assert_blend_val_loss(recipe, tmp_path / "split", COMMON, split, straight, [4, 8])
