"""Re-partition a DeepSpeed ZeRO-0/1/2/3 checkpoint (the toolkit's, or a plain `engine.save_checkpoint` folder) for
another data-parallel size, without a DeepSpeed engine: the fp32 masters and Adam moments are cut out of each rank's
flat partition (the layout deepspeed_io.py describes; ZeRO-3 in deepspeed_zero3.py) and laid into the new ranks'
partitions, one rank at a time through reusable file-backed scratch tensors; for the toolkit's checkpoints the data
position is split for the new ranks."""
from __future__ import annotations

import json
import shutil
from collections import OrderedDict
from pathlib import Path

import torch

from toolkit.checkpoint import output
from toolkit.checkpoint.deepspeed_io import (
    _ZERO12_KEYS,
    FP32_PARTITIONS,
    MODEL_STATES,
    OSD,
    _Zero12Layout,
    check_zero12_group,
    load_rank_file,
    optim_states,
    read_meta,
    zero3_model_states,
)
from toolkit.checkpoint.deepspeed_plain import PlainDeepSpeedSource, resolve_tag
from toolkit.checkpoint.deepspeed_zero3 import copy_pieces, reshard_zero3
from toolkit.errors import RecipeError, ToolkitError
from toolkit.format import manifest, safe_load
from toolkit.format.names import DEEPSPEED_POINTER, META, POINTER
from toolkit.recipe import resolve
from toolkit.recipe.schema import Recipe


def _new_recipe(recipe, dp: int):
    """The recipe as a run on `dp` ranks sees it: world size (and dp) set to the new size; a pinned accumulation
    step count is dropped so it is derived again from the unchanged global batch."""

    d = recipe.model_dump(mode="json")
    p, t = d["parallel"], d["training"]
    if p.get("world_size") is not None:
        p["world_size"] = dp
    if p.get("dp") is not None:
        p["dp"] = dp
    if t.get("grad_accum_steps") is not None and t.get("global_batch_size") is not None \
            and t.get("micro_batch_size") is not None:
        t["grad_accum_steps"] = None
    return Recipe.model_validate(d)


def _resolve_at(recipe, dp: int, old_batch):
    """The run's plan at `dp` ranks. A dp that the run's global batch and micro-batch do not divide into is refused
    with the dps that do: the recipe's own fix (change the batch) is not one a conversion can take."""
    try:
        return resolve(recipe, dp)
    except RecipeError as e:
        per_micro = old_batch.global_batch // old_batch.micro_batch
        if any(p.key == "training.global_batch_size" for p in e.problems) and per_micro:
            fits = [d for d in range(1, per_micro + 1) if per_micro % d == 0]
            raise ToolkitError(f"--dp {dp}: the run's global batch {old_batch.global_batch} is not a multiple of its "
                               f"micro-batch {old_batch.micro_batch} x dp {dp}, and a conversion keeps both (the "
                               f"data position and learning-rate schedule count them); pass a --dp dividing "
                               f"{per_micro}: {', '.join(map(str, fits))}") from None
        raise ToolkitError(f"--dp {dp}: the run's recipe does not run on {dp} ranks: "
                           f"{e.problems[0].render().splitlines()[0]}") from None


def _ds_config(cfg: dict, batch) -> dict:
    cfg = dict(cfg)
    cfg.update(train_batch_size=batch.global_batch, train_micro_batch_size_per_gpu=batch.micro_batch,
               gradient_accumulation_steps=batch.grad_accum)
    return cfg


class _Scratch:
    """File-backed tensors in a scratch folder: building a rank's partitions does not hold them in memory."""

    def __init__(self, folder: Path):
        self.folder, self.n = folder, 0
        folder.mkdir()

    def zeros(self, numel: int, dtype=torch.float32) -> torch.Tensor:
        self.n += 1
        path = self.folder / f"{self.n}.bin"
        return torch.from_file(str(path), shared=True, size=max(numel, 1), dtype=dtype)[:numel]  # zero-filled

    def clear(self) -> None:
        shutil.rmtree(self.folder)
        self.folder.mkdir()


def reshard_deepspeed(src_tag_dir: str | Path, dst_root: str | Path, dp: int, overwrite: bool = False,
                      log=lambda *_: None) -> Path:
    """Write a copy of a toolkit ZeRO-0/1/2/3 checkpoint re-partitioned for `dp` data-parallel ranks, as the new checkpoint
    directory `dst_root` (the step folder under the same tag, toolkit_meta.json with the new layout and manifest,
    `latest` and `latest_complete`). Returns the new step folder.

    DeepSpeed's own files are rewritten as a run on `dp` ranks would have saved them: the optimizer's flat fp32
    master partitions and Adam moments are re-cut (padding recomputed for the new size), param_slice_mappings
    rebuilt, dp_world_size updated. So DeepSpeed loads them natively; no DeepSpeed config change is needed.
    The global batch stays the same: a resumed run on `dp` ranks derives grad_accum from it, and the data
    position (micro-batches consumed in the epoch, counted per rank) is rescaled to that accumulation count. Each
    new rank takes the RNG state of old rank (rank % old dp).

    The checkpoint is built in a hidden folder next to `dst_root` and renamed into place at the end; an existing
    `dst_root` is refused unless `overwrite`. Memory: the source is memory-mapped and each new rank's partitions
    are assembled in file-backed scratch tensors, so resident memory stays small.
    """

    src, dst_root = Path(src_tag_dir), Path(dst_root)
    meta, recipe = read_meta(src)
    stage, old_dp = int(meta["layout"]["zero_stage"]), int(meta["layout"]["dp"])
    if not isinstance(dp, int) or dp < 1:
        raise ToolkitError(f"dp must be a positive integer, not {dp!r}")
    output.check_destination(src.parent, dst_root, overwrite)
    src_root, dst_abs = src.resolve().parent, dst_root.resolve()
    if dst_abs == src_root or dst_abs in src_root.parents or src_root in dst_abs.parents:
        raise ToolkitError(f"{dst_root} overlaps the source checkpoint directory {src_root}; write elsewhere")
    old_plan = resolve(recipe, int(meta["layout"]["world_size"]))
    new_recipe = _new_recipe(recipe, dp)
    new_plan = _resolve_at(new_recipe, dp, old_plan.batch)
    if new_plan.batch.global_batch != old_plan.batch.global_batch:
        raise ToolkitError(f"the global batch would change ({old_plan.batch.global_batch} -> "
                           f"{new_plan.batch.global_batch}) at dp={dp}")
    bf16 = recipe.training.precision == "bf16"
    _check_known_files(src, meta, stage, old_dp, bf16)
    data_states = _data_states(src, old_dp, old_plan.batch.grad_accum, new_plan.batch.grad_accum)

    tag = src.name
    with output.scratch_folder(dst_root, "reshard") as tmp:
        manifest.require_space(dst_root.parent, manifest.total_bytes(meta.get("files") or {}),
                               manifest.free_bytes(tmp), str(dst_root), f"the size of {src.name}")
        tag_dir = tmp / tag
        tag_dir.mkdir()
        log(f"re-partitioning DeepSpeed ZeRO-{stage} dp={old_dp} at {src} -> dp={dp}")
        _write_resharded(src, tag_dir, stage, old_dp, dp, bf16, new_plan.batch, data_states,
                         _Scratch(tmp / ".scratch"))
        layout = {**meta["layout"], "world_size": dp, "dp": dp}
        new_meta = {**meta, "schema_version": manifest.SCHEMA_VERSION, "layout": layout,
                    "recipe": new_recipe.model_dump(mode="json"),
                    "resharded_from": {"path": str(src.resolve()), "layout": meta["layout"]},
                    "files": manifest.complete(tag_dir, {})}
        (tag_dir / META).write_text(json.dumps(new_meta, indent=2))
        (tmp / DEEPSPEED_POINTER).write_text(tag)
        (tmp / POINTER).write_text(tag)
        if (src.parent / "zero_to_fp32.py").is_file():  # DeepSpeed's own consolidation script, as beside the source
            shutil.copy2(src.parent / "zero_to_fp32.py", tmp / "zero_to_fp32.py")
        output.replace(tmp, dst_root, overwrite)  # an old one (overwrite) is moved aside first: never neither
    return dst_root / tag


def _write_resharded(src: Path, tag_dir: Path, stage: int, old_dp: int, dp: int, bf16: bool, batch,
                     data_states: list[dict], scratch: _Scratch) -> None:
    """DeepSpeed's files and the toolkit's per-rank files of the checkpoint at `dp` ranks, into tag_dir."""
    _write_deepspeed_files(src, tag_dir, stage, old_dp, dp, bf16, batch, scratch)
    for r in range(dp):
        state = safe_load.load(src / f"toolkit_rank{r % old_dp:05d}.pt")
        state["data"] = data_states[r % old_dp]
        torch.save(state, tag_dir / f"toolkit_rank{r:05d}.pt")


def _write_deepspeed_files(src: Path, tag_dir: Path, stage: int, old_dp: int, dp: int, bf16: bool, batch,
                           scratch: _Scratch) -> None:
    """DeepSpeed's own files at `dp` ranks; `batch` (the toolkit's) also updates the recorded ds_config's batch."""
    edit = (lambda cfg: _ds_config(cfg, batch)) if batch is not None else (lambda cfg: cfg)
    if stage == 3:  # model states per rank, written with the optimizer files
        reshard_zero3(src, tag_dir, old_dp, dp, bf16, edit, scratch)
    else:
        states = load_rank_file(src / MODEL_STATES)
        states["dp_world_size"] = dp
        if isinstance(states.get("ds_config"), dict):
            states["ds_config"] = edit(states["ds_config"])
        torch.save(states, tag_dir / MODEL_STATES)
        del states
    if stage in (1, 2):
        _reshard_zero12(src, tag_dir, old_dp, dp, bf16, batch, scratch)
    shutil.rmtree(scratch.folder)


def _check_known_files(src: Path, meta: dict, stage: int, old_dp: int, bf16: bool) -> None:
    """Only files this module knows how to rewrite; anything else (MoE expert files, ...) is refused."""
    want = {*(f"toolkit_rank{r:05d}.pt" for r in range(old_dp))}
    want |= {zero3_model_states(r) for r in range(old_dp)} if stage == 3 else {MODEL_STATES}
    optim = [optim_states(r, bf16) for r in range(old_dp)]
    if stage in (1, 2, 3):
        if not (src / optim[0]).is_file() and (src / optim_states(0, not bf16)).is_file():
            optim = [optim_states(r, not bf16) for r in range(old_dp)]
        want |= set(optim)
    missing = sorted(n for n in want if not (src / n).is_file())
    if missing:
        raise ToolkitError(f"checkpoint {src} (ZeRO-{stage}, dp={old_dp}) lacks {', '.join(missing)}: a rank did not "
                           "save or the file was removed")
    other = sorted(set(meta.get("files") or {}) - want)
    if other:
        raise ToolkitError(f"checkpoint {src} holds files reshard_deepspeed cannot re-partition: {', '.join(other)}")


def _data_states(src: Path, old_dp: int, old_accum: int, new_accum: int) -> list[dict]:
    """Each old rank's data position, rescaled: consumed micro-batches count per rank, so with the same global
    batch they scale with grad_accum (steps done in the epoch x accumulation)."""
    out = []
    for r in range(old_dp):
        data = dict(safe_load.load(src / f"toolkit_rank{r:05d}.pt")["data"])
        consumed = int(data["consumed_micro_batches"])
        if consumed % old_accum:
            raise ToolkitError(f"toolkit_rank{r:05d}.pt: {consumed} micro-batches consumed is not a whole number of "
                               f"steps of {old_accum}; the checkpoint was not saved at a step boundary")
        data["consumed_micro_batches"] = consumed // old_accum * new_accum
        out.append(data)
    if any(d != out[0] for d in out):
        raise ToolkitError(f"the ranks of {src} saved different data positions: {out}")
    return out


def _reshard_zero12(src: Path, tag_dir: Path, old_dp: int, dp: int, bf16: bool, batch, scratch: _Scratch) -> None:
    from deepspeed.utils.tensor_fragment import fragment_address  # lazy: DeepSpeed paths only

    groups = [OrderedDict((k, tuple(v)) for k, v in g.items())
              for g in load_rank_file(src / MODEL_STATES)["param_shapes"]]
    names = [optim_states(r, bf16) for r in range(old_dp)]
    if not (src / names[0]).is_file():
        names = [optim_states(r, not bf16) for r in range(old_dp)]
    files = [load_rank_file(src / n) for n in names]
    osds = [f[OSD] for f in files]
    first = osds[0]
    unknown = sorted(set(first) - _ZERO12_KEYS)
    if unknown:
        raise ToolkitError(f"{names[0]} holds {unknown}, which reshard_deepspeed does not know how to re-partition")
    if not isinstance(first["base_optimizer_state"], dict):
        raise ToolkitError(f"{names[0]} is an elastic checkpoint (zero_optimization.elastic_checkpoint); "
                           "re-partitioning it is not supported")
    for name, osd in zip(names, osds):
        counts = osd["partition_count"]
        if any(int(c) != old_dp for c in (counts if isinstance(counts, list) else [counts])):
            raise ToolkitError(f"{name} was partitioned over {counts} ranks, but {META} says dp={old_dp}")
    paddings = first.get("param_alignment_paddings") or [None] * len(groups)
    if len(first[FP32_PARTITIONS]) != len(groups):
        raise ToolkitError(f"{names[0]} has {len(first[FP32_PARTITIONS])} fp32 groups, param_shapes {len(groups)}")
    old_layouts, new_layouts = [], []
    for g, shapes in enumerate(groups):
        old = _Zero12Layout(shapes, paddings[g], old_dp)
        check_zero12_group(old, g, [o[FP32_PARTITIONS][g] for o in osds], osds, names)
        old_layouts.append(old)
        new_layouts.append(_Zero12Layout(shapes, paddings[g], dp))
    for r in range(dp):
        fp32, state, group_paddings, mappings = [], {}, [], []
        for g, (old, new) in enumerate(zip(old_layouts, new_layouts)):
            lo, lean = r * new.partition, new.lean_size(r)
            master = scratch.zeros(lean)
            copy_pieces(master, old.gather([o[FP32_PARTITIONS][g] for o in osds], lo, lo + lean, old.partition))
            fp32.append(master)
            group_paddings.append(new.partition - lean)
            mappings.append(OrderedDict((k, fragment_address(numel=n, start=s)) for k, (n, s) in new.fragments(r).items()))
            state[g] = {}
            for key, value in first["base_optimizer_state"]["state"][g].items():
                if torch.is_tensor(value) and value.dim() > 0:
                    if value.numel() != old.partition:
                        raise ToolkitError(f"{names[0]}: optimizer state {key} of group {g} has {value.numel()} "
                                           f"elements, the partition {old.partition}: shapes do not add up")
                    moment = scratch.zeros(new.partition, value.dtype)
                    copy_pieces(moment[:lean], old.gather([o["base_optimizer_state"]["state"][g][key] for o in osds],
                                                         lo, lo + lean, old.partition))
                    state[g][key] = moment
                else:
                    state[g][key] = value  # step count: the same on every rank
        osd = {k: v for k, v in first.items() if k not in (FP32_PARTITIONS, "base_optimizer_state")}
        osd.update({"base_optimizer_state": {"state": state, "param_groups": first["base_optimizer_state"]["param_groups"]},
                    FP32_PARTITIONS: fp32, "group_paddings": group_paddings,
                    "partition_count": [dp] * len(groups), "param_slice_mappings": mappings})
        out = {k: v for k, v in files[0].items() if k != OSD}
        if isinstance(out.get("ds_config"), dict) and batch is not None:
            out["ds_config"] = _ds_config(out["ds_config"], batch)
        torch.save({OSD: osd, **out}, tag_dir / names[0].replace("zero_pp_rank_0_", f"zero_pp_rank_{r}_"))
        del fp32, state, osd
        scratch.clear()


def reshard_plain(src: str | Path, dst_root: str | Path, dp: int, overwrite: bool = False, log=print) -> Path:
    """A plain DeepSpeed ZeRO-1/2/3 checkpoint (engine.save_checkpoint in a user's own script: `latest` + a
    global_step* folder, or that folder) re-partitioned for `dp` ranks, written as the new checkpoint folder
    `dst_root` (`latest`, the tag folder, DeepSpeed's zero_to_fp32.py when the source has it beside it). The user's
    script at `dp` ranks resumes from it with its own `engine.load_checkpoint(dst_root)`, optimizer state included;
    the recorded ds_config is kept as saved (DeepSpeed takes the one the script passes)."""
    src, dst_root = Path(src), Path(dst_root)
    if not isinstance(dp, int) or dp < 1:
        raise ToolkitError(f"dp must be a positive integer, not {dp!r}")
    output.check_destination(src, dst_root, overwrite)
    tag = resolve_tag(src)
    probe = PlainDeepSpeedSource(tag)  # every rank's file is there, all of one save
    stage, old_dp, complete = probe.stage, probe.dp, probe.report["optimizer_complete"]
    probe.close()
    if stage == 0:
        raise ToolkitError(f"{tag} is a ZeRO-0 checkpoint: --to deepspeed re-partitions plain ZeRO-1/2/3 "
                           "checkpoints; convert it --to hf for the weights")
    if not complete:
        raise ToolkitError(f"{tag} holds no optimizer state (its *_optim_states.pt files are missing): "
                           "re-partitioning moves the fp32 masters and Adam moments; use a checkpoint saved with "
                           "its optimizer state, or convert --to hf for the weights alone")
    PlainDeepSpeedSource(tag, fp32=True).close()  # the optimizer files, checked (one save, partition counts)
    bf16 = any(p.name.startswith("bf16_") for p in tag.glob("*_optim_states.pt"))
    files = [p for p in tag.iterdir() if p.is_file()]
    known = {optim_states(r, bf16) for r in range(old_dp)}
    known |= {zero3_model_states(r) for r in range(old_dp)} if stage == 3 else {MODEL_STATES}
    other = sorted(p.name for p in files if p.name not in known and p.name.endswith(".pt"))
    if other:  # e.g. MoE expert files (expp_rank_*): leaving them behind would lose their weights
        raise ToolkitError(f"{tag} holds {', '.join(other[:3])}, which re-partitioning does not know how to re-cut; "
                           "--to deepspeed takes checkpoints of DeepSpeed's ZeRO model and optimizer files only")
    with output.scratch_folder(dst_root, "reshard") as tmp:
        manifest.require_space(dst_root.parent, sum(p.stat().st_size for p in files), manifest.free_bytes(tmp),
                               str(dst_root), f"the size of {tag.name}")
        log(f"re-partitioning DeepSpeed ZeRO-{stage} dp={old_dp} at {tag} -> dp={dp}")
        (tmp / tag.name).mkdir()
        _write_deepspeed_files(tag, tmp / tag.name, stage, old_dp, dp, bf16, None, _Scratch(tmp / ".scratch"))
        (tmp / "latest").write_text(tag.name)
        if (tag.parent / "zero_to_fp32.py").is_file() and (tag.parent / "latest").is_file():
            shutil.copy2(tag.parent / "zero_to_fp32.py", tmp / "zero_to_fp32.py")
        PlainDeepSpeedSource(tmp / tag.name, fp32=True).close()  # what was written reads back as a whole save
        output.replace(tmp, dst_root, overwrite)
    return dst_root
