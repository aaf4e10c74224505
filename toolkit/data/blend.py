"""`data.blend`: prepared datasets (`toolkit data prepare`) read through Megatron-Core's own
`BlendedMegatronDatasetBuilder` and `GPTDataset`, the same way on both backends.

The run asks the builder for exactly `training.steps x global batch` samples of `seq_len` tokens, all in the
train split: one pass over them is the whole run, and the position in it is the data stream's (saved and resumed
as for on-the-fly data). Megatron-Core shuffles the documents and samples of each source and interleaves the
sources by weight, so the stream reads the samples in order (no second shuffle); each data-parallel rank takes
every dp-th sample. The number of samples (hence the order) depends on `training.steps`, the global batch,
seq_len and the seed: a resumed run keeps them (`stop_at_step` does not change it).

Rank 0 builds Megatron-Core's index caches (document, sample and shuffle indices) in OUT_DIR/data_cache, never
next to the user's data; the other ranks wait for it, then read them.

The held-out set comes from the same builder call, as Megatron-LM's validation split does: eval.split becomes the
builder's split string (the last documents of every source go to the valid split, never to the train split), and
eval.blend becomes the valid entry of `blend_per_split` (prepared datasets of their own). The builder is asked for
the samples evaluation reads: eval.batches x global batch, or, with eval.batches null, as many as the held-out
documents fill once (summed over the sources), in whole global batches. Neither changes the train split's samples
but by removing the held-out documents (eval.blend removes none).
"""
from __future__ import annotations

import warnings
from pathlib import Path

from toolkit.data.indexed import tokenizer_fingerprint
from toolkit.errors import ToolkitError
from toolkit.recipe.schema import BlendSource, DataConfig, EvalConfig

CACHE = "data_cache"  # under the run's output folder


class _TokenizerView:
    """What GPTDataset reads of a tokenizer: the end-of-document id, the vocabulary size, and the identifiers its
    cache key hashes. No pad id: Megatron then pads with -1, an id no document holds."""

    def __init__(self, tokenizer, name: str):
        fp = tokenizer_fingerprint(tokenizer, name)
        self.eod, self.vocab_size = tokenizer.eos_token_id, fp["vocab_size"]
        self.unique_identifiers = {"class": "toolkit", "vocab_sha256": fp["vocab_sha256"], "eod": self.eod}


class BlendSequences:
    """The blended GPTDataset as the training loop reads data: item i is {"input_ids", "labels"} of seq_len
    tokens (labels = input_ids; the models shift them), like a packed on-the-fly dataset."""

    def __init__(self, dataset, seq_len: int, length: int | None = None):
        self.dataset, self.seq_len = dataset, seq_len
        self.length = len(dataset) if length is None else length  # a held-out set: the samples evaluation reads

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i) -> dict:
        """One sample, or a batch of them (stacked) for a list of indices, as a Hugging Face dataset gives."""
        if isinstance(i, (list, tuple, range)):
            import torch  # lazy: heavy; only a batch of held-out samples stacks

            rows = [self[j] for j in i]
            return {k: torch.stack([r[k] for r in rows]) for k in ("input_ids", "labels")}
        tokens = self.dataset[int(i)]["tokens"]
        return {"input_ids": tokens, "labels": tokens.clone()}

    def source_of(self, i: int) -> int:
        """Which blend entry sample i comes from (its index in data.blend)."""
        index = getattr(self.dataset, "dataset_index", None)
        return 0 if index is None else int(index[int(i)])


def build_blend(cfg: DataConfig, tokenizer, num_samples: int, out_dir: str | Path, seed: int,
                e: EvalConfig | None = None, global_batch: int = 1) -> tuple[BlendSequences, BlendSequences | None]:
    """(train split, held-out split or None): `num_samples` training samples of cfg.seq_len tokens, and with
    eval.split or eval.blend and evaluation on, the held-out samples evaluation reads. eval.split holds its
    documents out of training whether or not evaluation is on. Call it on every rank (with a process group, rank 0
    builds the caches first and the others wait for it: Megatron-Core asks for the rank, so a process group must
    exist, of one rank in a single process)."""
    with warnings.catch_warnings():  # megatron.core's import warns that Transformer Engine and Apex are absent
        warnings.simplefilter("ignore")
        from megatron.core.datasets.blended_megatron_dataset_builder import (  # lazy: heavy; blends only
            BlendedMegatronDatasetBuilder,
        )
        from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig  # lazy: heavy; blends only

    e = e or EvalConfig()
    if not cfg.blend:
        raise ToolkitError("data.blend: no source; list prepared datasets as [{path: PREFIX, weight: 1.0}]")
    paths = [s.path for s in cfg.blend]
    evaluating = bool(e.interval) and (e.split is not None or e.blend is not None)
    if e.blend is not None:  # the validation split's own blend: Megatron's blend_per_split (train, valid, test)
        splits = dict(blend_per_split=[_blend(cfg.blend), _blend(e.blend) if evaluating else None, None])
    elif e.split is not None:  # the last e.split of every source's documents: Megatron's split string
        splits = dict(blend=_blend(cfg.blend), split=f"{1 - e.split:.12f},{e.split:.12f},0")
    else:
        splits = dict(blend=_blend(cfg.blend), split="1,0,0")
    config = GPTDatasetConfig(
        random_seed=seed, sequence_length=cfg.seq_len, **splits,
        path_to_cache=str(Path(out_dir) / CACHE), tokenizer=_TokenizerView(tokenizer, cfg.tokenizer),
        reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False, create_attention_mask=False,
        add_extra_token_to_sequence=False, mid_level_dataset_surplus=0.005)
    tokens = _held_out_tokens(GPTDataset, config, e) if e.split is not None or evaluating else []
    held = global_batch * (e.batches or 0) if evaluating else 0  # Megatron goes over a small source again if needed
    if evaluating and not e.batches:  # one pass over the held-out documents, in whole global batches
        once = sum(t // cfg.seq_len for t in tokens)
        if once < global_batch:
            raise ToolkitError(f"{'eval.blend' if e.blend is not None else 'eval.split'}: the held-out documents fill "
                               f"{once} samples of {cfg.seq_len} tokens, fewer than one global batch of {global_batch};"
                               " set eval.batches (they are then read again), hold out more, or lower the batch")
        held = global_batch * (once // global_batch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train, valid, _ = BlendedMegatronDatasetBuilder(GPTDataset, [num_samples, held, 0], lambda: True,
                                                        config).build()
    if train is None or len(train) < num_samples:
        raise ToolkitError(f"data.blend: {paths} give {0 if train is None else len(train)} samples of {cfg.seq_len} "
                           f"tokens, fewer than the {num_samples} the run needs; add data or lower data.seq_len")
    if held and (valid is None or len(valid) < held):
        raise ToolkitError(f"eval: the held-out documents give {0 if valid is None else len(valid)} samples of "
                           f"{cfg.seq_len} tokens, fewer than the {held} evaluation reads; lower eval.batches")
    return BlendSequences(train, cfg.seq_len), BlendSequences(valid, cfg.seq_len, held) if held else None


def _blend(sources: list[BlendSource]) -> tuple[list[str], list[float] | None]:
    """Megatron's (prefixes, weights); no weights for one source (it is then read as one dataset)."""
    return [s.path for s in sources], [float(s.weight) for s in sources] if len(sources) > 1 else None


def _held_out_tokens(cls, config, e: EvalConfig) -> list[int]:
    """Tokens in the held-out documents of each source: eval.blend's whole datasets, or the valid split's range of
    each data.blend source's documents (Megatron's split matrix, rounded as Megatron rounds it). A split that holds
    out no document of a source is refused: that source would have no held-out data."""
    out = []
    if e.blend is not None:
        for source in e.blend:
            low = cls.build_low_level_dataset(source.path, config)  # kept while its memory-mapped lengths are read
            out.append(int(low.sequence_lengths.sum()))
        return out
    lo, hi = config.split_matrix[1] or (1.0, 1.0)
    for prefix in config.blend[0]:
        low = cls.build_low_level_dataset(prefix, config)
        lengths, n = low.sequence_lengths, cls.numel_low_level_dataset(low)
        beg, end = int(round(lo * n)), int(round(hi * n))
        if end <= beg:
            raise ToolkitError(f"eval.split: {e.split} of the {n} documents of {prefix} holds out none; raise "
                               f"eval.split to at least {1 / n:.3g}, or add documents to that source")
        out.append(int(lengths[beg:end].sum()))
    return out
