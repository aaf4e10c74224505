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
"""
from __future__ import annotations

import warnings
from pathlib import Path

from toolkit.data.indexed import tokenizer_fingerprint
from toolkit.errors import ToolkitError
from toolkit.recipe.schema import DataConfig

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

    def __init__(self, dataset, seq_len: int):
        self.dataset, self.seq_len = dataset, seq_len

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> dict:
        tokens = self.dataset[int(i)]["tokens"]
        return {"input_ids": tokens, "labels": tokens.clone()}

    def source_of(self, i: int) -> int:
        """Which blend entry sample i comes from (its index in data.blend)."""
        index = getattr(self.dataset, "dataset_index", None)
        return 0 if index is None else int(index[int(i)])


def build_blend(cfg: DataConfig, tokenizer, num_samples: int, out_dir: str | Path, seed: int) -> BlendSequences:
    """The train split of the blend, `num_samples` samples of cfg.seq_len tokens. Call it on every rank (with a
    process group, rank 0 builds the caches first and the others wait for it: Megatron-Core asks for the rank, so a
    process group must exist, of one rank in a single process)."""
    with warnings.catch_warnings():  # megatron.core's import warns that Transformer Engine and Apex are absent
        warnings.simplefilter("ignore")
        from megatron.core.datasets.blended_megatron_dataset_builder import (  # lazy: heavy; blends only
            BlendedMegatronDatasetBuilder,
        )
        from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig  # lazy: heavy; blends only

    blend = cfg.blend or []
    if not blend:
        raise ToolkitError("data.blend: no source; list prepared datasets as [{path: PREFIX, weight: 1.0}]")
    paths = [s.path for s in blend]
    weights = [float(s.weight) for s in blend] if len(blend) > 1 else None
    config = GPTDatasetConfig(
        random_seed=seed, sequence_length=cfg.seq_len, blend=(paths, weights), split="1,0,0",
        path_to_cache=str(Path(out_dir) / CACHE), tokenizer=_TokenizerView(tokenizer, cfg.tokenizer),
        reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False, create_attention_mask=False,
        add_extra_token_to_sequence=False, mid_level_dataset_surplus=0.005)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train, _, _ = BlendedMegatronDatasetBuilder(GPTDataset, [num_samples, 0, 0], lambda: True, config).build()
    if train is None or len(train) < num_samples:
        raise ToolkitError(f"data.blend: {paths} give {0 if train is None else len(train)} samples of {cfg.seq_len} "
                           f"tokens, fewer than the {num_samples} the run needs; add data or lower data.seq_len")
    return BlendSequences(train, cfg.seq_len)
