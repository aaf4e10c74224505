"""Plain DeepSpeed checkpoints: what `engine.save_checkpoint` writes in a user's own training script (HF Trainer,
Accelerate, a hand-written loop), with no toolkit files.

A checkpoint folder holds ``latest`` (the tag of the newest save) and one folder per tag (``global_stepN``) with
the files described in toolkit/checkpoint/deepspeed_io.py. Everything this reader needs is in DeepSpeed's own
records there: ``dp_world_size``, ``global_steps``, ``ds_version`` and ``ds_config`` (the ZeRO stage) in the model
states; the parameter names and shapes in ``param_shapes`` (one ordered dict per optimizer group),
``frozen_param_shapes`` (+ ``frozen_param_fragments``), ``shared_params`` (alias -> the parameter it is tied to)
and ``buffer_names`` (persistent buffers, whole in rank 0's ``module``). The names are the model's own, so any
architecture reads. The ZeRO partition arithmetic is DeepSpeedSource's (deepspeed_io.py); this module only
replaces where the layout comes from (the files instead of toolkit_meta.json) and checks that the files belong to
one save of one run before anything is read.
"""
from __future__ import annotations

import re
from collections import OrderedDict
from pathlib import Path

import torch

from toolkit.checkpoint.deepspeed_io import (
    MODEL_STATES,
    OSD,
    DeepSpeedSource,
    load_rank_file,
    optim_states,
    zero3_model_states,
)
from toolkit.errors import ToolkitError
from toolkit.format import paths
from toolkit.format.names import META, POINTER, STARTED

LATEST = "latest"
_ZERO3_MODEL = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")
_OPTIM = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_MP_MODEL = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")


def is_tag(folder: Path) -> bool:
    return folder.is_dir() and any(_ZERO3_MODEL.match(p.name) or _MP_MODEL.match(p.name) for p in folder.iterdir())


def is_plain(path: Path) -> bool:
    """Whether `path` looks like a plain DeepSpeed checkpoint folder (with `latest`) or one of its tag folders."""
    path = Path(path)
    if not path.is_dir() or (path / META).is_file() or (path / POINTER).is_file() or path.name.startswith("step_"):
        return False  # the toolkit's own DeepSpeed checkpoints (toolkit_meta.json, latest_complete, step_*)
    if any(path.glob(f"step_*/{STARTED}")):  # the toolkit's directory without its pointer: DeepSpeed's `latest` too
        return False
    return (path / LATEST).is_file() or is_tag(path)


def resolve_tag(path: Path) -> Path:
    """The tag folder to read: `path` itself when it holds model-states files, else the one its `latest` names."""
    path = Path(path)
    if is_tag(path):
        return path
    pointer = path / LATEST
    if not pointer.is_file():
        raise ToolkitError(f"{path} holds no DeepSpeed model-states files and no `latest` file; pass the checkpoint "
                           "folder engine.save_checkpoint wrote, or one of its global_step* folders")
    tag = paths.pointer(pointer)
    folder = paths.inside(path, tag, str(pointer))
    if not is_tag(folder):
        what = "holds no model-states files" if folder.is_dir() else "does not exist"
        raise ToolkitError(f"{pointer} names tag {tag!r}, but {folder} {what}"
                           f"; pass an existing global_step* folder instead (the save of {tag!r} did not finish or "
                           "was removed)")
    return folder


def _stage_of(states: dict) -> int:
    zero = (states.get("ds_config") or {}).get("zero_optimization") or {}
    return int(zero.get("stage", 0) or 0) if isinstance(zero, dict) else 0


def _opt_step(osd: dict):
    """The torch optimizer's step counter inside one optimizer file (the same on every rank of one save)."""
    base = osd.get("base_optimizer_state") or osd.get("optimizer_state_dict") or {}
    state = base.get("state") if isinstance(base, dict) else None
    if not state:
        return None
    first = next(iter(state.values()))
    step = first.get("step") if isinstance(first, dict) else None
    return int(step.item() if torch.is_tensor(step) else step) if step is not None else None


class PlainDeepSpeedSource(DeepSpeedSource):
    """Full tensors of a plain DeepSpeed checkpoint, by the model's own parameter names, one at a time (see
    DeepSpeedSource for what fp32 selects). `names()` lists the parameters (param_shapes order, then frozen ones)
    and persistent buffers; a tied alias (shared_params) is not listed: Hugging Face ties it on load.
    `report` holds what `toolkit inspect` shows."""

    def __init__(self, tag_dir: str | Path, fp32: bool = False):

        self.tag_dir, self.fp32 = Path(tag_dir), fp32
        files = self._scan()
        states = load_rank_file(self._file(files["model"][0]))
        self.stage, self.dp = _stage_of(states), int(states.get("dp_world_size") or 1)
        self.step = int(states.get("global_steps") or 0)
        self.ds_version = states.get("ds_version")
        module = states.get("module") or {}
        params = [t for k, t in module.items() if k not in set(states.get("buffer_names") or [])]
        self.dtype = params[0].dtype if params else torch.float32
        if not files["optim"]:  # none saved (or all removed): DeepSpeed names them bf16_ when training in bf16
            files["bf16"] = self.dtype == torch.bfloat16
        self._check_files(files, states)
        bf16 = self.stage > 0 and files["bf16"]
        if self.stage == 0 and fp32 and self.dtype != torch.float32:
            raise ToolkitError(f"{self.tag_dir}: a ZeRO-0 checkpoint records no parameter names for its fp32 master "
                               "weights (no param_shapes); convert its model states (drop --fp32)")
        self._where: dict[str, object] = {}
        self._pieces: dict[object, object] = {}  # see DeepSpeedSource.pieces
        if self.stage == 3:
            self._open_zero3(bf16)
        else:
            self._open_zero012(bf16)
        self._shapes = OrderedDict((k, tuple(v)) for k, v in self._shapes.items())
        buffers = [b for b in (states.get("buffer_names") or []) if b in module]
        for name in buffers:  # persistent buffers are whole in rank 0's module, in their own dtype
            self._where[name] = lambda t=module[name]: t.clone()
            self._shapes[name] = tuple(module[name].shape)
        self._names = [n for n in self._shapes if n not in self._shared]
        frozen = states.get("frozen_param_shapes") or {}
        fragments = states.get("frozen_param_fragments") or {}
        train = torch.float32 if fp32 else self.dtype
        self._dtypes = {n: module[n].dtype if n in buffers or (n in frozen and self.stage < 3)
                        else fragments[n].dtype if n in frozen else train for n in self._names}
        missing = [n for n in self._names if n not in self._where]
        if missing:
            raise ToolkitError(f"{self.tag_dir}: no weights found for {missing[:5]}: the files do not match their "
                               "own param_shapes; re-save the checkpoint")
        self.report = {"zero_stage": self.stage, "dp": self.dp, "step": self.step, "ds_version": self.ds_version,
                       "dtype": str(self.dtype).replace("torch.", ""), "files": files["all"],
                       "optimizer_complete": states.get("optimizer") is not None if self.stage == 0
                       else len(files["optim"]) == self.dp}

    # ------------------------------------------------------------------ checks before reading
    def _scan(self) -> dict:
        """The DeepSpeed files of the tag folder, grouped; refuses model-parallel and mixed-stage folders."""
        names = sorted(p.name for p in self.tag_dir.iterdir())
        zero3 = sorted((m for n in names if (m := _ZERO3_MODEL.match(n))), key=lambda m: int(m.group(1)))
        mp = [m for n in names if (m := _MP_MODEL.match(n))]
        optim = sorted((m for n in names if (m := _OPTIM.match(n))), key=lambda m: int(m.group(2)))
        if any(int(m.group(m.re.groups)) != 0 for m in [*zero3, *mp, *optim]):
            raise ToolkitError(f"{self.tag_dir} holds files of several model-parallel ranks (mp_rank_01...): "
                               "DeepSpeed tensor/pipeline parallel checkpoints are not read; convert one written "
                               "with data parallelism only")
        if zero3 and mp:
            raise ToolkitError(f"{self.tag_dir} mixes ZeRO-3 files ({zero3[0].string}) with ZeRO-0/1/2 files "
                               f"({mp[0].string}): two saves of different stages share the folder; keep the files "
                               "of one save only (or pass the folder of one save)")
        prefixes = {bool(m.group(1)) for m in optim}
        if len(prefixes) > 1:
            raise ToolkitError(f"{self.tag_dir} mixes bf16_ and plain optimizer files: two saves of different "
                               "precisions share the folder; keep the files of one save only")
        if not zero3 and not mp:
            raise ToolkitError(f"{self.tag_dir} holds no DeepSpeed model-states file")
        return {"model": [m.string for m in zero3] if zero3 else [MODEL_STATES], "zero3": bool(zero3),
                "optim": [m.string for m in optim], "bf16": prefixes == {True}, "all": len(names)}

    def _check_files(self, files: dict, states: dict) -> None:
        """Every rank's file is there, and all of them come from this one save (same stage, step, world size)."""
        where = f"checkpoint {self.tag_dir} (ZeRO-{self.stage}, dp={self.dp}, step {self.step})"
        if (self.stage == 3) != files["zero3"]:
            kind = "ZeRO-3 per-rank model states" if files["zero3"] else "a ZeRO-0/1/2 mp_rank_00 model states file"
            raise ToolkitError(f"{where}: its ds_config says ZeRO-{self.stage} but the folder holds {kind}: files of "
                               "different saves are mixed; keep the files of one save only")
        want_model = [zero3_model_states(r) for r in range(self.dp)] if self.stage == 3 else [MODEL_STATES]
        weights_only = self.stage in (1, 2) and not files["optim"] and not self.fp32  # optimizer files deleted
        want_optim = [] if self.stage == 0 or weights_only else [optim_states(r, files["bf16"]) for r in range(self.dp)]
        missing = [n for n in want_model + want_optim if not self._file(n).is_file()]
        if missing:
            raise ToolkitError(f"{where} lacks {', '.join(missing[:4])}: a rank did not save or the file was removed; "
                               "use another checkpoint or re-copy the missing file")
        extra = sorted(set(files["model"] + files["optim"]) - set(want_model + want_optim))
        if extra:
            raise ToolkitError(f"{where} also holds {', '.join(extra[:4])}, of ranks beyond dp={self.dp}: files of "
                               "another run are mixed in; keep the files of one save only")
        key = ("global_steps", "dp_world_size", "ds_version")
        mine = tuple(states.get(k) for k in key)
        for name in want_model[1:]:
            other = load_rank_file(self._file(name))
            theirs = tuple(other.get(k) for k in key)
            same = other.get("param_shapes") == states.get("param_shapes") and other.get("ds_config") == states.get(
                "ds_config")
            if theirs != mine or not same:
                raise ToolkitError(f"{where}: {name} is from another save ({dict(zip(key, theirs))} vs "
                                   f"{dict(zip(key, mine))}, or other parameters): files of two runs are mixed; keep "
                                   "the files of one save only")
        steps = {}
        for name in want_optim:
            osd = load_rank_file(self._file(name)).get(OSD)
            if not isinstance(osd, dict):
                raise ToolkitError(f"{name} in {self.tag_dir} holds no optimizer_state_dict: not a DeepSpeed ZeRO "
                                   "optimizer file; re-copy it")
            stage = osd.get("zero_stage")
            if stage is not None and int(stage) != self.stage:
                raise ToolkitError(f"{where}: {name} was written at ZeRO-{int(stage)}: files of different saves are "
                                   "mixed; keep the files of one save only")
            steps[name] = _opt_step(osd)
        if len(set(steps.values())) > 1:
            raise ToolkitError(f"{where}: the optimizer files are at different steps "
                               f"({', '.join(f'{n}: {s}' for n, s in steps.items())}): files of two runs or saves are "
                               "mixed; keep the files of one save only")

    def _check_partition_count(self, name: str, osd: dict) -> None:
        counts = osd.get("partition_count")
        counts = counts if isinstance(counts, list) else [counts]
        if any(int(c) != self.dp for c in counts):
            raise ToolkitError(f"{name} was partitioned over {counts} ranks, but the model states say "
                               f"dp_world_size={self.dp}: files of different runs are mixed")

    def _open_zero012(self, bf16: bool) -> None:
        if self.stage > 0:
            return super()._open_zero012(bf16)
        states = load_rank_file(self._file(MODEL_STATES))  # ZeRO-0: no param_shapes; the module is every weight
        buffers = set(states.get("buffer_names") or [])
        module = states["module"]
        self._shapes = OrderedDict((k, tuple(t.shape)) for k, t in module.items() if k not in buffers)
        self._shared = dict(states.get("shared_params") or {})
        for name in self._shapes:
            self._where[name] = lambda t=module[name]: t.clone()

    # ------------------------------------------------------------------ reading
    def names(self) -> list[str]:
        return list(self._names)

    def shape(self, name: str) -> tuple:
        return self._shapes[name]

    def shared(self) -> dict[str, str]:
        """Tied aliases (name -> the parameter it shares storage with), as DeepSpeed recorded them."""
        return dict(self._shared)

    def get(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise ToolkitError(f"{name!r} is not a tensor of checkpoint {self.tag_dir} (see names())")
        return self._where[name]().contiguous()

    def out_dtype(self, name: str) -> torch.dtype:
        """The dtype get(name) returns, known without reading the tensor."""
        return self._dtypes[name]

def inspect_plain(path: Path) -> dict:
    """`toolkit inspect` of a plain DeepSpeed checkpoint: stage, DP size, dtypes, step, optimizer completeness, and
    the DeepSpeed version that wrote it. Problems are listed, not raised, so a damaged checkpoint still reports."""
    path = Path(path)
    report = {"path": str(path), "format": "deepspeed (plain engine.save_checkpoint)", "complete": False,
              "problems": [], "step": None, "layout": None, "architecture": None, "parameters": None,
              "dtypes": None, "bytes": paths.regular_bytes(path)}
    try:
        tag = resolve_tag(path)
        src = PlainDeepSpeedSource(tag)
    except ToolkitError as e:
        report["problems"].append(str(e))
        return report
    r = src.report
    tags = sorted(p.name for p in path.iterdir() if is_tag(p)) if tag != path else [tag.name]
    report.update(complete=True, step=r["step"], tag=tag.name, tags=tags,
                  layout={"zero_stage": r["zero_stage"], "dp": r["dp"]},
                  written_by=f"DeepSpeed {r['ds_version']} (engine.save_checkpoint)",
                  optimizer_state="complete" if r["optimizer_complete"] else "missing",
                  parameters=sum(_numel(src.shape(n)) for n in src.names()))
    report["dtypes"] = zero_dtypes(r, report["parameters"])
    report["architecture"] = {"names": "the model's own (from param_shapes)", "tensors": len(src.names()),
                              "tied": src.shared() or None}
    src.close()
    return report


def zero_dtypes(r: dict, parameters: int) -> dict[str, int]:
    """The weights by dtype of a ZeRO checkpoint (`PlainDeepSpeedSource.report`), as inspect names them: the model's
    and the fp32 masters, where each is stored, under the names the other formats' reports use (F32, BF16, F16: it
    said float32 and bfloat16 until 2026-12-07)."""
    dtype = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}.get(r["dtype"], r["dtype"])
    if dtype == "F32":
        return {"F32 (model weights are the masters)": parameters}
    masters = "F32 masters in the optimizer files" if r["zero_stage"] > 0 else "F32 masters in the model states"
    weights = (f"{dtype} model weights" if r["zero_stage"] < 3 else
               f"{dtype} training dtype (no 16-bit weights stored; they are the F32 masters cast)")
    return {weights: parameters, masters: parameters}


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
