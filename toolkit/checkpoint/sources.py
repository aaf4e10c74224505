"""Checkpoint sources for `toolkit convert`: each reads its own layout from its own files, checks it is complete
before anything is written, and hands out one parameter's Hugging Face tensors at a time.

A source answers read(hf_names, field) with the full (unsharded) Hugging Face tensors of one Megatron parameter
(e.g. q, k and v for linear_qkv). `field` is "weight", or an optimizer tensor of that parameter ("exp_avg",
"exp_avg_sq", "master") for sources that carry optimizer state: those convert with the very same rules.
Megatron-LM's legacy and torch_dist sources are in toolkit/checkpoint/megatron_sources.py, the base classes in
toolkit/checkpoint/source_base.py.
"""
from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

import torch

from toolkit.adapters.megatron import scheduler_state
from toolkit.checkpoint import megatron_flat, megatron_lm, torch_dist
from toolkit.checkpoint.deepspeed_io import DeepSpeedSource
from toolkit.checkpoint.deepspeed_plain import is_plain
from toolkit.checkpoint.megatron_sources import MegatronLMSource, TorchDistSource
from toolkit.checkpoint.source_base import WEIGHT, Source, _ShardedSource  # noqa: F401 (WEIGHT, Source: re-exported)
from toolkit.checkpoint.torch_dist_optim import param_groups
from toolkit.errors import Problem, ToolkitError
from toolkit.families.entries import holders, iter_entries, raise_problems, rank_key
from toolkit.families.mapping import Dims, check_dims
from toolkit.families.registry import family_of_config
from toolkit.format import manifest, paths
from toolkit.format import safetensors_stream as st
from toolkit.format.names import (META, OPTIM_GROUPS, OPTIM_SCHEDULER, POINTER, chunk_key, model_file, optim_file,
                                  rank_tag)
from toolkit.model import to_hf_config
from toolkit.recipe.schema import Recipe

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "generation_config.json", "chat_template.jinja")
"""Files carried along into a Hugging Face output (each checked to lie inside its folder, links followed)."""


def meta_shards(dims: Dims, tp: int, pp: int, vpp: int, ep: int = 1) -> dict[tuple[int, ...], dict[str, tuple]]:
    """{(pp_rank, tp_rank[, ep_rank when ep > 1]): {"chunk{c}.{name}": shard shape}} of a Megatron layout, from the
    rules' shard_shape (tests pin it to what split really gives): the one place shapes come from, for checking
    sources and laying out files."""

    raise_problems(f"the model cannot be laid out at tp={tp} pp={pp} vpp={vpp}" + (f" ep={ep}" if ep > 1 else ""),
                   check_dims(dims, tp, pp, vpp, ep))
    out: dict[tuple[int, ...], dict[str, tuple]] = {rank_key(p, t, e, ep): {} for p in range(pp) for t in range(tp)
                                                    for e in range(ep)}
    for e in iter_entries(dims, pp, vpp, ep):
        shape = e.rule.shard_shape(e.hf_shapes, tp)
        for t in range(tp):
            for r in holders(e, ep):
                out[rank_key(e.pp_rank, t, r, ep)][chunk_key(e.chunk, e.megatron_name)] = shape
    return out


class HFSource(Source):
    """A Hugging Face folder: config.json and *.safetensors (sharded with model.safetensors.index.json, or one)."""

    kind = "Hugging Face"

    def __init__(self, folder: Path):
        self.folder = folder
        config = paths.inside(folder, "config.json", str(folder))
        if not config.is_file():
            raise ToolkitError(f"{folder} has no config.json; a Hugging Face model folder needs one")
        self.config = _json(config, "a Hugging Face config.json", dict)
        for name in TOKENIZER_FILES:  # copied into the output: never one from outside the folder
            if (folder / name).exists() or (folder / name).is_symlink():
                paths.inside(folder, name, f"{folder} (its tokenizer file)")
        index = paths.inside(folder, "model.safetensors.index.json", str(folder))
        if index.is_file():
            weight_map = _json(index, "a safetensors index", dict).get("weight_map") or {}
            if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
                raise ToolkitError(f"{index} has a weight_map that is not {{tensor name: file name}}; re-save the "
                                   "model with save_pretrained")
            files = sorted(set(weight_map.values()))
            for f in files:
                paths.inside(folder, f, f"{index}")
            missing = [f for f in files if not (folder / f).is_file()]
            if missing:
                raise ToolkitError(f"{folder} is incomplete: {', '.join(missing[:4])} listed in {index.name} "
                                   f"{'is' if len(missing) == 1 else 'are'} missing")
        else:
            files = sorted(p.name for p in folder.glob("*.safetensors"))
            if not files:
                raise ToolkitError(f"{folder} holds no *.safetensors files (.bin pickles are not read: re-save the "
                                   "model with save_pretrained(safe_serialization=True))")
        self._readers = [st.Reader(paths.inside(folder, f, str(folder))) for f in files]
        self._where = {k: r for r in self._readers for k in r.keys()}
        if index.is_file():
            wrong = [k for k, f in weight_map.items() if k not in self._where or self._where[k].path.name != f]
            if wrong:
                raise ToolkitError(f"{index} does not match the files: {', '.join(wrong[:4])} are not where it says")
        dims = self.dims()
        problems = []
        for e in iter_entries(dims, 1, 1):
            for name, shape in zip(e.hf_names, e.hf_shapes):
                if name not in self._where:
                    problems.append(Problem(name, "is missing", f"check the folder is a complete {dims.family} model"))
                elif self._where[name].shape(name) != shape:
                    problems.append(Problem(name, f"has shape {self._where[name].shape(name)}, config.json gives "
                                            f"{shape}", "the weights and config.json are of different models"))
        known = {n for e in iter_entries(dims, 1, 1) for n in e.hf_names} | {"lm_head.weight"}
        extra = sorted(k for k in self._where if k not in known and not k.endswith("rotary_emb.inv_freq"))
        if extra:
            problems.append(Problem("weights", f"{len(extra)} tensors the {dims.family} map does not know: "
                                    f"{', '.join(extra[:6])}", f"convert a {dims.family} model, or add the tensors to toolkit/families/{dims.family}.py"))
        raise_problems(f"{folder} does not match its config.json", problems)

    def read(self, hf_names: Sequence[str], field: str = WEIGHT) -> list[torch.Tensor]:
        return [self._where[n].get(n) for n in hf_names]

    def spans(self, hf_names: Sequence[str], field: str = WEIGHT):
        return [(self._where[n], n) for n in hf_names], list

    def dtype(self) -> torch.dtype:
        return self._where["model.embed_tokens.weight"].dtype("model.embed_tokens.weight")

    def close(self) -> None:
        for r in self._readers:
            r.close()


class ToolkitMegatronSource(_ShardedSource):
    """A step folder written by the toolkit's Megatron backend (or by `toolkit convert --to megatron`)."""

    kind = "toolkit Megatron"

    def __init__(self, tag_dir: Path, meta: dict, weights_only: bool = False):

        self.tag_dir, self.meta, self.step = tag_dir, meta, meta.get("step")
        lay = meta["layout"]
        self.layout, self.ep = (lay["tp"], lay["pp"], lay["vpp"]), lay.get("ep", 1)
        self.config, self.divisible_by = model_config(meta)
        self._index()
        tp, pp, _ = self.layout
        where, ep = f"checkpoint {tag_dir}", self.ep
        ranks = [(p, t, e) for p in range(pp) for t in range(tp) for e in range(ep)]
        self._models = {rank_key(p, t, e, ep): st.Reader(paths.inside(
            tag_dir, model_file(tag_dir, t, p, e if ep > 1 else None).name, where)) for p, t, e in ranks}
        optims = {rank_key(p, t, e, ep): paths.inside(tag_dir, optim_file(tag_dir, t, p, e if ep > 1 else None).name,
                                                      where) for p, t, e in ranks}
        self._optims = {}
        if not weights_only and all(f.is_file() for f in optims.values()):
            self._optims = {k: st.Reader(f) for k, f in optims.items()}
            fields = {split_field(k) for r in self._optims.values() for k in r.keys()}
            self.fields = (WEIGHT, *sorted(f for f in fields if f))
            steps = {r.metadata.get("step") for r in self._optims.values()}
            if len(steps) != 1:
                raise ToolkitError(f"{tag_dir}: the ranks' optimizer files are at different steps {sorted(steps)}")
            self.optimizer_meta = dict(next(iter(self._optims.values())).metadata)
        self._flat = None
        self._check()
        if not weights_only and not self._optims and lay.get("zero_stage") == 1 and meta.get("recipe"):
            self._distributed_optimizer(ranks)
        if self.fields != (WEIGHT,):
            self._megatron_optimizer()

    def _megatron_optimizer(self) -> None:
        """Megatron's param groups and scheduler state, which a Megatron-LM or torch_dist target needs to write the
        optimizer state: the groups as the training run saved them (OPTIM_GROUPS beside the plain optimizer's state;
        the distributed optimizer's optim_*.pt), the scheduler's kept from a Megatron source (OPTIM_SCHEDULER) or
        made from the recipe's schedule (adapters.megatron.scheduler_state). Missing or unreadable: left None, and
        such a target writes the weights only, saying why."""
        saved = self.optimizer_meta or {}
        try:
            if self.optimizer_groups is None and saved.get(OPTIM_GROUPS):
                inner = param_groups([{"param_groups": g} for g in json.loads(saved[OPTIM_GROUPS])])
                if inner:  # one optimizer, or a mixture of experts' dense one (the experts': made from it on writing)
                    self.optimizer_groups = [{**g, **({"betas": tuple(g["betas"])} if "betas" in g else {})}
                                             for g in inner]
            if saved.get(OPTIM_SCHEDULER):
                self.scheduler = json.loads(saved[OPTIM_SCHEDULER])
            elif self.meta.get("recipe") and self.step is not None:
                self.scheduler = scheduler_state(Recipe.model_validate(self.meta["recipe"]), int(self.step))
        except (ValueError, TypeError, KeyError):
            self.optimizer_groups = self.scheduler = None

    def _distributed_optimizer(self, ranks: list) -> None:
        """The distributed optimizer's state of a training checkpoint: Megatron's own save_parameter_state files
        (distopt_*.pt: flat buffers, read by parameter name as Megatron-LM's distrib_optim.pt is,
        toolkit/checkpoint/megatron_flat.py) and its state_dict (optim_*.pt: the param groups and step). The bucket
        cuts follow from the recipe's DDP settings and the run's data-parallel size."""
        tag_dir, where = self.tag_dir, f"checkpoint {self.tag_dir}"
        ep = self.ep
        files = {(p, t, e): paths.inside(tag_dir, f"distopt_{rank_tag(t, p, e if ep > 1 else None)}.pt", where)
                 for p, t, e in ranks}
        natives = {k: f.with_name(f"optim_{f.name.removeprefix('distopt_')}") for k, f in files.items()}
        if not any(f.is_file() for f in files.values()):
            self.optimizer_note = "it holds no distopt_*.pt files: weights only"
            return
        missing = [f.name for f in natives.values() if not f.is_file()]
        if missing:  # the distopt files' own absence is LegacyFlatState's to say
            raise_problems(f"{tag_dir}: its distributed optimizer's state is incomplete", [Problem(
                ", ".join(missing[:4]), "is missing, though the ranks' distopt_*.pt files are there",
                "re-copy the checkpoint, or convert with --weights-only")])
        mc = Recipe.model_validate(self.meta["recipe"]).parallel.megatron
        args = argparse.Namespace(overlap_grad_reduce=mc.overlap_grad_reduce, ddp_bucket_size=mc.bucket_size,
                                  data_parallel_size=self.meta["layout"]["dp"])
        self._flat = megatron_flat.LegacyFlatState(
            tag_dir, args, self._dims, self.layout, self.dtype() != torch.float32,
            {k: megatron_lm.safe_load(f, mmap=True) for k, f in natives.items()},
            lambda p, t, c, name: self._models[rank_key(p, t, 0, ep)].get(chunk_key(c, name)),
            lambda f: megatron_lm.safe_load(f, mmap=True), files, ep)
        self._flat.what = "distopt_*.pt buffers"
        raise_problems(f"{tag_dir}: its distributed optimizer's state does not fit the model", self._flat.problems)
        self.optimizer_note = self._flat.note
        if self._flat.fields:
            self.fields, self.optimizer_meta = (WEIGHT, *self._flat.fields), self._flat.meta
            self.optimizer_groups, self.optimizer_distributed = self._flat.groups, True

    def read(self, hf_names: Sequence[str], field: str = WEIGHT) -> list[torch.Tensor]:
        if field != WEIGHT and self._flat is not None:
            return self._flat.read(hf_names, field, lambda: super(ToolkitMegatronSource, self).read(hf_names))
        return super().read(hf_names, field)

    def _check(self) -> None:
        tp, pp, vpp = self.layout
        problems = []
        for k, shapes in meta_shards(self._dims, tp, pp, vpp, self.ep).items():
            reader = self._models[k]
            got = {k: reader.shape(k) for k in reader.keys()}
            missing, unexpected = sorted(set(shapes) - set(got)), sorted(set(got) - set(shapes))
            bad = [f"{k} {got[k]} (expected {shapes[k]})" for k in shapes if k in got and got[k] != shapes[k]]
            for what, items in (("is missing", missing), ("has unexpected", unexpected), ("has misshapen", bad)):
                if items:
                    problems.append(Problem(reader.path.name, f"{what} {', '.join(items[:4])}",
                                            "the file does not belong to the model and layout in toolkit_meta.json"))
            if self._optims:
                want = {f"{k}:{f}" for k in shapes for f in self.fields if f != WEIGHT}
                have = set(self._optims[k].keys())
                if want != have:
                    problems.append(Problem(self._optims[k].path.name, f"does not hold exactly the optimizer "
                                            f"state of its model file (missing {sorted(want - have)[:2]}, unexpected "
                                            f"{sorted(have - want)[:2]})", "re-save the checkpoint"))
        raise_problems(f"{self.tag_dir} does not match its toolkit_meta.json", problems)

    def _get(self, p: int, t: int, key: str, e: int = 0) -> torch.Tensor:
        return (self._optims if ":" in key else self._models)[rank_key(p, t, e, self.ep)].get(key)

    def spans(self, hf_names: Sequence[str], field: str = WEIGHT):
        if field != WEIGHT and self._flat is not None:
            return None
        entry = self._entries[tuple(hf_names)]
        key = chunk_key(entry.chunk, entry.megatron_name, None if field == WEIGHT else field)
        readers = self._optims if ":" in key else self._models
        ranks = [rank_key(entry.pp_rank, t, entry.ep_rank or 0, self.ep) for t in range(self.layout[0])]
        return ([(readers[r], key) for r in ranks],
                lambda shards: list(entry.to_hf(shards).values()))

    def dtype(self) -> torch.dtype:
        r = next(iter(self._models.values()))
        return r.dtype(r.keys()[0])

    def close(self) -> None:
        for r in [*self._models.values(), *self._optims.values()]:
            r.close()


def split_field(key: str) -> str | None:
    return key.partition(":")[2] or None


def model_config(meta: dict) -> tuple[dict, int]:
    """(HF config dict, vocab divisor) of a toolkit checkpoint: stored by conversions, else from its recipe."""
    if meta.get("hf_config"):
        return meta["hf_config"], int(meta.get("make_vocab_size_divisible_by", 128))

    recipe = Recipe.model_validate(meta["recipe"])
    return to_hf_config(recipe.model).to_dict(), recipe.parallel.megatron.make_vocab_size_divisible_by


class DeepSpeedHFSource(Source):
    """A toolkit DeepSpeed step folder (any ZeRO stage): full HF tensors gathered from the ranks' partitions."""

    kind = "DeepSpeed"

    def __init__(self, tag_dir: Path, meta: dict, fp32: bool):

        self._ds, self._fp32 = DeepSpeedSource(tag_dir, fp32=fp32), fp32
        self.meta, self.step, self.config = meta, self._ds.step, self._ds.config
        self.kind = f"DeepSpeed ZeRO-{meta['layout']['zero_stage']} ({'fp32 master' if fp32 else 'model states'})"

    def read(self, hf_names: Sequence[str], field: str = WEIGHT) -> list[torch.Tensor]:
        return [self._get(n) for n in hf_names]

    def _get(self, name: str) -> torch.Tensor:
        """A stored (Hugging Face file) name; a MoE expert's is cut out of transformers' fused tensor, the last one
        gathered kept for the next expert of the same layer."""
        family = family_of_config(self.config)
        spec = family.from_memory(name, self.dims()) if family.from_memory else None
        if spec is None:
            return self._ds.get(name)
        fused, take = spec
        if getattr(self, "_fused", (None,))[0] != fused:
            self._fused = (fused, self._ds.get(fused))
        return take(self._fused[1]).clone()

    def dtype(self) -> torch.dtype:
        return torch.float32 if self._fp32 else self._ds.dtype  # the masters are fp32 whatever the training dtype

    def close(self) -> None:
        getattr(self._ds, "close", lambda: None)()


def _json(path: Path, what: str, kind: type):
    """A JSON file of the source, or one line saying it is not `what`."""
    try:
        value = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ToolkitError(f"{path} is not {what} ({e}); re-copy or re-save it") from None
    if not isinstance(value, kind):
        raise ToolkitError(f"{path} holds a JSON {type(value).__name__}, not {what}; re-copy or re-save it")
    return value


def follow_pointer(src: Path) -> Path:
    """A checkpoint directory's newest complete checkpoint (its latest_complete pointer), else `src` itself. No
    silent fallback to an older one: a damaged checkpoint is reported, not skipped."""

    if (src / META).is_file() or not (src / POINTER).is_file():
        return src
    pointed = paths.inside(src, (src / POINTER).read_text(errors="replace").strip(), str(src / POINTER))
    if not pointed.is_dir():
        raise ToolkitError(f"{src / POINTER} points at {pointed.name}, which does not exist; pass the step_* folder "
                           "to convert")
    return pointed


def refusal(src: Path, vocab_size: int | None = None) -> str | None:
    """Why `toolkit convert` would refuse to read `src` (None: it reads it). `toolkit inspect` calls a checkpoint
    complete only when this is None, so the two never disagree."""
    try:
        source = open_source(src, vocab_size)
    except ToolkitError as e:
        return str(e)
    source.close()
    return None


def open_source(src: Path, vocab_size: int | None = None, fp32: bool = False, weights_only: bool = False,
                checksums: bool = True) -> Source:
    """The right source for a path, from its own files. checksums=False checks a toolkit checkpoint's manifest by
    sizes only and leaves its folder in `source.unchecked`: the caller must hash it (manifest.verify) before it
    trusts what it read (toolkit convert does it while it converts)."""

    paths.resolve(src)  # a link that loops: one line, not a traceback
    if not src.exists():
        raise ToolkitError(f"{src} does not exist")
    if (src / "config.json").is_file() and not is_plain(src):
        return HFSource(src)
    src = follow_pointer(src)
    if (src / META).is_file() or src.name.startswith("step_"):
        problems = manifest.verify(src, checksums)
        if problems:
            raise ToolkitError(f"{src} is not a complete checkpoint: {'; '.join(problems)}")
        meta = manifest.read_meta(src)
        backend = meta.get("backend")
        if backend == "megatron" and meta.get("checkpoint_format") == "torch_dist":  # checkpoint.format: torch_dist
            source = TorchDistSource(src, vocab_size or meta["recipe"]["model"]["vocab_size"], weights_only)
            source.meta, source.tag_dir = meta, src  # the run's recipe and per-rank state travel, as from a toolkit one
            if source.scheduler is None and source.fields != (WEIGHT,) and meta.get("recipe") and meta.get("step"):
                source.scheduler = scheduler_state(Recipe.model_validate(meta["recipe"]), int(meta["step"]))
        elif backend == "megatron":
            source = ToolkitMegatronSource(src, meta, weights_only)
        elif backend == "deepspeed":
            source = DeepSpeedHFSource(src, meta, fp32)
        else:
            raise ToolkitError(f"{src / META} names backend {backend!r}; expected megatron or deepspeed")
        source.unchecked = None if checksums else src
        return source
    if (src / "latest_checkpointed_iteration.txt").is_file() or src.name.startswith("iter_"):
        it_dir = megatron_lm.iteration_dir(src)
        if torch_dist.is_torch_dist(it_dir):
            return TorchDistSource(it_dir, vocab_size, weights_only)
        return MegatronLMSource(src, vocab_size, weights_only)
    if is_plain(src):
        raise ToolkitError(f"{src} is a plain DeepSpeed checkpoint (engine.save_checkpoint, no toolkit files): it "
                           "converts --to hf (with --config HF_FOLDER_OR_config.json when it holds no config.json), "
                           "--to universal, or --to deepspeed --dp N (another DP size)")
    raise ToolkitError(f"{src} is not a checkpoint this toolkit reads: expected a Hugging Face folder (config.json + "
                       "*.safetensors), a toolkit checkpoint (step_* folder with toolkit_meta.json, or its directory) "
                       "or a Megatron-LM checkpoint (latest_checkpointed_iteration.txt + iter_*/mp_rank_* or a torch_dist iter_*)")
