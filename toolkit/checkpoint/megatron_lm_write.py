"""Writing Megatron-LM's legacy layout (`toolkit convert --to megatron_lm`) at any TP x PP x VPP.

Output: <dst>/latest_checkpointed_iteration.txt and <dst>/iter_XXXXXXX/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt
(`_EEE`: the expert-parallel rank of a mixture of experts written at --ep > 1), each a
torch.save of what Megatron-LM's save_checkpoint writes with `--no-save-optim --no-save-rng`: `args` (an
argparse.Namespace with the model arguments for the new layout, the ones Megatron-LM's check_checkpoint_args
compares), `checkpoint_version` 3.0, `iteration`, `num_floating_point_operations_so_far`, and `model` (or `model0`..
per virtual chunk) with local-spec names and the `_extra_state` entries a local-spec GPTModel's state_dict has.
Megatron-LM continues from it with `--no-load-optim --no-load-rng` (or `--finetune`). From a source that carries the
distributed optimizer's state, that state is written too (`distrib_optim.pt`, and the optimizer and scheduler
entries of model_optim_rng.pt: toolkit/checkpoint/megatron_lm_optim.py), and Megatron-LM continues with
`--use-distributed-optimizer --no-load-rng`.

Memory: a rank file is a single pickle of its whole pipeline stage, so it is written before its weights are known:
the zip torch.save writes, laid out by a writer of our own with the weights' bytes left as holes
(toolkit/format/pt_write.py), when the stage's first parameter comes; each weight's bytes are then written into it
as the parameter is converted (copied in from the source's files where they are byte ranges of them:
byte_ranges.plan, Skeleton.write_ranges), and the file is finished once its stage is complete. No stage is ever
held in memory: a conversion holds the parameter in hand.

This module does not import torch: `toolkit convert --no-verify` writes weights-only Megatron-LM checkpoints without
it (toolkit/checkpoint/copy_only.py). The full path hands in torch's pieces and the optimizer writer
(toolkit/checkpoint/megatron_lm_optim.py), whose tensors pt_skeleton.slots turns into the writer's.
"""
from __future__ import annotations

import argparse
import math
import re
from pathlib import Path

from toolkit.checkpoint.byte_ranges import addressing
from toolkit.checkpoint.megatron_lm import LOCAL_ORDER, hf_fields, rank_dir, registration_order
from toolkit.families import family_named
from toolkit.families.entries import holders, iter_entries, raise_problems, rank_key
from toolkit.families.mapping import check_dims, megatron_rope_args
from toolkit.format import pt_write
from toolkit.format import safetensors_stream as st
from toolkit.format.pt_write import Skeleton, Tensor
from toolkit.format.pt_zip import ITEMSIZE

WEIGHT = "weight"
_LINEAR = re.compile(r"^(decoder\.layers\.\d+\..*linear_(?:proj|qkv|fc1|fc2))\.weight$")
"""A Megatron linear's weight: its module has an `_extra_state` entry in a local-spec GPTModel's state_dict."""


def moe_args(dims, config: dict, ep: int) -> dict:
    """Megatron-LM's mixture-of-experts arguments of a Qwen3-MoE (none for a dense model): what `--num-experts`,
    `--moe-router-topk`, `--moe-ffn-hidden-size`, ... set, routing as the family's Megatron config does."""
    if not dims.experts:
        return {}
    return {"num_experts": dims.experts, "moe_router_topk": dims.topk, "moe_ffn_hidden_size": dims.moe_ffn,
            "moe_router_score_function": "softmax", "moe_router_pre_softmax": not config.get("norm_topk_prob", False),
            "moe_router_load_balancing_type": "aux_loss",
            "moe_aux_loss_coeff": float(config.get("router_aux_loss_coef", 0.0) or 0.0), "moe_layer_freq": 1,
            "moe_shared_expert_intermediate_size": None, "moe_grouped_gemm": False,
            "moe_token_dispatcher_type": "alltoall", "expert_model_parallel_size": ep}


RUN_ARGS = {"add_position_embedding": True, "tokenizer_type": None, "consumed_train_samples": 0,
            "skipped_train_samples": 0, "consumed_valid_samples": 0, "seq_length": None, "attention_dropout": None,
            "hidden_dropout": None}
"""Args of the run, not the model, that Megatron-LM's load_checkpoint reads from a checkpoint: check_checkpoint_args
asserts add_position_embedding (and, with a --vocab-file, tokenizer_type) equal to the new run's, a resumed run
starts its data at consumed_train_samples, and --use-checkpoint-args takes seq_length and the dropouts from it. From
a Megatron-LM source they are carried as it saved them, so the run that wrote it continues with the same script at
the new layout and no data read twice; otherwise these values: what a Megatron-LM run with `--position-embedding-type
rope` has before its first step, and None where the new run's own flags should apply (--use-checkpoint-args skips a
None; it would force a tokenizer_type on the new run)."""


def run_args(source) -> dict:
    """RUN_ARGS of `source`: a Megatron-LM legacy or torch_dist source's own (`args`), else the defaults, with a toolkit
    training checkpoint's data position (its step times the recipe's global batch, as its scheduler state counts
    samples: toolkit/adapters/megatron.py scheduler_state)."""
    out = dict(RUN_ARGS)
    recipe, step = (getattr(source, "meta", None) or {}).get("recipe"), getattr(source, "step", None)
    batch = ((recipe or {}).get("training") or {}).get("global_batch_size")
    if batch and step:
        out["consumed_train_samples"] = int(step) * int(batch)
    args = getattr(source, "args", None)
    return {k: getattr(args, k, v) for k, v in out.items()} if args is not None else out


def model_args(dims, config: dict, tp: int, pp: int, vpp: int, divisible_by: int, dtype, ckpt_format: str,
               ep: int = 1, run: dict | None = None) -> argparse.Namespace:
    """Megatron-LM's model arguments for a model of dims.family at tp x pp x vpp (x ep) (the family's own Megatron
    fields, add_qkv_bias or qk_layernorm, and the experts included: the readers take the family from them). `dtype`:
    torch's (then params_dtype is it), or a safetensors name (then params_dtype is pt_write's name for torch's, which
    only pt_write pickles). `no_save_rng` and `no_save_optim` say what the checkpoint lacks, as Megatron-LM's own args
    do after a save with --no-save-rng --no-save-optim: its load_checkpoint (and Megatron-Bridge's) then asks a
    torch_dist checkpoint for neither; a writer that adds optimizer state sets no_save_optim False. `run`: RUN_ARGS'
    values (run_args; default RUN_ARGS)."""
    name = st.dtype_name(dtype)
    return argparse.Namespace(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None, num_layers=dims.layers,
        hidden_size=dims.hidden, ffn_hidden_size=dims.ffn, num_attention_heads=dims.heads,
        group_query_attention=dims.kv_heads != dims.heads, num_query_groups=dims.kv_heads, kv_channels=dims.head_dim,
        max_position_embeddings=config.get("max_position_embeddings"), norm_epsilon=config.get("rms_norm_eps", 1e-5),
        **megatron_rope_args(config, "the model's config"), untie_embeddings_and_output_weights=not dims.tied, padded_vocab_size=dims.padded_vocab,
        make_vocab_size_divisible_by=divisible_by, normalization="RMSNorm", swiglu=True,
        position_embedding_type="rope", add_bias_linear=False, **(run or RUN_ARGS),
        params_dtype=pt_write.torch_dtype(name) if isinstance(dtype, str) else dtype, bf16=name == "BF16",
        fp16=name == "F16", ckpt_format=ckpt_format, no_save_rng=True, no_save_optim=True,
        **family_named(dims.family).megatron_fields, **moe_args(dims, config, ep),
        toolkit_hf_fields=hf_fields({**config, "model_type": family_named(dims.family).model_types[0]}))


def content_metadata(distributed: bool) -> dict:
    """What Megatron-LM 0.16's save_checkpoint stores as a torch_dist checkpoint's content metadata
    (dist_checkpointing.save(content_metadata=...): common.pt's "content_metadata"). Its load_checkpoint, and
    Megatron-Bridge's, read it back (dist_checkpointing.load_content_metadata) and hand it to the model's and the
    optimizer's sharded_state_dict: without it they would take a distributed optimizer's state for
    'dp_zero_gather_scatter', and refuse it at another TP x PP or misread it at the same one. `distributed`: the
    checkpoint holds the distributed optimizer's state (saved fully_reshardable, per parameter)."""
    meta = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    if distributed:
        meta.update(distrib_optim_sharding_type="fully_reshardable", distrib_optim_fully_reshardable_mem_efficient=False)
    return meta


def megatron_lm_flags(ckpt_format: str, optimizer: bool, distributed: bool, divisible_by: int = 128) -> str:
    """The flags Megatron-LM 0.16's load_checkpoint needs, beyond --load and the model's arguments, to continue from
    an output of this format ("torch" or "torch_dist") with or without optimizer state (docs/convert.md, "Continuing
    in Megatron-LM or Megatron-Bridge"): its legacy loader reads neither no_save_optim nor no_save_rng, and its
    optimizer load reads no_save_optim in neither format. A vocabulary padded by other than Megatron-LM's default
    128 needs that divisor too (its padded vocabulary is the model's shape). With optimizer state, the scheduler state
    written beside it is the one to go on with: without --use-checkpoint-opt_param-scheduler Megatron-Core's
    OptimizerParamScheduler asserts that every argument of the new run (--lr, --min-lr, warm-up and decay samples,
    ...) equals the checkpoint's, which a toolkit run's (made from its recipe) only matches by hand."""
    legacy = ckpt_format == "torch"
    return " ".join(["--ckpt-format", ckpt_format, *(["--transformer-impl", "local"] if legacy else []),
                     *(["--make-vocab-size-divisible-by", str(divisible_by)] if divisible_by != 128 else []),
                     *(["--use-distributed-optimizer"] if optimizer and distributed else []),
                     *(["--use-checkpoint-opt_param-scheduler"] if optimizer else ["--no-load-optim"]),
                     *(["--no-load-rng"] if legacy else [])])


def _registered(chunk: dict) -> dict:
    """A chunk's state dict in the order a local-spec GPTModel's state_dict() lists it: parameters in registration
    order, each module's `_extra_state` after its parameters (a reader of the plain optimizer's state relies on it, as
    that state is keyed by registration position)."""
    params = registration_order([k for k in chunk if not k.endswith("._extra_state")], LOCAL_ORDER)
    rank = {k: 2 * i for i, k in enumerate(params)}
    for k in chunk:
        if k.endswith("._extra_state"):
            module = k.removesuffix("._extra_state") + "."
            rank[k] = max(rank[q] for q in params if q.startswith(module)) + 1
    return {k: chunk[k] for k in sorted(chunk, key=rank.__getitem__)}


class _StageEnd:
    """The last write of a stage: finishes its rank files (and the optimizer's) once the writes before it are done."""

    def __init__(self, target, p: int):
        self.target, self.p = target, p

    def write(self, _key, _value) -> int:
        self.target._finish_stage(self.p)
        return 0


class MegatronLMTarget:
    """A Megatron-LM legacy checkpoint root; see the module docstring. The distributed optimizer's state too
    (`distrib_optim.pt`, toolkit/checkpoint/megatron_lm_optim.py) when the source carries a Megatron optimizer's and
    `optimizer_writer` (megatron_lm_optim.optimizer_writer) is given. `dtype`: torch's, a safetensors name, or None
    for the source's."""

    raw_bytes = True  # weights whose bytes are source byte ranges are copied in (byte_ranges.plan, write_ranges)
    concurrent_writes = True  # rank files are written in place (pt_write); a stage's end is a barrier (WriteBehind)

    def __init__(self, root: Path, source, tp: int, pp: int, vpp: int, dtype, ep: int = 1,
                 weights_only: bool = False, optimizer_writer=None):
        self.root, self.source, self.layout, self.ep = root, source, (tp, pp, vpp), ep
        self.dims = source.out_dims(tp)
        raise_problems(f"the model cannot be laid out at tp={tp} pp={pp} vpp={vpp} ep={ep}",
                       check_dims(self.dims, tp, pp, vpp, ep))
        self.step = int(source.step or 0)
        self.tag_dir = root / f"iter_{self.step:07d}"
        self.dtype_name = st.dtype_name(dtype) if dtype is not None else source.dtype_name()
        # torch's dtype, where the optimizer writer needs it (the full path)
        self.out_dtype = None if isinstance(dtype, str) else dtype
        if self.out_dtype is None and optimizer_writer is not None and not weights_only:
            self.out_dtype = source.dtype()
        entries = list(iter_entries(self.dims, pp, vpp, ep))
        self._stages = {p: [e for e in entries if e.pp_rank == p] for p in range(pp)}
        self._count = {p: len(self._stages[p]) for p in range(pp)}
        self._seen: dict[int, set] = {p: set() for p in range(pp)}  # the stage's parameters written
        self._files: dict[tuple, Skeleton] = {}  # the open rank files, by rank_key
        self.writers: list[Skeleton] = []  # every rank file, for the copy statistics
        self._slots: dict[int, dict] = {}  # stage -> (rank_key, chunk, name) -> its unwritten tensor in the file
        self.total = sum(math.prod(e.rule.shard_shape(e.hf_shapes, tp)) * len(holders(e, ep))
                         for e in entries) * tp * ITEMSIZE[self.dtype_name]
        self._args = model_args(self.dims, source.config, tp, pp, vpp, source.out_divisor, self.dtype_name, "torch",
                                ep, run_args(source))
        self.optim, self.note = None, None
        if not weights_only and optimizer_writer is not None:
            self.optim, self.note = optimizer_writer(self, source)
        self.fields = (WEIGHT, *(self.optim.fields if self.optim else ()))
        if self.optim:
            self.total += self.optim.total

    def megatron_lm_flags(self) -> str:
        """What Megatron-LM needs to continue from this output (megatron_lm_flags)."""
        return megatron_lm_flags("torch", self.optim is not None,
                                 bool(getattr(self._args, "use_distributed_optimizer", False)), self.source.out_divisor)

    def writes(self, entry, field: str, hf_tensors: list) -> list | None:
        """(rank file, its tensor, TP shard) for each rank file holding this parameter (every expert-parallel rank
        holding it), for convert's write-behind thread, which writes them in order; its optimizer fields go into the
        optimizer's buffers here. After a stage's last parameter, the stage is finished in the same order.

        byte_ranges.plan calls this on address tensors first (addressing()), and this may then be called again with
        the tensors: so nothing is written or counted twice (a stage is opened once, its end is reached when every
        parameter has been seen), and a field the optimizer's buffers take (the weights of an fp32 model are its
        main weights) gives None there, as it must come through memory."""
        tp, p, planning = self.layout[0], entry.pp_rank, addressing()
        if planning and self.optim and (field != WEIGHT or not self.optim.has_master):
            return None
        if p in self._stages:
            self._open_stage(p)
        pieces = entry.to_megatron(hf_tensors, tp)
        if self.optim and not planning:
            self.optim.put(entry, field, pieces)
        writes = []
        if field == WEIGHT:
            for t, piece in enumerate(pieces):
                for e in holders(entry, self.ep):
                    key = rank_key(p, t, e, self.ep)
                    slot = self._slots[p][(key, entry.chunk, entry.megatron_name)]
                    data = piece if planning else st.tensor_bytes(piece, self.dtype_name)
                    writes.append((self._files[key], slot, data))
        if field == self.fields[-1]:
            self._seen[p].add((entry.chunk, entry.megatron_name, entry.ep_rank))
            if len(self._seen[p]) == self._count[p]:
                writes.append((_StageEnd(self, p), None, None))
        return writes

    def _open_stage(self, p: int) -> None:
        """Every rank file of stage p, written with its weights left unwritten (pt_write.Skeleton): the local-spec
        state dict, with the `_extra_state` entries, and what the optimizer writer puts beside the model."""
        tp, pp, vpp = self.layout
        entries = self._stages.pop(p)
        for t, e in ((t, e) for t in range(tp) for e in range(self.ep)):
            key = rank_key(p, t, e, self.ep)
            chunks: list[dict] = [{} for _ in range(vpp)]
            slots, stage_slots = [], self._slots.setdefault(p, {})
            for entry in (x for x in entries if e in holders(x, self.ep)):
                chunk = chunks[entry.chunk]
                slot = Tensor.empty(entry.rule.shard_shape(entry.hf_shapes, tp), self.dtype_name)
                chunk[entry.megatron_name] = stage_slots[(key, entry.chunk, entry.megatron_name)] = slot
                slots.append(slot)
                linear = _LINEAR.match(entry.megatron_name)
                if linear:
                    chunk[f"{linear.group(1)}._extra_state"] = None
                if entry.megatron_name == "output_layer.weight":
                    chunk["output_layer._extra_state"] = None
            chunks = [_registered(c) for c in chunks]
            models = {"model": chunks[0]} if vpp == 1 else {f"model{c}": s for c, s in enumerate(chunks)}
            extra, fills = self.optim.extra_slots(p, t, e) if self.optim else ({}, [])
            folder = self.tag_dir / rank_dir(t, p, pp, e, self.ep)
            folder.mkdir(parents=True, exist_ok=True)
            self._files[key] = Skeleton(folder / "model_optim_rng.pt", {
                "args": self._args, "checkpoint_version": 3.0, "iteration": self.step,
                "num_floating_point_operations_so_far": 0, **models, **extra}, slots, fills)
            self.writers.append(self._files[key])

    def _finish_stage(self, p: int) -> None:
        tp, pp, _ = self.layout
        del self._slots[p]
        for t, e in ((t, e) for t in range(tp) for e in range(self.ep)):
            self._files.pop(rank_key(p, t, e, self.ep)).finish()
            if self.optim:
                self.optim.finish(p, t, e, self.tag_dir / rank_dir(t, p, pp, e, self.ep))

    def close(self) -> None:
        if self._stages or self._files:
            raise RuntimeError(f"internal: stages {sorted({*self._stages, *(k[0] for k in self._files)})} were "
                               "never completed")
        if self.optim:
            self.optim.close()
        (self.root / "latest_checkpointed_iteration.txt").write_text(str(self.step))
