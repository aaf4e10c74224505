"""Hand-written Megatron-Core training of a Llama: the baseline that bench/overhead.py times the toolkit against.

    torchrun --nproc_per_node 2 bench/overhead_raw_megatron.py --spec spec.json --times times.json

What a user writes by hand with Megatron-Core: process groups, GPTModel, DistributedDataParallel,
get_megatron_optimizer and get_forward_backward_func, called directly. spec.json (written by bench/overhead.py)
holds the Megatron-Core arguments the toolkit derives from the same recipe (toolkit/adapters/megatron.py), so both
sides build the same model and optimizer and train on the same data with the same seed.

Two pieces of the toolkit are used, as environment glue rather than training code: on a machine without a GPU
its CPU shim (toolkit/megatron/cpu_shim.py: Megatron-Core 0.16 hard-codes CUDA, and nothing runs on CPU
without such a shim), and its local layer spec (toolkit/megatron/local_spec.py: Megatron's local spec with a
torch RMSNorm, because Megatron's own local spec offers no RMSNorm without Apex). Everything else is Megatron's.
Supports TP, PP and DP (no virtual pipeline, no context parallelism).
"""
import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead_clock import StepClock, finish, packed_dataset  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for the two pieces of glue named above

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from megatron.core import parallel_state as ps  # noqa: E402
from megatron.core.distributed import (DistributedDataParallel, DistributedDataParallelConfig,  # noqa: E402
                                       finalize_model_grads)
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer  # noqa: E402
from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from toolkit.megatron.local_spec import local_block_spec  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def forward_step(data_iterator, model):
    """GPTModel scores position t against labels[t]: shift the tokens left and mask the last position."""
    ids = next(data_iterator)["input_ids"]
    labels = torch.roll(ids, shifts=-1, dims=1)
    mask = torch.ones_like(labels, dtype=torch.float32)
    mask[:, -1] = 0
    positions = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
    out = model(ids, positions, attention_mask=None, labels=labels)

    def loss_func(output):
        loss = (output.float() * mask).sum() / mask.sum()
        return loss, {"loss": loss.detach().clone()}

    return out, loss_func


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec", required=True)
    ap.add_argument("--times", required=True)
    args = ap.parse_args()
    spec = json.loads(Path(args.spec).read_text())
    mc, clock = spec["megatron"], StepClock()

    dist.init_process_group("gloo")
    if not torch.cuda.is_available():
        from toolkit.megatron import cpu_shim

        cpu_shim.install()
    ps.initialize_model_parallel(**mc["initialize_model_parallel"])
    seed = spec["seed"] + 100 * ps.get_pipeline_model_parallel_rank()  # stages must not share a seed
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)

    tokenizer = AutoTokenizer.from_pretrained(spec["tokenizer"])
    if dist.get_rank() != 0:
        dist.barrier()  # rank 0 fills the datasets cache first
    data = packed_dataset(spec, tokenizer)
    if dist.get_rank() == 0:
        dist.barrier()

    tc = dict(mc["TransformerConfig"], activation_func=F.silu)
    tc["params_dtype"] = tc["pipeline_dtype"] = DTYPES[tc["params_dtype"]]
    config = TransformerConfig(**tc)
    model = GPTModel(config, local_block_spec(config, None), pre_process=ps.is_pipeline_first_stage(),
                     post_process=ps.is_pipeline_last_stage(), **mc["GPTModel"])
    model = DistributedDataParallel(config=config, ddp_config=DistributedDataParallelConfig(
        **mc["DistributedDataParallelConfig"]), module=model)
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = model.no_sync
    optimizer = get_megatron_optimizer(OptimizerConfig(**dict(mc["OptimizerConfig"], params_dtype=config.params_dtype)),
                                       [model])

    sampler = DistributedSampler(data, num_replicas=ps.get_data_parallel_world_size(),
                                 rank=ps.get_data_parallel_rank(), shuffle=True, seed=spec["seed"], drop_last=True)
    batches = iter(DataLoader(data, batch_size=spec["micro_batch"], sampler=sampler))
    forward_backward = get_forward_backward_func()
    losses, logged = [], []
    for step in range(1, spec["steps"] + 1):
        clock.tick()
        micro = [next(batches) for _ in range(spec["grad_accum"])]
        model.zero_grad_buffer()
        optimizer.zero_grad()
        for g in optimizer.param_groups:
            g["lr"] = spec["lrs"][step - 1] * g.get("lr_mult", 1.0)
            g["weight_decay"] = spec["weight_decay"] * g.get("wd_mult", 1.0)
        out = forward_backward(forward_step_func=forward_step, data_iterator=iter(micro), model=model,
                               num_microbatches=len(micro), seq_length=spec["seq_len"],
                               micro_batch_size=spec["micro_batch"], forward_only=False)
        optimizer.step()
        losses += [x["loss"] for x in out]  # only the last pipeline stage has losses
        if step % spec["log_interval"] == 0 or step == spec["steps"]:
            total = torch.tensor([float(sum(losses)), float(len(losses))]) if losses else torch.zeros(2)
            dist.all_reduce(total)
            logged.append([step, (total[0] / total[1]).item()])
            losses = []
            if dist.get_rank() == 0:
                print(f"step {step} loss {logged[-1][1]:.4f}", flush=True)
    finish(clock, args.times, losses=logged)


if __name__ == "__main__":
    main()
