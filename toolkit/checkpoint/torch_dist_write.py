"""Writing Megatron-Core `torch_dist` checkpoints (`toolkit convert --to torch_dist`), one tensor at a time.

Output: <dst>/latest_checkpointed_iteration.txt and <dst>/iter_XXXXXXX/ with metadata.json, common.pt (a
Megatron-LM-style args Namespace for the target TP x PP x VPP, iteration, checkpoint_version), two item files
`__0_0.distcp` and `__0_1.distcp` (ITEM_FILES) and torch DCP's `.metadata`. The tensors are Megatron-Core's sharded
keys (layers stacked on a leading axis, one chunk per layer, the full TP = 1 tensor, Transformer Engine names for
the per-layer norms, `_extra_state` objects as Megatron's local spec saves them), so Megatron-Core's
`dist_checkpointing.load` reshards it onto any TP x PP x VPP at load time; the TP x PP x VPP given only fixes the
vocabulary padding and the args.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import pickle
import threading
from pathlib import Path

import torch

from toolkit.checkpoint.dist_keys import sharded_name
from toolkit.checkpoint.byte_ranges import addressing
from toolkit.checkpoint.megatron_flat import SAVED_AS
from toolkit.checkpoint.megatron_lm_optim import optimizer_plan
from toolkit.checkpoint.megatron_lm_write import model_args
from toolkit.checkpoint.pt_skeleton import bytes_around
from toolkit.errors import ToolkitError
from toolkit.families.entries import iter_entries, raise_problems
from toolkit.families.mapping import TE_NORM_NAMES, check_dims
from toolkit.format.file_copy import copy_ranges, pwrite_all, start_writeback

WEIGHT = "weight"
EXTRA_STATE_MODULES = ("self_attention.linear_proj", "self_attention.linear_qkv", "mlp.linear_fc1", "mlp.linear_fc2")
"""The layer modules whose `_extra_state` Megatron-Core's sharded_state_dict lists (one object per layer)."""
_LOCAL_TO_TE = {local: te for te, local in TE_NORM_NAMES.items()}
ITEM_FILES = 2
"""The .distcp files the items are spread over, parameter by parameter, and written at once by convert's two
write-behind threads (one file's writes queue on its inode lock). Megatron-Core's own save writes two per rank too
(its torch_dist strategy's default thread_count)."""


def sharded_key(local_name: str) -> str:
    """Megatron-Core's sharded key of a local-spec name without its layer index (norms carry TE names)."""
    for local, te in _LOCAL_TO_TE.items():
        if local_name.endswith(local):
            return local_name[: -len(local)] + te
    return local_name


class _ItemFile:
    """One .distcp file: each item is a torch.save of one chunk, a standalone zip as torch's own FileSystemWriter
    writes it; its byte range is recorded, and the kernel is asked to start writing it to disk at once. An item whose
    bytes are byte ranges of the source files (byte_ranges.plan) is written as the bytes torch.save puts around such
    a tensor (skip_data, kept per shape and dtype) with the tensor's bytes copied file to file in between
    (write_ranges). As in save_pool.save_ranges, those items' zip records carry the CRC-32 of the skipped bytes, which
    torch.load (and so dist_checkpointing.load) does not check. Takes writes from several threads at once: an item's
    bytes are reserved under a lock, then written in place."""

    def __init__(self, path: Path):
        self.path, self.f = path, open(path, "wb")
        self.where: dict = {}
        self._declared: dict = {}  # chunk index -> (shape, dtype) of the tensor it will hold
        self.kernel_bytes = self.gathered_bytes = self.user_bytes = 0
        self._lock, self._end = threading.Lock(), 0  # the end of the bytes reserved so far

    def declare(self, index, shape: tuple, dtype: torch.dtype) -> None:
        self._declared[index] = (tuple(shape), dtype)

    def declared(self, index) -> tuple[tuple, torch.dtype, int]:
        shape, dtype = self._declared[index]
        return shape, dtype, math.prod(shape) * dtype.itemsize

    def write(self, index, tensor_or_bytes) -> int:
        with self._lock:  # torch.save writes through the file object: its bytes are reserved as they are written
            self.f.seek(self._end)
            start = self._end
            torch.save(tensor_or_bytes if isinstance(tensor_or_bytes, torch.Tensor) else [tensor_or_bytes], self.f)
            self.f.flush()
            self._end = self.f.tell()
            size = self._end - start
        return self._record(index, start, size)

    def write_ranges(self, index, ranges: list) -> int:
        shape, dtype, size = self.declared(index)
        head, tail = _around(self.path.parent, shape, dtype)
        if sum(n for _, _, n in ranges) != size:
            raise ToolkitError(f"internal: {index.fqn} takes {size} bytes, the ranges to copy hold "
                               f"{sum(n for _, _, n in ranges)}")
        with self._lock:
            start = self._end
            self._end += len(head) + size + len(tail)
        fd = self.f.fileno()
        pwrite_all(fd, memoryview(head), start)
        kernel, gathered, user = copy_ranges(fd, start + len(head), ranges)
        pwrite_all(fd, memoryview(tail), start + len(head) + size)
        with self._lock:
            self.kernel_bytes, self.gathered_bytes = self.kernel_bytes + kernel, self.gathered_bytes + gathered
            self.user_bytes += user
        return self._record(index, start, len(head) + size + len(tail))

    def _record(self, index, start: int, size: int) -> int:
        from torch.distributed.checkpoint.filesystem import _StorageInfo  # lazy: torch_dist outputs only

        self.where[index] = _StorageInfo(self.path.name, start, size)
        start_writeback(self.f.fileno(), start, size)
        return size

    def close(self) -> None:
        self.f.flush()
        os.fsync(self.f.fileno())  # on disk before the output folder is renamed into place
        self.f.close()


_AROUND: dict = {}
"""(shape, dtype) -> the bytes torch.save writes to a file object before and after such a tensor's data."""
_AROUND_LOCK = threading.Lock()


def _around(folder: Path, shape: tuple, dtype: torch.dtype) -> tuple[bytes, bytes]:
    """The bytes torch.save writes to a file object before and after the data of a contiguous tensor of this shape
    and dtype, kept per shape and dtype (_AROUND); made in a scratch file in `folder` (pt_skeleton.bytes_around)."""
    with _AROUND_LOCK:  # one scratch file, one writer thread at a time
        return _around_locked(folder, shape, dtype)


def _around_locked(folder: Path, shape: tuple, dtype: torch.dtype) -> tuple[bytes, bytes]:
    if (shape, dtype) not in _AROUND:
        scratch = folder / ".torch_save_bytes.tmp"
        try:
            head, tail, meta = bytes_around(torch.empty(shape, dtype=dtype), scratch, through_object=True)
        finally:
            scratch.unlink(missing_ok=True)
        if meta is None or tuple(meta.shape) != tuple(shape):
            raise ToolkitError(f"internal: no data offset in torch.save's bytes of a {shape} {dtype} tensor")
        _AROUND[(shape, dtype)] = (head, tail)
    return _AROUND[(shape, dtype)]


def compact(piece: torch.Tensor) -> torch.Tensor:
    """`piece` with a storage of its own bytes only (torch.save writes a view's whole storage): an alias of a
    contiguous piece (no copy), a copy of any other."""
    if not piece.is_contiguous() or piece.numel() == 0:
        return piece.clone()
    if piece.untyped_storage().nbytes() == piece.numel() * piece.element_size():
        return piece
    raw = torch.from_numpy(piece.reshape(-1).view(torch.uint8).numpy())  # its own storage over the same bytes
    return raw.view(piece.dtype).reshape(piece.shape)


PLAIN_AS = {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq", "master": "fp32_param"}
"""Our optimizer field -> the plain optimizer's name for it in its sharded state dict."""


def optimizer_key(field: str, key: str, distributed: bool = True) -> str:
    """The sharded key of a parameter's optimizer field: the distributed optimizer's saved `fully_reshardable`, or
    the plain optimizer's."""
    return f"optimizer.state.{(SAVED_AS if distributed else PLAIN_AS)[field]}.{key}"


class TorchDistTarget:
    """A torch_dist checkpoint root; see the module docstring. With the optimizer state when the source carries a
    Megatron-LM checkpoint's (megatron_lm_optim.optimizer_plan decides), per parameter in fp32, shaped and chunked as
    its weight, which Megatron-Core reshards onto any TP x PP x VPP x DP at load: the distributed optimizer's as
    `optimizer.state.{param,exp_avg,exp_avg_sq}.<key>` (Megatron-LM's --dist-ckpt-optim-fully-reshardable), the plain
    optimizer's as `optimizer.state.{exp_avg,exp_avg_sq[,fp32_param]}.<key>` (its sharded_state_dict; fp32_param for
    a 16-bit model), and in common.pt the optimizer's param groups with the step and the scheduler's state.

    The weights, and the optimizer's tensors, load at any expert-parallel size, but not its common state: at ep > 1
    Megatron-Core chains a second optimizer for a mixture of experts' routed experts, and saves {0: the dense
    optimizer's, 1: the experts'} (with `chained_optim_avoid_prefix`, its tensors keep their unprefixed names). So a
    mixture of experts' optimizer state is written for the ep given (`--ep`, 1 by default), which the run that loads
    it must use; without optimizer state `--ep` is refused."""

    raw_bytes = True  # items whose bytes are source byte ranges are copied in (byte_ranges.plan, write_ranges)
    concurrent_writes = True  # two item files, each taking writes from several threads (_ItemFile)

    def __init__(self, root: Path, source, tp: int, pp: int, vpp: int, dtype: torch.dtype | None,
                 weights_only: bool = False, ep: int = 1):
        import torch.distributed.checkpoint.metadata as md  # lazy: torch_dist outputs only

        self.root, self.source, self.layout, self.ep = root, source, (tp, pp, vpp), ep
        self.dims = source.dims(tp)  # padded vocabulary of the target tp
        raise_problems(f"the model cannot be laid out at tp={tp} pp={pp} vpp={vpp} ep={ep}",
                       check_dims(self.dims, tp, pp, vpp, ep))
        self.step = int(source.step or 0)
        self.tag_dir = root / f"iter_{self.step:07d}"
        self.tag_dir.mkdir(parents=True)
        self.out_dtype = dtype or source.dtype()
        self.note, self._optim = None, None
        if not weights_only:
            self._optim, self.note = optimizer_plan(self, source)
        if ep > 1 and not self._optim:
            raise ToolkitError(f"--ep {ep}: a torch_dist checkpoint's weights load at any ep (Megatron-Core reshards "
                               "them); --ep only shapes a mixture of experts' optimizer state, and none is written "
                               f"here ({self.note or 'the source has none'}): drop --ep")
        self._has_master = bool(self._optim) and "master" in self._optim["fields"]
        self._distributed = bool(self._optim) and self._optim["distributed"]
        self.fields = (WEIGHT, *(self._optim["fields"] if self._optim else ()))
        self._files = [_ItemFile(self.tag_dir / f"__0_{i}.distcp") for i in range(ITEM_FILES)]
        self._file_of: dict[tuple, _ItemFile] = {}  # (sharded key, chunk offsets) -> the file its item goes in
        self.writers = list(self._files)  # what --verbose counts the bytes copied file to file of
        self._md = md
        self._meta: dict = {}
        self._global: dict[tuple, tuple[str, tuple]] = {}  # hf_names -> (sharded key, index on its leading axes)
        self.total = 0
        for e in iter_entries(self.dims, 1, 1):
            name, index = sharded_name(e.megatron_name)
            self._global[e.hf_names] = (sharded_key(name), index)
            shape = e.rule.shard_shape(e.hf_shapes, 1)
            full = torch.Size((self.dims.layers, self.dims.experts)[:len(index)] + tuple(shape))
            if sharded_key(name) not in self._meta:  # a stacked tensor: once, for its first layer (and expert)
                self._meta[sharded_key(name)] = md.TensorStorageMetadata(md.TensorProperties(dtype=self.out_dtype),
                                                                         full, [])
                self.total += full.numel() * self.out_dtype.itemsize
        if self.dims.tied:  # Megatron keeps the output layer's copy at pp > 1; written so every layout loads
            emb = self._meta["embedding.word_embeddings.weight"]
            self._meta["output_layer.weight"] = md.TensorStorageMetadata(emb.properties, emb.size, [])
            self.total += emb.size.numel() * self.out_dtype.itemsize
        if self._optim:  # each weight's moments and fp32 main weights (the plain optimizer's: of 16-bit weights)
            fp32 = md.TensorProperties(dtype=torch.float32)
            for key, m in list(self._meta.items()):
                for field in SAVED_AS if self._distributed else self._optim["fields"]:
                    self._meta[optimizer_key(field, key, self._distributed)] = md.TensorStorageMetadata(fp32, m.size,
                                                                                                       [])
                    self.total += m.size.numel() * 4

    def writes(self, entry, field: str, hf_tensors: list[torch.Tensor]) -> list:
        """(file, chunk index, tensor) for this parameter, once (the tied output layer: with the embeddings)."""
        if not entry.reads_back:
            return []
        key, index = self._global[tuple(entry.hf_names)]
        full = entry.to_megatron(hf_tensors, 1)[0]
        keys = [key, "output_layer.weight"] if self.dims.tied and key == "embedding.word_embeddings.weight" else [key]
        if field == WEIGHT:  # the distributed optimizer saves an fp32 model's mains, which are its weights
            mains = self._optim and self._distributed and not self._has_master
            names = keys + ([optimizer_key("master", k) for k in keys] if mains else [])
        else:
            names = [optimizer_key(field, k, self._distributed) for k in keys]
        out = []
        for k in names:
            dtype = self._meta[k].properties.dtype  # the weights in the output dtype, the optimizer in fp32
            if not addressing():  # byte_ranges.plan's address tensors stand for bytes: it checks the dtypes agree
                full = full.to(dtype)
            # the chunk's shape from the entry (an address tensor's columns count blocks, not elements)
            shape = torch.Size((1,) * len(index) + tuple(entry.rule.shard_shape(entry.hf_shapes, 1)))
            offsets, piece = (*index, *(0,) * (len(shape) - len(index))), full.reshape((1,) * len(index) + full.shape)
            if not addressing() and piece.shape != shape:
                raise ToolkitError(f"internal: {k} is {tuple(piece.shape)}, its entry says {tuple(shape)}")
            at, chunks = self._md.MetadataIndex(k, torch.Size(offsets)), self._meta[k].chunks
            if all(c.offsets != at.offset for c in chunks):  # once: byte_ranges.plan asks first, and on None the
                chunks.append(self._md.ChunkStorageMetadata(at.offset, shape))  # streaming path asks again
            items = self._file_of.setdefault((k, at.offset), self._files[len(self._file_of) % len(self._files)])
            items.declare(at, tuple(shape), dtype)
            out.append((items, at, piece if addressing() else compact(piece)))
        return out

    def close(self) -> None:
        md = self._md
        for fqn in self._extra_state_keys():
            self._meta[fqn] = md.BytesStorageMetadata()
            self._files[0].write(md.MetadataIndex(fqn), None)
        for items in self._files:
            items.close()
        missing = [k for k, m in self._meta.items() if hasattr(m, "chunks") and
                   sum(c.sizes.numel() for c in m.chunks) != m.size.numel()]
        if missing:
            raise ToolkitError(f"internal: torch_dist output incomplete for {missing[:4]}")
        metadata = md.Metadata(state_dict_metadata=self._meta,
                               storage_data={i: w for items in self._files for i, w in items.where.items()})
        (self.tag_dir / ".metadata").write_bytes(pickle.dumps(metadata))
        common = {"args": self._args(), "checkpoint_version": 3.0, "iteration": self.step,
                  "num_floating_point_operations_so_far": 0}
        if self._optim:
            common["args"].use_distributed_optimizer = self._distributed
            parts = [self._common_optimizer(g) for g in (self._optim["groups"], self._optim["expert_groups"]) if g]
            common["optimizer"] = parts[0] if len(parts) == 1 else dict(enumerate(parts))  # ChainedOptimizer's
            common["opt_param_scheduler"] = self._optim["scheduler"]
        torch.save(common, self.tag_dir / "common.pt")
        (self.tag_dir / "metadata.json").write_text(json.dumps(
            {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
             "common_backend_version": 1}))
        (self.root / "latest_checkpointed_iteration.txt").write_text(str(self.step))

    def _common_optimizer(self, groups: list[dict]) -> dict:
        """One optimizer's part of common.pt: its param groups with the step (and the grad scaler's state)."""
        if self._distributed:
            part = {"optimizer": {"param_groups": groups}, "param_state_sharding_type": "fully_reshardable"}
        else:  # the plain optimizer's: the step shared by every parameter, torch's state dict nested for 16 bits
            inner = {"state": {"common_step": torch.tensor(float(self._optim["step"]))}, "param_groups": groups}
            part = {"optimizer": inner} if self._has_master else inner
        if self._optim["scaler"] and (self._distributed or self._has_master):
            part["grad_scaler"] = self._optim["scaler"]
        return part

    def _extra_state_keys(self) -> list[str]:
        """The `_extra_state` objects Megatron-Core's sharded_state_dict lists: one per layer and module, and for a
        mixture of experts one per layer, routed expert and expert linear (`shard_{layer}.{expert}_{layers}.{experts}`)
        instead of the dense MLP's."""
        layers, experts = self.dims.layers, self.dims.experts
        modules = EXTRA_STATE_MODULES if not experts else [m for m in EXTRA_STATE_MODULES if not m.startswith("mlp.")]
        keys = [f"decoder.layers.{m}._extra_state/shard_{i}_{layers}" for i in range(layers) for m in modules]
        return keys + [f"decoder.layers.mlp.experts.experts.{fc}._extra_state/shard_{i}.{e}_{layers}.{experts}"
                       for i in range(layers) for e in range(experts) for fc in ("linear_fc1", "linear_fc2")]

    def _args(self) -> argparse.Namespace:
        """Megatron-LM's model arguments for this model at the target layout (what --use-checkpoint-args reads)."""
        return model_args(self.dims, self.source.config, *self.layout, self.source.divisible_by, self.out_dtype,
                          "torch_dist", self.ep)
