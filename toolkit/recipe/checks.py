"""Rules a recipe must satisfy for the world size it runs on; every problem is collected, then raised once."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from toolkit.errors import Problem, RecipeError
from toolkit.layout import Batch, Layout, derive_batch, derive_dp
from toolkit.recipe.presets import model_keys_from_hf_config, read_hf_config
from toolkit.recipe.schema import Recipe


@dataclass(frozen=True)
class Plan:
    """A recipe resolved for a world size: the layout, the batch arithmetic and how it was derived."""

    recipe: Recipe
    layout: Layout
    batch: Batch
    notes: list[str] = field(default_factory=list)

    def resolved(self) -> dict:
        """The recipe with every derived value written in: what the run will actually use (`toolkit show`)."""
        d = self.recipe.model_dump(mode="json")
        d["training"].update(global_batch_size=self.batch.global_batch, micro_batch_size=self.batch.micro_batch,
                             grad_accum_steps=self.batch.grad_accum)
        d["parallel"].update(world_size=self.layout.world_size, dp=self.layout.dp)
        d["output_dir"] = self.recipe.out_dir
        d["checkpoint"]["dir"] = self.recipe.checkpoint_dir
        return d


def check_model(r: Recipe) -> list[Problem]:
    m, out = r.model, []
    kv = m.num_kv_heads or m.num_attention_heads
    if m.hidden_size % m.num_attention_heads:
        out.append(Problem("model.hidden_size", f"{m.hidden_size} is not divisible by num_attention_heads "
                           f"{m.num_attention_heads}", "choose a hidden size that is a multiple of the head count"))
    if m.num_attention_heads % kv:
        out.append(Problem("model.num_kv_heads", f"num_attention_heads {m.num_attention_heads} is not divisible by "
                           f"num_kv_heads {kv}", "grouped-query attention needs heads = kv_heads x an integer"))
    if r.data.seq_len > m.max_position_embeddings:
        out.append(Problem("data.seq_len", f"{r.data.seq_len} exceeds model.max_position_embeddings "
                           f"{m.max_position_embeddings}", "shorten data.seq_len or raise max_position_embeddings "
                           "(with rope_scaling for a pretrained model)"))
    if m.pretrained and not m.hf_path:
        out.append(Problem("model.pretrained", "true, but model.hf_path is not set",
                           "set model.hf_path to a local Hugging Face model folder"))
    return out


def check_model_parallel(r: Recipe) -> list[Problem]:
    p, m, out = r.parallel, r.model, []
    kv = m.num_kv_heads or m.num_attention_heads
    for name, heads in (("num_attention_heads", m.num_attention_heads), ("num_kv_heads", kv)):
        if heads % p.tp:
            out.append(Problem(f"model.{name}", f"{heads} is not divisible by parallel.tp {p.tp}: tensor parallelism "
                               "gives each rank whole heads", f"use a tp that divides {heads}"))
    if m.num_layers % (p.pp * p.vpp):
        out.append(Problem("model.num_layers", f"{m.num_layers} is not divisible by pp x vpp = {p.pp} x {p.vpp} = "
                           f"{p.pp * p.vpp}: every pipeline chunk needs the same number of layers",
                           "choose pp and vpp whose product divides the layer count"))
    if p.vpp > 1 and p.pp == 1:
        out.append(Problem("parallel.vpp", f"{p.vpp} virtual chunks need pipeline parallelism, but pp = 1",
                           "set parallel.pp >= 2 or parallel.vpp to 1"))
    if p.sp and p.tp == 1:
        out.append(Problem("parallel.sp", "sequence parallelism splits activations across the tensor-parallel group, "
                           "but tp = 1", "set parallel.tp >= 2 or parallel.sp to false"))
    if p.sp and r.data.seq_len % p.tp:
        out.append(Problem("data.seq_len", f"{r.data.seq_len} is not divisible by parallel.tp {p.tp}, which sequence "
                           "parallelism requires", f"use a seq_len that is a multiple of {p.tp}"))
    if p.cp > 1 and r.data.seq_len % (2 * p.cp):
        out.append(Problem("data.seq_len", f"{r.data.seq_len} is not divisible by 2 x cp = {2 * p.cp}: context "
                           "parallelism cuts each sequence into 2 x cp load-balanced chunks",
                           f"use a seq_len that is a multiple of {2 * p.cp}"))
    return out + check_experts(r)


def check_experts(r: Recipe) -> list[Problem]:
    """A mixture-of-experts model section is complete, and parallel.ep splits its experts (Megatron-Core's rules)."""
    p, m, out = r.parallel, r.model, []
    moe = m.family == "qwen3_moe"
    keys = ("num_experts", "num_experts_per_tok", "moe_intermediate_size")
    if moe and any(getattr(m, k) is None for k in keys):
        out.append(Problem("model.num_experts", f"the {m.family} family needs {', '.join(keys)}",
                           "set them (or use model.hf_path / a preset such as qwen3-30b-a3b)"))
    if not moe and any(getattr(m, k) is not None for k in keys):
        out.append(Problem("model.num_experts", f"set, but model.family {m.family} has no experts, so it would be "
                           "ignored", "remove num_experts / num_experts_per_tok / moe_intermediate_size, or use a "
                           "mixture-of-experts family (qwen3_moe)"))
    if moe and m.num_experts and m.num_experts_per_tok and m.num_experts_per_tok > m.num_experts:
        out.append(Problem("model.num_experts_per_tok", f"{m.num_experts_per_tok} > num_experts {m.num_experts}",
                           "route each token to at most num_experts experts"))
    if p.ep > 1 and not moe:
        out.append(Problem("parallel.ep", f"{p.ep}, but model.family {m.family} has no experts",
                           "set parallel.ep: 1, or use a mixture-of-experts family (qwen3_moe)"))
    elif p.ep > 1 and p.backend != "megatron":
        out.append(Problem("parallel.ep", f"{p.ep}: expert parallelism is Megatron-Core's; the deepspeed backend "
                           "trains the Hugging Face MoE model with ZeRO (DeepSpeed 0.19.8's AutoEP fails with "
                           "transformers 5.24: docs/megatron.md)", "set parallel.backend: megatron, or ep: 1"))
    elif p.ep > 1 and m.num_experts and m.num_experts % p.ep:
        out.append(Problem("parallel.ep", f"{m.num_experts} experts are not divisible by ep = {p.ep}",
                           "choose an ep that divides model.num_experts"))
    if moe and p.backend == "megatron" and p.tp > 1 and not p.sp:
        out.append(Problem("parallel.sp", f"false, but Megatron-Core trains a mixture of experts at tp = {p.tp} only "
                           "with sequence parallelism", "set parallel.sp: true"))
    return out


def check_backend(r: Recipe) -> list[Problem]:
    p, out = r.parallel, []
    if p.backend == "deepspeed":
        extra = [f"{k}={v}" for k, v in (("tp", p.tp), ("pp", p.pp), ("cp", p.cp), ("vpp", p.vpp)) if v > 1]
        extra += ["sp=true"] * p.sp
        if r.training.activation_checkpointing == "selective":
            out.append(Problem("training.activation_checkpointing", "selective recomputation is a Megatron-Core "
                               "feature; the deepspeed backend recomputes whole blocks",
                               "use full (or none) with backend: deepspeed"))
        if extra:
            out.append(Problem("parallel.backend", f"the deepspeed backend runs data parallel + ZeRO only, but the "
                               f"recipe asks for {', '.join(extra)}",
                               "set parallel.backend: megatron for tensor/pipeline/sequence/context parallelism"))
        if r.checkpoint.format == "torch_dist":
            out.append(Problem("checkpoint.format", "torch_dist is Megatron-Core's checkpoint format; the deepspeed "
                               "backend saves DeepSpeed's own files", "use checkpoint.format: toolkit with backend: "
                               "deepspeed, or parallel.backend: megatron"))
    else:
        if "nvme" in (p.offload_optimizer, p.offload_params):
            out.append(Problem("parallel.offload_optimizer" if p.offload_optimizer == "nvme" else
                               "parallel.offload_params", "the megatron backend cannot offload to NVMe",
                               "use backend: deepspeed with zero_stage: 3 for ZeRO-Infinity, or offload: none"))
        elif "cpu" in (p.offload_optimizer, p.offload_params):
            out.append(Problem("parallel.offload_optimizer", "the megatron backend does not offload to CPU here",
                               "use backend: deepspeed for ZeRO-Offload, or set offload to none"))
        if p.zero_stage > 1:
            out.append(Problem("parallel.zero_stage", f"{p.zero_stage} is a DeepSpeed stage; the megatron backend "
                               "shards optimizer states only (zero_stage 1 = distributed optimizer)",
                               "set parallel.zero_stage to 0 or 1, or use backend: deepspeed"))
    if p.pp > 1 and p.zero_stage >= 2:
        out.append(Problem("parallel.zero_stage", f"ZeRO-{p.zero_stage} shards gradients, which pipeline parallelism "
                           f"(pp={p.pp}) cannot combine with", "use zero_stage 0 or 1 with pipeline parallelism"))
    return out


def check_offload(r: Recipe) -> list[Problem]:
    p, out = r.parallel, []
    if "nvme" in (p.offload_optimizer, p.offload_params) and not p.nvme_path:
        out.append(Problem("parallel.nvme_path", "offload to nvme needs a folder on a local NVMe drive, but "
                           "nvme_path is not set", "set parallel.nvme_path, e.g. /local_nvme/offload"))
    if p.offload_params != "none" and p.zero_stage != 3:
        out.append(Problem("parallel.offload_params", f"{p.offload_params} needs ZeRO-3 (parameters are only "
                           f"partitioned at stage 3), but zero_stage = {p.zero_stage}",
                           "set parallel.zero_stage: 3 or offload_params: none"))
    if p.offload_optimizer == "nvme" and p.zero_stage != 3:
        out.append(Problem("parallel.offload_optimizer", f"nvme needs ZeRO-3 (ZeRO-Infinity), but zero_stage = "
                           f"{p.zero_stage}", "set parallel.zero_stage: 3, or offload_optimizer: cpu"))
    if p.offload_optimizer == "cpu" and p.zero_stage == 0:
        out.append(Problem("parallel.offload_optimizer", "cpu needs ZeRO stage 1, 2 or 3 (ZeRO-Offload), but "
                           "zero_stage = 0", "set parallel.zero_stage to 2 (the usual choice with CPU offload)"))
    return out


def check_training(r: Recipe) -> list[Problem]:
    t, out = r.training, []
    if t.schedule.warmup_steps > t.steps:
        out.append(Problem("training.schedule.warmup_steps", f"{t.schedule.warmup_steps} exceeds training.steps "
                           f"{t.steps}", "shorten the warm-up or train longer"))
    if t.stop_at_step is not None and t.stop_at_step > t.steps:  # it never stops there (accepted until 2026-12-07)
        out.append(Problem("training.stop_at_step", f"{t.stop_at_step} is past training.steps {t.steps}, so the run "
                           "would never stop there", "give a step within training.steps, or leave it out"))
    if t.schedule.min_lr > t.optimizer.lr:
        out.append(Problem("training.schedule.min_lr", f"{t.schedule.min_lr} is above the peak lr "
                           f"{t.optimizer.lr}", "set min_lr below training.optimizer.lr (often lr / 10)"))
    if not all(0 <= b < 1 for b in t.optimizer.betas):
        out.append(Problem("training.optimizer.betas", f"{list(t.optimizer.betas)}: each beta must be in [0, 1)",
                           "the usual values are [0.9, 0.95]"))
    return out


def check_blend(r: Recipe) -> list[Problem]:
    """data.blend: at least one source, every weight above 0 (so they sum to a positive number), always packed."""
    blend, out = r.data.blend, []
    if blend is None:
        return out
    if not blend:
        return [Problem("data.blend", "is an empty list", "list prepared datasets as [{path: PREFIX, weight: 1.0}], "
                        "or remove data.blend to read data.paths")]
    for i, source in enumerate(blend):
        if source.weight <= 0:
            out.append(Problem(f"data.blend[{i}].weight", f"{source.weight} for {source.path}: blend weights must be "
                               f"above 0 (they sum to {sum(s.weight for s in blend):g})",
                               "give every source a positive weight, e.g. 0.7 and 0.3, or remove the source"))
    if r.data.kind == "chat":
        out.append(Problem("data.kind", "chat, but a data.blend holds pre-tokenized text without turns or loss masks",
                           "read conversations from data.paths (or data.hub_dataset), or set data.kind: text"))
    if not r.data.packing:
        out.append(Problem("data.packing", "false, but a blend is always packed (GPTDataset cuts the documents into "
                           "seq_len samples)", "set data.packing: true, or use data.paths for padded documents"))
    return out


def resolve(r: Recipe, world_size: int | None = None, source: str | None = None) -> Plan:
    """Check every rule for `world_size` ranks (default: the recipe's own) and derive the layout and batch."""
    p = r.parallel
    if world_size is not None and world_size < 1:  # 0 is a typo, not "use the recipe's own"
        raise RecipeError(source or r.name, [Problem("--world-size", f"{world_size}: a world size counts ranks, "
                                                     "at least 1", "give the number of ranks, e.g. --world-size 8, "
                                                     "or leave it out to use parallel.world_size")])
    world = world_size or p.world_size or (p.dp or 1) * p.tp * p.pp * p.cp
    problems = check_model(r) + check_model_parallel(r) + check_backend(r) + check_offload(r) + check_training(r)
    problems += check_eval(r) + check_blend(r)
    dp, dp_problems = derive_dp(world, p.tp, p.pp, p.cp, p.dp)
    problems += dp_problems
    if dp is not None and p.ep > 1 and (dp * p.cp) % p.ep:
        problems.append(Problem("parallel.ep", f"{p.ep} does not divide dp x cp = {dp} x {p.cp} = {dp * p.cp}: "
                                "Megatron-Core takes the expert-parallel ranks from the data-parallel (and context-"
                                "parallel) ranks", f"launch a multiple of tp x pp x ep = {p.tp * p.pp * p.ep} "
                                f"ranks, or choose an ep dividing {dp * p.cp}"))
    batch, notes = None, []
    if dp is not None:
        t = r.training
        batch, notes, batch_problems = derive_batch(t.global_batch_size, t.micro_batch_size, t.grad_accum_steps, dp)
        problems += batch_problems
    if batch is not None and p.backend == "megatron" and p.vpp > 1 and batch.grad_accum % p.pp:
        problems.append(Problem("training.grad_accum_steps", f"{batch.grad_accum} micro-batches per step, but the "
                                f"interleaved pipeline schedule (vpp={p.vpp}) needs a multiple of pp = {p.pp}",
                                f"make global_batch_size / (micro_batch_size x dp) a multiple of {p.pp}"))
    if problems:
        raise RecipeError(source or r.name, problems)
    layout = Layout(p.backend, world, dp, p.tp, p.pp, p.vpp, p.cp, p.sp, p.zero_stage, p.ep)
    return Plan(r, layout, batch, notes)


def check_eval(r: Recipe) -> list[Problem]:
    """The eval section names exactly one held-out source when evaluation is on."""
    e = r.eval
    if e.split is not None and e.paths is not None:
        return [Problem("eval.split", "set together with eval.paths; the held-out data comes from one of them",
                        "keep eval.split (a fraction of data.paths) or eval.paths (files of their own), not both")]
    if e.paths is not None and not e.paths:
        return [Problem("eval.paths", "is an empty list", "list held-out files (or globs), or use eval.split")]
    if e.blend is not None:
        return _check_eval_blend(r)
    if e.interval and e.split is None and e.paths is None:
        return [Problem("eval.interval", f"{e.interval}, but no held-out data is named",
                        "set eval.split (e.g. 0.05 of the training data), eval.paths (files of their own) or "
                        "eval.blend (prepared datasets of their own)")]
    return []


def _check_eval_blend(r: Recipe) -> list[Problem]:
    """eval.blend: alone, with a data.blend for training, at least one source, every weight above 0."""
    e = r.eval
    for key, other in (("eval.split", e.split), ("eval.paths", e.paths)):
        if other is not None:
            return [Problem(key, "set together with eval.blend; the held-out data comes from one of them",
                            f"keep eval.blend (prepared datasets of their own) or {key}, not both")]
    if r.data.blend is None:
        return [Problem("eval.blend", "holds prepared datasets, but training reads data.paths (tokenized on the fly)",
                        "train on a data.blend too, or hold out files with eval.paths (or eval.split)")]
    if not e.blend:
        return [Problem("eval.blend", "is an empty list", "list prepared held-out datasets as [{path: PREFIX, "
                        "weight: 1.0}], or remove eval.blend")]
    return [Problem(f"eval.blend[{i}].weight", f"{s.weight} for {s.path}: blend weights must be above 0",
                    "give every source a positive weight, or remove the source")
            for i, s in enumerate(e.blend) if s.weight <= 0]


def check_paths(r: Recipe) -> list[Problem]:
    """Files the run will read or write, checked just before it starts (not by `validate`, so cluster recipes
    can be validated on a laptop)."""
    out = []
    for i, source in enumerate(r.data.blend or []):
        missing = [s for s in (".bin", ".idx") if not Path(source.path + s).is_file()]
        if missing:
            out.append(Problem(f"data.blend[{i}].path", f"{source.path} has no {' or '.join(missing)} file (relative "
                               f"paths are read from {os.getcwd()})", "give the --output prefix of `toolkit data "
                               "prepare` (PREFIX, without .bin/.idx), or prepare the data first"))
    for i, source in enumerate(r.eval.blend or []):
        missing = [s for s in (".bin", ".idx") if not Path(source.path + s).is_file()]
        if missing:
            out.append(Problem(f"eval.blend[{i}].path", f"{source.path} has no {' or '.join(missing)} file",
                               "give the --output prefix of `toolkit data prepare` (without .bin/.idx)"))
    if r.data.hub_dataset is None and r.data.blend is None:
        for pattern in r.data.paths:
            if not expand_glob(pattern):
                out.append(Problem("data.paths", f"{pattern} matches no file (relative paths are read from "
                                   f"{os.getcwd()})", "run from the repository root or use absolute paths"))
    for pattern in r.eval.paths or []:
        if not expand_glob(pattern):
            out.append(Problem("eval.paths", f"{pattern} matches no file (relative paths are read from "
                               f"{os.getcwd()})", "run from the repository root or use absolute paths"))
    if r.data.tokenizer.startswith((".", "/")) and not Path(r.data.tokenizer).is_dir():  # a path, not a hub name
        out.append(Problem("data.tokenizer", f"{r.data.tokenizer} is not a folder", "point it at a tokenizer folder"))
    if r.model.pretrained and r.model.hf_path and not list(Path(r.model.hf_path).glob("*.safetensors")):
        out.append(Problem("model.hf_path", f"{r.model.hf_path} has no *.safetensors weights to load",
                           "convert the weights to safetensors, or set model.pretrained: false"))
    out += _check_hf_config(r)
    out += check_nvme_path(r)
    out += check_output_paths(r)
    return out


def check_output_paths(r: Recipe) -> list[Problem]:
    """The folders the run writes: each a folder (or not there yet) that this user can write, and no metrics.jsonl of
    someone else's in output_dir (the run appends to it). Found at the first logged step until 2026-12-07, with a
    traceback, after training had begun (and checkpoints had been saved elsewhere)."""
    out = []
    for key, folder in (("output_dir", Path(r.out_dir)), ("checkpoint.dir", Path(r.checkpoint_dir))):
        if folder.exists() and not folder.is_dir():
            out.append(Problem(key, f"{folder} is a file", "give a folder path: the run writes its files in it"))
            continue
        existing = next((p for p in [folder, *folder.absolute().parents] if p.exists()), None)
        if existing is not None and not existing.is_dir():
            out.append(Problem(key, f"{folder} cannot be made: {existing} is a file", "give a folder path"))
        elif existing is not None and not os.access(existing, os.W_OK | os.X_OK):
            out.append(Problem(key, f"{folder} cannot be written: {existing} is not writable by this user (or is on a "
                               "read-only file system)", "choose a folder you can write"))
    metrics = Path(r.out_dir) / "metrics.jsonl"
    if metrics.is_file() and not _our_metrics(metrics):
        out.append(Problem("output_dir", f"{metrics} is not a log of the toolkit's (its first line is not a step "
                           "record), and the run would append to it", "move it away or choose another output_dir"))
    return out


def _our_metrics(path: Path) -> bool:
    """Whether metrics.jsonl begins with a step record as toolkit.metrics writes them (or is empty)."""
    with path.open("rb") as f:
        first = f.readline(1 << 16).strip()
    if not first:
        return True
    try:
        record = json.loads(first)
    except ValueError:
        return False
    return isinstance(record, dict) and {"time", "step", "loss"} <= set(record)


def _check_hf_config(r: Recipe) -> list[Problem]:
    """A preset and an hf_path together must describe the same architecture."""
    if not (r.model.preset and r.model.hf_path):
        return []
    cfg = Path(r.model.hf_path) / "config.json"
    if not cfg.is_file():
        return [Problem("model.hf_path", f"{cfg} does not exist", "point hf_path at a Hugging Face model folder")]
    hf, problems = read_hf_config(cfg)
    if problems:
        return problems
    theirs = model_keys_from_hf_config(hf)
    ours = r.model.model_dump()
    head_dim = ours["hidden_size"] // ours["num_attention_heads"]  # what a recipe's head_dim: null means
    diff = [f"{k}: {ours[k]} in the recipe, {v} in config.json" for k, v in theirs.items()
            if k in ours and k != "rope_scaling" and ours[k] != v and not (k == "num_kv_heads" and ours[k] is None)
            and not (k == "head_dim" and ours[k] is None and v == head_dim)]
    if not diff:
        return []
    return [Problem("model.preset", f"{r.model.preset} does not match {cfg}: " + "; ".join(diff),
                    "drop model.preset (the architecture then comes from hf_path) or fix the mismatching keys")]


def check_nvme_path(r: Recipe) -> list[Problem]:
    """The NVMe offload folder must already exist and be writable on the machine that runs. DeepSpeed would create
    a mistyped path itself (on whatever disk holds it) and then fail forty lines deep in its start-up. Checked at
    the start of a run, not by `validate`: a cluster recipe names a path (/local_nvme/...) a laptop lacks."""
    p = r.parallel
    if "nvme" not in (p.offload_optimizer, p.offload_params) or not p.nvme_path:
        return []
    path = Path(p.nvme_path)
    if path.absolute().is_relative_to(Path(r.out_dir).absolute()) and not path.exists():
        # a scratch folder inside the run's own output folder (tiny_zero3_nvme's rehearsal): the run creates it
        if _creatable(path):
            return []
        return [Problem("parallel.nvme_path", f"{p.nvme_path} cannot be created (no writable folder above it)",
                        "set output_dir (or nvme_path) to a writable place")]
    if not path.is_dir():
        what = "is not a folder" if path.exists() else "does not exist"
        return [Problem("parallel.nvme_path", f"{p.nvme_path} {what} on this machine",
                        f"create it on every node (mkdir -p {p.nvme_path}) on the local NVMe drive, or fix the path")]
    if not os.access(path, os.W_OK | os.X_OK):
        return [Problem("parallel.nvme_path", f"{p.nvme_path} is not writable by this user",
                        "chmod/chown it (or pick a folder you own) on the local NVMe drive")]
    return []


def _creatable(path: Path) -> bool:
    """The folder exists and is writable, or its nearest existing ancestor is (so it can be created)."""
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path.is_dir() and os.access(path, os.W_OK)


def expand_glob(pattern: str) -> list[Path]:
    p = Path(pattern)
    if p.is_absolute():
        return sorted(Path(p.anchor).glob(str(p.relative_to(p.anchor))))
    return sorted(Path().glob(pattern))
