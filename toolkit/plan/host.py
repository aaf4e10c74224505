"""What a recipe's own layout keeps in each node's host memory (offloaded optimizer states and parameters, pinned
buffers), by the planner's estimate: `toolkit doctor --recipe` sets it against the node's memory (it printed no host
memory figure until 2026-12-07, so a ZeRO-Offload recipe needing 114 GiB per node was "ready" on a 24 GiB machine)."""
from __future__ import annotations

from toolkit.errors import ToolkitError
from toolkit.plan.choice import from_recipe
from toolkit.plan.estimate import estimate
from toolkit.plan.hardware import Cluster
from toolkit.recipe.schema import Recipe


def offload_host_bytes(r: Recipe, gpus_per_node: int) -> tuple[int | None, int]:
    """(bytes per node the recipe's layout holds in host memory, the ranks per node that estimate is for): its
    parallel.world_size ranks (one node's worth when it names none) at up to gpus_per_node per node. None where the
    layout does not resolve at that size."""
    world = r.parallel.world_size or gpus_per_node
    per_node = min(gpus_per_node, world)
    try:
        e = estimate(r, from_recipe(r, world), Cluster(gpus=world, gpus_per_node=per_node))
    except ToolkitError:
        return None, per_node
    return e.memory.cpu_per_node, per_node
