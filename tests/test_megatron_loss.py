"""The Megatron loss under context parallelism, composed with what Megatron-Core's own schedule does to it: the
gradient the data-parallel x CP reduction averages must be that of the whole sequence's mean loss. In one process:
the CP group is simulated by splitting a sequence's token losses in two and summing the all-reduced totals."""
from __future__ import annotations

import pytest
import torch
from megatron.core import parallel_state as ps
from megatron.core.pipeline_parallel import schedules

from toolkit.megatron import runtime

CP = 2


class _Config:
    calculate_per_token_loss = False
    timers = None
    num_moe_experts = None
    mtp_num_layers = None


def test_cp_ranks_losses_average_to_the_sequence_mean(monkeypatch):
    torch.manual_seed(0)
    token_losses = torch.rand(1, 16, requires_grad=True)
    mask = torch.ones(1, 16)
    mask[0, 5] = mask[0, 11] = 0
    halves = [slice(0, 8), slice(8, 16)]
    totals = torch.stack([(token_losses.detach() * mask).sum(), mask.sum()])  # what the CP all-reduce yields
    monkeypatch.setattr(ps, "get_context_parallel_world_size", lambda: CP)
    monkeypatch.setattr(ps, "get_context_parallel_group", lambda: None)
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda t, group=None: t.copy_(totals))
    per_rank = []
    for half in halves:
        def loss_func(output, half=half):
            return runtime._loss(mask[:, half], output)
        store: list = []
        out, _ = schedules.forward_step_calc_loss(None, token_losses[:, half], loss_func, _Config(), None, False, 1,
                                                  store, cp_group_size=CP, is_last_stage=True)
        per_rank.append(out)
        assert store[0]["loss"].item() == pytest.approx((totals[0] / totals[1]).item())  # the logged value
    averaged = sum(per_rank) / CP  # the gradient reduction's average over the CP ranks
    want = (token_losses * mask).sum() / mask.sum()
    assert averaged.item() == pytest.approx(want.item(), rel=1e-6)  # a second factor of cp would double it
