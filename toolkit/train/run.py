"""One training run from a recipe on the DeepSpeed backend: set up in order, then loop over steps."""
from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.distributed as dist

from toolkit.errors import RecipeError, ToolkitError
from toolkit.recipe import Plan, Recipe, check_paths, resolve
from toolkit.train import checkpoint as ckpt
from toolkit.train.dist import DistInfo, init_distributed, rank_zero_first
from toolkit.train.metrics import RunLog, detect_peak_tflops, flops_per_token


def prepare(recipe: Recipe) -> tuple[Plan, DistInfo]:
    """Join the process group, then check the recipe against the real world size and the files it needs."""
    info = init_distributed()
    plan = resolve(recipe, info.world_size)
    problems = check_paths(recipe)
    if problems:
        raise RecipeError(recipe.name, problems)
    if plan.layout.backend != "deepspeed":
        raise ToolkitError(f"backend {plan.layout.backend!r} is not available in this version of the toolkit; "
                           "use parallel.backend: deepspeed")
    return plan, info


def build_engine(plan: Plan, info: DistInfo, tokenizer):
    """Model and DeepSpeed engine. The DeepSpeed config exists before the model so ZeRO-3 can partition the
    parameters as they are created (zero.Init) instead of after a full copy has been materialised."""
    import deepspeed

    from toolkit.adapters.deepspeed import build_ds_config
    from toolkit.model import build_model
    from toolkit.train.schedule import build_scheduler

    r = plan.recipe
    ds_config = build_ds_config(plan, info.device)
    model = build_model(r.model, r.training.seed, tokenizer, ds_config if plan.layout.zero_stage == 3 else None)
    if r.training.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config,
                                           lr_scheduler=lambda opt: build_scheduler(opt, r.training))
    return engine


def _check_vocab(r: Recipe, tokenizer) -> None:
    if len(tokenizer) > r.model.vocab_size:
        raise RecipeError(r.name, [__import__("toolkit.errors").errors.Problem(
            "model.vocab_size", f"{r.model.vocab_size} is smaller than the tokenizer's {len(tokenizer)} ids",
            f"set model.vocab_size to at least {len(tokenizer)}")])


def train(recipe: Recipe) -> list[dict]:
    """Run the recipe to its last step (resuming when a checkpoint exists). Returns rank 0's logged records."""
    from transformers import AutoTokenizer

    from toolkit.data import DataStream, build_dataset

    plan, info = prepare(recipe)
    r, layout, batch = plan.recipe, plan.layout, plan.batch
    log = RunLog(r.out_dir, info.rank == 0, r.logging.tensorboard)
    log.info(f"[toolkit] {r.name}: {layout.describe()}; {batch.describe()}")
    for note in plan.notes:
        log.info(f"[toolkit] {note}")
    if info.rank != 0:
        import datasets

        datasets.disable_progress_bars()  # one progress bar per job, not one per rank
    tokenizer = AutoTokenizer.from_pretrained(r.data.tokenizer)
    _check_vocab(r, tokenizer)
    dataset = build_dataset(r.data, tokenizer, rank_zero_first)
    stream = DataStream(dataset, batch.micro_batch, batch.grad_accum, layout.dp, info.rank, r.training.seed,
                        r.data.num_workers)
    log.info(f"[toolkit] data: {len(dataset):,} sequences of {r.data.seq_len} tokens, "
             f"{stream.steps_per_epoch} steps per epoch")
    engine = build_engine(plan, info, tokenizer)
    root = Path(r.checkpoint_dir)
    layout_meta = {"world_size": layout.world_size, "zero_stage": layout.zero_stage, "dp": layout.dp}
    start = 0
    tag_dir = ckpt.find_resume(root, r.checkpoint.resume)
    if tag_dir is not None:
        state = ckpt.load(engine, tag_dir, layout_meta)
        stream.load_state_dict(state["data"])
        start = state["step"]
        log.info(f"[toolkit] resumed from {tag_dir} at step {start}")
    meta = {"layout": layout_meta, "recipe": r.model_dump(mode="json"), "backend": "deepspeed"}
    records = _loop(engine, stream, plan, info, log, start, root, meta)
    if r.logging.sample_prompt and (not records or records[-1]["step"] == r.training.steps):
        log.info(f"[toolkit] sample: {sample(engine, tokenizer, r.logging.sample_prompt, r.logging.sample_tokens)!r}")
    log.close()
    return records


def _loop(engine, stream, plan: Plan, info: DistInfo, log: RunLog, start: int, root: Path, meta: dict) -> list[dict]:
    r, batch = plan.recipe, plan.batch
    tokens_per_step = batch.global_batch * r.data.seq_len
    flops_step = flops_per_token(r.model, r.data.seq_len) * tokens_per_step
    peak = r.logging.peak_tflops or detect_peak_tflops(info.device, r.training.precision)
    device = engine.device
    records, losses = [], []
    t0, last_logged = time.perf_counter(), start
    last = min(r.training.steps, r.training.stop_at_step or r.training.steps)
    for step in range(start, last):
        lr = engine.get_lr()[0]  # the lr this step trains with (the scheduler moves on inside engine.step)
        done = step + 1
        log_now = done % r.logging.interval == 0 or done == last
        for micro in stream.next_step():
            out = engine(input_ids=micro["input_ids"].to(device), labels=micro["labels"].to(device))
            engine.backward(out.loss)
            grad_norm = _grad_norm(engine) if log_now and engine.is_gradient_accumulation_boundary() else None
            engine.step()
            losses.append(out.loss.detach())
        if log_now:
            # the only host sync of the loop: average the pending losses over steps and data-parallel ranks
            loss = torch.stack(losses).float().mean()
            dist.all_reduce(loss, op=dist.ReduceOp.SUM)
            elapsed = time.perf_counter() - t0
            steps = done - last_logged
            tflops = flops_step * steps / elapsed / 1e12 / info.world_size
            gn = engine.get_global_grad_norm() if grad_norm is None else grad_norm
            rec = {"step": done, "loss": loss.item() / info.world_size, "lr": lr,
                   "grad_norm": None if gn is None else float(gn), "tokens_per_s": tokens_per_step * steps / elapsed,
                   "tflops_per_rank": tflops, "mfu": tflops / peak if peak else None}
            log.step(rec)
            records.append(rec)
            losses, t0, last_logged = [], time.perf_counter(), done
        if done % r.checkpoint.interval == 0 or done == last:
            tag_dir = ckpt.save(engine, root, done, stream.state_dict(), meta)
            if info.rank == 0:
                pruned = ckpt.prune(root, r.checkpoint.keep)
                log.info(f"[toolkit] saved {tag_dir}" + (f"; removed {len(pruned)} older" if pruned else ""))
            t0 = time.perf_counter()  # checkpoint time is not training throughput
    return records


def _grad_norm(engine):
    """ZeRO-0 keeps no gradient norm; compute it from the (already all-reduced) gradients before the step.
    ZeRO-1/2/3 return None here and report theirs through engine.get_global_grad_norm() after the step."""
    if engine.zero_optimization_stage() != 0:
        return None
    grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
    return torch.nn.utils.get_total_norm(grads) if grads else None


@torch.no_grad()
def sample(engine, tokenizer, prompt: str, max_new_tokens: int) -> str:
    """Greedy continuation of `prompt`. Every rank calls this: under ZeRO-3 each forward gathers parameters from
    all ranks, so generation must stay in lock-step (synced_gpus)."""
    model = engine.module
    model.eval()
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"].to(engine.device)
    out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, use_cache=True,
                         synced_gpus=engine.zero_optimization_stage() == 3 and dist.get_world_size() > 1,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    model.train()
    return prompt + tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
