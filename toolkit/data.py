"""Training data: files or a hub dataset -> tokenized, packed fixed-length sequences -> per-rank micro-batches.

Every rank builds the same dataset; a DistributedSampler (reseeded each epoch with set_epoch) hands each
data-parallel rank a disjoint slice, so one optimizer step over all ranks sees the same sequences as a single
process with the same global batch. The stream's position (epoch, micro-batches consumed) is saved with each
checkpoint so a resumed run continues with exactly the next batch.
"""
from __future__ import annotations

from contextlib import nullcontext
from itertools import chain
from pathlib import Path

from torch.utils.data import DataLoader, DistributedSampler

from toolkit.errors import ToolkitError
from toolkit.recipe.checks import expand_glob
from toolkit.recipe.schema import DataConfig

_BUILDERS = {".txt": "text", ".text": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}


def _builder(files: list[str], fmt: str) -> str:
    if fmt != "auto":
        return fmt
    kinds = {_BUILDERS.get(Path(f).suffix) for f in files}
    if len(kinds) != 1 or None in kinds:
        raise ToolkitError(f"data.paths: cannot tell the format of {files} from their extensions; set data.format "
                           "to text, json or parquet (all files must share one format)")
    return kinds.pop()


def load_raw(cfg: DataConfig):
    import datasets  # lazy: heavy; corpus reads only

    if cfg.hub_dataset:
        return datasets.load_dataset(cfg.hub_dataset, split="train")
    files = [str(p) for pattern in cfg.paths for p in expand_glob(pattern)]
    builder = _builder(files, cfg.format)
    return datasets.load_dataset(builder, data_files=files, split="train")


def tokenize_and_pack(raw, tokenizer, cfg: DataConfig):
    """Token blocks of exactly seq_len ids (packing), or one truncated/padded document per row."""
    text_field = "text" if "text" in raw.column_names and cfg.format in ("text", "auto") else cfg.text_field
    if text_field not in raw.column_names:
        raise ToolkitError(f"data.text_field: column {text_field!r} not in the dataset (columns: "
                           f"{raw.column_names}); set data.text_field to the text column")
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ToolkitError(f"data.tokenizer: {cfg.tokenizer} has no eos token, needed to separate documents")
    n = cfg.seq_len

    def encode(batch):
        ids = tokenizer(batch[text_field], add_special_tokens=False)["input_ids"]
        return {"ids": [x + [eos] for x in ids]}

    def pack(batch):
        flat = list(chain.from_iterable(batch["ids"]))
        blocks = [flat[i:i + n] for i in range(0, len(flat) - n + 1, n)]
        return {"input_ids": blocks, "labels": blocks}

    def pad(batch):
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
        rows = [x[:n] for x in batch["ids"]]
        return {"input_ids": [x + [pad_id] * (n - len(x)) for x in rows],
                "labels": [x + [-100] * (n - len(x)) for x in rows]}

    tokenized = raw.map(encode, batched=True, remove_columns=raw.column_names, desc="tokenizing")
    out = tokenized.map(pack if cfg.packing else pad, batched=True, batch_size=1000,
                        remove_columns=["ids"], desc="packing" if cfg.packing else "padding")
    return out.with_format("torch")


def build_dataset(cfg: DataConfig, tokenizer, rank_zero_first=nullcontext):
    """The tokenized dataset. `rank_zero_first` lets rank 0 fill the `datasets` cache before the others read it."""
    with rank_zero_first():
        ds = tokenize_and_pack(load_raw(cfg), tokenizer, cfg)
    if len(ds) == 0:
        raise ToolkitError(f"data: no complete sequence of {cfg.seq_len} tokens in {cfg.paths}; add data or "
                           "lower data.seq_len")
    return ds


class DataStream:
    """Per-rank micro-batches, step by step, across epochs, with a resumable position."""

    def __init__(self, dataset, micro_batch: int, grad_accum: int, dp: int, dp_rank: int, seed: int,
                 num_workers: int = 0):
        self.dataset, self.micro, self.accum, self.num_workers = dataset, micro_batch, grad_accum, num_workers
        self.sampler = DistributedSampler(dataset, num_replicas=dp, rank=dp_rank, shuffle=True, seed=seed,
                                          drop_last=True)
        self.steps_per_epoch = len(self.sampler) // (micro_batch * grad_accum)
        if self.steps_per_epoch == 0:
            raise ToolkitError(f"data: {len(dataset)} sequences cannot fill one step of global batch "
                               f"{micro_batch * grad_accum * dp}; add data or shrink the batch")
        self.epoch, self.consumed = 0, 0  # consumed = micro-batches of this epoch already handed out
        self._it = None

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "consumed_micro_batches": self.consumed}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.consumed = int(state["epoch"]), int(state["consumed_micro_batches"])
        self._it = None

    def _start_epoch(self):
        self.sampler.set_epoch(self.epoch)
        usable = self.steps_per_epoch * self.accum * self.micro  # drop the tail that cannot fill a whole step
        indices = list(self.sampler)[:usable][self.consumed * self.micro:]
        loader = DataLoader(self.dataset, batch_size=self.micro, sampler=indices, num_workers=self.num_workers)
        self._it = iter(loader)

    def next_step(self) -> list[dict]:
        """The grad_accum micro-batches of the next optimizer step (starting a new epoch when needed)."""
        if self.consumed >= self.steps_per_epoch * self.accum:
            self.epoch, self.consumed, self._it = self.epoch + 1, 0, None
        if self._it is None:
            self._start_epoch()
        batches = [next(self._it) for _ in range(self.accum)]
        self.consumed += self.accum
        return batches
