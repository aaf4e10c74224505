"""The small values the planner's pieces hand each other: bytes of model state on one rank, and where they live."""
from __future__ import annotations

from dataclasses import dataclass, field

GPU, CPU, NVME = "gpu", "cpu", "nvme"
KINDS = ("weights", "grads", "master", "moments")


@dataclass(frozen=True)
class StateBytes:
    """Model states one rank holds, in bytes, as the framework allocates them (padding included).

    weights: the parameters the forward reads (16-bit in mixed precision; under ZeRO-3 only the rank's partition).
    grads: gradient storage the framework keeps between backward and the optimizer step.
    master: fp32 master weights (0 in fp32 training, where the weights are the masters).
    moments: Adam's exp_avg + exp_avg_sq.
    placement: for each of the four kinds, "gpu", "cpu" or "nvme".
    notes: the rules that produced the numbers (partitioning, padding, buffer dtypes), one line each.
    """

    weights: int
    grads: int
    master: int
    moments: int
    placement: dict[str, str] = field(default_factory=lambda: dict.fromkeys(KINDS, GPU))
    notes: tuple[str, ...] = ()

    def on(self, where: str) -> int:
        """Bytes of the four kinds that live on `where`."""
        return sum(getattr(self, k) for k in KINDS if self.placement.get(k, GPU) == where)

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.master + self.moments
