"""Step timestamps for bench/overhead.py, taken the same way in the toolkit and in the hand-written scripts.

`tick()` is called at the start of every training step, right before the step's batch is fetched; step i
took ticks[i+1] - ticks[i] (its data, forward, backward, optimizer step, logging and whatever else the loop
does between two steps), and the first step was complete at ticks[1]. Each tick holds the wall clock and the
process's CPU time (all its threads): the CPU seconds of a step are the work this rank did, which other
processes on a shared machine disturb far less than the wall clock. The process start comes from the
kernel (/proc), so imports and interpreter start-up count towards the time to the first step.
Standard library only: importing this must cost nothing measurable.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def process_start_epoch() -> float:
    """When this process started (Unix time, 10 ms resolution): its age from /proc, subtracted from now."""
    fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    started_after_boot = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22 of proc(5): starttime
    uptime = float(Path("/proc/uptime").read_text().split()[0])
    return time.time() - (uptime - started_after_boot)


class StepClock:
    def __init__(self):
        self.ticks: list[tuple[float, float]] = []

    def tick(self) -> None:
        self.ticks.append((time.time(), time.process_time()))

    def save(self, path: str, **extra) -> None:
        """Write {rank, process_start, ticks, ...} to `path` with the rank appended to the name."""
        rank = int(os.environ.get("RANK", "0"))
        record = {"rank": rank, "process_start": process_start_epoch(), "ticks": self.ticks, **extra}
        Path(f"{path}.rank{rank}").write_text(json.dumps(record))


def packed_dataset(spec: dict, tokenizer):
    """The raw scripts' data, as a user would write it: documents joined with EOS and cut into seq_len blocks."""
    from itertools import chain

    from datasets import load_dataset

    n, eos = spec["seq_len"], tokenizer.eos_token_id

    def encode(batch):
        return {"ids": [x + [eos] for x in tokenizer(batch["text"], add_special_tokens=False)["input_ids"]]}

    def pack(batch):
        flat = list(chain.from_iterable(batch["ids"]))
        blocks = [flat[i:i + n] for i in range(0, len(flat) - n + 1, n)]
        return {"input_ids": blocks, "labels": blocks}

    raw = load_dataset("json", data_files=spec["data_files"], split="train")
    ds = raw.map(encode, batched=True, remove_columns=raw.column_names)
    # the whole corpus in one batch: blocks cut from all of it, as the toolkit cuts them (per batch of 1,000
    # documents each batch would drop its own partial block)
    return ds.map(pack, batched=True, batch_size=None, remove_columns=["ids"]).with_format("torch")


def finish(clock: StepClock, path: str, **extra) -> None:
    """The end of a hand-written script: save this rank's ticks, leave the process group together, and exit
    without the interpreter's teardown, which intermittently aborts a rank after the work is done ("terminate
    called without an active exception" from a library thread) and is not what is timed."""
    import torch.distributed as dist  # already imported by the caller: costs nothing here

    clock.save(path, **extra)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
