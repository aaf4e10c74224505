"""Resumable checkpoints of a training run, for both backends: save, choose one to resume from, load, prune.

Layout of <checkpoint dir>:
  step_00000050/            the backend's own files (DeepSpeed's engine.save_checkpoint, or the Megatron backend's
                            per-rank files, toolkit/megatron/checkpoint.py), plus
    toolkit_rank00000.pt    this rank's RNG states and data position (read as weights only)
    toolkit_meta.json       written last, by rank 0, after every rank hashed and flushed its files: step, layout,
                            recipe, and the manifest (every file with its size and XXH3-128,
                            toolkit/format/manifest.py)
  latest                    DeepSpeed's pointer (so DeepSpeed's zero_to_fp32 tooling works)
  latest_complete           the toolkit's pointer, replaced atomically only once a checkpoint is complete

A save writes toolkit_started.json first, so the toolkit writes into and deletes only step folders it made (names.own);
a checkpoint directory holding any other step_* entry is refused before training starts (refuse_checkpoint_dir).
A checkpoint without toolkit_meta.json is incomplete and is never resumed from; one whose files no longer match
their manifest is skipped (and the log says which file). A save first checks the disk can hold it.
"""
from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from toolkit.errors import ToolkitError
from toolkit.format import manifest, paths, safe_load
from toolkit.format.names import (
    DEEPSPEED_POINTER,
    META,
    POINTER,
    SCHEMA_VERSION,
    STARTED,  # noqa: F401 - for tests and readers
    TAG_GLOB,
    complete_tags,
    is_complete,
    mark_started,
    own,
    rank_file,
    refuse_foreign,
    tag_for,
)
from toolkit.layout import keeping_divisor, padded_vocab_size
from toolkit.model import to_hf_config
from toolkit.recipe.schema import Recipe
from toolkit.train import faults


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    paths.fsync(path.parent)  # the rename is durable: a crash right after it must not undo it


def rng_state() -> dict:
    np_state = np.random.get_state()
    return {"python": random.getstate(), "torch": torch.get_rng_state(),
            "numpy": (np_state[0], torch.from_numpy(np_state[1].copy()), *np_state[2:])}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy(), *rest))


def is_intact(tag_dir: Path) -> bool:
    """Complete, and every file still has the size and checksum the manifest recorded."""
    return is_complete(tag_dir) and not verify_manifest(tag_dir)


# ------------------------------------------------------------------ saving
def save(backend, root: Path, step: int, data_state: dict, meta: dict) -> Path:
    """Save on every rank; mark complete (meta, then pointers) only after all ranks have written, hashed and flushed
    their files. Refused on every rank, before anything is written, when the disk cannot hold the checkpoint."""
    tag = tag_for(step)
    tag_dir, rank = root / tag, dist.get_rank()
    _prepare(backend, root, tag_dir)
    backend.save_state(root, tag)
    faults.point("save-files", step, rank, own_files(backend, tag_dir, rank))
    torch.save({"rng": rng_state(), "data": data_state, "step": step}, tag_dir / rank_file(rank))
    mine = manifest.entries(own_files(backend, tag_dir, rank), fsync=True)  # every rank hashes its own files
    faults.point("save-flushed", step, rank, own_files(backend, tag_dir, rank))
    gathered = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(mine, gathered, dst=0)  # also the barrier: every rank's files are on disk
    if rank == 0:
        known = {name: entry for part in gathered for name, entry in part.items()}
        files = manifest.complete(tag_dir, known)  # anything no rank claimed is hashed here
        meta = {"schema_version": SCHEMA_VERSION, "step": step, "tag": tag, **meta, "files": files}
        _write_atomic(tag_dir / META, json.dumps(meta, indent=2))
        faults.point("save-meta", step, rank)  # complete, but the pointers still name the previous one
        _write_atomic(root / DEEPSPEED_POINTER, tag)
        _write_atomic(root / POINTER, tag)
    dist.barrier()
    return tag_dir


def _prepare(backend, root: Path, tag_dir: Path) -> None:
    """Collective, before anything is written: refuse on every rank when the disk (the fullest one, if ranks see
    different disks) cannot hold one more checkpoint, and clear a folder of the same step left by an earlier run
    (a crash mid-save) so none of its files leak into the new manifest. The size is the newest complete
    checkpoint's manifest total, else the model and optimizer state the ranks hold (summed over ranks)."""
    done = [p for p in complete_tags(root) if p != tag_dir] if root.is_dir() else []
    previous = _manifest_bytes(done[-1]) if done else 0
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    summed = torch.tensor([0 if previous else state_bytes(backend)], dtype=torch.int64, device=device)
    dist.all_reduce(summed, op=dist.ReduceOp.SUM)
    # one MAX reduce: the largest previous size, the smallest free space, whether any rank sees the old folder
    exists = tag_dir.exists() or tag_dir.is_symlink()
    worst = torch.tensor([previous, -manifest.free_bytes(root), int(exists), int(exists and not own(tag_dir))],
                         dtype=torch.int64, device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    previous, free, stale, alien = int(worst[0]), -int(worst[1]), bool(worst[2]), bool(worst[3])
    if alien:  # appeared during the run (refuse_checkpoint_dir saw none at the start): never save into it
        raise ToolkitError(f"checkpoint.dir {root} holds {tag_dir.name}, which the toolkit did not write; move it "
                           f"out of {root} or choose another checkpoint.dir. Nothing in {root} was written or deleted")
    basis = (f"the size of {done[-1].name}" if previous and done else
             f"the model and optimizer state on the {dist.get_world_size()} ranks")
    manifest.require_space(root, previous or int(summed.item()), free, f"checkpoint {tag_dir.name}", basis)
    if dist.get_rank() == 0:
        if stale:  # the toolkit's own (checked above): a crashed save of this step
            (tag_dir / META).unlink(missing_ok=True)  # first: never complete while it is being taken apart
            shutil.rmtree(tag_dir)
        mark_started(tag_dir, int(tag_dir.name[5:]))  # before any rank writes a file of this save
    dist.barrier()


def _manifest_bytes(tag_dir: Path) -> int:
    try:
        return manifest.total_bytes(manifest.read_meta(tag_dir).get("files") or {})
    except ToolkitError:
        return 0


def own_files(backend, tag_dir: Path, rank: int) -> list[Path]:
    """The files this rank wrote into tag_dir (its save calls have returned, so they are whole)."""
    names = [rank_file(rank)]
    if hasattr(backend, "rank_files"):
        names += backend.rank_files(tag_dir)
    else:  # DeepSpeed names per-rank files zero_pp_rank_{r}_mp_rank_00_*; rank 0 writes mp_rank_00_model_states.pt
        names += [p.name for p in tag_dir.glob(f"*zero_pp_rank_{rank}_mp_rank_*")]
        if rank == 0 and (tag_dir / "mp_rank_00_model_states.pt").is_file():
            names.append("mp_rank_00_model_states.pt")
    return [tag_dir / n for n in dict.fromkeys(names)]


def _tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t))


def state_bytes(backend) -> int:
    """Bytes of this rank's share of a checkpoint, from the tensors it holds: the backend's own estimate, else
    DeepSpeed's (rank 0 writes the module weights; every rank its optimizer partition: the fp32 tensors the torch
    optimizer steps and their state)."""
    if hasattr(backend, "checkpoint_bytes"):
        return backend.checkpoint_bytes()
    engine = backend.engine
    module = list(engine.module.parameters())
    opt = getattr(engine.optimizer, "optimizer", engine.optimizer)  # ZeRO wraps the torch optimizer
    seen = {id(p) for p in module}
    stepped = [p for g in opt.param_groups for p in g["params"] if id(p) not in seen]
    state = [v for s in opt.state.values() for v in s.values()]
    return (_tensor_bytes(module) if dist.get_rank() == 0 else 0) + _tensor_bytes(stepped) + _tensor_bytes(state)


def prune(root: Path, keep: int) -> list[Path]:
    """Rank 0: delete complete checkpoints beyond the newest `keep`, and incomplete ones older than the newest
    complete one (debris of a crash). Called only after a newer checkpoint is complete. Only folders the toolkit
    wrote (names.own) are deleted: complete ones whose meta file holds a manifest, incomplete ones with the marker
    a save writes first (or empty)."""
    done = [p for p in complete_tags(root) if _has_manifest(p)]
    if not done:
        return []
    newest = done[-1].name
    stale = done[:-keep] + [p for p in root.glob(TAG_GLOB) if own(p) and not is_complete(p) and p.name < newest]
    for p in stale:
        shutil.rmtree(p)
    return stale


def _has_manifest(tag_dir: Path) -> bool:
    try:
        return isinstance(manifest.read_meta(tag_dir).get("files"), dict)
    except ToolkitError:
        return False


# ------------------------------------------------------------------ choosing and loading
def refuse_checkpoint_dir(root: Path) -> None:
    """Refuse, on every rank together, a checkpoint directory holding step_* entries the toolkit did not write
    (names.foreign): training would save into them and prune them."""
    try:
        refuse_foreign(root)
        problem = ""
    except ToolkitError as e:
        problem = str(e)
    _agree(problem)  # a rank that sees none still stops with the others


def find_resume(root: Path, resume: str, log=None) -> Path | None:
    """The checkpoint folder to resume from (None: start fresh): with "auto", the newest whose manifest verifies.
    `log` gets one line naming the choice and one per newer checkpoint skipped, with the file that failed. Under a
    process group every rank must call this (the checksum work is shared; the ranks agree on the answer)."""
    refuse_checkpoint_dir(root)
    if resume == "auto":
        return _newest(root, log)
    start = None if resume == "never" else _explicit(Path(resume), log)
    _agree(_newer_than(root, start))
    return start


def _newer_than(root: Path, start: Path | None) -> str:
    """The problem (or "") of a run that starts from `start` (None: from scratch) while `root`, where it saves, holds
    complete checkpoints past that step which it does not resume from: an earlier run's. Training would prune them or
    save over them, and a later checkpoint.resume: auto would take the newest by step, possibly theirs: two runs
    mixed without a word, as `checkpoint.resume: never` into a used output_dir did until 2026-12-07."""
    begin = int(manifest.read_meta(start).get("step") or 0) if start is not None else 0
    here = start.resolve() if start is not None else None
    newer = [p for p in complete_tags(root) if int(p.name.removeprefix("step_")) > begin and p.resolve() != here] \
        if root.is_dir() else []
    if not newer:
        return ""
    where = f"step {begin} ({start})" if start is not None else "scratch (checkpoint.resume: never)"
    return (f"checkpoint.dir {root} holds {len(newer)} complete checkpoint(s) of an earlier run past the step this run "
            f"starts from, {where}: {', '.join(p.name for p in newer[-3:])}; training would prune or replace them, "
            "and a later checkpoint.resume: auto could resume the earlier run. Use another output_dir (or "
            "checkpoint.dir), or move those folders out first")


def _agree(problem: str) -> None:
    """Raise `problem` on every rank when any rank has one (ranks may see different disks)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        seen: list = [None] * dist.get_world_size()
        dist.all_gather_object(seen, problem)
        problem = next((p for p in seen if p), "")
    if problem:
        raise ToolkitError(problem)


def _newest(root: Path, log=None) -> Path | None:
    say = log or (lambda _: None)
    folders = sorted((p for p in root.glob(TAG_GLOB) if own(p)), reverse=True) if root.is_dir() else []
    for tag_dir in folders:
        problems = _verify(tag_dir)
        if not problems:
            files = manifest.read_meta(tag_dir).get("files") or {}
            say(f"[toolkit] resuming from {tag_dir}: the newest checkpoint whose manifest verifies "
                f"({manifest.describe_check(files)})")
            return tag_dir
        more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
        say(f"[toolkit] skipping checkpoint {tag_dir}: {problems[0]}{more}")
    return None


def _explicit(p: Path, log) -> Path:
    if is_complete(p):
        problems = _verify(p)
        if problems:
            raise ToolkitError(f"checkpoint.resume: {p} does not match its manifest: {'; '.join(problems)}")
        return p
    if (p / POINTER).is_file() or list(p.glob(TAG_GLOB)):
        found = _newest(p, log)
        if found is None:
            raise ToolkitError(f"checkpoint.resume: {p} holds no checkpoint whose manifest verifies (`toolkit "
                               f"inspect {p}` lists what is wrong with each)")
        return found
    raise ToolkitError(f"checkpoint.resume: {p} is neither a complete checkpoint (a step_* folder with {META}) nor "
                       f"a checkpoint directory with a {POINTER} pointer")


def _verify(tag_dir: Path) -> list[str]:
    """verify_manifest, with the checksums shared out over the ranks of a process group."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return verify_manifest(tag_dir)
    try:
        files = manifest.read_meta(tag_dir).get("files") or {}
    except ToolkitError:
        files = {}
    mine = manifest.share(files, dist.get_rank(), dist.get_world_size())
    found: list = [None] * dist.get_world_size()
    dist.all_gather_object(found, manifest.verify(tag_dir, checksums=mine))
    return list(dict.fromkeys(p for part in found for p in part))  # in manifest order, once each


def verify_manifest(tag_dir: Path) -> list[str]:
    """What is wrong with a checkpoint folder against its manifest (missing, resized or changed files); []."""
    return manifest.verify(tag_dir)


def _describe(layout: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(layout.items()))


def load(backend, tag_dir: Path, layout_meta: dict, micro_batch: int | None = None) -> dict:
    """Restore the backend's model and optimizer state, then this rank's RNG. Returns the saved toolkit state.
    Every pickle is read as weights only (toolkit/format/safe_load.py), also inside DeepSpeed and Megatron.
    A torch_dist checkpoint (Megatron backend) also loads at another layout (`micro_batch`: this run's)."""
    meta = manifest.read_meta(tag_dir)
    saved = meta.get("layout", {})
    moved = saved != layout_meta
    ours = "megatron" if "tp" in layout_meta else "deepspeed"
    if meta.get("backend") in ("deepspeed", "megatron") and meta["backend"] != ours:  # read as this backend's files:
        # "... is missing: ... not written by this layout or is incomplete" (until 2026-12-08)
        raise ToolkitError(f"checkpoint {tag_dir} was written by the {meta['backend']} backend and this run uses "
                           f"{ours}: a run resumes its own backend's checkpoints only; relaunch with "
                           f"parallel.backend: {meta['backend']}, or start fresh in another output_dir (from its "
                           "weights: convert it --to hf and set model.hf_path to that folder, model.pretrained: true)")
    if moved and meta.get("checkpoint_format") == "torch_dist" and "tp" in layout_meta:
        _check_reshard(tag_dir, saved, layout_meta)
    elif moved and _only_data_parallel(saved, layout_meta):
        pass  # the plain optimizer's per-(tp, pp) files hold whole states: every data-parallel rank loads its own
    elif moved:
        if _only_data_parallel({**saved, "zero_stage": 0}, {**layout_meta, "zero_stage": 0}):
            was = f"checkpoint {tag_dir} was written with {_describe(saved)}, this run has {_describe(layout_meta)}"
            if saved.get("zero_stage") == 0:  # the plain optimizer's whole states, into a distributed optimizer
                raise ToolkitError(f"{was}: it holds the plain optimizer's state; set parallel.zero_stage: 0 to "
                                   "resume it (at any dp), or start fresh in another output_dir")
            raise ToolkitError(f"{was}: the distributed optimizer's state is sharded over its data-parallel ranks; "
                               f"relaunch with the saved layout, or `toolkit convert {tag_dir} NEW_DIR --to megatron` (the "
                               "plain optimizer's state, by parameter name) and resume from NEW_DIR "
                               "(checkpoint.resume) with parallel.zero_stage: 0 at any dp; checkpoint.format: "
                               "torch_dist saves checkpoints that resume at any layout")
        if "tp" not in layout_meta and saved.get("zero_stage") != layout_meta.get("zero_stage"):
            # `--to deepspeed` moves a checkpoint to another dp, never to another stage: following that advice
            # looped back to this line (a trial of 2026-12-07)
            raise ToolkitError(f"checkpoint {tag_dir} was written at ZeRO stage {saved.get('zero_stage')}, this run "
                               f"has stage {layout_meta.get('zero_stage')}: a ZeRO checkpoint resumes at its own "
                               f"stage (toolkit convert moves it to another dp, not another stage); relaunch with "
                               f"parallel.zero_stage: {saved.get('zero_stage')}, or start fresh in another output_dir "
                               "(from its weights: convert it --to hf and set model.hf_path, model.pretrained: true)")
        if "tp" in layout_meta:
            move = (f"toolkit convert {tag_dir} NEW_DIR --to megatron --tp {layout_meta['tp']} --pp "
                    f"{layout_meta['pp']} --vpp {layout_meta['vpp']}")
        else:
            move = f"toolkit convert {tag_dir} NEW_DIR --to deepspeed --dp {layout_meta['dp']}"
        raise ToolkitError(f"checkpoint {tag_dir} was written with {_describe(saved)}, this run has "
                           f"{_describe(layout_meta)}; relaunch with the saved layout, move the checkpoint to this "
                           f"layout with `{move}` and resume from NEW_DIR (checkpoint.resume), or "
                           "start fresh in another output_dir")
    check_model(tag_dir, meta, _running_model(backend))
    if "tp" in layout_meta and hasattr(backend, "recipe"):  # the Megatron backend
        check_vocab_padding(tag_dir, meta, backend.recipe, layout_meta)
    if meta.get("weights_only"):  # written by `toolkit convert` from a source with no training state
        raise ToolkitError(f"checkpoint {tag_dir} holds weights only: it was converted from a "
                           f"{meta.get('converted_from', 'foreign')} checkpoint, which carries no data position and "
                           "RNG state per rank, so training cannot resume from it; to train from its weights, convert it "
                           "--to hf and set model.hf_path to that folder with model.pretrained: true")
    _check_pickles(tag_dir)
    state = safe_load.load(tag_dir / rank_file(0 if moved else dist.get_rank()))
    # the data position counts micro-batches: in this run's, when the layout or the micro-batch size changed (a
    # resume at another micro_batch_size read it in the saved size's until 2026-12-07, and trained again on
    # sequences it had seen). RNG streams cannot map onto another set of ranks: every rank takes rank 0's.
    resized = micro_batch is not None and meta.get("micro_batch") not in (None, micro_batch)
    if moved or resized:
        state["data"] = moved_data_position(state["data"], meta.get("micro_batch"), saved.get("dp"), micro_batch,
                                            layout_meta["dp"], tag_dir)
    with safe_load.weights_only_everywhere(tag_dir):  # also DeepSpeed's and Megatron's own torch.load calls
        backend.load_state(tag_dir)
    set_rng_state(state["rng"])
    return state


def _only_data_parallel(saved: dict, layout_meta: dict) -> bool:
    """A Megatron checkpoint with the plain optimizer (zero_stage 0) whose layout differs from this run's only in
    data parallelism (dp and the world size): its files are per (tp, pp, ep) rank, each holding that rank's
    whole weights and optimizer state, so any number of data-parallel ranks loads them."""
    same = ("tp", "pp", "vpp", "cp", "ep")
    return "tp" in layout_meta and saved.get("zero_stage") == 0 == layout_meta.get("zero_stage") and all(
        saved.get(k, 1) == layout_meta.get(k, 1) for k in same)


def _check_reshard(tag_dir: Path, saved: dict, layout_meta: dict) -> None:
    """Megatron-Core reshards a torch_dist checkpoint over TP, PP, VPP, CP and DP, but the optimizer must be the
    same kind (plain or distributed): their sharded states differ."""
    if saved.get("zero_stage") != layout_meta["zero_stage"]:
        kind = {0: "the plain optimizer", 1: "the distributed optimizer"}
        raise ToolkitError(f"checkpoint {tag_dir} was saved with {kind.get(saved.get('zero_stage'), saved)}, this run "
                           f"uses {kind[layout_meta['zero_stage']]}; set parallel.zero_stage: {saved.get('zero_stage')} "
                           "to resume it (TP, PP and DP may differ), or start fresh in another output_dir")
    was, now = int(saved.get("ep", 1)), int(layout_meta.get("ep", 1))
    if (was > 1) != (now > 1):  # Megatron-Core gives the experts an optimizer of their own only at ep > 1
        raise ToolkitError(f"checkpoint {tag_dir} was saved at parallel.ep {was}, this run has ep {now}: Megatron-Core "
                           "keeps the experts' optimizer state apart from the rest only when ep > 1, so its resharding "
                           f"load cannot cross ep 1 <-> ep > 1; resume with ep {'> 1' if was > 1 else '1'} (ep, TP, PP "
                           f"and DP may otherwise change), or `toolkit convert {tag_dir} NEW_DIR --to megatron --ep "
                           f"{now} --tp {layout_meta['tp']} --pp {layout_meta['pp']} --vpp {layout_meta['vpp']}` and "
                           "resume from NEW_DIR (checkpoint.resume) with checkpoint.format: toolkit")


def moved_data_position(data: dict, old_micro, old_dp, new_micro, new_dp: int, where: Path) -> dict:
    """The data position in this run's micro-batches: every step reads the same global sequences at any data
    parallelism (DistributedSampler deals one shuffled order round the ranks), so the sequences consumed this
    epoch, consumed x micro x dp, stay the same."""
    if old_micro is None or new_micro is None or old_dp is None:
        raise ToolkitError(f"{where / META} does not record the micro-batch size and dp it was trained with, so its "
                           "data position cannot move to another layout; resume it at its saved layout")
    sequences = int(data["consumed_micro_batches"]) * int(old_micro) * int(old_dp)
    if sequences % (new_micro * new_dp):
        raise ToolkitError(f"checkpoint {where} consumed {sequences} sequences of this epoch, not a whole number of "
                           f"this run's micro-batches x dp ({new_micro} x {new_dp}); keep training.global_batch_size "
                           "and choose a micro_batch_size that divides it")
    return {**data, "consumed_micro_batches": sequences // (new_micro * new_dp)}


def check_vocab_padding(tag_dir: Path, meta: dict, recipe: Recipe, layout_meta: dict) -> None:
    """Megatron pads the vocabulary to a multiple of make_vocab_size_divisible_by x tp and trains the padding rows
    (their logits are in the loss's softmax). Megatron-Core's torch_dist load does not refuse another padding (the
    embedding and output layer allow a shape mismatch), and the run would go on as another model; refuse it, with
    the divisor that keeps the saved padding at this run's tp (docs/megatron.md, "Vocabulary padding")."""
    if not meta.get("recipe") or "tp" not in meta.get("layout", {}):
        return
    saved = Recipe.model_validate(meta["recipe"])
    vocab, was_by, was_tp = (saved.model.vocab_size, saved.parallel.megatron.make_vocab_size_divisible_by,
                             meta["layout"]["tp"])
    now_by, tp = recipe.parallel.megatron.make_vocab_size_divisible_by, layout_meta["tp"]
    was, now = padded_vocab_size(vocab, was_tp, was_by), padded_vocab_size(recipe.model.vocab_size, tp, now_by)
    if was == now:
        return
    keep = keeping_divisor(vocab, was, tp)
    knob = "parallel.megatron.make_vocab_size_divisible_by"
    fix = (f"set {knob}: {keep} (which pads it to {was} rows at tp={tp})" if keep
           else f"resume at parallel.tp: {was_tp} with {knob}: {was_by}")
    move = (f"toolkit convert {tag_dir} NEW_DIR --to megatron --tp {tp} --pp {layout_meta.get('pp', 1)} --vpp "
            f"{layout_meta.get('vpp', 1)} --make-vocab-size-divisible-by {now_by}")
    raise ToolkitError(f"checkpoint {tag_dir} pads the vocabulary ({vocab}) to {was} rows ({was_by} x tp={was_tp}); "
                       f"this run pads it to {now} ({now_by} x tp={tp}), and Megatron trains the padding rows, so "
                       f"this run would resume another model: {fix}; or take the new padding knowingly with `{move}` "
                       "and resume from NEW_DIR (checkpoint.resume); or start fresh in another output_dir")


ARCHITECTURE = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "vocab_size", "tie_word_embeddings")


def _architecture(hf_config: dict) -> dict:
    arch = {k: hf_config.get(k) for k in ARCHITECTURE}
    arch["num_key_value_heads"] = arch["num_key_value_heads"] or arch["num_attention_heads"]
    return arch


def _running_model(backend) -> dict | None:
    """The Hugging Face config of the model this run built (None when the backend cannot tell)."""
    if hasattr(backend, "hf_config"):
        return backend.hf_config
    module = getattr(getattr(backend, "engine", None), "module", None)
    return module.config.to_dict() if hasattr(module, "config") else None


def check_model(tag_dir: Path, meta: dict, running: dict | None) -> None:
    """Refuse a checkpoint of another architecture before any tensor is loaded (the backends would fail on the
    first mismatched shape, deep inside their loaders)."""
    if running is None:
        return
    if meta.get("hf_config"):
        saved = meta["hf_config"]
    elif meta.get("recipe"):

        saved = to_hf_config(Recipe.model_validate(meta["recipe"]).model).to_dict()
    else:
        return
    was, now = _architecture(saved), _architecture(running)
    diff = [f"{k} {was[k]} (this run: {now[k]})" for k in ARCHITECTURE if was[k] != now[k]]
    if diff:
        raise ToolkitError(f"checkpoint {tag_dir} holds another model: {', '.join(diff)}; resume it with the model "
                           f"it was trained with (its recipe is in {META}), or start fresh in another output_dir (or "
                           "checkpoint.dir)")


def _check_pickles(tag_dir: Path) -> None:
    """Collective: every rank checks a share of the folder's .pt files as weights only (memory-mapped: the pickles
    are read, not the tensors), so that all ranks refuse a planted file together, naming it."""
    names = sorted(p.name for p in tag_dir.glob("*.pt"))
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    mine = [why for name in names[rank::world] if (why := safe_load.check_file(tag_dir / name))]
    found = [mine]
    if world > 1:
        found = [None] * world
        dist.all_gather_object(found, mine)
    problems = [p for part in found for p in part]
    if problems:
        n = len(problems) - 1
        more = f" (and {n} more file{'s' if n > 1 else ''})" if n else ""
        raise ToolkitError(f"checkpoint {tag_dir}: {problems[0]}{more}")
