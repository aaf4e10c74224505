"""Hand-written DeepSpeed training of a Llama: the baseline that bench/overhead.py times the toolkit against.

    torchrun --nproc_per_node 2 bench/overhead_raw_deepspeed.py --spec spec.json --times times.json

What a user writes by hand with DeepSpeed, transformers and datasets, and nothing of the toolkit. spec.json
(written by bench/overhead.py from the recipe the toolkit runs) holds the DeepSpeed JSON the toolkit renders,
the Llama config, the data files and the run's numbers, so both sides train the same model on the same data
with the same DeepSpeed config, seed, schedule and logging interval.
"""
import argparse
import json
import sys
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead_clock import StepClock, finish, packed_dataset  # noqa: E402

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.optim.lr_scheduler import LambdaLR  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler  # noqa: E402
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.initialization import no_init_weights  # noqa: E402
from transformers.integrations.deepspeed import initialize_weights_zero3  # noqa: E402


def lr_factor(spec: dict, step: int) -> float:
    """The recipe's warm-up + cosine schedule, as the lr of every step relative to the peak."""
    lrs = spec["lrs"]
    return lrs[min(step, len(lrs) - 1)] / spec["peak_lr"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec", required=True)
    ap.add_argument("--times", required=True)
    args = ap.parse_args()
    spec = json.loads(Path(args.spec).read_text())
    ds_config, clock = spec["ds_config"], StepClock()

    deepspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    tokenizer = AutoTokenizer.from_pretrained(spec["tokenizer"])
    if rank != 0:
        dist.barrier()  # rank 0 fills the datasets cache first
    data = packed_dataset(spec, tokenizer)
    if rank == 0:
        dist.barrier()

    torch.manual_seed(spec["seed"])
    config = LlamaConfig.from_dict(spec["hf_config"])
    if ds_config["zero_optimization"]["stage"] == 3:
        # what transformers' from_config does under ZeRO-3 (its HfDeepSpeedConfig route needs accelerate): build
        # partitioned, then run the initialisers module by module on gathered weights
        with no_init_weights(), deepspeed.zero.Init(config_dict_or_path=ds_config):
            model = LlamaForCausalLM(config)
        initialize_weights_zero3(model)
    else:
        model = LlamaForCausalLM(config)
    decay = [p for p in model.parameters() if len(getattr(p, "ds_shape", p.shape)) >= 2]
    no_decay = [p for p in model.parameters() if len(getattr(p, "ds_shape", p.shape)) < 2]
    groups = [{"params": decay, "weight_decay": spec["weight_decay"]}, {"params": no_decay, "weight_decay": 0.0}]
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=ds_config,
                                           lr_scheduler=lambda opt: LambdaLR(opt, partial(lr_factor, spec)))

    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=spec["seed"], drop_last=True)
    batches = iter(DataLoader(data, batch_size=ds_config["train_micro_batch_size_per_gpu"], sampler=sampler))
    losses, logged = [], []
    for step in range(1, spec["steps"] + 1):
        clock.tick()
        for _ in range(ds_config["gradient_accumulation_steps"]):
            batch = next(batches)
            loss = engine(input_ids=batch["input_ids"], labels=batch["labels"]).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.detach())
        if step % spec["log_interval"] == 0 or step == spec["steps"]:
            mean = torch.stack(losses).mean()
            dist.all_reduce(mean)
            logged.append([step, mean.item() / world])
            losses = []
            if rank == 0:
                print(f"step {step} loss {logged[-1][1]:.4f}", flush=True)
    finish(clock, args.times, losses=logged)


if __name__ == "__main__":
    main()
