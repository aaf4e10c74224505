"""One training run from a recipe, on either backend: set up in order, resume, then loop over steps."""
from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from toolkit.adapters.megatron import check_megatron
from toolkit.checkpoint.convert import convert_to_hf
from toolkit.checkpoint.output import not_written_by_us
from toolkit.checkpoint.safetensors_sources import TOKENIZER_FILES
from toolkit.data import DataStream, build_dataset, check_files, check_fills_a_step
from toolkit.data.blend import build_blend
from toolkit.data.heldout import build_heldout, check_eval_files, eval_micro_batches, eval_sequences
from toolkit.data.indexed import check_prepared
from toolkit.errors import Problem, RecipeError, ToolkitError
from toolkit.layout import padded_vocab_size
from toolkit.format import manifest
from toolkit.format.names import refuse_foreign
from toolkit.megatron.backend import MegatronBackend
from toolkit.megatron.runtime import te_available, uses_transformer_engine
from toolkit.metrics import RunLog, detect_peak_tflops, flops_per_token
from toolkit.model import TOKEN_IDS
from toolkit.proc import abandoned_build_locks, cannot_write, extensions_in_use, use_own_extensions_cache
from toolkit.recipe import Plan, Recipe, check_paths, resolve
from toolkit.train import checkpoint as ckpt
from toolkit.train import faults, preempt
from toolkit.train.dist import DistInfo, init_distributed, rank_zero_first, shutdown
from toolkit.train.ds_backend import DeepSpeedBackend


def check_before_start(recipe: Recipe) -> None:
    """What can be checked before any process group, model or output folder exists: the files the run reads
    (data, tokenizer, weights), the head of every data file (empty, binary, wrongly shaped), the NVMe folder, and
    a checkpoint directory holding step_* entries the toolkit did not write (refused before anything is created)."""
    refuse_foreign(Path(recipe.checkpoint_dir))
    if recipe.parallel.backend == "deepspeed":  # a build lock a killed op build left makes DeepSpeed wait forever
        why = cannot_write(extensions_in_use())
        if why:  # DeepSpeed builds its ops there as it starts (a traceback from init_distributed until 2026-12-07)
            raise ToolkitError(f"the torch extensions cache {extensions_in_use()} cannot be written: {why}; DeepSpeed "
                               "builds its ops there: set TORCH_EXTENSIONS_DIR to a folder you can write")
        for lock in abandoned_build_locks(extensions_in_use()):
            raise ToolkitError(f"{lock} was left by a DeepSpeed op build that was killed (no process holds it), and "
                               f"DeepSpeed would wait for it forever: delete it (rm {lock}) and start again")
    problems = check_paths(recipe)
    if recipe.parallel.backend == "deepspeed" and recipe.training.precision == "fp16" and not torch.cuda.is_available():
        # DeepSpeed's CPU accelerator refuses fp16 once the engine is built: a traceback after start-up
        problems.append(Problem("training.precision", "fp16 does not run on CPU with DeepSpeed (its CPU accelerator "
                                "supports bf16 and fp32)", "use bf16 or fp32 here; fp16 is for GPUs"))
    if recipe.data.blend is None and not any(p.key == "data.paths" for p in problems):
        problems += check_files(recipe.data)
    if not any(p.key == "eval.paths" for p in problems):
        problems += check_eval_files(recipe)
    export = Path(recipe.out_dir) / "hf"
    if recipe.checkpoint.export_hf and os.path.lexists(export):  # replaced at the end only if convert wrote it
        theirs = "is a symbolic link" if export.is_symlink() else not_written_by_us(export)
        if theirs:
            what = theirs if export.is_symlink() else f"holds {theirs}, which toolkit convert did not write"
            problems.append(Problem("checkpoint.export_hf", f"{export} {what}: the export at the end of the run "
                                    "would be refused", "move it away, or choose another output_dir"))
    if problems:
        raise RecipeError(recipe.name, problems)


def vocab_padding_notes(r: Recipe, layout) -> list[str]:
    """A line when Megatron pads a pretrained model's vocabulary: its loss is a softmax over the padding rows too
    (zero at the start, trained after), so it is not the loss transformers or the DeepSpeed backend compute from the
    same weights (a trial of 2026-12-07 measured 7.70 against 7.63 at the first step). Said nowhere until then."""
    m, mc = r.model, r.parallel.megatron
    if layout.backend != "megatron" or not m.pretrained:
        return []
    padded = padded_vocab_size(m.vocab_size, layout.tp, mc.make_vocab_size_divisible_by)
    if padded == m.vocab_size:
        return []
    keep = [d for d in range(min(mc.make_vocab_size_divisible_by, m.vocab_size), 0, -1)
            if m.vocab_size % (d * layout.tp) == 0]
    fix = (f"parallel.megatron.make_vocab_size_divisible_by: {keep[0]} pads none at tp={layout.tp}" if keep else
           f"no divisor pads none at tp={layout.tp}")
    return [f"vocabulary padding: {m.vocab_size} rows pad to {padded} at tp={layout.tp} (by "
            f"{mc.make_vocab_size_divisible_by}); Megatron's loss is a softmax over the {padded - m.vocab_size} zero "
            f"padding rows too, so it starts above what transformers computes from these weights ({fix})"]


def dropout_notes(r: Recipe) -> list[str]:
    """A line when model.hf_path's config.json sets a dropout: the toolkit's families train without one, and an
    export writes 0.0 (both without a word until 2026-12-07)."""
    if not r.model.hf_path or not (Path(r.model.hf_path) / "config.json").is_file():
        return []
    try:
        config = json.loads((Path(r.model.hf_path) / "config.json").read_text())
    except (OSError, ValueError):
        return []  # check_paths has said what is wrong with it
    set_ = {k: v for k, v in config.items() if k.endswith("dropout") and isinstance(v, (int, float)) and v}
    if not set_:
        return []
    return [f"model.hf_path: its config sets {', '.join(f'{k}: {v}' for k, v in set_.items())}; the toolkit trains "
            "without dropout, and a Hugging Face export of this run writes 0.0"]


def prepare(recipe: Recipe) -> tuple[Plan, DistInfo]:
    """Check the files, join the process group, then check the recipe against the real world size and backend."""
    check_before_start(recipe)
    info = init_distributed(with_deepspeed=recipe.parallel.backend == "deepspeed")
    try:
        plan = resolve(recipe, info.world_size)
        if plan.layout.backend == "megatron":
            problems = check_megatron(recipe, te_available())
            if problems:
                raise RecipeError(recipe.name, problems)
    except RecipeError as e:  # from the recipe, the world size and the installed packages: alike on every rank
        e.alike_on_every_rank = True  # rank 0 says it (every rank did until 2026-12-07)
        raise
    return plan, info


def build_backend(plan: Plan, info: DistInfo, tokenizer):
    if plan.layout.backend == "megatron":

        return MegatronBackend(plan, info)

    return DeepSpeedBackend(plan, info, tokenizer)


def _load_tokenizer(r: Recipe):
    from transformers import AutoTokenizer  # lazy: heavy; model paths only

    try:
        tokenizer = AutoTokenizer.from_pretrained(r.data.tokenizer)
    except (OSError, ValueError) as e:
        raise RecipeError(r.name, [Problem("data.tokenizer", f"cannot load {r.data.tokenizer!r}: {e}",
                                           "point it at a local tokenizer folder (or a hub name when online)")]) from None
    _check_vocab(r, tokenizer)
    return tokenizer


def _check_vocab(r: Recipe, tokenizer) -> None:
    if len(tokenizer) > r.model.vocab_size:
        raise RecipeError(r.name, [Problem("model.vocab_size", f"{r.model.vocab_size} is smaller than the "
                                           f"tokenizer's {len(tokenizer)} ids",
                                           f"set model.vocab_size to at least {len(tokenizer)}")])


def build_train_data(r: Recipe, global_batch: int, tokenizer):
    """The training sequences, the same for both backends: a data.blend through Megatron-Core's builder
    (training.steps x global batch samples), or data.paths / data.hub_dataset tokenized on the fly."""
    if r.data.blend is None:
        return build_dataset(r.data, tokenizer, rank_zero_first)
    return build_data(r, global_batch, tokenizer)[0]


def build_data(r: Recipe, global_batch: int, tokenizer, notes: list | None = None):
    """(training sequences, held-out sequences or None), the same for both backends. A data.blend and its held-out
    set (eval.split or eval.blend) come from one call of Megatron-Core's builder; on-the-fly data and eval.paths
    files go through build_heldout. Lines for the run's log go to `notes`."""
    if r.data.blend is None:
        return build_heldout(r, tokenizer, build_dataset(r.data, tokenizer, rank_zero_first, notes), rank_zero_first,
                             global_batch, notes)
    problems = check_prepared(r.data, tokenizer) + check_prepared(r.data, tokenizer, r.eval.blend or [], "eval.blend")
    if problems:
        raise RecipeError(r.name, problems)
    train, held = build_blend(r.data, tokenizer, r.training.steps * global_batch, r.out_dir, r.training.seed,
                              r.eval, global_batch)
    if r.eval.paths:
        return build_heldout(r, tokenizer, train, rank_zero_first, global_batch, notes)
    return train, held


def train(recipe: Recipe) -> list[dict]:
    """Run the recipe to its last step (resuming when a checkpoint exists). Returns rank 0's logged records."""
    use_own_extensions_cache()
    plan, info = prepare(recipe)
    r, layout, batch = plan.recipe, plan.layout, plan.batch
    if info.rank != 0:
        import datasets  # lazy: heavy; corpus reads only

        datasets.disable_progress_bars()  # one progress bar per job, not one per rank
    tokenizer = _load_tokenizer(r)
    notices = []
    if r.data.kind == "chat" and r.data.packing and layout.backend == "megatron" and uses_transformer_engine(
            r, info.device == "cuda"):
        # TE's attention takes packed sequences only as THD packed_seq_params, which this runtime does not build
        notices.append("data.packing: chat conversations are padded one per sequence, not packed: Megatron with "
                       "Transformer Engine layers cannot keep packed conversations apart here (docs/sft.md)")
        r = r.model_copy(update={"data": r.data.model_copy(update={"packing": False})})
    notices += vocab_padding_notes(r, layout) + dropout_notes(r)
    dataset, heldout = build_data(r, batch.global_batch, tokenizer, notices)
    check_fills_a_step(len(dataset), batch.micro_batch, batch.grad_accum, layout.dp)
    evaluating = heldout is not None and bool(r.eval.interval)
    eval_count = eval_sequences(len(heldout), r.eval.batches, batch.global_batch) if evaluating else 0
    # The output folder (log, TensorBoard events) is created only once the data is known to be usable: a run that
    # stops on bad data leaves nothing behind.
    log = RunLog(r.out_dir, info.rank == 0, r.logging.tensorboard)
    log.info(f"[toolkit] {r.name}: {layout.describe()}; {batch.describe()}")
    for note in plan.notes + notices:
        log.info(f"[toolkit] {note}")
    backend = build_backend(plan, info, tokenizer)
    stream = DataStream(dataset, batch.micro_batch, batch.grad_accum, layout.dp, backend.dp_rank, r.training.seed,
                        r.data.num_workers, shuffle=r.data.blend is None)
    blend = f" from a blend of {len(r.data.blend)} prepared datasets" if r.data.blend else ""
    log.info(f"[toolkit] data: {len(dataset):,} sequences of {r.data.seq_len} tokens{blend}, "
             f"{stream.steps_per_epoch} steps per epoch")
    eval_batches = None
    if evaluating:
        eval_batches = eval_micro_batches(heldout, eval_count, batch.micro_batch, layout.dp, backend.dp_rank)
        source = f"eval.split {r.eval.split}" if r.eval.split is not None else f"eval.paths {r.eval.paths}"
        if r.eval.blend is not None:
            source = f"eval.blend of {len(r.eval.blend)} prepared datasets"
        asked = r.eval.batches and r.eval.batches * batch.global_batch > eval_count
        fewer = f" (eval.batches {r.eval.batches} asks for {r.eval.batches * batch.global_batch}: all full global " \
                f"batches it holds)" if asked else ""
        log.info(f"[toolkit] eval: every {r.eval.interval} steps and at the end, {eval_count} of "
                 f"{len(heldout):,} held-out sequences ({source}){fewer}")
    root, start = Path(r.checkpoint_dir), 0
    tag_dir = ckpt.find_resume(root, r.checkpoint.resume, log=log.info)  # names the choice and any skipped
    if tag_dir is not None:
        state = ckpt.load(backend, tag_dir, backend.layout_meta, batch.micro_batch)
        stream.load_state_dict(state["data"])
        start = state["step"]
        log.info(f"[toolkit] resumed from {tag_dir} at step {start}")
        for line in resume_notes(manifest.read_meta(tag_dir).get("recipe"), r):
            log.info(line)
        log.resumed(start)
    meta = {"layout": backend.layout_meta, "recipe": r.model_dump(mode="json"), "backend": backend.name,
            "checkpoint_format": r.checkpoint.format, "micro_batch": batch.micro_batch,
            "tokens": {k: getattr(tokenizer, k, None) for k in TOKEN_IDS}}
    if info.rank == 0:
        earlier = preempt.clear_marker(Path(r.out_dir))
        if earlier is not None:
            log.info(f"[toolkit] continuing after a preemption at step {earlier.get('step')}")
    watch = preempt.PreemptionWatch()
    try:
        records = _loop(backend, stream, plan, info, log, start, root, meta, watch, eval_batches)
        watch.settle()
    except preempt.Preempted as stop:
        log.info(f"[toolkit] {stop}")
        log.close()
        shutdown()
        raise
    finally:
        watch.close()
    finished = not records or records[-1]["step"] == r.training.steps
    if r.logging.sample_prompt and finished:
        if hasattr(backend, "sample"):
            prompt = r.logging.sample_prompt
            if r.data.kind == "chat":  # the prompt as a user turn, through the chat template the model trains on
                prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                       add_generation_prompt=True)
            text = backend.sample(tokenizer, prompt, r.logging.sample_tokens)
            log.info(f"[toolkit] sample: {text!r}")
        else:
            log.info(f"[toolkit] logging.sample_prompt is ignored: the {backend.name} backend does not generate yet")
    if r.checkpoint.export_hf and finished:
        _export_hf(r, info, log)
    log.close()
    shutdown()
    return records


# What a resume carries from the checkpoint into a recipe that may have changed: the data position (an epoch and a
# count of micro-batches, meaningful for the same sequences in the same order) and the step of the LR schedule.
_CARRIED = {"data": None, "training": ("steps", "global_batch_size", "seed", "schedule")}
_UNCARRIED = {"data.num_workers"}


def resume_notes(saved: dict | None, r: Recipe) -> list[str]:
    """One line when this run's data or schedule differs from the recipe its checkpoint was saved with. Not refused:
    more steps, a new schedule or new data are what a user may want, but the saved data position then counts
    another stream's micro-batches, and a data.blend's order (which depends on training.steps) changes."""
    if not isinstance(saved, dict):
        return []
    now = r.model_dump(mode="json")
    changed = []
    for section, keys in _CARRIED.items():
        was, new = saved.get(section) or {}, now[section]
        for key in keys or sorted(new):
            name = f"{section}.{key}"
            if name not in _UNCARRIED and key in was and was[key] != new[key]:
                changed.append(f"{name} {_short(was[key])} -> {_short(new[key])}")
    if not changed:
        return []
    return [f"[toolkit] note: this run's recipe differs from the checkpoint's in {'; '.join(changed)}: the saved data "
            "position and schedule step carry over as they are (the data order changes with data and, for a "
            "data.blend, with training.steps)"]


def _short(value) -> str:
    text = str(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _export_hf(r: Recipe, info: DistInfo, log: RunLog) -> None:
    """checkpoint.export_hf: the last checkpoint as a Hugging Face folder, <output_dir>/hf, written by rank 0 through
    the same converter as `toolkit convert --to hf` (verified, all or nothing, tokenizer carried along)."""
    if info.rank == 0:
        tokenizer = Path(r.data.tokenizer)  # the folder the run read (a hub name: none)
        tokenizer = tokenizer if any((tokenizer / name).is_file() for name in TOKENIZER_FILES) else None
        dst = convert_to_hf(r.checkpoint_dir, Path(r.out_dir) / "hf", overwrite=True, tokenizer=tokenizer)
        log.info(f"[toolkit] exported to Hugging Face: {dst}")
    dist.barrier()


def _loop(backend, stream, plan: Plan, info: DistInfo, log: RunLog, start: int, root: Path, meta: dict,
          watch: preempt.PreemptionWatch, eval_batches: list[dict] | None = None) -> list[dict]:
    r, batch = plan.recipe, plan.batch
    tokens_per_step = batch.global_batch * r.data.seq_len
    flops_step = flops_per_token(r.model, r.data.seq_len) * tokens_per_step
    peak = r.logging.peak_tflops or detect_peak_tflops(info.device, r.training.precision)
    records, pending = [], []
    t0, last_logged = time.perf_counter(), start
    saving = 0.0  # seconds of checkpoint saves since t0: not training throughput
    last = min(r.training.steps, r.training.stop_at_step or r.training.steps)
    for step in range(start, last):
        lr, done = backend.current_lr(step), step + 1
        eval_now = eval_batches is not None and (done % r.eval.interval == 0 or done == last)
        log_now = done % r.logging.interval == 0 or done == last or eval_now
        faults.begin_step(done)  # fault injection (tests only): which step the backend is in
        loss, grad_norm = backend.step(stream.next_step(), lr, log_now)
        if loss is not None:  # Megatron: only the last pipeline stage computes a loss
            pending.append(loss)
        if log_now:
            rec = _record(pending, done, done - last_logged, t0 + saving, lr, grad_norm, tokens_per_step, flops_step,
                          peak, info.world_size)
            if eval_now:  # after the interval's time is read: evaluation is not training throughput
                rec.update(_evaluate(backend, eval_batches))
            log.step(rec)
            records.append(rec)
            pending, t0, last_logged, saving = [], time.perf_counter(), done, 0.0
        stop = watch.agreed()  # a preemption signal on any rank (noted a step ago): checkpoint here, then leave
        if done % r.checkpoint.interval == 0 or done == last or stop:
            began = time.perf_counter()
            tag_dir = ckpt.save(backend, root, done, stream.state_dict(), meta)
            if info.rank == 0:
                pruned = ckpt.prune(root, r.checkpoint.keep)
                log.info(f"[toolkit] saved {tag_dir}" + (f"; removed {len(pruned)} older" if pruned else ""))
            # checkpoint time is not training throughput. Until 2026-12-07 the interval's clock restarted here while
            # its step count did not, so a save between two logged steps nearly doubled tokens/s and TFLOP/s
            saving += time.perf_counter() - began
            if stop and done < last:
                if info.rank == 0:
                    preempt.write_marker(Path(r.out_dir), done, tag_dir, watch.name)
                dist.barrier()
                raise preempt.Preempted(done, tag_dir, watch.name)
    return records


def _record(pending, step, steps, t0, lr, grad_norm, tokens_per_step, flops_step, peak, world) -> dict:
    """The logged numbers. The one host sync of the loop: the losses of the interval, averaged over every rank
    that computed one (all data-parallel ranks; with pipelines, the last stage's ranks). The interval's time is
    read after that sync, so work still queued on the GPU counts (reading it before would overstate tokens/s)."""
    local = torch.zeros(2, device=_comm_device())  # (sum of losses, how many)
    if pending:
        local[0], local[1] = torch.stack(pending).float().sum().to(local.device), len(pending)
    dist.all_reduce(local, op=dist.ReduceOp.SUM)
    loss = (local[0] / local[1]).item()
    elapsed = time.perf_counter() - t0
    tflops = flops_step * steps / elapsed / 1e12 / world
    rec = {"step": step, "loss": loss, "lr": lr, "grad_norm": None if grad_norm is None else float(grad_norm),
           "tokens_per_s": tokens_per_step * steps / elapsed, "tflops_per_rank": tflops,
           "mfu": tflops / peak if peak else None}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rec["max_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30  # this rank's peak so far (toolkit plan)
    return rec


def _evaluate(backend, batches: list[dict]) -> dict:
    """The validation loss: every rank's (sum of token losses, token count), summed over all ranks, then divided:
    the token-weighted mean over the same held-out sequences at every layout."""
    total = backend.evaluate(batches).to(_comm_device(), torch.float64)
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    loss = (total[0] / total[1]).item()
    return {"val_loss": loss, "val_ppl": math.exp(loss) if loss < 700 else math.inf}


def _comm_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
