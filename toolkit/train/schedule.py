"""The learning-rate schedule: linear warm-up to the peak, then cosine/linear decay to min_lr at the last step."""
from __future__ import annotations

import math

from torch.optim.lr_scheduler import LambdaLR

from toolkit.recipe.schema import TrainingConfig


def lr_multiplier(step: int, warmup: int, total: int, decay: str, min_ratio: float) -> float:
    """Factor on the peak lr for optimizer step `step` (0-based): step 0 already trains (lr = peak/warmup)."""
    if step < warmup:
        return (step + 1) / warmup
    if decay == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - 1 - warmup))
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if decay == "cosine" else 1 - progress
    return min_ratio + (1 - min_ratio) * shape


def build_scheduler(optimizer, t: TrainingConfig):
    """A torch LambdaLR over `optimizer` (DeepSpeed steps it after each optimizer step and checkpoints it)."""

    s = t.schedule
    min_ratio = s.min_lr / t.optimizer.lr

    def factor(step: int) -> float:
        return lr_multiplier(step, s.warmup_steps, t.steps, s.decay, min_ratio)

    return LambdaLR(optimizer, factor)
