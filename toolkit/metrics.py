"""Throughput arithmetic and the run's log: console, metrics.jsonl and TensorBoard (rank 0 only)."""
from __future__ import annotations

import json
import time
from pathlib import Path

from toolkit.families import family_named
from toolkit.families.mapping import param_count, recipe_dims
from toolkit.recipe.schema import ModelConfig

# Dense bf16/fp16 peak TFLOP/s of one device, by a substring of its name (vendor data sheets, no sparsity).
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "A800": 312.0, "H800": 989.0, "L40S": 362.0,
               "A10G": 125.0, "A6000": 155.0, "V100": 125.0, "4090": 165.0, "MI300X": 1307.0}


def count_params(m: ModelConfig) -> dict:
    """Parameter counts of the recipe's model, from the recipe alone: its family's map, summed
    (toolkit.families.mapping.param_count)."""
    return param_count(family_named(m.family), recipe_dims(m))


def checkpoint_bytes(recipe) -> int:
    """Bytes one checkpoint of a recipe's run takes: weights in the training dtype, plus the fp32 master weights
    (16-bit training) and Adam's two fp32 moments, whatever the sharding (it only spreads them over files).
    DeepSpeed's ZeRO-1/2 optimizer keeps and saves an fp32 copy of its partition even in fp32 training, so such a
    run saves 16 bytes per parameter, not 12 (a trial measured 13.3 MiB against the 10.0 estimated until
    2026-12-07)."""
    p, fp32 = recipe.parallel, recipe.training.precision == "fp32"
    copy = fp32 and p.backend == "deepspeed" and p.zero_stage in (1, 2)
    return count_params(recipe.model)["total"] * ((16 if copy else 12) if fp32 else 2 + 12)


def flops_per_token(m: ModelConfig, seq_len: int) -> float:
    """Model FLOPs per trained token (forward + backward = 3 x forward): 6 x the matmul parameters plus attention
    scores 12 x layers x hidden x seq_len (PaLM appendix B). Recomputation is not counted: this is MFU's numerator.
    A mixture of experts counts the experts a token is routed to (its active parameters), not all of them. The
    output layer is a matmul whether or not it shares the input embeddings' weights: a tied one was left out until
    2026-12-07 (about 25% of a Qwen2.5-0.5B's FLOPs), so tied and untied models' MFU did not compare."""
    c = count_params(m)
    matmul = c["non_embedding"] - (c["total"] - c.get("active", c["total"]))
    if m.tie_word_embeddings:  # non_embedding holds an untied output layer only
        matmul += m.vocab_size * m.hidden_size
    return 6 * matmul + 12 * m.num_layers * m.hidden_size * seq_len


def detect_peak_tflops(device: str, precision: str) -> float | None:
    """The device's dense 16-bit peak, or None where it is unknown (CPU, fp32): then no MFU is printed."""
    if device != "cuda" or precision == "fp32":
        return None
    import torch  # lazy: keeps toolkit plan free of torch

    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), None)


_OPEN: list = []  # the run logs of this process, for close_all


def close_all() -> None:
    """Flush every run log's TensorBoard writer, for an exit that skips the interpreter's teardown
    (recipes/train.py)."""
    for log in _OPEN:
        log.close()


class RunLog:
    """Writes each logged step to the console, <out>/metrics.jsonl and TensorBoard. Only rank 0 writes."""

    def __init__(self, out_dir: str, enabled: bool, tensorboard: bool):
        self.enabled, self.tensorboard = enabled, tensorboard
        self.writer = None
        self.path = Path(out_dir) / "metrics.jsonl"
        self.resumed_from: int | None = None
        _OPEN.append(self)

    def resumed(self, step: int) -> None:
        """This launch continues a checkpoint of `step`: the launch that wrote it may have logged later steps before
        it stopped. Its first record carries "resumed_from": step (metrics.jsonl keeps every launch's records: the
        last record of a step is the run's), and TensorBoard discards the events of steps after `step`
        (SummaryWriter's purge_step)."""
        self.resumed_from = step

    def _open(self) -> None:
        """The output folder and TensorBoard's writer, at the first logged step: a run refused before it trains
        (a checkpoint of another layout, a model that does not match) leaves nothing behind."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.tensorboard and self.writer is None:
            from torch.utils.tensorboard import SummaryWriter  # lazy: only when a run logs to TensorBoard

            purge = None if self.resumed_from is None else self.resumed_from + 1
            self.writer = SummaryWriter(str(self.path.parent / "tensorboard"), purge_step=purge)
        self.tensorboard = False

    def info(self, text: str) -> None:
        if self.enabled:
            print(text, flush=True)

    def step(self, record: dict) -> None:
        if not self.enabled:
            return
        self._open()
        record = {"time": round(time.time(), 3), **record}
        if self.resumed_from is not None:  # the first record of a launch that resumed
            record["resumed_from"], self.resumed_from = self.resumed_from, None
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        parts = [f"step {record['step']:>6}", f"loss {record['loss']:.4f}", f"lr {record['lr']:.3e}"]
        if record.get("grad_norm") is not None:
            parts.append(f"grad_norm {record['grad_norm']:.3f}")
        if record.get("val_loss") is not None:
            parts.append(f"val_loss {record['val_loss']:.4f} | val_ppl {record['val_ppl']:.4g}")
        parts.append(f"tokens/s {record['tokens_per_s']:,.0f}")
        parts.append(f"TFLOP/s/rank {record['tflops_per_rank']:.3g}")
        if record.get("mfu") is not None:
            parts.append(f"MFU {record['mfu']:.1%}")
        print(" | ".join(parts), flush=True)
        if self.writer:
            for k, v in record.items():
                if k not in ("step", "time", "resumed_from") and isinstance(v, (int, float)):
                    self.writer.add_scalar(f"{'eval' if k.startswith('val_') else 'train'}/{k}", v, record["step"])

    def close(self) -> None:
        if self.writer:
            self.writer.close()
            self.writer = None
