"""Per-rank micro-batches from a map-style dataset, step by step, with a resumable position.

A DistributedSampler (reseeded each epoch with set_epoch) hands each data-parallel rank a disjoint slice, so one
optimizer step over all ranks sees the same sequences as a single process with the same global batch. The stream's
position (epoch, micro-batches consumed) is saved with each checkpoint so a resumed run continues with exactly the
next batch. Data that comes shuffled already (a Megatron-Core blend) is read in order instead (shuffle=False).
"""
from __future__ import annotations

from torch.utils.data import DataLoader, DistributedSampler

from toolkit.errors import ToolkitError


def check_fills_a_step(sequences: int, micro_batch: int, grad_accum: int, dp: int) -> None:
    """Each data-parallel rank gets sequences // dp of them (the sampler drops the tail); one step needs
    micro_batch x grad_accum per rank."""
    if sequences // dp < micro_batch * grad_accum:
        raise ToolkitError(f"data: {sequences} sequences cannot fill one step of global batch "
                           f"{micro_batch * grad_accum * dp}; add data or shrink the batch")


class DataStream:
    """Per-rank micro-batches, step by step, across epochs, with a resumable position."""

    def __init__(self, dataset, micro_batch: int, grad_accum: int, dp: int, dp_rank: int, seed: int,
                 num_workers: int = 0, shuffle: bool = True):
        self.dataset, self.micro, self.accum, self.num_workers = dataset, micro_batch, grad_accum, num_workers
        self.shuffle, self.dp, self.dp_rank = shuffle, dp, dp_rank
        self.sampler = DistributedSampler(dataset, num_replicas=dp, rank=dp_rank, shuffle=shuffle, seed=seed,
                                          drop_last=True)
        check_fills_a_step(len(dataset), micro_batch, grad_accum, dp)
        self.steps_per_epoch = len(self.sampler) // (micro_batch * grad_accum)
        self.epoch, self.consumed = 0, 0  # consumed = micro-batches of this epoch already handed out
        self._it = None

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "consumed_micro_batches": self.consumed}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.consumed = int(state["epoch"]), int(state["consumed_micro_batches"])
        self._it = None

    def _start_epoch(self):
        self.sampler.set_epoch(self.epoch)
        usable = self.steps_per_epoch * self.accum * self.micro  # drop the tail that cannot fill a whole step
        if self.shuffle:
            indices = list(self.sampler)[:usable][self.consumed * self.micro:]
        else:  # already shuffled (a Megatron-Core blend): every dp-th sample, lazily, however many there are
            indices = range(self.dp_rank, len(self.sampler) * self.dp, self.dp)[:usable][self.consumed * self.micro:]
        loader = DataLoader(self.dataset, batch_size=self.micro, sampler=indices, num_workers=self.num_workers)
        self._it = iter(loader)

    def next_step(self) -> list[dict]:
        """The grad_accum micro-batches of the next optimizer step (starting a new epoch when needed)."""
        if self.consumed >= self.steps_per_epoch * self.accum:
            self.epoch, self.consumed, self._it = self.epoch + 1, 0, None
        if self._it is None:
            self._start_epoch()
        batches = [next(self._it) for _ in range(self.accum)]
        self.consumed += self.accum
        return batches
