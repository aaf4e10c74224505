"""GPU-only checks (marked `gpu`). On a machine without CUDA they are deselected, not skipped as passes; on a GPU
machine with at least 2 GPUs and transformer-engine installed, run them with

    python -m pytest -m gpu tests/test_gpu.py -q
"""
from __future__ import annotations

import pytest

from conftest import launch, read_metrics

pytestmark = pytest.mark.gpu
COMMON = ["training.steps=20", "training.schedule.warmup_steps=5", "logging.interval=5", "checkpoint.interval=1000"]


def _falls(out) -> None:
    losses = [m["loss"] for m in read_metrics(out)]
    assert losses[-1] < losses[0] - 0.5, losses


def test_deepspeed_zero3_bf16_on_two_gpus(tmp_path):
    launch("tiny_zero3", [*COMMON, "training.precision=bf16"], nproc=2, out_dir=tmp_path / "run")
    _falls(tmp_path / "run")
    assert read_metrics(tmp_path / "run")[-1]["mfu"] is not None  # a known GPU has a bf16 peak


def test_megatron_transformer_engine_tp2_with_sequence_parallel(tmp_path):
    launch("tiny_tp2", [*COMMON, "training.precision=bf16", "parallel.sp=true",
                        "parallel.megatron.transformer_impl=transformer_engine"], nproc=2, out_dir=tmp_path / "run")
    _falls(tmp_path / "run")


def test_megatron_context_parallel_2(tmp_path):
    launch("tiny_dp2_distopt", [*COMMON, "training.precision=bf16", "parallel.cp=2", "parallel.zero_stage=0",
                                "training.global_batch_size=8", "training.micro_batch_size=8"],
           nproc=2, out_dir=tmp_path / "run")
    _falls(tmp_path / "run")
