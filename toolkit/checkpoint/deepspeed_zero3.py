"""Re-partition DeepSpeed ZeRO-3 files for another data-parallel size, without a DeepSpeed engine.

What ZeRO-3 keeps per rank (DeepSpeed 0.19.8, layout in deepspeed_io.py): every trainable parameter of n elements
is cut into dp slices of ceil(n / dp), the last zero-padded; rank r's optimizer file holds, per sub-group, the
concatenation of its slice of each parameter (``fp32_flat_groups``) and the torch optimizer's state over those flat
tensors (``optimizer_state_dict.state[i]``: ``exp_avg``/``exp_avg_sq`` of the same length, ``step``), one torch
"parameter" per sub-group. Sub-groups split each optimizer group greedily once the rank's slices reach
``zero_optimization.sub_group_size`` elements (default 1e9), so they are recomputed for the new size. Frozen
parameters are sliced the same way into every rank's model-states file (``frozen_param_fragments``).

For each new rank, the new slices are copied from the old ranks' memory-mapped files into file-backed scratch
tensors (so resident memory stays small) and saved as the files DeepSpeed would have written at that size:
``engine.load_checkpoint`` at the new size loads them natively, optimizer state included.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from pathlib import Path

import torch

from toolkit.checkpoint.deepspeed_io import OSD, load_rank_file, optim_states, zero3_model_states
from toolkit.errors import ToolkitError

FLAT = "fp32_flat_groups"
# what a ZeRO-3 optimizer record may hold; anything else (AutoEP partition groups, ...) is refused
_ZERO3_KEYS = {"zero_stage", "loss_scaler", "dynamic_loss_scale", "overflow", "partition_count", OSD, FLAT}
SUB_GROUP_DEFAULT = 1_000_000_000  # DeepSpeed's zero_optimization.sub_group_size default


def _chunk(shape, dp: int) -> int:
    return -(-math.prod(shape) // dp)


def sub_groups(params: list[tuple[str, tuple]], dp: int, size: int) -> list[list[tuple[str, tuple]]]:
    """DeepSpeed's split of one optimizer group into sub-groups at `dp` ranks (stage3._create_fp16_sub_groups)."""
    if size is None or size >= sum(_chunk(s, dp) for _, s in params):
        return [list(params)]
    out, cur, n = [], [], 0
    for i, p in enumerate(params):
        cur.append(p)
        n += _chunk(p[1], dp)
        if n >= size or i == len(params) - 1:
            out.append(cur)
            cur, n = [], 0
    return out


def _slices(flats: list[list[torch.Tensor]], offs: list[int], shape, old_dp: int, lo: int, hi: int):
    """Views of elements [lo, hi) of a parameter whose old rank r slice starts at offs[r] of rank r's sub-groups."""
    c, out = _chunk(shape, old_dp), []
    for r in range(lo // c, (hi - 1) // c + 1) if hi > lo else ():
        a, b = max(lo, r * c) - r * c, min(hi, (r + 1) * c) - r * c
        base = 0
        for t in flats[r]:  # the rank's sub-groups, virtually concatenated
            x, y = max(offs[r] + a, base), min(offs[r] + b, base + t.numel())
            if x < y:
                out.append(t.view(-1)[x - base:y - base])
            base += t.numel()
    if sum(p.numel() for p in out) != hi - lo:
        raise ToolkitError(f"elements [{lo}, {hi}) of a {tuple(shape)} parameter lie beyond the saved partitions")
    return out


def reshard_zero3(src: Path, tag_dir: Path, old_dp: int, dp: int, bf16: bool, edit_config, scratch) -> None:
    """Write the ZeRO-3 model-states and optimizer files of `src` (saved on `old_dp` ranks) as `dp` ranks would have
    saved them, into `tag_dir`. `edit_config(ds_config) -> ds_config` adjusts the recorded DeepSpeed config;
    `scratch.zeros(n, dtype)` gives file-backed zero tensors and `scratch.clear()` drops them."""
    models = [zero3_model_states(r) for r in range(old_dp)]
    optims = [optim_states(r, bf16) for r in range(old_dp)]
    if not (src / optims[0]).is_file() and (src / optim_states(0, not bf16)).is_file():
        optims = [optim_states(r, not bf16) for r in range(old_dp)]
    missing = [n for n in models + optims if not (src / n).is_file()]
    if missing:
        raise ToolkitError(f"ZeRO-3 checkpoint {src} (dp={old_dp}) lacks {', '.join(missing[:4])}: a rank did not "
                           "save or the file was removed; re-partitioning needs every rank's files")
    states = load_rank_file(src / models[0])
    files = [load_rank_file(src / n) for n in optims]
    osds = [f.get(OSD) for f in files]
    first = osds[0]
    if not isinstance(first, dict) or FLAT not in first:
        raise ToolkitError(f"{optims[0]} holds no ZeRO-3 optimizer record ({FLAT}); re-copy it")
    unknown = sorted(set(first) - _ZERO3_KEYS)
    if unknown:
        raise ToolkitError(f"{optims[0]} holds {unknown}, which re-partitioning ZeRO-3 does not know how to re-cut")
    old_subs = [OrderedDict((k, tuple(v)) for k, v in g.items()) for g in states["param_shapes"]]
    inner = first[OSD]
    groups = [list(g["params"]) for g in inner["param_groups"]]
    if [i for g in groups for i in g] != list(range(len(old_subs))):
        raise ToolkitError(f"{optims[0]}: its optimizer groups hold sub-groups {groups}, not 0..{len(old_subs) - 1} "
                           "in order: a layout this re-partitioning does not know")
    for r, osd in enumerate(osds):
        count = osd.get("partition_count") if isinstance(osd, dict) else None
        if count is None or any(int(c) != old_dp for c in (count if isinstance(count, list) else [count])):
            raise ToolkitError(f"{optims[r]} was partitioned over {count} ranks, but the model states say "
                               f"dp_world_size={old_dp}: files of different runs are mixed")
        for i, shapes in enumerate(old_subs):
            want = sum(_chunk(s, old_dp) for s in shapes.values())
            have = [osd[FLAT][i].numel()] + [t.numel() for t in osd[OSD]["state"].get(i, {}).values()
                                             if torch.is_tensor(t) and t.dim() > 0]
            if any(h != want for h in have):
                raise ToolkitError(f"{optims[r]}: sub-group {i} holds {have} elements, its parameters split over "
                                   f"dp={old_dp} need {want}: shapes do not add up")
    keys = sorted({k for s in inner["state"].values() for k, v in s.items() if torch.is_tensor(v) and v.dim() > 0})
    scalars = {k: v for s in inner["state"].values() for k, v in s.items() if k not in keys}
    for s in inner["state"].values():  # the step count: one value for all sub-groups, kept for the new ones
        if any(not _same(s.get(k), v) for k, v in scalars.items()):
            raise ToolkitError(f"{optims[0]}: the sub-groups' optimizer steps differ ({s} vs {scalars}); "
                               "re-partitioning needs one step count")
    # where each parameter's old slice starts in a rank's sub-groups (virtually concatenated), and its old sub-group
    offs, off = {}, 0
    for shapes in old_subs:
        for name, shape in shapes.items():
            offs[name] = off
            off += _chunk(shape, old_dp)
    sub_size = ((states.get("ds_config") or {}).get("zero_optimization") or {}).get("sub_group_size",
                                                                                  SUB_GROUP_DEFAULT)
    new_subs, new_groups = [], []
    for g in groups:
        params = [kv for i in g for kv in old_subs[i].items()]
        split = sub_groups(params, dp, sub_size)
        new_groups.append(list(range(len(new_subs), len(new_subs) + len(split))))
        new_subs += [OrderedDict(s) for s in split]
    old = {"fp32": [list(o[FLAT]) for o in osds]}
    for k in keys:
        old[k] = [[o[OSD]["state"][i][k] for i in range(len(old_subs))] for o in osds]
    frozen = states.get("frozen_param_shapes") or {}
    frags = [load_rank_file(src / n).get("frozen_param_fragments") or {} for n in models] if frozen else []
    for r in range(dp):
        flat, state = [], {}
        for i, shapes in enumerate(new_subs):
            n_sub = sum(_chunk(s, dp) for s in shapes.values())
            made = {"fp32": scratch.zeros(n_sub, old["fp32"][0][0].dtype)}
            made.update({k: scratch.zeros(n_sub, old[k][0][0].dtype) for k in keys})
            at = 0
            for name, shape in shapes.items():
                n, c = math.prod(shape), _chunk(shape, dp)
                lo, hi = min(r * c, n), min((r + 1) * c, n)  # the rest of the slice stays zero (padding)
                for what, t in made.items():
                    copy_pieces(t[at:at + hi - lo], _slices(old[what], [offs[name]] * old_dp, shape, old_dp, lo, hi))
                at += c
            flat.append(made.pop("fp32"))
            state[i] = {**{k: v.clone() if torch.is_tensor(v) else v for k, v in scalars.items()}, **made}
        osd = {k: v for k, v in first.items() if k not in (FLAT, OSD)}
        osd["partition_count"] = dp
        osd[OSD] = {"state": state, "param_groups": [{**pg, "params": new_groups[g]}
                                                     for g, pg in enumerate(inner["param_groups"])]}
        osd[FLAT] = flat
        out = {k: v for k, v in files[0].items() if k != OSD}
        if isinstance(out.get("ds_config"), dict):
            out["ds_config"] = edit_config(out["ds_config"])
        torch.save({OSD: osd, **out}, tag_dir / optims[0].replace("zero_pp_rank_0_", f"zero_pp_rank_{r}_"))
        model = dict(states)
        model.update(dp_world_size=dp, param_shapes=[OrderedDict((k, torch.Size(s)) for k, s in g.items())
                                                     for g in new_subs])
        if r and "shared_params" in model:  # DeepSpeed records tied parameters on rank 0 only (_get_shared_params)
            model["shared_params"] = {}
        if isinstance(model.get("ds_config"), dict):
            model["ds_config"] = edit_config(model["ds_config"])
        if frozen:
            model["frozen_param_fragments"] = OrderedDict(
                (name, _frozen_slice([f[name] for f in frags], shape, old_dp, dp, r)) for name, shape in frozen.items())
        torch.save(model, tag_dir / zero3_model_states(r))
        del flat, state, osd, model
        scratch.clear()


def _frozen_slice(old: list[torch.Tensor], shape, old_dp: int, dp: int, r: int) -> torch.Tensor:
    """New rank r's slice of a frozen parameter (ceil(n / dp) elements, zero-padded), from the old ranks' slices."""
    n, c = math.prod(shape), _chunk(shape, dp)
    out = torch.zeros(c, dtype=old[0].dtype)
    lo, hi = min(r * c, n), min((r + 1) * c, n)
    copy_pieces(out[:hi - lo], _slices([[t] for t in old], [0] * old_dp, shape, old_dp, lo, hi))
    return out


def _same(a, b) -> bool:
    return torch.equal(a, b) if torch.is_tensor(a) and torch.is_tensor(b) else a == b


def copy_pieces(dst: torch.Tensor, pieces: list[torch.Tensor]) -> None:
    """Lay `pieces` end to end into the flat `dst`, which they must fill exactly."""
    at = 0
    for p in pieces:
        dst[at:at + p.numel()].copy_(p.view(-1))
        at += p.numel()
    if at != dst.numel():
        raise ToolkitError(f"re-partitioning copied {at} elements into a slice of {dst.numel()}")
