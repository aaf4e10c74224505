"""Megatron-Core's sharded keys in a `torch_dist` checkpoint (toolkit/checkpoint/torch_dist.py), without torch: which
key and index a toolkit parameter name has there, which keys are optimizer state, and Megatron's names of the
optimizer's fields."""
from __future__ import annotations

import math
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


def tiling_problem(shape: tuple[int, ...], chunks) -> str | None:
    """None when `chunks` (records with .offsets and .sizes, as torch DCP's `.metadata` lists a tensor's saved chunks)
    tile a tensor of `shape` exactly: each inside it, no two overlapping, together covering every value (what DCP's
    own save planner checks before it writes). Otherwise what is wrong, in a few words: a reader that only counted
    values would take two overlapping chunks for a whole tensor, and leave the values no chunk holds unwritten."""
    import numpy as np  # lazy: this module's other importers do not need it

    shape = tuple(int(s) for s in shape)
    if not chunks:
        return None if math.prod(shape) == 0 else "has no saved chunk"
    odd = next((c for c in chunks if len(c.offsets) != len(shape) or len(c.sizes) != len(shape)), None)
    if odd is not None:
        return f"has a chunk of {len(odd.offsets)} dimensions (sizes: {len(odd.sizes)}), but its shape has {len(shape)}"
    off = np.array([tuple(c.offsets) for c in chunks], dtype=np.int64).reshape(len(chunks), len(shape))
    end = off + np.array([tuple(c.sizes) for c in chunks], dtype=np.int64).reshape(off.shape)
    outside = np.flatnonzero(np.any((off < 0) | (end < off) | (end > np.array(shape, dtype=np.int64)), axis=1))
    if len(outside):
        return f"has a chunk at {off[outside[0]].tolist()} reaching past its shape {list(shape)}"
    full = np.all(end > off, axis=1)  # chunks that hold values (a zero-size one overlaps nothing)
    off, end = off[full], end[full]
    if _grid(off, end, shape):  # what every save writes: checked in n log n
        return None
    if len(off) > PAIRWISE_MAX:  # every pair would take minutes (and hostile metadata can list millions)
        return (f"has {len(off)} chunks that do not tile it as a grid (each dimension cut into the same pieces), as "
                "every save does")
    for i in range(0, len(off), 512):  # every pair, 512 rows at a time
        hit = np.all((off[i:i + 512, None] < end[None]) & (off[None] < end[i:i + 512, None]), axis=2)
        hit[np.arange(hit.shape[0]), np.arange(i, i + hit.shape[0])] = False
        if hit.any():
            a, b = np.argwhere(hit)[0]
            return f"has chunks at {off[i + a].tolist()} and {off[b].tolist()} that overlap"
    covered = int(np.prod(end - off, axis=1).sum())
    if covered != math.prod(shape):
        return f"has chunks that cover {covered} of its {math.prod(shape)} values"
    return None


PAIRWISE_MAX = 4096
"""tiling_problem checks chunks that are not a grid pair by pair, up to this many (under a second here)."""


def _grid(off, end, shape: tuple[int, ...]) -> bool:
    """Whether the chunks ([start, end) per dimension, rows of `off` and `end`) are a grid that tiles `shape`: along
    each dimension their pieces cut [0, size) without gaps or overlaps, and every combination of pieces is one chunk,
    once. Then no two overlap and together they cover every value."""
    import numpy as np  # lazy: as tiling_problem

    combinations = 1
    for d, size in enumerate(shape):
        pieces = np.unique(np.stack([off[:, d], end[:, d]], axis=1), axis=0)  # sorted by start, then end
        if pieces[0, 0] != 0 or pieces[-1, 1] != size or np.any(pieces[1:, 0] != pieces[:-1, 1]):
            return False
        combinations *= len(pieces)
    return combinations == len(off) and len(np.unique(off, axis=0)) == len(off)


def known_backend(meta: dict) -> bool:
    """Whether a torch_dist metadata.json's versions are those this reader knows: sharded_backend_version 1 and a torch
    common state, as Megatron-Core 0.16 writes them (either may be absent)."""
    return meta.get("sharded_backend_version", 1) == 1 and meta.get("common_backend", "torch") == "torch"
