"""The Megatron backend's checkpoints in Megatron-Core's own `torch_dist` format (`checkpoint.format: torch_dist`).

A step folder then holds what Megatron-LM's save_checkpoint writes into an iter_* folder, through Megatron-Core's
own `dist_checkpointing.save`: `__R_I.distcp` (every rank's shards), `.metadata` (torch DCP's index), `common.pt`
and `metadata.json`. The state saved is Megatron-LM's: `args` (the model's Megatron-LM arguments at the saved
layout, so `toolkit convert`, `toolkit inspect` and Megatron-LM's --use-checkpoint-args read it), `iteration`,
`model` (or `model0..N` with virtual pipeline chunks) = each chunk's sharded_state_dict(), and `optimizer` = the
optimizer's sharded_state_dict of those (Adam moments, fp32 main weights of a 16-bit model, step, grad scaler).
The distributed optimizer saves its state as `fully_reshardable` (gathered to each model-parallel group's
data-parallel rank 0, stored per parameter), so that, like the plain optimizer's, it loads at another TP x PP x DP.

The toolkit's own per-run state (step, data position, RNG), its manifest and pointer stay as in the toolkit format
(toolkit/train/checkpoint.py). Resuming calls `dist_checkpointing.load` with the sharded state dicts of this
run's layout: Megatron-Core reshards on load, so TP, PP, VPP and DP may differ from the saved ones.
"""
from __future__ import annotations

import ctypes
import logging
import multiprocessing
import os
import signal
import threading
from multiprocessing.managers import SyncManager
from pathlib import Path

import torch

from toolkit.checkpoint.megatron_lm_write import content_metadata, model_args
from toolkit.errors import ToolkitError
from toolkit.families import dims_from_hf
from toolkit.format import safe_load
from toolkit.model import to_hf_config
from toolkit.train.preempt import SIGNALS

FORMAT = "torch_dist"
DCP_METADATA = ".metadata"


def _metadata(backend) -> dict:
    """How Megatron-Core shapes the model's and the optimizer's sharded state (per parameter, whatever the layout),
    as Megatron-LM's save_checkpoint says it and stores it in the checkpoint (megatron_lm_write.content_metadata)."""
    return content_metadata(backend.layout_meta["zero_stage"] == 1)


def _keys(chunks: list) -> list[str]:
    return ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]


def sharded_state(backend, is_loading: bool, meta: dict | None = None) -> dict:
    """Megatron-LM's sharded state dict of this rank: model chunk(s) and optimizer (ShardedTensors), shaped by `meta`
    (the content metadata; default: what this run saves)."""
    meta = meta or _metadata(backend)
    state = {k: w.module.sharded_state_dict(metadata=meta) for k, w in zip(_keys(backend.chunks), backend.chunks)}
    state["optimizer"] = backend.optimizer.sharded_state_dict(state, is_loading=is_loading, metadata=meta)
    return state


def _args(backend):
    r, lm = backend.recipe, backend.layout_meta
    divisible_by = r.parallel.megatron.make_vocab_size_divisible_by
    config = to_hf_config(r.model).to_dict()
    dims = dims_from_hf(to_hf_config(r.model), lm["tp"], divisible_by)
    dtype = next(backend.chunks[0].module.parameters()).dtype
    args = model_args(dims, config, lm["tp"], lm["pp"], lm["vpp"], divisible_by, dtype, FORMAT, lm.get("ep", 1))
    args.use_distributed_optimizer, args.no_save_optim = lm["zero_stage"] == 1, False  # the RNG is the toolkit's own
    args.data_parallel_size = lm["dp"]
    return args


class _OwnFolder(logging.Filter):
    """Megatron-Core's save warns "Overwriting old incomplete / corrupted checkpoint..." whenever the folder it saves
    into is not empty. The toolkit's step folder always is: the toolkit made it for this save and wrote its own
    started marker into it first (a folder it did not write is refused before any save), so that warning, on every
    torch_dist save, would be about the toolkit's own files. It is dropped; any other message passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Overwriting old incomplete / corrupted checkpoint")


def _shield(parent: int) -> None:
    """Run first in the server process of the results queue (_shielded_queue): preemption signals are the training
    process's (toolkit/train/preempt.py), and the server dies with the process that started it."""
    for sig in SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: SIGKILL when the parent dies
    except (OSError, AttributeError):  # not Linux: no parent-death signal; shutdown still comes with a normal exit
        pass
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(0)


_managers: list = []  # the queue's manager, kept for the life of the process


def _shielded_queue() -> None:
    """Megatron-Core's torch_dist save sends each rank's write results through a queue served by a process it
    spawns once (a multiprocessing Manager: filesystem_async._get_write_results_queue) and writes through processes
    it forks per save. Slurm signals every process of a job step (SIGUSR1 before the time limit, SIGTERM on
    preemption): the server died at the first signal, and every save after it failed (BrokenPipeError), so a
    preempted run crashed instead of saving and exiting for its requeue (tests/test_preemption.py, 2026-12-07). The
    toolkit starts that server itself, ignoring those signals and killed with its parent, and hands its queue to
    Megatron-Core where it keeps its own."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async  # lazy: Megatron runs only

    if getattr(filesystem_async, "_results_queue", False) is None:  # Megatron-Core 0.16's; none made yet
        manager = SyncManager(ctx=multiprocessing.get_context("spawn"))
        manager.start(initializer=_shield, initargs=(os.getpid(),))
        _managers.append(manager)
        filesystem_async._results_queue = manager.Queue()


def save(backend, tag_dir: Path, step: int) -> None:
    """Collective over every rank: Megatron-Core's dist_checkpointing.save into the (existing) step folder. Its
    writer processes, forked during the save, inherit the preemption signals blocked (_shielded_queue says why); the
    training process notes them once the save is over (or meanwhile, on another thread)."""
    from megatron.core import dist_checkpointing  # lazy: Megatron runs only

    _shielded_queue()

    args = _args(backend)
    if backend.recipe.training.global_batch_size:  # the data position, as Megatron-LM's args count it in samples
        args.consumed_train_samples = step * backend.recipe.training.global_batch_size
    state = {"args": args, "checkpoint_version": 3.0, "iteration": step,
             "num_floating_point_operations_so_far": 0, **sharded_state(backend, is_loading=False)}
    warnings, own = logging.getLogger("megatron.core.dist_checkpointing.serialization"), _OwnFolder()
    warnings.addFilter(own)
    main = threading.current_thread() is threading.main_thread()
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS) if main else None
    try:
        dist_checkpointing.save(state, str(tag_dir), _strategy(), async_sharded_save=False,
                                content_metadata=_metadata(backend))
    finally:
        if blocked is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        warnings.removeFilter(own)


def _strategy():
    """As Megatron-LM 0.16 saves by default (its ckpt_fully_parallel_save): the shards that every data-parallel rank
    holds alike (the weights; the plain optimizer's state) are spread over those ranks, so that each writes about
    1/DP of them. With Megatron-Core's plain strategy, which the toolkit used until 2026-12-08, the first
    data-parallel rank of each model-parallel group wrote them all while the others waited. None (the plain
    strategy) without data parallelism, where there is nothing to spread."""
    from megatron.core import parallel_state  # lazy: Megatron runs only
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy  # lazy: as above
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper  # lazy

    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    if group.size() == 1:
        return None
    return FullyParallelSaveStrategyWrapper(get_default_save_sharded_strategy("torch_dist"), group)


def written_files(rank: int, tag_dir: Path) -> list[str]:
    """This rank's shard files (rank 0's common.pt, metadata.json and .metadata are hashed by rank 0 too, as files
    no rank claimed)."""
    return sorted(p.name for p in tag_dir.glob(f"__{rank}_*.distcp"))


def is_torch_dist(tag_dir: Path) -> bool:
    return (tag_dir / "metadata.json").is_file() and (tag_dir / DCP_METADATA).is_file()


def load(backend, tag_dir: Path) -> None:
    """Restore model and optimizer at this run's layout through Megatron-Core's resharding load. DCP's `.metadata`
    is a plain pickle that torch unpickles without restrictions: it is first read here with only DCP's record classes
    allowed (a planted one is refused, never run); common.pt and the shards load as weights only (the caller's
    safe_load.weights_only_everywhere)."""
    if not is_torch_dist(tag_dir):
        raise ToolkitError(f"{tag_dir} holds no torch_dist checkpoint (metadata.json and .metadata); it was saved "
                           "with checkpoint.format: toolkit: resume it with that format")
    safe_load.load_dcp_metadata(tag_dir / DCP_METADATA)  # before Megatron is even imported
    from megatron.core import dist_checkpointing  # lazy: Megatron runs only

    if backend.layout_meta["zero_stage"] == 1:
        _prefill_adam_state(backend.optimizer)
    # as Megatron-LM's load_checkpoint does: the sharded state dicts shaped as the checkpoint says it was saved (a
    # checkpoint written before 2026-12-07 says nothing: then as this run saves)
    saved = dist_checkpointing.load_content_metadata(str(tag_dir))
    loaded = dist_checkpointing.load(sharded_state(backend, is_loading=True, meta=saved), str(tag_dir))
    for k, w in zip(_keys(backend.chunks), backend.chunks):
        w.module.load_state_dict(loaded[k], strict=True)
    if backend.layout_meta["zero_stage"] == 1:
        _load_distributed(backend.optimizer, loaded["optimizer"])
    else:
        backend.optimizer.load_state_dict(loaded["optimizer"])
    _unshare_steps(backend.optimizer)


def _load_distributed(optimizer, state) -> None:
    """DistributedOptimizer.load_state_dict in its two parts, working around its torch-AdamW fallback (no Apex or
    Transformer Engine, as on CPU): the first part restores each parameter's Adam "step", but the fully_reshardable
    parameter-state loader then expects "step" among the saved tensors, which the save leaves out. Set the steps
    aside meanwhile (as checkpoint._load_distributed_state does for Megatron's legacy distopt files)."""
    inner = list(getattr(optimizer, "chained_optimizers", [optimizer]))
    parts = [state] if len(inner) == 1 else [state[i] for i in range(len(inner))]
    for o, part in zip(inner, parts):
        param_state = part.pop("param_state")
        kind = part.pop("param_state_sharding_type")
        if kind != "fully_reshardable":
            raise ToolkitError(f"the distributed optimizer's state was saved as {kind!r}; the toolkit writes and "
                               "reads 'fully_reshardable'")
        o.load_state_dict(part)
        steps = {p: s.pop("step") for p, s in o.optimizer.state.items() if "step" in s}
        o.load_parameter_state_from_fully_reshardable(param_state)
        for p, step in steps.items():
            o.optimizer.state[p]["step"] = step


def _prefill_adam_state(optimizer) -> None:
    """The distributed optimizer's sharded_state_dict reads every parameter's Adam "step" even when loading (its
    torch-AdamW fallback, without Apex or Transformer Engine, as on CPU), which a fresh optimizer has not got yet:
    give it zeros, which the load then overwrites."""
    for o in getattr(optimizer, "chained_optimizers", [optimizer]):
        base = o.optimizer
        for group in base.param_groups:
            for p in group["params"]:
                if not base.state[p]:
                    base.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                                     "exp_avg_sq": torch.zeros_like(p)}


def _unshare_steps(optimizer) -> None:
    """Give every parameter its own Adam step tensor: torch's AdamW increments each one in place, so a shared one
    would advance once per parameter per step."""
    for o in getattr(optimizer, "chained_optimizers", [optimizer]):
        base = getattr(o, "optimizer", None)
        for s in (base.state.values() if base is not None else []):
            if torch.is_tensor(s.get("step")):
                s["step"] = s["step"].detach().clone()
