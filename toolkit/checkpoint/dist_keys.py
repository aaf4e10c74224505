"""Megatron-Core's sharded keys in a `torch_dist` checkpoint (toolkit/checkpoint/torch_dist.py), without torch: which
key and index a toolkit parameter name has there, which keys are optimizer state, and Megatron's names of the
optimizer's fields."""
from __future__ import annotations

import re

LAYERS = "decoder.layers."
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.*)$")
FIELDS = {"param": "master", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}
SAVED_AS = {v: k for k, v in FIELDS.items()}
"""Our optimizer field -> Megatron's name for it (the distributed optimizer's)."""


def sharded_name(local_name: str) -> tuple[str, tuple[int, ...]]:
    """(local-spec name without its layer and expert indices, those indices) of a toolkit name at pp = vpp = ep = 1:
    a layer's parameter sits at (layer,) of its stacked tensor, a routed expert's at (layer, expert), the rest at ()."""
    m = _LAYER.match(local_name)
    if m is None:
        return local_name, ()
    x = _EXPERT.match(m.group(2))
    if x is None:
        return LAYERS + m.group(2), (int(m.group(1)),)
    return f"{LAYERS}mlp.experts.experts.{x.group(2)}", (int(m.group(1)), int(x.group(1)))


def is_optimizer_key(fqn: str) -> bool:
    return re.match(r"^(?:chained_\d+\.)?optimizer\.", fqn) is not None
