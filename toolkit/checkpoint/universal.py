"""DeepSpeed's universal checkpoint format: written from a ZeRO-1/2/3 checkpoint, plain (`engine.save_checkpoint` in
a user's script) or the toolkit's own (`toolkit convert CKPT OUT --to universal`), and read back (`toolkit convert
OUT HF --to hf`).

A universal checkpoint holds every parameter whole, by name, with its optimizer state, so DeepSpeed's own
`load_universal_checkpoint` (`"checkpoint": {"load_universal": true}` in the DeepSpeed config) resumes it at any
data-parallel size or ZeRO stage. The files are the ones DeepSpeed's `ds_to_universal.py` (0.19.8) writes:

    OUT/latest_universal                      the tag below (what engine.load_checkpoint(OUT) reads)
    OUT/<tag>/zero/<param>/fp32.pt            the fp32 master weight
    OUT/<tag>/zero/<param>/exp_avg.pt         Adam's first moment
    OUT/<tag>/zero/<param>/exp_avg_sq.pt      Adam's second moment
    OUT/<tag>/zero/<param>/step.pt            ZeRO-1/2 only: the optimizer step (a tensor)
    OUT/<tag>/zero/optimizer_state.pt         the optimizer's other state (loss scaler, param_groups, ...)
    OUT/<tag>/*model_states.pt                copied unchanged

ZeRO-1/2 store each state as {"param": tensor of the parameter's shape, "cat_dim": 0}; ZeRO-3 as the flat tensor
(that is what DeepSpeed's loaders expect of each stage). For ZeRO-1/2, a module tensor with no optimizer state
(frozen parameters, tied aliases) gets an fp32.pt of its model-states value, as ds_to_universal.py does. One
difference from ds_to_universal.py, on purpose: its ZeRO-3 optimizer_state.pt carries rank 0's whole optimizer
file (fp32 partition and moments included, unused by the loader); ours keeps only what the loader reads (the
step, param_groups, loss-scaler state), so memory stays that of one parameter.

Writing streams from memory-mapped rank files read through the allow-listed loader (toolkit/format/safe_load.py):
each state file is written and read back and compared on one of a few threads (save_pool.py). Its bytes go file
to file (os.copy_file_range into a torch.save file written around a hole, save_pool.save_ranges) where the
rank files' tensor offsets are found (pt_ranges.py); otherwise it is made in memory, with the tensors alive at once
bounded in bytes. The output is built in a hidden
folder beside OUT and moved into place only when complete (output.py).
"""
from __future__ import annotations

import json
import shutil
import time
from collections import OrderedDict
from pathlib import Path

import torch

from toolkit.checkpoint import output
from toolkit.checkpoint.deepspeed_io import (
    FP32_PARTITIONS,
    MODEL_STATES,
    OSD,
    _cat,
    _concat_slice,
    _numel,
    _Zero12Layout,
    load_rank_file,
    optim_states,
    read_meta,
    zero3_model_states,
)
from toolkit.checkpoint.deepspeed_plain import PlainDeepSpeedSource, _stage_of, is_plain, resolve_tag
from toolkit.checkpoint.pt_ranges import FileRanges, ranges_of
from toolkit.checkpoint.save_pool import SavePool
from toolkit.checkpoint.sources import follow_pointer
from toolkit.errors import ToolkitError
from toolkit.format import manifest, paths, safe_load
from toolkit.format.names import META
from toolkit.model import released_config
from toolkit.recipe.schema import Recipe

POINTER = "latest_universal"
ZERO = "zero"
STATES = ("fp32", "exp_avg", "exp_avg_sq")
OPTIMIZER_STATE = "optimizer_state.pt"
_SHARDED_ZERO12 = ("base_optimizer_state", "param_slice_mappings", FP32_PARTITIONS)


# ====================================================================== reading
def is_universal(path: Path) -> bool:
    """A universal checkpoint folder (with latest_universal) or one of its tag folders (zero/optimizer_state.pt)."""
    path = Path(path)
    return path.is_dir() and ((path / POINTER).is_file() or (path / ZERO / OPTIMIZER_STATE).is_file())


def resolve_universal(path: Path) -> Path:
    """The tag folder: `path` itself when it holds zero/, else the one its latest_universal names."""
    path = Path(path)
    if (path / ZERO / OPTIMIZER_STATE).is_file():
        return path
    pointer = path / POINTER
    tag = paths.pointer(pointer)
    folder = paths.inside(path, tag, str(pointer))
    if not (folder / ZERO / OPTIMIZER_STATE).is_file():
        raise ToolkitError(f"{pointer} names tag {tag!r}, but {folder / ZERO / OPTIMIZER_STATE} does not exist: the "
                           "universal checkpoint is incomplete; write it again (toolkit convert CKPT OUT --to "
                           "universal)")
    return folder


class UniversalSource:
    """Full tensors of a universal checkpoint, by the model's own names, one at a time: the fp32 masters from
    zero/<name>/fp32.pt (fp32=True), or cast to the dtype the model trained in (the default, as the engine's own
    16-bit weights). Names, shapes, tied aliases and buffers come from the copied model-states file; the same
    interface as PlainDeepSpeedSource, so plain_to_hf.py writes the Hugging Face folder."""

    def __init__(self, tag_dir: str | Path, fp32: bool = False):
        self.tag_dir, self.fp32 = Path(tag_dir), fp32
        models = sorted(p.name for p in self.tag_dir.glob("*model_states.pt"))
        for name in models:  # never a file elsewhere through a link (paths)
            paths.inside(self.tag_dir, name, f"universal checkpoint {self.tag_dir}")
        first = MODEL_STATES if MODEL_STATES in models else zero3_model_states(0)
        if first not in models:
            raise ToolkitError(f"{self.tag_dir} holds no {MODEL_STATES} or {zero3_model_states(0)}: not a universal "
                               "checkpoint DeepSpeed wrote or toolkit convert --to universal wrote")
        states = load_rank_file(self.tag_dir / first)
        self.stage, self.dp = _stage_of(states), int(states.get("dp_world_size") or 1)
        self.step = int(states.get("global_steps") or 0)
        config = states.get("ds_config") or {}
        self.dtype = (torch.bfloat16 if (config.get("bf16") or {}).get("enabled") else
                      torch.float16 if (config.get("fp16") or {}).get("enabled") else torch.float32)
        self._shared = dict(states.get("shared_params") or {})
        self._shapes = OrderedDict((k, tuple(v)) for g in states.get("param_shapes") or [] for k, v in g.items())
        self._kind = {n: "zero" for n in self._shapes}
        module = states.get("module") or {}
        frozen = states.get("frozen_param_shapes") or {}
        for name, shape in frozen.items():
            self._shapes[name], self._kind[name] = tuple(shape), "zero" if self.stage < 3 else "frozen3"
        for name in [b for b in (states.get("buffer_names") or []) if b in module]:
            self._shapes[name], self._kind[name] = tuple(module[name].shape), "buffer"
        self._module, self._models = module, [m for m in models if m != MODEL_STATES]
        self._names = [n for n in self._shapes if n not in self._shared]
        missing = [n for n in self._names if self._kind[n] == "zero" and not self._file(n, "fp32.pt").is_file()]
        if missing:
            raise ToolkitError(f"{self.tag_dir / ZERO} lacks fp32.pt of {missing[:3]}: the universal checkpoint is "
                               "incomplete; write it again")

    def _file(self, name: str, leaf: str) -> Path:
        """zero/<name>/<leaf>, refused unless it resolves inside the tag folder (zero/ or a file linked out)."""
        return paths.inside(self.tag_dir, Path(ZERO) / name / leaf, f"universal checkpoint {self.tag_dir}")

    def names(self) -> list[str]:
        return list(self._names)

    def shape(self, name: str) -> tuple:
        return self._shapes[name]

    def shared(self) -> dict[str, str]:
        return dict(self._shared)

    def out_dtype(self, name: str) -> torch.dtype:
        if self._kind[name] == "buffer":
            return self._module[name].dtype
        return torch.float32 if self.fp32 else self.dtype

    def get(self, name: str) -> torch.Tensor:
        kind, shape = self._kind.get(name), self._shapes.get(name)
        if kind is None:
            raise ToolkitError(f"{name!r} is not a tensor of universal checkpoint {self.tag_dir} (see names())")
        if kind == "buffer":
            return self._module[name].clone()
        if kind == "frozen3":  # ZeRO-3 frozen parameters: not in zero/, a slice in every rank's model states
            frags = [load_rank_file(self.tag_dir / m)["frozen_param_fragments"][name].view(-1) for m in self._models]
            t = torch.cat(frags)[:_numel(shape)].view(shape)
        else:
            t = load_state(self._file(name, "fp32.pt"), shape)
        return t.to(self.out_dtype(name)).contiguous()

    def close(self) -> None:
        self._module = {}


def load_state(file: Path, shape) -> torch.Tensor:
    """One universal state file: {"param": tensor, ...} (ZeRO-1/2) or a flat tensor (ZeRO-3), in `shape`."""
    data = safe_load.load(file, mmap=True, deepspeed=True)
    t = data.get("param") if isinstance(data, dict) else data
    if not torch.is_tensor(t) or t.numel() != _numel(shape):
        raise ToolkitError(f"{file} holds {getattr(t, 'shape', type(t).__name__)}, not {_numel(shape)} elements of "
                           f"shape {tuple(shape)}: the universal checkpoint does not match its model states")
    return t.reshape(shape)


# ====================================================================== writing
def write_universal(src: str | Path, dst: str | Path, overwrite: bool = False, log=print) -> Path:
    """Write DST as a universal checkpoint of the ZeRO-1/2/3 checkpoint SRC (see the module docstring)."""
    src, dst = Path(src), Path(dst)
    output.check_destination(src, dst, overwrite)
    tag = _tag_of(src)
    probe = PlainDeepSpeedSource(tag)  # checks that every rank's file is there and all are of one save
    try:
        stage, dp, ok = probe.stage, probe.dp, probe.report["optimizer_complete"]
    finally:
        probe.close()
    if stage == 0:
        raise ToolkitError(f"{tag} is a ZeRO-0 checkpoint: DeepSpeed's universal format is made from ZeRO-1/2/3 "
                           "optimizer partitions; save with ZeRO-1, 2 or 3, or convert --to hf")
    if not ok:
        raise ToolkitError(f"{tag} holds no optimizer state (its *_optim_states.pt files are missing): a universal "
                           "checkpoint carries the fp32 masters and Adam moments; use a checkpoint saved with its "
                           "optimizer state, or convert --to hf for the weights alone")
    probe = PlainDeepSpeedSource(tag, fp32=True)  # the optimizer files, checked (one save, partition counts)
    probe.close()
    bf16 = any(p.name.startswith("bf16_") for p in tag.glob("*_optim_states.pt"))
    models = [zero3_model_states(r) for r in range(dp)] if stage == 3 else [MODEL_STATES]
    optims = [optim_states(r, bf16) for r in range(dp)]
    need = sum(tag.joinpath(n).stat().st_size for n in models + optims)
    with output.scratch_folder(dst, "partial") as tmp:
        manifest.require_space(dst.parent, need, manifest.free_bytes(tmp), str(dst), "the universal checkpoint")
        out = tmp / tag.name
        (out / ZERO).mkdir(parents=True)
        log(f"converting DeepSpeed ZeRO-{stage} dp={dp} at {tag} -> universal")
        t0 = time.monotonic()
        count = (_zero3 if stage == 3 else _zero12)(tag, out / ZERO, models, optims, dp)
        for name in models:
            shutil.copy2(paths.inside(tag, name, str(tag)), out / name)
        _carry_config(src, tag, out)
        (tmp / POINTER).write_text(tag.name)
        log(f"wrote {count} parameters (fp32, exp_avg, exp_avg_sq each), read back and compared, in "
            f"{time.monotonic() - t0:.1f} s")
        output.replace(tmp, dst, overwrite)
    return dst


def _carry_config(src: Path, tag: Path, out: Path) -> None:
    """The model's config.json into the universal tag folder, where `--to hf` finds it with no --config: a
    toolkit run's, made from its recipe, or the one beside a plain checkpoint (DeepSpeed's loader ignores it)."""
    if (tag / META).is_file():
        meta = manifest.read_meta(tag)
        if meta.get("recipe"):
            config = released_config(Recipe.model_validate(meta["recipe"]).model, meta.get("tokens"))
            (out / "config.json").write_text(json.dumps(config, indent=2, default=str))
        return
    for folder in (tag, src):
        if (folder / "config.json").is_file():
            shutil.copy2(paths.inside(folder, "config.json", str(folder)), out / "config.json")
            return


def _tag_of(src: Path) -> Path:
    """The step folder to convert: a plain checkpoint's (its `latest`, or the global_step* folder given), or a toolkit
    DeepSpeed checkpoint's (its latest_complete, or the step_* folder given; manifest checked first)."""
    if is_universal(src):
        raise ToolkitError(f"{src} is already a universal checkpoint: DeepSpeed loads it at any DP size as it is "
                           "(checkpoint.load_universal); convert it --to hf for the weights")
    if is_plain(src):
        return resolve_tag(src)
    tag = follow_pointer(src)
    if (tag / META).is_file():
        read_meta(tag)  # every file against the manifest; refuses another backend
        return tag
    raise ToolkitError(f"{src} is not a DeepSpeed checkpoint written by engine.save_checkpoint (a folder with "
                       "`latest`, a global_step* folder, or a toolkit DeepSpeed checkpoint): --to universal "
                       "converts those")


def _save(obj, file: Path) -> None:
    """torch.save, then read back through the allow-listed loader (DeepSpeed's records) and compared; in this thread
    (the per-parameter files go through save_pool.SavePool)."""
    file.parent.mkdir(parents=True, exist_ok=True)
    torch.save(obj, file)
    back = safe_load.load(file, mmap=True, deepspeed=True)
    pairs = [(obj, back)] if torch.is_tensor(obj) else [(obj[k], back.get(k)) for k in obj if torch.is_tensor(obj[k])]
    if any(not torch.is_tensor(b) or a.dtype != b.dtype or not torch.equal(a, b) for a, b in pairs):
        raise ToolkitError(f"verification failed: {file} reads back different from what was written; nothing was "
                           "written")


def _osds(tag: Path, optims: list[str]) -> list[dict]:
    osds = []
    for name in optims:
        osd = load_rank_file(tag / name).get(OSD)
        if not isinstance(osd, dict):
            raise ToolkitError(f"{name} in {tag} holds no {OSD}: not a DeepSpeed ZeRO optimizer file; re-copy it")
        osds.append(osd)
    return osds


def _state_tensors(osd: dict, zero3: bool) -> list:
    """A rank's flat fp32 partitions and Adam moments, in a fixed order (what the per-parameter files are cut from)."""
    flat = osd["fp32_flat_groups"] if zero3 else osd[FP32_PARTITIONS]
    state = (osd[OSD] if zero3 else osd["base_optimizer_state"])["state"]
    return [*flat, *(state[i][k] for i in sorted(state) for k in ("exp_avg", "exp_avg_sq"))]


def _file_ranges(tag: Path, optims: list[str], osds: list[dict], zero3: bool) -> list[FileRanges]:
    """Where those tensors lie in each rank's optimizer file (pt_ranges: offsets read with map_location="meta" and
    checked against the mapped bytes), so the per-parameter files are filled file to file; a rank whose offsets
    cannot be found or do not check out has none, and its pieces are written through memory."""
    out = []
    for name, osd in zip(optims, osds):
        try:
            meta = _state_tensors(safe_load.load(tag / name, deepspeed=True, map_location="meta")[OSD], zero3)
            out.append(FileRanges(tag / name, _state_tensors(osd, zero3), meta))
        except (ToolkitError, KeyError, TypeError, IndexError):
            out.append(FileRanges(tag / name, [], [None]))
    return out


def _submit(pool: SavePool, file: Path, pieces: list, ranges: list, template, make, nbytes: int) -> None:
    """The file filled file to file from its pieces' byte ranges when they all have one, else made in memory."""
    where = ranges_of(pieces, ranges)
    if where is not None:
        pool.submit_ranges(file, template, where, pieces)
    else:
        pool.submit(file, make, nbytes)


def _moments(state: dict, where: str) -> dict:
    missing = [k for k in ("exp_avg", "exp_avg_sq") if not torch.is_tensor(state.get(k))]
    if missing:
        raise ToolkitError(f"{where} has no {', '.join(missing)}: DeepSpeed's universal format holds Adam's moments; "
                           "this optimizer (not Adam/AdamW) is not supported")
    return state


def _zero12(tag: Path, zero: Path, models: list[str], optims: list[str], dp: int) -> int:
    states = load_rank_file(tag / MODEL_STATES)
    osds = _osds(tag, optims)
    ranges = _file_ranges(tag, optims, osds, False)
    paddings = osds[0].get("param_alignment_paddings") or [None] * len(states["param_shapes"])
    written = set()
    with SavePool() as pool:
        for g, shapes in enumerate(states["param_shapes"]):
            shapes = OrderedDict((k, tuple(v)) for k, v in shapes.items())
            layout = _Zero12Layout(shapes, paddings[g], dp)
            base = [_moments(o["base_optimizer_state"]["state"][g], f"{optims[r]} group {g}")
                    for r, o in enumerate(osds)]
            parts = {"fp32": [o[FP32_PARTITIONS][g] for o in osds], "exp_avg": [b["exp_avg"] for b in base],
                     "exp_avg_sq": [b["exp_avg_sq"] for b in base]}
            step = base[0].get("step")
            for name, (off, n) in layout.offsets.items():
                (zero / name).mkdir(parents=True, exist_ok=True)
                for key in STATES:
                    pieces = layout.gather(parts[key], off, off + n, layout.partition)
                    dtype = parts[key][0].dtype
                    _submit(pool, zero / name / f"{key}.pt", pieces, ranges,
                            lambda s=shapes[name], d=dtype: {"cat_dim": 0, "param": torch.empty(s, dtype=d)},
                            lambda p=pieces, s=shapes[name]: {"cat_dim": 0, "param": _cat(p, s)},  # a fresh tensor
                            n * parts[key][0].element_size())
                if step is not None:
                    pool.submit(zero / name / "step.pt", lambda st=step: st.clone() if torch.is_tensor(st) else st, 0)
                written.add(name)
        for name, t in (states.get("module") or {}).items():  # no optimizer state: the model-states value, as fp32
            if name not in written:
                (zero / name).mkdir(parents=True, exist_ok=True)
                pool.submit(zero / name / "fp32.pt", lambda t=t: {"param": t.float()}, 4 * t.numel())
    opt = {k: v for k, v in osds[0].items() if k not in _SHARDED_ZERO12}
    opt["param_groups"] = osds[0]["base_optimizer_state"]["param_groups"]
    _save(opt, zero / OPTIMIZER_STATE)
    return len(written)


def _zero3(tag: Path, zero: Path, models: list[str], optims: list[str], dp: int) -> int:
    states = load_rank_file(tag / models[0])
    osds = _osds(tag, optims)
    ranges = _file_ranges(tag, optims, osds, True)
    count = 0
    with SavePool() as pool:
        for idx, shapes in enumerate(states["param_shapes"]):
            flats = {"fp32": [o["fp32_flat_groups"][idx] for o in osds]}
            inner = [_moments(o[OSD]["state"][idx], f"{optims[r]} sub-group {idx}") for r, o in enumerate(osds)]
            flats.update(exp_avg=[s["exp_avg"] for s in inner], exp_avg_sq=[s["exp_avg_sq"] for s in inner])
            off = 0
            for name, shape in shapes.items():
                n = _numel(shape)
                chunk = -(-n // dp)
                (zero / name).mkdir(parents=True, exist_ok=True)
                for key in STATES:
                    pieces = []
                    for r in range(dp):
                        take = max(0, min(chunk, n - r * chunk))
                        pieces += _concat_slice([flats[key][r]], off, off + take) if take else []
                    # else torch.cat makes a fresh tensor (not a view of the file), in the worker thread
                    _submit(pool, zero / name / f"{key}.pt", pieces, ranges,
                            lambda n=n, d=flats[key][0].dtype: torch.empty(n, dtype=d), lambda p=pieces: torch.cat(p),
                            n * flats[key][0].element_size())
                off += chunk
                count += 1
    opt = {k: v for k, v in osds[0].items() if k != "fp32_flat_groups"}
    inner = opt[OSD]
    opt[OSD] = {**inner, "state": {k: {s: v for s, v in st.items() if s == "step"} for k, st in inner["state"].items()}}
    opt["param_groups"] = inner["param_groups"]
    _save(opt, zero / OPTIMIZER_STATE)
    return count


def inspect_universal(path: Path) -> dict:
    """`toolkit inspect` of a universal checkpoint."""
    path = Path(path)
    report = {"path": str(path), "format": "deepspeed universal", "complete": False, "problems": [],
              "step": None, "layout": None, "architecture": None, "parameters": None, "dtypes": None,
              "bytes": paths.regular_bytes(path)}
    try:
        tag = resolve_universal(path)
        src = UniversalSource(tag)
    except ToolkitError as e:
        report["problems"].append(str(e))
        return report
    # every state file, as a conversion reads it (memory-mapped: the pickle, and the size its tensor needs); inspect
    # called a truncated or planted fp32.pt complete until 2026-12-07
    report["problems"] = [why for f in sorted((tag / "zero").rglob("*.pt")) if (why := safe_load.check_file(f))]
    if report["problems"]:
        src.close()
        return report
    count = sum(_numel(src.shape(n)) for n in src.names())
    report.update(complete=True, step=src.step, tag=tag.name, layout={"zero_stage": src.stage, "dp": src.dp},
                  written_by="DeepSpeed universal checkpoint (ds_to_universal.py or toolkit convert --to universal);"
                             f" saved from ZeRO-{src.stage} dp={src.dp}, loads at any DP size",
                  optimizer_state="complete (fp32, exp_avg, exp_avg_sq per parameter)", parameters=count,
                  dtypes={"float32 masters and Adam moments": count},
                  architecture={"names": "the model's own (from param_shapes)", "tensors": len(src.names()),
                                "tied": src.shared() or None})
    src.close()
    return report
