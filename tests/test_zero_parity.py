"""Every DeepSpeed mode on 2 real CPU ranks reproduces a single-process PyTorch run, step by step.

The reference is a plain PyTorch loop (no DeepSpeed) over the same initial weights (one HF checkpoint), the same
global batch (16 sequences: 2 ranks x micro 8 in the distributed runs, 2 micro-batches of 8 accumulated here)
and the same AdamW + schedule + clipping. fp32 throughout.
"""
from __future__ import annotations

import math

import pytest

from conftest import launch, read_metrics
from reference import assert_val_losses_match, reference_losses

STEPS = 6
# fp32 on CPU: reduction order differs between 1 and 2 ranks (and DeepSpeed's CPU Adam vs torch's AdamW for
# offload), so losses agree to ~1e-7 relative, not bit for bit. 5e-6 is far below a wrong batch or lr (>1e-2).
RTOL = 5e-6
SCHEDULE = ["training.schedule.warmup_steps=2", "training.schedule.min_lr=1e-4"]  # warm-up, then cosine decay
# Validation loss on in the layout runs and the reference: 5% of the sequences held out, one global batch of them
# evaluated every 2 steps and at the end (compared at the same tolerance as the training loss).
EVAL = ["eval.interval=2", "eval.split=0.05", "eval.batches=1"]


@pytest.fixture(scope="module")
def reference(tiny_hf_checkpoint):
    """(training losses, validation loss by step) of the single-process reference."""
    evals: dict[int, float] = {}
    return reference_losses(tiny_hf_checkpoint, STEPS, [*SCHEDULE, *EVAL], evals=evals), evals


@pytest.mark.slow
@pytest.mark.parametrize("recipe,extra", [
    ("tiny_zero0", []), ("tiny_zero1", []), ("tiny_zero2", []), ("tiny_zero3_offload", []),
    ("tiny_zero3_nvme", []), ("tiny_zero3", ["training.activation_checkpointing=full"]),
], ids=["zero0", "zero1", "zero2", "zero3_offload", "zero3_nvme", "zero3_recompute"])
def test_two_ranks_match_single_process(recipe, extra, reference, tiny_hf_checkpoint, tmp_path):
    reference, ref_evals = reference
    (tmp_path / "nvme").mkdir()  # a run checks its NVMe folder exists before it starts
    overrides = [*extra, "model.preset=null", f"model.hf_path={tiny_hf_checkpoint}", "model.pretrained=true",
                 f"training.steps={STEPS}", *SCHEDULE, *EVAL, "logging.interval=1", "checkpoint.interval=1000",
                 f"parallel.nvme_path={tmp_path / 'nvme'}"]
    if recipe == "tiny_zero0":
        overrides.append("parallel.nvme_path=null")
    launch(recipe, overrides, nproc=2, out_dir=tmp_path / "run")
    records = read_metrics(tmp_path / "run")
    got = [m["loss"] for m in records]
    assert len(got) == STEPS
    assert reference[-1] < reference[0] - 0.05, "the reference must actually learn for the comparison to mean much"
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, reference))
    print(f"{recipe}: max relative loss difference to single process over {STEPS} steps: {worst:.2e}")
    for step, (a, b) in enumerate(zip(got, reference), 1):
        assert math.isclose(a, b, rel_tol=RTOL), f"{recipe} step {step}: loss {a} vs single-process {b}\n{got}\n{reference}"
    assert_val_losses_match(records, ref_evals, RTOL, recipe)


@pytest.mark.slow
def test_random_init_is_the_same_at_every_zero_stage(tmp_path):
    """Plain ZeRO-3 on 2 ranks, from no pretrained weights: built under zero.Init and initialised per gathered
    module, it starts from the same weights as a plain single-process model built from the same seed, and trains
    step by step like it (pretrained ZeRO-3 is the offload, NVMe and recompute cases above, which also compare
    the validation loss)."""
    from transformers import AutoTokenizer

    from toolkit.model import build_model
    from toolkit.recipe import load_recipe

    r = load_recipe("tiny_zero0", ["model.preset=tiny"])
    folder = tmp_path / "seeded"
    build_model(r.model, r.training.seed, AutoTokenizer.from_pretrained(r.data.tokenizer)).save_pretrained(folder)
    expected = reference_losses(folder, STEPS, SCHEDULE)
    launch("tiny_zero3", ["model.preset=tiny", f"training.steps={STEPS}", *SCHEDULE, "logging.interval=1",
                          "checkpoint.interval=1000"], nproc=2, out_dir=tmp_path / "run")
    got = [m["loss"] for m in read_metrics(tmp_path / "run")]
    for step, (a, b) in enumerate(zip(got, expected), 1):
        assert math.isclose(a, b, rel_tol=RTOL), f"step {step}: ZeRO-3 random init {a} vs single process {b}"
