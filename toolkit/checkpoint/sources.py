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
from toolkit.checkpoint import megatron_flat, megatron_lm
from toolkit.checkpoint.deepspeed_io import DeepSpeedSource
from toolkit.checkpoint.deepspeed_plain import is_plain, is_tag
from toolkit.checkpoint.megatron_sources import MegatronLMSource, TorchDistSource, rank_state
from toolkit.checkpoint.safetensors_sources import HFSource, ToolkitWeights, follow_pointer, stored_config
from toolkit.checkpoint.source_base import WEIGHT, Source  # noqa: F401 (WEIGHT, Source: re-exported)
from toolkit.checkpoint.torch_dist_optim import param_groups
from toolkit.errors import Problem, ToolkitError
from toolkit.families.entries import raise_problems, rank_key
from toolkit.families.mapping import model_differences
from toolkit.families.registry import family_of_config
from toolkit.format import manifest, paths
from toolkit.format.names import META, OPTIM_GROUPS, OPTIM_SCHEDULER, POINTER, chunk_key, rank_tag
from toolkit.model import released_config
from toolkit.recipe.schema import Recipe


class ToolkitMegatronSource(ToolkitWeights):
    """A step folder written by the toolkit's Megatron backend (or by `toolkit convert --to megatron`): its weights
    and plain optimizer state (ToolkitWeights), its distributed optimizer's state, and Megatron's param groups."""

    def __init__(self, tag_dir: Path, meta: dict, weights_only: bool = False, rows: int | None = None):
        super().__init__(tag_dir, meta, *model_config(meta), weights_only, rows)
        self._flat = None
        lay = meta["layout"]
        if not weights_only and not self._optims and lay.get("zero_stage") == 1 and meta.get("recipe"):
            self._distributed_optimizer(self.ranks)
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
            {k: rank_state(f) for k, f in natives.items()},
            lambda p, t, c, name: self._models[rank_key(p, t, 0, ep)].get(chunk_key(c, name)),
            rank_state, files, ep)
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

    def spans(self, hf_names: Sequence[str], field: str = WEIGHT):
        if field != WEIGHT and self._flat is not None:
            return None
        return super().spans(hf_names, field)


def model_config(meta: dict) -> tuple[dict, int]:
    """(HF config dict, vocab divisor) of a toolkit checkpoint: stored by conversions, else from its recipe."""
    stored = stored_config(meta)
    if stored is not None:
        return stored

    recipe = Recipe.model_validate(meta["recipe"])
    return released_config(recipe.model, meta.get("tokens")), recipe.parallel.megatron.make_vocab_size_divisible_by


def recorded_model(from_args: dict, meta: dict, src: Path) -> dict:
    """The Hugging Face config of a toolkit torch_dist step: the model its recipe names (model_config), which must be
    the one its Megatron args describe. The args alone cannot name every family: Mistral's are Llama's (the same
    arguments and weights; megatron_lm.family_of_args), so a Mistral run came back as Llama before 2026-12-07."""
    config = model_config(meta)[0]
    changed = model_differences(from_args, config)
    if changed:
        raise ToolkitError(f"{src}: its {META} describes another model than the Megatron args in its common.pt "
                           f"({'; '.join(changed)}): the folder mixes two runs' files; re-copy it from one run")
    return config


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
                checksums: bool = True, rows: int | None = None) -> Source:
    """The right source for a path, from its own files. checksums=False checks a toolkit checkpoint's manifest by
    sizes only and leaves its folder in `source.unchecked`: the caller must hash it (manifest.verify) before it
    trusts what it read (toolkit convert does it while it converts). `rows`: the vocabulary rows a Megatron source
    is read with (source_base.carried_rows; a source without padding rows ignores it)."""

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
            recorded = meta["recipe"]["model"]["vocab_size"]
            if vocab_size is not None and vocab_size != recorded:  # it replaced the recipe's until 2026-12-07
                raise ToolkitError(f"--vocab-size {vocab_size}: {src} records its vocabulary ({recorded}) in its "
                                   f"recipe; --vocab-size gives the true vocabulary of a Megatron-LM checkpoint, "
                                   "whose padded rows do not tell it: drop it")
            source = TorchDistSource(src, recorded, weights_only, rows)
            source.meta, source.tag_dir = meta, src  # the run's recipe and per-rank state travel, as from a toolkit one
            source.config = recorded_model(source.config, meta, src)
            if source.scheduler is None and source.fields != (WEIGHT,) and meta.get("recipe") and meta.get("step"):
                source.scheduler = scheduler_state(Recipe.model_validate(meta["recipe"]), int(meta["step"]))
        elif backend == "megatron":
            source = ToolkitMegatronSource(src, meta, weights_only, rows)
        elif backend == "deepspeed":
            source = DeepSpeedHFSource(src, meta, fp32)
        else:
            raise ToolkitError(f"{src / META} names backend {backend!r}; expected megatron or deepspeed")
        source.unchecked = None if checksums else src
        return source
    if (src / "latest_checkpointed_iteration.txt").is_file() or src.name.startswith("iter_"):
        it_dir = megatron_lm.iteration_dir(src)
        if megatron_lm.is_torch_dist(it_dir):
            return TorchDistSource(it_dir, vocab_size, weights_only, rows)
        return MegatronLMSource(src, vocab_size, weights_only, rows)
    if is_plain(src):
        raise ToolkitError(f"{src} is a plain DeepSpeed checkpoint (engine.save_checkpoint, no toolkit files): it "
                           "converts --to hf (with --config HF_FOLDER_OR_config.json when it holds no config.json), "
                           "--to universal, or --to deepspeed --dp N (another DP size)")
    raise not_a_checkpoint(src)


READS = ("a Hugging Face folder (config.json + *.safetensors), a toolkit checkpoint (a step_* folder with "
         "toolkit_meta.json, or its directory), a Megatron-LM checkpoint (latest_checkpointed_iteration.txt + iter_* "
         "folders, legacy or torch_dist; or one iter_* folder) or a DeepSpeed one (the folder engine.save_checkpoint "
         "wrote, with `latest`; one global_step* folder; or a universal checkpoint)")


def not_a_checkpoint(path: Path) -> ToolkitError:
    """The one line for a folder no reader takes: where it holds the tag or iteration folders of a checkpoint whose
    pointer file is missing, it names the newest of them to pass instead; otherwise it lists what is read."""
    def newest(folders: list[Path]) -> Path:
        return max(folders, key=lambda p: (int("0" + "".join(c for c in p.name if c.isdigit())), p.name))

    subfolders = [p for p in path.iterdir() if p.is_dir()] if path.is_dir() else []
    steps = sorted(p for p in subfolders if p.name.startswith("step_"))
    if steps:  # a toolkit checkpoint directory without its latest_complete pointer
        problems = {p: manifest.verify(p, checksums=False) for p in steps}
        whole = [p for p in steps if not problems[p]]
        if whole:
            return ToolkitError(f"{path} holds step_* folders but no {POINTER} naming the newest complete one: pass "
                                f"that folder itself, e.g. {whole[-1]}")
        return ToolkitError(f"{path} holds no complete toolkit checkpoint: its newest, {steps[-1].name}, is "
                            f"incomplete ({problems[steps[-1]][0]}); resume the run to write a complete one, or see "
                            f"`toolkit inspect {path}`")
    tags = [p for p in subfolders if is_tag(p)]
    if tags:
        return ToolkitError(f"{path} holds DeepSpeed tag folders ({len(tags)}) but no `latest` file naming the one to "
                            f"read: pass that folder itself, e.g. {newest(tags)}")
    iters = [p for p in subfolders if p.name.startswith("iter_")]
    if iters:
        return ToolkitError(f"{path} holds Megatron iter_* folders ({len(iters)}) but no "
                            f"latest_checkpointed_iteration.txt naming the one to read: pass that folder itself, "
                            f"e.g. {newest(iters)}")
    return ToolkitError(f"{path} is not a checkpoint this toolkit reads: expected {READS}")
