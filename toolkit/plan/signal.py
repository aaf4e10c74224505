"""How long before a Slurm time limit the preemption signal must come for a recipe's layout: two steps (the ranks
agree on a signal one or two step boundaries after it arrives: toolkit/train/preempt.py) and a checkpoint save, from
the planner's step time on H100s and an assumed checkpoint write speed. `toolkit slurm render` prints a note when its
--signal-seconds is shorter (a trial of 2026-12-07: the shipped 70B and 8B scripts signalled at 120 s, less than two
of their estimated steps, so a job would have reached its time limit without a checkpoint)."""
from __future__ import annotations

import math

from toolkit.errors import ToolkitError
from toolkit.metrics import checkpoint_bytes
from toolkit.plan.choice import from_recipe
from toolkit.plan.estimate import estimate
from toolkit.plan.hardware import Cluster
from toolkit.recipe import load_recipe
from toolkit.recipe.schema import Recipe

SAVE_GBPS_PER_NODE = 1.0
"""Assumed checkpoint write speed of one node, GB/s: a shared parallel file system under a whole job's writes. Fast
local NVMe does several times better; a busy network file system can do worse."""


def signal_seconds_needed(r: Recipe, nodes: int, gpus_per_node: int) -> tuple[float, float, int] | None:
    """(estimated step seconds, estimated save seconds, the --signal-seconds to render: 1.5 times two steps and a
    save, in whole minutes) of the recipe's own layout on nodes x gpus_per_node H100s; None when it has no
    estimate there."""
    try:
        step = estimate(r, from_recipe(r, nodes * gpus_per_node), Cluster(gpus=nodes * gpus_per_node,
                                                                           gpus_per_node=gpus_per_node)).step_s
    except ToolkitError:
        return None
    save = checkpoint_bytes(r) / nodes / (SAVE_GBPS_PER_NODE * 1e9)
    return step, save, 60 * math.ceil(1.5 * (2 * step + save) / 60)


def signal_note(recipe: str, overrides: list[str], nodes: int, gpus_per_node: int, signal_seconds: int) -> list[str]:
    """`toolkit slurm render`'s note when `signal_seconds` is shorter than signal_seconds_needed advises."""
    need = signal_seconds_needed(load_recipe(recipe, overrides), nodes, gpus_per_node)
    if not need or need[2] <= signal_seconds:
        return []
    return [f"note: --signal-seconds {signal_seconds} may be too short: two steps of about {need[0]:.0f} s (toolkit "
            f"plan, H100s) and a save of about {need[1]:.0f} s must fit before the time limit; render with "
            f"--signal-seconds {need[2]} (docs/slurm.md)"]
