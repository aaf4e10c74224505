"""Comparing two universal checkpoint folders file by file (ours against DeepSpeed's ds_to_universal.py)."""
from __future__ import annotations

import enum
from pathlib import Path

import torch


def comparable(x):
    """A value with every tensor turned into (dtype, shape, values) and every record into its fields."""
    if isinstance(x, enum.Enum):
        return repr(x)
    if torch.is_tensor(x):
        return ("tensor", x.dtype, tuple(x.shape), x.flatten().tolist())
    if isinstance(x, dict):
        return {k: comparable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [comparable(v) for v in x]
    return (type(x).__name__, comparable(vars(x))) if hasattr(x, "__dict__") else x


def assert_same_universal(ours: Path, ds: Path) -> list[str]:
    """Every file of DeepSpeed's universal folder `ds` is in `ours` (and nothing else but our output mark and the
    model's config.json, which DeepSpeed's loader ignores), equal tensor for tensor. Returns the files compared."""
    files = sorted(str(p.relative_to(ours)) for p in ours.rglob("*")
                   if p.is_file() and p.name not in (".toolkit_output.json", "config.json"))
    assert files == sorted(str(p.relative_to(ds)) for p in ds.rglob("*") if p.is_file())
    for f in files:
        if not f.endswith(".pt"):
            assert (ours / f).read_bytes() == (ds / f).read_bytes(), f
            continue
        mine, theirs = torch.load(ours / f, weights_only=False), torch.load(ds / f, weights_only=False)
        if f.endswith("zero/optimizer_state.pt") and "fp32_flat_groups" in theirs:
            # ZeRO-3: DeepSpeed keeps rank 0's whole optimizer file there; its loader reads only the step and the
            # param_groups, which is all we keep (universal.py): the rest must be equal
            osd = theirs.pop("fp32_flat_groups") and theirs["optimizer_state_dict"]
            osd["state"] = {k: {"step": v["step"]} for k, v in osd["state"].items()}
        assert comparable(mine) == comparable(theirs), f
    return files
