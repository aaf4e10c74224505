"""The toolkit's DeepSpeed checkpoints without a DeepSpeed engine: read full Hugging Face tensors one at a time,
and re-partition a ZeRO-0/1/2 checkpoint for another data-parallel size.

What DeepSpeed 0.19.8 writes into a step folder (engine.save_checkpoint; the toolkit has no TP/PP on DeepSpeed,
so every name carries mp_rank_00), on `dp` data-parallel ranks:

* ZeRO-0/1/2: ``mp_rank_00_model_states.pt`` (written by rank 0): ``module`` = every weight, whole, in the
  dtype the model trains in (bf16/fp16/fp32); ``param_shapes`` = one ordered {name: torch.Size} per optimizer
  group; ``shared_params``, ``frozen_param_shapes``/``frozen_param_fragments``, ``dp_world_size``,
  ``lr_scheduler``, ``global_steps``, ``ds_config``, ``ds_version``.
  ZeRO-0 also keeps the whole optimizer there (``optimizer``): a plain torch state dict when training in fp32
  (then the module weights are the master weights), or DeepSpeed's FP16_Optimizer state for bf16/fp16 with the
  fp32 masters in ``fp32_groups`` (one tensor per parameter) or ``fp32_groups_flat`` (one per group).
* ZeRO-1/2: ``[bf16_]zero_pp_rank_{r}_mp_rank_00_optim_states.pt`` per rank r (``bf16_`` when training in
  bf16), ``optimizer_state_dict`` holding:
  ``single_partition_of_fp32_groups`` = rank r's slice of each group's flat fp32 master vector. The flat vector
  is the group's parameters in ``param_shapes`` order, each followed by ``param_alignment_paddings[g][i]`` zeros,
  then padded to a multiple of 2 x dp; rank r owns elements [r*P, (r+1)*P) and saves them without the end
  padding (``group_paddings`` = how much it dropped). ``base_optimizer_state`` = the torch optimizer's state over
  those partitions (``exp_avg``/``exp_avg_sq`` of P elements each, padding included, and ``step``);
  ``partition_count``, ``param_slice_mappings`` (name -> fragment_address(numel, start) inside the partition),
  ``loss_scaler``, ``zero_stage``, ``clip_grad``, ``ds_version``.
* ZeRO-3: ``zero_pp_rank_{r}_mp_rank_00_model_states.pt`` per rank: the same keys, but ``module`` holds empty
  placeholders; ``[bf16_]zero_pp_rank_{r}_mp_rank_00_optim_states.pt`` per rank: ``fp32_flat_groups`` = per
  sub-group the concatenation of rank r's slice of each parameter; a parameter of n elements is cut into dp
  slices of ceil(n / dp) (the last zero-padded). No 16-bit weights are stored anywhere.

Files are opened with ``torch.load(weights_only=True, mmap=True)`` (toolkit/format/safe_load.py): tensors stay
on disk until sliced, and the only objects other than tensors and plain containers that are accepted are the four
DeepSpeed records of its allow-list.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from pathlib import Path
from typing import Self

import torch

from toolkit.checkpoint.pt_ranges import optimizer_ranges, ranges_of
from toolkit.errors import ToolkitError
from toolkit.format import manifest, paths, safe_load
from toolkit.format.names import META
from toolkit.model import param_groups, released_config, to_hf_config
from toolkit.recipe.schema import Recipe

MODEL_STATES = "mp_rank_00_model_states.pt"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
OSD = "optimizer_state_dict"
FP32_PARTITIONS = "single_partition_of_fp32_groups"
# what a ZeRO-1/2 optimizer file may hold besides the partitioned tensors; anything else is refused by reshard
_ZERO12_KEYS = {"loss_scaler", "dynamic_loss_scale", "overflow", "clip_grad", "base_optimizer_state", FP32_PARTITIONS,
                "zero_stage", "group_paddings", "param_alignment_paddings", "partition_count", "ds_version",
                "param_slice_mappings"}


def zero3_model_states(rank: int) -> str:
    return f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"


def optim_states(rank: int, bf16: bool) -> str:
    return f"{'bf16_' if bf16 else ''}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def load_rank_file(path: Path) -> dict:
    """One checkpoint file, memory-mapped: tensors are read from disk only when sliced."""
    if not path.is_file():
        raise ToolkitError(f"{path.name} is missing from {path.parent}: the checkpoint is incomplete (a rank did not "
                           "save, or the file was removed); resume from another checkpoint")
    return safe_load.load(path, mmap=True, deepspeed=True)


def read_meta(tag_dir: Path) -> tuple[dict, object]:
    """The checkpoint's toolkit_meta.json and recipe, after checking every file against the manifest."""

    if not tag_dir.is_dir():
        raise ToolkitError(f"{tag_dir} is not a folder: pass a checkpoint step folder (e.g. .../step_00000050)")
    problems = manifest.verify(tag_dir)
    if problems:
        raise ToolkitError(f"checkpoint {tag_dir} is damaged or incomplete: {'; '.join(problems)}")
    meta = manifest.read_meta(tag_dir)
    if meta.get("backend") != "deepspeed":
        raise ToolkitError(f"{tag_dir} was written by the {meta.get('backend')!r} backend, not DeepSpeed")
    layout = meta.get("layout") or {}
    if "zero_stage" not in layout or "dp" not in layout:
        raise ToolkitError(f"{tag_dir / META} has no layout (zero_stage, dp): not a toolkit DeepSpeed checkpoint")
    return meta, Recipe.model_validate(meta["recipe"])


def _expected_params(hf_config) -> dict[str, tuple]:
    """Name -> shape of every parameter of the Hugging Face model (tied weights once), built on the meta device."""
    from transformers import AutoModelForCausalLM  # lazy: heavy; model paths only

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def _trainer_groups(hf_config) -> list[dict]:
    """The optimizer groups the DeepSpeed backend builds (toolkit.model.param_groups), as [{name: shape}]."""
    from transformers import AutoModelForCausalLM  # lazy: heavy; model paths only

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    names = {id(p): n for n, p in model.named_parameters()}
    return [OrderedDict((names[id(p)], tuple(p.shape)) for p in g["params"]) for g in param_groups(model, 0.0)]


def _numel(shape) -> int:
    return math.prod(shape)


def _concat_slice(tensors: list[torch.Tensor], start: int, stop: int) -> list[torch.Tensor]:
    """Views of elements [start, stop) of the virtual concatenation of flat `tensors` (nothing is copied)."""
    out, base = [], 0
    for t in tensors:
        n = t.numel()
        lo, hi = max(start, base), min(stop, base + n)
        if lo < hi:
            out.append(t.view(-1)[lo - base:hi - base])
        base += n
    if sum(p.numel() for p in out) != stop - start:
        raise ToolkitError(f"elements [{start}, {stop}) lie beyond the {base} elements of a partition")
    return out


class _Zero12Layout:
    """Where each parameter of one ZeRO-1/2 optimizer group sits in the group's flat vector, and how that vector
    is cut into `dp` partitions."""

    def __init__(self, shapes: dict, paddings: list[int] | None, dp: int):
        self.dp = dp
        self.offsets: dict[str, tuple[int, int]] = OrderedDict()
        off = 0
        paddings = paddings or [0] * len(shapes)
        if len(paddings) != len(shapes):
            raise ToolkitError(f"{len(paddings)} parameter paddings for a group of {len(shapes)} parameters")
        for (name, shape), pad in zip(shapes.items(), paddings):
            n = _numel(shape)
            self.offsets[name] = (off, n)
            off += n + pad
        self.used = off  # the group's elements, with the per-parameter alignment padding
        align = 2 * dp  # DeepSpeed: nccl_start_alignment_factor (2) x dp
        self.partition = (self.used + align - 1) // align * align // dp

    def lean_size(self, rank: int) -> int:
        """What rank `rank` saves of its partition: the partition without the end padding."""
        return max(0, min(self.used - rank * self.partition, self.partition))

    def fragments(self, rank: int) -> dict[str, tuple[int, int]]:
        """name -> (numel, start inside the partition) of every parameter overlapping rank `rank`'s partition."""
        lo, hi = rank * self.partition, (rank + 1) * self.partition
        out = OrderedDict()
        for name, (off, n) in self.offsets.items():
            a, b = max(off, lo), min(off + n, hi)
            if a < b:
                out[name] = (b - a, a - lo)
        return out

    def gather(self, partitions: list[torch.Tensor], start: int, stop: int, partition: int) -> list[torch.Tensor]:
        """Views of flat elements [start, stop) from per-rank `partitions` of `partition` elements each."""
        out = []
        for r in range(start // partition, (stop - 1) // partition + 1) if stop > start else ():
            lo, hi = max(start, r * partition), min(stop, (r + 1) * partition)
            part = partitions[r].view(-1)
            if hi - r * partition > part.numel():
                raise ToolkitError(f"rank {r}'s partition has {part.numel()} elements, {hi - r * partition} needed")
            out.append(part[lo - r * partition:hi - r * partition])
        return out


def _cat(pieces: list[torch.Tensor], shape) -> torch.Tensor:
    return torch.cat(pieces).view(shape) if pieces else torch.empty(shape)


class DeepSpeedSource:
    """Full (unpartitioned) Hugging Face tensors of a toolkit DeepSpeed checkpoint (ZeRO-0, 1, 2 or 3), one at a
    time, with memory that does not grow with the model: rank files are memory-mapped and only the slices of the
    asked tensor are read.

    fp32=False: the weights the model computes with, in the dtype it trained in (bf16, fp16 or fp32).
      ZeRO-0/1/2: the module weights of mp_rank_00_model_states.pt, as saved.
      ZeRO-3: DeepSpeed stores no 16-bit weights; they are the fp32 master partitions (optimizer files) cast to
      the training dtype. That is exactly what the engine holds: after every step ZeRO-3 refreshes its 16-bit
      partitions by copying (round-to-nearest casting) the fp32 ones, and save_16bit_model gathers those.
    fp32=True: the fp32 master weights of the optimizer: ZeRO-1/2/3 from the optimizer files' flat partitions
      (concatenated across ranks, alignment padding removed); ZeRO-0 from the FP16/BF16 optimizer's fp32 groups in
      the model-states file, or the module weights themselves when training in fp32 (they are the masters).

    `names()` are the Hugging Face parameter names (lm_head.weight only when the embeddings are untied), `config`
    the Hugging Face config dict, `step` the training step of the checkpoint.
    """

    def __init__(self, tag_dir: str | Path, fp32: bool = False):

        self.tag_dir, self.fp32 = Path(tag_dir), fp32
        self.meta, self.recipe = read_meta(self.tag_dir)
        self.step = int(self.meta["step"])
        self.stage, self.dp = int(self.meta["layout"]["zero_stage"]), int(self.meta["layout"]["dp"])
        self.dtype = DTYPES[self.recipe.training.precision]
        hf_config = to_hf_config(self.recipe.model)
        self.config, self._hf_config = released_config(self.recipe.model, self.meta.get("tokens")), hf_config
        self._expected = _expected_params(hf_config)
        self._where: dict[str, object] = {}  # name -> zero-argument function returning the full tensor
        self._pieces: dict[object, object] = {}  # a ZeRO-3 getter -> its pieces (views of the files), uncast
        bf16 = self.recipe.training.precision == "bf16"
        if self.stage == 3:
            self._open_zero3(bf16)
        else:
            self._open_zero012(bf16)
        self._check_names()

    # ------------------------------------------------------------------ opening
    def _file(self, name: str) -> Path:
        return paths.inside(self.tag_dir, name, f"checkpoint {self.tag_dir}")

    def _require(self, names: list[str]) -> None:
        missing = [n for n in names if not self._file(n).is_file()]
        if missing:
            raise ToolkitError(f"checkpoint {self.tag_dir} (ZeRO-{self.stage}, dp={self.dp}) lacks {', '.join(missing)}: "
                               "a rank did not save or the file was removed; resume from another checkpoint")

    def _optim_names(self, bf16: bool) -> list[str]:
        """The per-rank optimizer files (either naming, in case the precision was changed by a user JSON)."""
        names = [optim_states(r, bf16) for r in range(self.dp)]
        other = [optim_states(r, not bf16) for r in range(self.dp)]
        return other if all(self._file(n).is_file() for n in other) and not self._file(names[0]).is_file() else names

    def _open_zero3(self, bf16: bool) -> None:
        model_names, optim_names = [zero3_model_states(r) for r in range(self.dp)], self._optim_names(bf16)
        self._require(model_names + optim_names)
        states = load_rank_file(self._file(model_names[0]))
        self._shapes = OrderedDict((k, tuple(v)) for group in states["param_shapes"] for k, v in group.items())
        self._shared = dict(states.get("shared_params") or {})
        flats = []
        for r, name in enumerate(optim_names):
            osd = load_rank_file(self._file(name))[OSD]
            self._check_partition_count(name, osd)
            flats.append(list(osd["fp32_flat_groups"]))  # memory-mapped; the rest of the file is dropped
        if self.fp32:  # the masters are written as they are: their byte ranges, to copy file to file
            self._files = [optimizer_ranges(self._file(n), f, "fp32_flat_groups", OSD) for n, f in zip(optim_names, flats)]
        chunks = {name: -(-_numel(shape) // self.dp) for name, shape in self._shapes.items()}
        per_rank = sum(chunks.values())
        for r, groups in enumerate(flats):
            have = sum(t.numel() for t in groups)
            if have != per_rank:
                raise ToolkitError(f"{optim_names[r]} holds {have} fp32 elements, but the {len(chunks)} parameters of "
                                   f"param_shapes split over dp={self.dp} need {per_rank}: shapes do not add up")
        cast = None if self.fp32 else self.dtype
        off = 0
        for name, shape in self._shapes.items():
            self._where[name] = self._zero3_getter(flats, off, chunks[name], shape, cast)
            off += chunks[name]
        frozen = states.get("frozen_param_shapes") or {}
        if frozen:  # not trained, so no fp32 master: every rank keeps a slice in its model-states file
            frags = [load_rank_file(self._file(n))["frozen_param_fragments"] for n in model_names]
            for name, shape in frozen.items():
                self._where[name] = lambda name=name, shape=tuple(shape): torch.cat(
                    [f[name].view(-1) for f in frags])[:_numel(shape)].view(shape).clone()
                self._shapes[name] = tuple(shape)

    def _zero3_getter(self, flats, off, chunk, shape, cast):
        n = _numel(shape)

        def pieces() -> list[torch.Tensor]:
            out = []
            for r, groups in enumerate(flats):
                take = min(chunk, n - r * chunk)
                if take > 0:
                    out += _concat_slice(groups, off, off + take)
            return out

        def get() -> torch.Tensor:
            t = _cat(pieces(), shape)
            return t.to(cast) if cast is not None else t

        if cast is None:
            self._pieces[get] = pieces
        return get

    def _open_zero012(self, bf16: bool) -> None:
        self._require([MODEL_STATES])
        states = load_rank_file(self._file(MODEL_STATES))
        if states.get("param_shapes") is not None:
            groups = [OrderedDict((k, tuple(v)) for k, v in g.items()) for g in states["param_shapes"]]
        else:  # ZeRO-0 records none: the optimizer groups are the trainer's (toolkit.model.param_groups)
            groups = _trainer_groups(self._hf_config)
        self._shapes = OrderedDict(kv for g in groups for kv in g.items())
        self._shared = dict(states.get("shared_params") or {})
        module = states["module"]
        frozen = states.get("frozen_param_shapes") or {}
        for name, shape in frozen.items():
            self._shapes[name] = tuple(shape)
        if not self.fp32 or (self.stage == 0 and self.dtype == torch.float32):
            for name, shape in self._shapes.items():
                if name not in module:
                    raise ToolkitError(f"{MODEL_STATES} has no module weight {name!r} although param_shapes lists it")
                if tuple(module[name].shape) != shape:
                    raise ToolkitError(f"{MODEL_STATES}: module weight {name} has shape {tuple(module[name].shape)}, "
                                       f"param_shapes says {shape}")
                self._where[name] = lambda t=module[name]: t.clone()
            return
        for name in frozen:  # frozen weights have no fp32 master; they are what the module holds
            self._where[name] = lambda t=module[name]: t.clone()
        if self.stage == 0:
            self._open_zero0_masters(states.get("optimizer") or {}, groups)
        else:
            self._open_zero12_masters(bf16, groups)

    def _open_zero0_masters(self, opt: dict, groups: list[dict]) -> None:
        if "fp32_groups" in opt:  # one fp32 tensor per parameter
            masters = opt["fp32_groups"]
            if [len(g) for g in masters] != [len(g) for g in groups]:
                raise ToolkitError(f"{MODEL_STATES}: the optimizer's fp32 groups hold {[len(g) for g in masters]} "
                                   f"tensors, param_shapes {[len(g) for g in groups]}: shapes do not add up")
            for g, shapes in enumerate(groups):
                for i, (name, shape) in enumerate(shapes.items()):
                    if masters[g][i].numel() != _numel(shape):
                        raise ToolkitError(f"{MODEL_STATES}: fp32 master of {name} has {masters[g][i].numel()} "
                                           f"elements, param_shapes says {shape}")
                    self._where[name] = lambda t=masters[g][i], shape=shape: t.reshape(shape).clone()
        elif "fp32_groups_flat" in opt:  # one flat fp32 tensor per group, parameters back to back
            for g, shapes in enumerate(groups):
                flat, off = opt["fp32_groups_flat"][g], 0
                for name, shape in shapes.items():
                    n = _numel(shape)
                    self._where[name] = lambda flat=flat, off=off, n=n, shape=shape: flat[off:off + n].view(shape).clone()
                    off += n
                if off > flat.numel():
                    raise ToolkitError(f"{MODEL_STATES}: fp32 group {g} has {flat.numel()} elements, its parameters "
                                       f"need {off}: shapes do not add up")
        else:
            raise ToolkitError(f"{MODEL_STATES} holds no fp32 master weights (no fp32_groups in its optimizer state); "
                               "read the module weights with fp32=False")

    def _check_partition_count(self, name: str, osd: dict) -> None:
        counts = osd.get("partition_count")
        counts = counts if isinstance(counts, list) else [counts]
        if any(int(c) != self.dp for c in counts):
            raise ToolkitError(f"{name} was partitioned over {counts} ranks, but {META} says dp={self.dp}")

    def _open_zero12_masters(self, bf16: bool, groups: list[dict]) -> None:
        names = self._optim_names(bf16)
        self._require(names)
        parts, osds = [], []
        for name in names:
            osd = load_rank_file(self._file(name))[OSD]
            self._check_partition_count(name, osd)
            parts.append(list(osd[FP32_PARTITIONS]))
            osds.append({k: osd.get(k) for k in ("group_paddings", "param_alignment_paddings", "param_slice_mappings")})
        paddings = osds[0]["param_alignment_paddings"] or [None] * len(groups)
        for g, shapes in enumerate(groups):
            layout = _Zero12Layout(shapes, paddings[g], self.dp)
            check_zero12_group(layout, g, [p[g] for p in parts], osds, names)
            group_parts = [p[g] for p in parts]
            for name, (off, n) in layout.offsets.items():
                self._where[name] = lambda gp=group_parts, off=off, n=n, shape=shapes[name], lay=layout: _cat(
                    lay.gather(gp, off, off + n, lay.partition), shape)

    def _check_names(self) -> None:
        """Every Hugging Face parameter is found (a tied weight under either of its names), nothing else is there,
        and the shapes are the recipe model's."""
        want = self._expected
        for alias, source in self._shared.items():
            if alias in want and alias not in self._where and source in self._where:
                self._where[alias], self._shapes[alias] = self._where[source], self._shapes[source]
        shared = set(self._shared) | set(self._shared.values())
        missing = [n for n in want if n not in self._where]
        extra = [n for n in self._shapes if n not in want and n not in shared]
        if missing or extra:
            raise ToolkitError(f"checkpoint {self.tag_dir} does not hold the recipe's model: "
                               f"missing {missing[:5]}, unexpected {extra[:5]}")
        bad = [f"{n}: {self._shapes[n]} vs {want[n]}" for n in want if tuple(self._shapes[n]) != tuple(want[n])]
        if bad:
            raise ToolkitError(f"checkpoint {self.tag_dir}: shapes differ from the recipe's model: {bad[:5]}")

    # ------------------------------------------------------------------ reading
    def names(self) -> list[str]:
        return list(self._expected)

    def get(self, name: str) -> torch.Tensor:
        if name not in self._expected:
            raise ToolkitError(f"{name!r} is not a parameter of this checkpoint's model (see names())")
        return self._where[name]().contiguous()

    def pieces(self, name: str) -> list[torch.Tensor] | None:
        """The flat views of the memory-mapped files that get(name) concatenates, in order, when it only
        concatenates them (ZeRO-3 without a cast), so a writer can take the bytes without a copy; else None."""
        pieces = self._pieces.get(self._where.get(name))
        return pieces() if pieces is not None else None

    def file_ranges(self, pieces: list[torch.Tensor]) -> list[tuple[int, int, int]] | None:
        """(fd, offset, count) in the rank files of each of pieces(name), for a file-to-file copy; None if unknown."""
        return ranges_of(pieces, getattr(self, "_files", []))

    def __iter__(self):
        for name in self.names():
            yield name, self.get(name)

    def close(self) -> None:
        """Drop the memory-mapped rank files."""
        self._where.clear()
        self._pieces.clear()
        for f in getattr(self, "_files", []):
            f.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def check_zero12_group(layout: _Zero12Layout, g: int, parts: list[torch.Tensor], osds: list[dict],
                       names: list[str]) -> None:
    """The saved partitions of group `g` must be exactly what the layout predicts (else refuse: the checkpoint was
    written with a partitioning this reader does not know, e.g. round-robin gradients)."""
    for r, part in enumerate(parts):
        lean = layout.lean_size(r)
        if part.numel() not in (lean, layout.partition):
            raise ToolkitError(f"{names[r]}: fp32 partition of group {g} has {part.numel()} elements; the group's "
                               f"{layout.used} elements over dp={layout.dp} give {lean}: shapes do not add up")
        mapping = (osds[r].get("param_slice_mappings") or [None] * (g + 1))[g]
        if mapping is not None:
            saved = {k: (int(v.numel), int(v.start)) for k, v in mapping.items()}
            if saved != dict(layout.fragments(r)):
                raise ToolkitError(f"{names[r]}: the parameters of group {g} are not laid out in param_shapes order "
                                   "(param_slice_mappings differ); this partitioning is not supported")


# ====================================================================== resharding
