"""The DeepSpeed backend behind the training loop: a DeepSpeed engine over a Hugging Face Llama."""
from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from toolkit.adapters.deepspeed import build_ds_config
from toolkit.errors import ToolkitError
from toolkit.families import family_named
from toolkit.model import build_model, param_groups, token_loss_sum
from toolkit.recipe import Plan
from toolkit.train import faults
from toolkit.train.dist import DistInfo
from toolkit.train.schedule import build_scheduler


class DeepSpeedBackend:
    name = "deepspeed"

    def __init__(self, plan: Plan, info: DistInfo, tokenizer):
        """The DeepSpeed config exists before the model so ZeRO-3 can partition the parameters as they are
        created (zero.Init) instead of after a full copy has been materialised."""
        import deepspeed  # lazy: DeepSpeed paths only


        r, layout = plan.recipe, plan.layout
        ds_config = build_ds_config(plan, info.device)
        model = build_model(r.model, r.training.seed, tokenizer, ds_config if layout.zero_stage == 3 else None)
        if r.training.activation_checkpointing == "full":
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.engine, _, _, _ = deepspeed.initialize(
            model=model, model_parameters=param_groups(model, r.training.optimizer.weight_decay), config=ds_config,
            lr_scheduler=lambda opt: build_scheduler(opt, r.training))
        self.dp_rank, self.dp = info.rank, layout.dp
        self.per_token = r.data.kind == "chat"
        # transformers adds a MoE model's load-balancing loss only when asked for its router logits (its configs
        # default to not), so router_aux_loss_coef would silently do nothing; the logged loss stays the LM loss
        self.aux_coef = (r.model.router_aux_loss_coef or 0.0) if family_named(r.model.family).moe else 0.0
        self.layout_meta = {"world_size": layout.world_size, "zero_stage": layout.zero_stage, "dp": layout.dp}

    def current_lr(self, step: int) -> float:
        return self.engine.get_lr()[0]  # the lr this step trains with (the scheduler moves on in engine.step)

    def step(self, batches: list[dict], lr: float, want_grad_norm: bool):
        """Forward/backward every micro-batch and take the optimizer step (at `lr`, which the engine's scheduler
        already holds). Returns (mean loss tensor of this rank, grad norm or None); no host sync unless the grad
        norm is asked for."""
        engine, device, losses, grad_norm = self.engine, self.engine.device, [], None
        extra = {"output_router_logits": True} if self.aux_coef else {}
        if self.per_token:
            # chat data: the mean over all loss tokens of the step. transformers divides each micro-batch's sum by
            # num_items_in_batch; DeepSpeed then divides by the accumulation steps and averages over dp ranks.
            n = torch.stack([(m["labels"][:, 1:] != -100).sum() for m in batches]).sum().double().to(device)
            dist.all_reduce(n)
            extra["num_items_in_batch"] = n.clamp(min=1).float() / (self.dp * len(batches))
        for micro in batches:
            # packed chat data carries position ids that restart at 0 per conversation: transformers then keeps the
            # conversations from attending to each other (its packed-sequence mask, masking_utils), but only with
            # no KV cache (use_cache=False), so that is passed too
            if "position_ids" in micro:
                extra.update(position_ids=micro["position_ids"].to(device), use_cache=False)
            out = engine(input_ids=micro["input_ids"].to(device), labels=micro["labels"].to(device), **extra)
            faults.point("forward")
            engine.backward(out.loss)
            boundary = engine.is_gradient_accumulation_boundary()
            if boundary:
                faults.point("backward")
            if want_grad_norm and boundary and engine.zero_optimization_stage() == 0:
                grad_norm = _grad_norm(engine.module)  # ZeRO-0 keeps none; the gradients are all-reduced by now
            engine.step()
            losses.append(out.loss.detach() - (self.aux_coef * out.aux_loss.detach() if self.aux_coef else 0.0))
        faults.point("optimizer")
        if want_grad_norm and grad_norm is None:
            grad_norm = engine.get_global_grad_norm()
        return torch.stack(losses).float().mean(), grad_norm

    @torch.no_grad()
    def evaluate(self, batches: list[dict]) -> torch.Tensor:
        """(sum of token losses, token count) of this rank's held-out micro-batches, in eval mode. Every rank calls
        this with the same number of micro-batches: under ZeRO-3 each forward gathers parameters from all ranks."""
        engine, total = self.engine, torch.zeros(2, dtype=torch.float64, device=self.engine.device)
        engine.eval()
        try:
            for micro in batches:
                packed = {}  # packed chat data: each conversation sees only itself, as in training (step)
                if "position_ids" in micro:
                    packed = dict(position_ids=micro["position_ids"].to(engine.device), use_cache=False)
                logits = engine(input_ids=micro["input_ids"].to(engine.device), **packed).logits
                total += token_loss_sum(logits, micro["labels"].to(engine.device))
        finally:
            engine.train()
        return total

    def save_state(self, root: Path, tag: str) -> None:
        self.engine.save_checkpoint(str(root), tag=tag, save_latest=False)

    def load_state(self, tag_dir: Path) -> None:
        path, _ = self.engine.load_checkpoint(str(tag_dir.parent), tag=tag_dir.name)
        if path is None:
            raise ToolkitError(f"DeepSpeed could not load checkpoint {tag_dir}")

    @torch.no_grad()
    def sample(self, tokenizer, prompt: str, max_new_tokens: int) -> str:
        """Greedy continuation of `prompt`. Every rank calls this: under ZeRO-3 each forward gathers parameters
        from all ranks, so generation must stay in lock-step (synced_gpus)."""
        engine, model = self.engine, self.engine.module
        model.eval()
        ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"].to(engine.device)
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, use_cache=True,
                             synced_gpus=engine.zero_optimization_stage() == 3 and dist.get_world_size() > 1,
                             pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
        model.train()
        return prompt + tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def _grad_norm(module) -> torch.Tensor | None:
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    return torch.nn.utils.get_total_norm(grads) if grads else None
