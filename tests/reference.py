"""The single-process reference every parallel layout is compared with: a plain PyTorch training loop.

Hugging Face's causal LM of the checkpoint's family (LlamaForCausalLM, Qwen2ForCausalLM, ...) from one checkpoint, torch AdamW (no weight decay on norms, as both backends
do), the toolkit's LR schedule, global-norm clipping, and the toolkit's data stream at dp=1 with the recipe's
global batch. No DeepSpeed, no Megatron.
"""
from __future__ import annotations

import torch


def reference_losses(hf_path, steps: int, schedule: list[str], model_out: dict | None = None,
                     evals: dict | None = None) -> list[float]:
    """Losses of `steps` optimizer steps; with `model_out`, the trained weights are put in model_out["state"].
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
            loss = model(input_ids=micro["input_ids"], labels=micro["labels"]).loss
            (loss / plan.batch.grad_accum).backward()
            micro_losses.append(loss.item())
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
    import math

    got = {m["step"]: m["val_loss"] for m in records if "val_loss" in m}
    assert expected and sorted(got) == sorted(expected), f"{label}: evaluated at {sorted(got)}, expected {sorted(expected)}"
    worst = max(abs(got[s] - expected[s]) / expected[s] for s in expected)
    print(f"{label}: max relative val_loss difference to single process: {worst:.2e}")
    for m in records:
        if "val_loss" in m:
            assert math.isclose(m["val_ppl"], math.exp(m["val_loss"]), rel_tol=1e-12)
    for s in expected:
        assert math.isclose(got[s], expected[s], rel_tol=rtol), f"{label} val_loss at step {s}: {got[s]} vs {expected[s]}"
