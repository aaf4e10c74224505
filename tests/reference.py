"""The single-process reference every parallel layout is compared with: a plain PyTorch training loop.

Hugging Face's causal LM of the checkpoint's family (LlamaForCausalLM, Qwen2ForCausalLM, ...) from one checkpoint, torch AdamW (no weight decay on norms, as both backends
do), the toolkit's LR schedule, global-norm clipping, and the toolkit's data stream at dp=1 with the recipe's
global batch. No DeepSpeed, no Megatron.
"""
from __future__ import annotations

import torch


def reference_losses(hf_path, steps: int, schedule: list[str], model_out: dict | None = None) -> list[float]:
    """Losses of `steps` optimizer steps; with `model_out`, the trained weights are put in model_out["state"]."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from toolkit.data import DataStream, build_dataset
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
    stream = DataStream(build_dataset(r.data, tok), plan.batch.micro_batch, plan.batch.grad_accum, 1, 0,
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
    if model_out is not None:
        model_out["state"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return losses
