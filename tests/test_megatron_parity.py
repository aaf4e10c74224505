"""Megatron-Core layouts on CPU (gloo, real processes) reproduce the single-process reference.

Every layout loads the same Hugging Face checkpoint through the shared mapping rules (toolkit.checkpoint), so
the initial weights are identical. Two checks:
- logits of one forward pass at TP2, PP2, TP2xPP2, PP2xVPP2 equal Megatron's own TP1xPP1 model and Hugging
  Face's LlamaForCausalLM (this pins RoPE, GQA, SwiGLU, RMSNorm epsilon and the weight mapping);
- the loss of 4 training steps at TP2, PP2 (1F1B), TP2xPP2, PP2xVPP2 (interleaved), DP2 with the distributed
  optimizer, TP2 + sequence parallel, and TP2xPP2 + SP + full recomputation equals the plain PyTorch loop of
  tests/reference.py (same global batch, AdamW, schedule, clipping).
"""
from __future__ import annotations

import math

import pytest
import torch

from conftest import PARITY_LAYOUTS, launch, read_metrics
from reference import assert_val_losses_match, reference_losses

STEPS = 4
SCHEDULE = ["training.schedule.warmup_steps=2", "training.schedule.min_lr=1e-4"]
# Validation loss on in the layout runs and the reference: 5% of the sequences held out, one global batch of them
# evaluated every 2 steps and at the end (compared at the same tolerance as the training loss).
EVAL = ["eval.interval=2", "eval.split=0.05", "eval.batches=1"]
LOGITS_ATOL = 1e-5   # fp32: measured differences are ~2e-7 on logits of magnitude ~1
LOSS_RTOL = 5e-6     # fp32: reduction order differs between layouts; a wrong lr or batch moves it by >1e-2


@pytest.fixture(scope="module")
def megatron_tp1(megatron_logits):
    return megatron_logits(1, 1, 1)["tiny4l"]


@pytest.mark.slow
def test_megatron_tp1_matches_hugging_face(megatron_tp1, tiny4l_hf_checkpoint):
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(tiny4l_hf_checkpoint, dtype=torch.float32)
    ids = megatron_tp1["ids"]
    with torch.no_grad():
        ref = hf(ids).logits
    assert (megatron_tp1["logits"] - ref).abs().max().item() < LOGITS_ATOL


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp,vpp", PARITY_LAYOUTS[1:])
def test_layout_logits_match_single_process(tp, pp, vpp, megatron_tp1, megatron_logits):
    got = megatron_logits(tp, pp, vpp)["tiny4l"]
    assert torch.equal(got["ids"], megatron_tp1["ids"])
    diff = (got["logits"] - megatron_tp1["logits"]).abs().max().item()
    print(f"tp{tp} pp{pp} vpp{vpp}: max |logit difference| to Megatron TP1xPP1: {diff:.2e}")
    assert diff < LOGITS_ATOL


@pytest.fixture(scope="module")
def reference(tiny4l_hf_checkpoint):
    """(training losses, validation loss by step) of the single-process reference."""
    evals: dict[int, float] = {}
    return reference_losses(tiny4l_hf_checkpoint, STEPS, [*SCHEDULE, *EVAL], evals=evals), evals


@pytest.mark.slow
@pytest.mark.parametrize("recipe,nproc,extra", [
    ("tiny_tp2", 2, []), ("tiny_pp2", 2, []), ("tiny_tp2_pp2", 4, []), ("tiny_pp2_vpp2", 2, []),
    ("tiny_dp2_distopt", 2, []), ("tiny_tp2", 2, ["parallel.sp=true"]),
    ("tiny_tp2_pp2", 4, ["parallel.sp=true", "training.activation_checkpointing=full"]),
    ("tiny_tp2", 2, ["training.activation_checkpointing=selective"]),
    ("tiny_tp2", 1, ["parallel.tp=1", "parallel.world_size=1"]),
], ids=["tp2", "pp2", "tp2_pp2", "pp2_vpp2", "dp2_distopt", "tp2_sp", "tp2_pp2_sp_recompute", "tp2_selective",
        "megatron_single_process"])
def test_layout_training_matches_single_process(recipe, nproc, extra, reference, tiny4l_hf_checkpoint, tmp_path):
    reference, ref_evals = reference
    launch(recipe, ["model.preset=null", f"model.hf_path={tiny4l_hf_checkpoint}", "model.pretrained=true",
                    f"training.steps={STEPS}", *SCHEDULE, *EVAL, "logging.interval=1", "checkpoint.interval=1000",
                    *extra], nproc=nproc, out_dir=tmp_path / "run")
    records = read_metrics(tmp_path / "run")
    got = [m["loss"] for m in records]
    assert len(got) == STEPS and reference[-1] < reference[0] - 0.05
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, reference))
    print(f"{recipe}: max relative loss difference to single process over {STEPS} steps: {worst:.2e}")
    for step, (a, b) in enumerate(zip(got, reference), 1):
        assert math.isclose(a, b, rel_tol=LOSS_RTOL), f"{recipe} step {step}: {a} vs {b}\n{got}\n{reference}"
    assert_val_losses_match(records, ref_evals, LOSS_RTOL, recipe)
