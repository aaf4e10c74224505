"""The held-out data of the validation loss: where it comes from, and which sequences each data-parallel rank
evaluates.

Every on-the-fly held-out source is built in `build_heldout` (eval.split: the tail of the training sequences;
eval.paths: files of their own); a data.blend's (eval.split, eval.blend) comes from Megatron-Core's builder with
the training samples (`toolkit.data.blend`). The sequences evaluated are the first `eval.batches x global batch`
of the held-out set, the same at every evaluation and at every parallel layout; `eval_micro_batches` deals them
out to the data-parallel ranks, whose (sum of token losses, token count) pairs are summed over all ranks before
dividing, so the value does not depend on the layout.
"""
from __future__ import annotations

from contextlib import nullcontext

from toolkit.data.text import build_dataset, check_files
from toolkit.errors import Problem, ToolkitError
from toolkit.recipe.schema import DataConfig, Recipe


def eval_data_config(r: Recipe) -> DataConfig | None:
    """The data section that reads eval.paths: the training data's format, tokenizer, seq_len and packing."""
    if not r.eval.paths:
        return None
    return r.data.model_copy(update={"paths": list(r.eval.paths), "hub_dataset": None})


def check_eval_files(r: Recipe) -> list[Problem]:
    """The head of every eval.paths file, checked like data.paths before anything starts."""
    cfg = eval_data_config(r)
    if cfg is None:
        return []
    return [Problem("eval.paths", p.message, p.fix.replace("data.paths", "eval.paths")) for p in check_files(cfg)]


def build_heldout(r: Recipe, tokenizer, train, rank_zero_first=nullcontext, global_batch: int = 1,
                  notes: list | None = None):
    """(training dataset, held-out dataset or None) from the training sequences `train`. eval.split holds out the
    last fraction of them (the end of the corpus: only the document at the boundary is shared) and removes them
    from training, whether or not evaluation is on, so turning it on does not change what is trained on. What is
    left for training must fill one global batch. (A data.blend's eval.split is Megatron's split string, in
    toolkit.data.blend; with a data.blend only the eval.paths branch is taken here.)"""
    e = r.eval
    if e.split is not None:
        n = len(train)
        held = int(n * e.split)
        if held == 0:
            raise ToolkitError(f"eval.split: {e.split} of {n} sequences of {r.data.seq_len} tokens holds out no full "
                               f"sequence; raise eval.split to at least {1 / n:.3g} or add data")
        if n - held < global_batch:
            raise ToolkitError(f"eval.split: {e.split} of {n} sequences leaves {n - held} for training, fewer than one "
                               f"global batch of {global_batch}; lower eval.split or add data")
        return train.select(range(n - held)), train.select(range(n - held, n))
    cfg = eval_data_config(r)
    if cfg is not None and e.interval:
        try:
            held = []
            out = build_dataset(cfg, tokenizer, rank_zero_first, held)
            if notes is not None:
                notes += [line.replace("data: ", "eval.paths: ", 1) for line in held]
            return train, out
        except ToolkitError as err:  # its line names the files it read: eval.paths, not data.paths
            line = str(err)
            raise ToolkitError("eval.paths: " + line.removeprefix("data.paths: ").replace("data.paths", "eval.paths")
                               ) from None
    return train, None


def eval_sequences(held: int, batches: int | None, global_batch: int) -> int:
    """How many held-out sequences one evaluation reads: eval.batches global batches, or every full one (null)."""
    full = held // global_batch
    if full == 0:
        raise ToolkitError(f"eval: {held} held-out sequences cannot fill one global batch of {global_batch}; raise "
                           "eval.split, add eval.paths files, or lower training.global_batch_size")
    return global_batch * min(batches or full, full)


def eval_micro_batches(held, count: int, micro_batch: int, dp: int, dp_rank: int) -> list[dict]:
    """This rank's micro-batches of the first `count` held-out sequences (count is a multiple of micro x dp):
    sequence i goes to rank i mod dp, so the ranks together read exactly the single process's sequences."""
    mine = list(range(dp_rank, count, dp))
    return [held[mine[i:i + micro_batch]] for i in range(0, len(mine), micro_batch)]
