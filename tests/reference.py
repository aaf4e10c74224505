"""The single-process reference every parallel layout is compared with: a plain PyTorch training loop.

Hugging Face's causal LM of the checkpoint's family (LlamaForCausalLM, Qwen2ForCausalLM, ...) from one checkpoint, torch AdamW (no weight decay on norms, as both backends
do), the toolkit's LR schedule, global-norm clipping, and the toolkit's data stream at dp=1 with the recipe's
global batch. No DeepSpeed, no Megatron.
"""
from __future__ import annotations

import math

import torch


def reference_losses(hf_path, steps: int, schedule: list[str], model_out: dict | None = None,
                     evals: dict | None = None, router_logits: bool = False) -> list[float]:
    """Losses of `steps` optimizer steps; with `model_out`, the trained weights are put in model_out["state"].
    With `router_logits` a mixture of experts trains with transformers' load-balancing loss (its
    output_router_logits, router_aux_loss_coef from config.json) and the LM loss without it is returned.
    With eval.* overrides in `schedule` and an `evals` dict, evals[step] is the validation loss after that step,
    computed here directly: the token-weighted mean cross-entropy over the first eval.batches global batches of
    the held-out sequences, in one process, with no toolkit backend."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from toolkit.data import DataStream, build_dataset
    from toolkit.data.heldout import build_heldout, eval_sequences
    from toolkit.model import param_groups
    from toolkit.recipe import load_recipe, resolve
    from toolkit.train.schedule import build_scheduler

    r = load_recipe("tiny_zero0", ["model.preset=null", f"model.hf_path={hf_path}", "model.pretrained=true",
                                   f"training.steps={steps}", *schedule])
    plan = resolve(r, world_size=1)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(hf_path, dtype=torch.float32)
    opt = torch.optim.AdamW(param_groups(model, r.training.optimizer.weight_decay), lr=r.training.optimizer.lr,
                            betas=r.training.optimizer.betas,
                            eps=r.training.optimizer.eps, weight_decay=r.training.optimizer.weight_decay)
    sched = build_scheduler(opt, r.training)
    tok = AutoTokenizer.from_pretrained(r.data.tokenizer)
    train, held = build_heldout(r, tok, build_dataset(r.data, tok))
    stream = DataStream(train, plan.batch.micro_batch, plan.batch.grad_accum, 1, 0,
                        r.training.seed)
    losses = []
    for _ in range(steps):
        micro_losses = []
        for micro in stream.next_step():
            out = model(input_ids=micro["input_ids"], labels=micro["labels"],
                        **({"output_router_logits": True} if router_logits else {}))
            (out.loss / plan.batch.grad_accum).backward()
            aux = model.config.router_aux_loss_coef * out.aux_loss.item() if router_logits else 0.0
            micro_losses.append(out.loss.item() - aux)
        torch.nn.utils.clip_grad_norm_(model.parameters(), r.training.grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(sum(micro_losses) / len(micro_losses))
        done = len(losses)
        if evals is not None and r.eval.interval and (done % r.eval.interval == 0 or done == steps):
            evals[done] = _val_loss(model, held, eval_sequences(len(held), r.eval.batches, plan.batch.global_batch))
    if model_out is not None:
        model_out["state"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return losses


def checkpoint_val_loss(recipe: str, run_dir, overrides: list[str], world: int) -> tuple[float, float]:
    """(validation loss, the same loss over as many training sequences) of a finished run's last checkpoint,
    computed in this process: the weights converted to Hugging Face (`toolkit convert`), the held-out and training
    sequences from toolkit.run.build_data for the run's recipe (a data.blend reads the run's own index caches), and
    Hugging Face's model in fp32, in one process, with no toolkit backend."""
    import tempfile
    from pathlib import Path

    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from toolkit.checkpoint.convert import convert_to_hf
    from toolkit.data.heldout import eval_sequences
    from toolkit.recipe import load_recipe, resolve
    from toolkit.run import build_data

    plan = resolve(load_recipe(recipe, [f"output_dir={run_dir}", *overrides]), world_size=world)
    r, batch = plan.recipe, plan.batch
    with tempfile.TemporaryDirectory() as tmp:
        own_group = not dist.is_initialized()  # Megatron-Core's dataset builder asks for the rank
        if own_group:
            dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        try:
            train, held = build_data(r, batch.global_batch, AutoTokenizer.from_pretrained(r.data.tokenizer))
        finally:
            if own_group:
                dist.destroy_process_group()
        model = AutoModelForCausalLM.from_pretrained(convert_to_hf(Path(run_dir) / "checkpoints", Path(tmp) / "hf"),
                                                     dtype=torch.float32)
    count = eval_sequences(len(held), r.eval.batches, batch.global_batch)
    return _val_loss(model, held, count), _val_loss(model, train, count)


@torch.no_grad()
def _val_loss(model, held, count: int) -> float:
    model.eval()
    total, tokens = 0.0, 0
    for i in range(count):
        ids, labels = held[i]["input_ids"][None], held[i]["labels"][None]
        logits = model(input_ids=ids).logits[0, :-1].double()
        target = labels[0, 1:]
        total += torch.nn.functional.cross_entropy(logits, target, ignore_index=-100, reduction="sum").item()
        tokens += int((target != -100).sum())
    model.train()
    return total / tokens


def assert_val_losses_match(records: list[dict], expected: dict[int, float], rtol: float, label: str) -> None:
    """The run's val_loss at every evaluated step equals the reference's (and val_ppl is its exponential)."""
    got = {m["step"]: m["val_loss"] for m in records if "val_loss" in m}
    assert expected and sorted(got) == sorted(expected), f"{label}: evaluated at {sorted(got)}, expected {sorted(expected)}"
    worst = max(abs(got[s] - expected[s]) / expected[s] for s in expected)
    print(f"{label}: max relative val_loss difference to single process: {worst:.2e}")
    for m in records:
        if "val_loss" in m:
            assert math.isclose(m["val_ppl"], math.exp(m["val_loss"]), rel_tol=1e-12)
    for s in expected:
        assert math.isclose(got[s], expected[s], rel_tol=rtol), f"{label} val_loss at step {s}: {got[s]} vs {expected[s]}"


def assert_blend_val_loss(recipe, run_dir, overrides, split: list[dict], straight: list[dict], steps: list[int]):
    """The validation loss is bit-identical after a resume, and the last one equals the loss of the last checkpoint
    computed in one process on the held-out sequences toolkit.run.build_data gives (the same for both backends)."""
    val = {m["step"]: m["val_loss"] for m in split if "val_loss" in m}
    assert sorted(val) == steps and val == {m["step"]: m["val_loss"] for m in straight if "val_loss" in m}
    expected, on_training_data = checkpoint_val_loss(recipe, run_dir, overrides, world=2)
    print(f"val_loss {val[steps[-1]]} vs single process {expected} (on training sequences: {on_training_data})")
    assert math.isclose(val[steps[-1]], expected, rel_tol=5e-6)  # fp32; as in the parity tests
    assert not math.isclose(on_training_data, expected, rel_tol=1e-4)  # other sequences give another value
