"""Writing Megatron-Core `torch_dist` checkpoints (`toolkit convert --to torch_dist`), one tensor at a time.

Output: <dst>/latest_checkpointed_iteration.txt and <dst>/iter_XXXXXXX/ with metadata.json, common.pt (a
Megatron-LM-style args Namespace for the target TP x PP x VPP, iteration, checkpoint_version, and the content metadata
Megatron-LM's save stores: megatron_lm_write.content_metadata), two item files
`__0_0.distcp` and `__0_1.distcp` (ITEM_FILES) and torch DCP's `.metadata`. The tensors are Megatron-Core's sharded
keys (layers stacked on a leading axis, one chunk per layer, the full TP = 1 tensor, Transformer Engine names for
the per-layer norms, `_extra_state` objects as Megatron's local spec saves them), so Megatron-Core's
`dist_checkpointing.load` reshards it onto any TP x PP x VPP at load time; the TP x PP x VPP given only fixes the
vocabulary padding and the args.

This module does not import torch: every file is written by a writer of torch.save's and pickle's formats of our
own (toolkit/format/pt_write.py), the `.metadata` with DCP's classes named, not imported (pt_write.Obj, pickled as
a dataclass pickles), so `toolkit convert --no-verify` writes weights-only torch_dist checkpoints without torch
(toolkit/checkpoint/copy_only.py). The full path hands in torch's pieces and the optimizer plan
(toolkit/checkpoint/megatron_lm_optim.py).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import struct
import threading
from pathlib import Path

from toolkit.checkpoint.byte_ranges import addressing
from toolkit.checkpoint.dist_keys import SAVED_AS, sharded_name
from toolkit.checkpoint.megatron_lm_write import content_metadata, megatron_lm_flags, model_args, run_args
from toolkit.errors import ToolkitError
from toolkit.families.entries import iter_entries, raise_problems
from toolkit.families.mapping import TE_NORM_NAMES, check_dims
from toolkit.format import pt_write
from toolkit.format import safetensors_stream as st
from toolkit.format.file_copy import copy_ranges, pwrite_all, start_writeback
from toolkit.format.pt_write import Call, Global, Obj
from toolkit.format.pt_zip import ITEMSIZE

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


_MD = "torch.distributed.checkpoint.metadata"
_SIZE = Global("torch", "Size")


def _size(dims) -> Call:
    """torch.Size(dims) as it pickles; a tuple of its own each time, so the pickle never depends on which equal
    tuples happen to be one object (the same bytes whichever path wrote the file)."""
    return Call(_SIZE, (tuple(int(d) for d in dims),))


def _index(fqn: str, offsets: tuple | None) -> Obj:
    """DCP's MetadataIndex(fqn, offset) as it pickles (its __init__ leaves out a None offset)."""
    return Obj(Global(_MD, "MetadataIndex"), {"fqn": fqn, "index": None, **(
        {"offset": _size(offsets)} if offsets is not None else {})})


_STRIDED = Call(Global("torch.serialization", "_get_layout"), ("torch.strided",))
_CONTIGUOUS = Call(Global(_MD, "_MEM_FORMAT_ENCODING"), (0,))
"""torch.strided and DCP's contiguous-format encoding: one object each, as torch's are (the pickle refers back)."""


def _properties(dtype: str) -> Obj:
    """DCP's TensorProperties(dtype) as it pickles: its __getstate__'s tuple (dtype, layout, requires_grad, memory
    format, pin_memory)."""
    return Obj(Global(_MD, "TensorProperties"), (pt_write.torch_dtype(dtype), _STRIDED, False, _CONTIGUOUS, False))


def _scalar(value: float) -> tuple[pt_write.Tensor, bytes]:
    """torch.tensor(value) (fp32, 0-d) for pt_write, and its bytes."""
    return pt_write.Tensor(pt_write.Storage("F32", 1), 0, (), ()), struct.pack("<f", value)


ITEM_ALIGN = 64
"""Each item's tensor bytes start on this many bytes in its .distcp file; the gap before it is never read (DCP reads
an item by its offset and length). torch's FileSystemWriter puts items back to back, so there a tensor's bytes may
start at an odd offset, where a reader that maps the file (the verification) cannot view them as bf16 and copies
them: half of the bytes of a 1.1B checkpoint, before these items were aligned."""


class _ItemFile:
    """One .distcp file: each item is a torch.save of one chunk, a standalone zip as torch's own FileSystemWriter
    writes it (pt_write: the bytes torch.save puts around such a tensor, kept per shape and dtype, with the tensor's
    bytes between); its byte range is recorded, and the kernel is asked to start writing it to disk at once. An item
    whose bytes are byte ranges of the source files (byte_ranges.plan) has them copied file to file (write_ranges).
    As with torch's skip_data, those items' zip records carry a CRC-32 of 0, which torch.load (and so
    dist_checkpointing.load) does not check. Takes writes from several threads at once: a tensor item's bytes are
    reserved when it is declared (by the conversion's thread, in its order, so the file's layout does not depend on
    which writer thread comes first), then written in place. Items are keyed (sharded key, chunk offsets, or None for
    an object)."""

    def __init__(self, path: Path):
        self.path, self.fd = path, os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self.where: dict = {}  # item key -> (byte offset, length)
        self._declared: dict = {}  # item key -> (shape, dtype) of the tensor it will hold, and its offset
        self.kernel_bytes = self.gathered_bytes = self.user_bytes = self.read_bytes = 0
        self._lock, self._end = threading.Lock(), 0  # the end of the bytes reserved so far

    def declare(self, key, shape: tuple, dtype: str) -> None:
        """The item `key` will hold a tensor of this shape and dtype: its bytes are reserved (once: byte_ranges.plan
        declares it first, and the streaming path again when the plan gives it up)."""
        if key not in self._declared:
            head, tail = _around(tuple(shape), dtype)
            size = len(head) + math.prod(shape) * ITEMSIZE[dtype] + len(tail)
            self._declared[key] = (tuple(shape), dtype, self._reserve(size, len(head)))

    def declared(self, key) -> tuple[tuple, str, int]:
        shape, dtype, _ = self._declared[key]
        return shape, dtype, math.prod(shape) * ITEMSIZE[dtype]

    def _reserve(self, size: int, head: int = 0) -> int:
        """The offset of an item of `size` bytes whose tensor data starts `head` bytes in: the data on ITEM_ALIGN."""
        with self._lock:
            start = self._end + (-(self._end + head) % ITEM_ALIGN)
            self._end = start + size
        return start

    def write(self, key, data) -> int:
        """A tensor item from memory (`data`: its bytes, any buffer), or with `key[1]` None, an object's (`data`:
        the object, without tensors)."""
        if key[1] is None:
            raw = pt_write.zip_bytes([data])
            start = self._reserve(len(raw))
            pwrite_all(self.fd, memoryview(raw), start)
            return self._record(key, start, len(raw))
        shape, dtype, size = self.declared(key)
        view = memoryview(data).cast("B")
        if view.nbytes != size:
            raise ToolkitError(f"internal: {key[0]} takes {size} bytes, {view.nbytes} came")
        head, tail = _around(shape, dtype)
        start = self._declared[key][2]
        pwrite_all(self.fd, memoryview(head + view.tobytes() + tail) if size < 2**16 else memoryview(head), start)
        if size >= 2**16:
            pwrite_all(self.fd, view, start + len(head))
            pwrite_all(self.fd, memoryview(tail), start + len(head) + size)
        return self._record(key, start, len(head) + size + len(tail))

    def write_ranges(self, key, ranges: list) -> int:
        shape, dtype, size = self.declared(key)
        head, tail = _around(shape, dtype)
        if sum(n for _, _, n in ranges) != size:
            raise ToolkitError(f"internal: {key[0]} takes {size} bytes, the ranges to copy hold "
                               f"{sum(n for _, _, n in ranges)}")
        start = self._declared[key][2]
        pwrite_all(self.fd, memoryview(head), start)
        kernel, gathered, user, read = copy_ranges(self.fd, start + len(head), ranges)
        pwrite_all(self.fd, memoryview(tail), start + len(head) + size)
        with self._lock:
            self.kernel_bytes, self.gathered_bytes = self.kernel_bytes + kernel, self.gathered_bytes + gathered
            self.user_bytes, self.read_bytes = self.user_bytes + user, self.read_bytes + read
        return self._record(key, start, len(head) + size + len(tail))

    def _record(self, key, start: int, size: int) -> int:
        with self._lock:
            self.where[key] = (start, size)
        start_writeback(self.fd, start, size)
        return size

    def close(self) -> None:
        os.fsync(self.fd)  # on disk before the output folder is renamed into place
        os.close(self.fd)


_AROUND: dict = {}
"""(shape, dtype) -> the bytes torch.save writes to a file object before and after such a tensor's data."""
_AROUND_LOCK = threading.Lock()


def _around(shape: tuple, dtype: str) -> tuple[bytes, bytes]:
    """The bytes torch.save writes to a file object before and after the data of a contiguous tensor of this shape
    and dtype (pt_write.item_around), kept per shape and dtype."""
    with _AROUND_LOCK:
        if (shape, dtype) not in _AROUND:
            _AROUND[(shape, dtype)] = pt_write.item_around(pt_write.Tensor.empty(shape, dtype))
        return _AROUND[(shape, dtype)]


PLAIN_AS = {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq", "master": "fp32_param"}
"""Our optimizer field -> the plain optimizer's name for it in its sharded state dict."""


def optimizer_key(field: str, key: str, distributed: bool = True) -> str:
    """The sharded key of a parameter's optimizer field: the distributed optimizer's saved `fully_reshardable`, or
    the plain optimizer's."""
    return f"optimizer.state.{(SAVED_AS if distributed else PLAIN_AS)[field]}.{key}"


class TorchDistTarget:
    """A torch_dist checkpoint root; see the module docstring. With the optimizer state when the source carries a
    Megatron-LM checkpoint's (`optimizer_plan`, megatron_lm_optim.optimizer_plan, decides), per parameter in fp32,
    shaped and chunked as its weight, which Megatron-Core reshards onto any TP x PP x VPP x DP at load: the
    distributed optimizer's as `optimizer.state.{param,exp_avg,exp_avg_sq}.<key>` (Megatron-LM's
    --dist-ckpt-optim-fully-reshardable), the plain optimizer's as `optimizer.state.{exp_avg,exp_avg_sq[,fp32_param]}.
    <key>` (its sharded_state_dict; fp32_param for a 16-bit model), and in common.pt the optimizer's param groups with
    the step and the scheduler's state.

    The weights, and the optimizer's tensors, load at any expert-parallel size, but not its common state: at ep > 1
    Megatron-Core chains a second optimizer for a mixture of experts' routed experts, and saves {0: the dense
    optimizer's, 1: the experts'} (with `chained_optim_avoid_prefix`, its tensors keep their unprefixed names). So a
    mixture of experts' optimizer state is written for the ep given (`--ep`, 1 by default), which the run that loads
    it must use; without optimizer state `--ep` is refused. `dtype`: torch's, a safetensors name, or None for the
    source's."""

    raw_bytes = True  # items whose bytes are source byte ranges are copied in (byte_ranges.plan, write_ranges)
    concurrent_writes = True  # two item files, each taking writes from several threads (_ItemFile)

    def __init__(self, root: Path, source, tp: int, pp: int, vpp: int, dtype, weights_only: bool = False,
                 ep: int = 1, optimizer_plan=None):
        self.root, self.source, self.layout, self.ep = root, source, (tp, pp, vpp), ep
        self.dims = source.out_dims(tp)  # padded vocabulary of the target tp
        raise_problems(f"the model cannot be laid out at tp={tp} pp={pp} vpp={vpp} ep={ep}",
                       check_dims(self.dims, tp, pp, vpp, ep))
        self.step = int(source.step or 0)
        self.tag_dir = root / f"iter_{self.step:07d}"
        self.dtype_name = st.dtype_name(dtype) if dtype is not None else source.dtype_name()
        self._args()  # before anything is written: a config Megatron-LM's arguments cannot say is refused
        self.tag_dir.mkdir(parents=True)
        self.out_dtype = None  # torch's, for the optimizer plan (the full path only)
        self.note, self._optim = None, None
        if not weights_only and optimizer_plan is not None:
            self.out_dtype = dtype if dtype is not None and not isinstance(dtype, str) else source.dtype()
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
        self._meta: dict[str, tuple] = {}  # sharded key -> (dtype, global shape, [(chunk offsets, chunk shape)])
        self._global: dict[tuple, tuple[str, tuple]] = {}  # hf_names -> (sharded key, index on its leading axes)
        self.total = 0
        for e in iter_entries(self.dims, 1, 1):
            name, index = sharded_name(e.megatron_name)
            self._global[e.hf_names] = (sharded_key(name), index)
            full = (self.dims.layers, self.dims.experts)[:len(index)] + tuple(e.rule.shard_shape(e.hf_shapes, 1))
            if sharded_key(name) not in self._meta:  # a stacked tensor: once, for its first layer (and expert)
                self._meta[sharded_key(name)] = (self.dtype_name, full, [])
                self.total += math.prod(full) * ITEMSIZE[self.dtype_name]
        if self.dims.tied:  # Megatron keeps the output layer's copy at pp > 1; written so every layout loads
            _, size, _ = self._meta["embedding.word_embeddings.weight"]
            self._meta["output_layer.weight"] = (self.dtype_name, size, [])
            self.total += math.prod(size) * ITEMSIZE[self.dtype_name]
        if self._optim:  # each weight's moments and fp32 main weights (the plain optimizer's: of 16-bit weights)
            for key, (_, size, _) in list(self._meta.items()):
                for field in SAVED_AS if self._distributed else self._optim["fields"]:
                    self._meta[optimizer_key(field, key, self._distributed)] = ("F32", size, [])
                    self.total += math.prod(size) * 4

    def writes(self, entry, field: str, hf_tensors: list) -> list:
        """(file, item key, the tensor's bytes) for this parameter, once (the tied output layer: with the
        embeddings); byte_ranges.plan's address tensors in place of the bytes while it plans (addressing())."""
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
            dtype, _, chunks = self._meta[k]  # the weights in the output dtype, the optimizer in fp32
            # the chunk's shape from the entry (an address tensor's columns count blocks, not elements)
            shape = (1,) * len(index) + tuple(entry.rule.shard_shape(entry.hf_shapes, 1))
            offsets = (*index, *(0,) * (len(shape) - len(index)))
            if not addressing() and (1,) * len(index) + tuple(full.shape) != shape:
                raise ToolkitError(f"internal: {k} is {tuple(full.shape)}, its entry says {shape}")
            if all(c[0] != offsets for c in chunks):  # once: byte_ranges.plan asks first, and on None the streaming
                chunks.append((offsets, shape))  # path asks again
            at = (k, offsets)
            items = self._file_of.setdefault(at, self._files[len(self._file_of) % len(self._files)])
            items.declare(at, shape, dtype)
            out.append((items, at, full if addressing() else st.tensor_bytes(full, dtype)))
        return out

    def close(self) -> None:
        extra = self._extra_state_keys()
        for fqn in extra:
            self._files[0].write((fqn, None), None)
        for items in self._files:
            items.close()
        missing = [k for k, (_, size, chunks) in self._meta.items()
                   if sum(math.prod(c[1]) for c in chunks) != math.prod(size)]
        if missing:
            raise ToolkitError(f"internal: torch_dist output incomplete for {missing[:4]}")
        state = {k: Obj(Global(_MD, "TensorStorageMetadata"), {"properties": _properties(dtype), "size": _size(size),
                 "chunks": [Obj(Global(_MD, "ChunkStorageMetadata"), {"offsets": _size(o), "sizes": _size(c)})
                            for o, c in chunks]}) for k, (dtype, size, chunks) in self._meta.items()}
        state.update({fqn: Obj(Global(_MD, "BytesStorageMetadata")) for fqn in extra})
        storage = {_index(*key): Obj(Global("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
                                     {"relative_path": items.path.name, "offset": at, "length": n})
                   for items in self._files for key, (at, n) in sorted(items.where.items(), key=lambda w: w[1])}
        metadata = Obj(Global(_MD, "Metadata"), {"state_dict_metadata": state, "planner_data": None,
                                                 "storage_data": storage, "storage_meta": None, "version": None})
        (self.tag_dir / ".metadata").write_bytes(pt_write.dumps(metadata)[0])
        common = {"args": self._args(), "checkpoint_version": 3.0, "iteration": self.step,
                  "num_floating_point_operations_so_far": 0,
                  "content_metadata": content_metadata(bool(self._optim) and self._distributed)}
        fills = []
        if self._optim:
            common["args"].use_distributed_optimizer, common["args"].no_save_optim = self._distributed, False
            parts = [self._common_optimizer(g, fills) for g in (self._optim["groups"], self._optim["expert_groups"])
                     if g]
            common["optimizer"] = parts[0] if len(parts) == 1 else dict(enumerate(parts))  # ChainedOptimizer's
            common["opt_param_scheduler"] = self._optim["scheduler"]
        pt_write.Skeleton(self.tag_dir / "common.pt", common, [], fills).finish()
        (self.tag_dir / "metadata.json").write_text(json.dumps(
            {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
             "common_backend_version": 1}))
        (self.root / "latest_checkpointed_iteration.txt").write_text(str(self.step))

    def _common_optimizer(self, groups: list[dict], fills: list) -> dict:
        """One optimizer's part of common.pt: its param groups with the step (and the grad scaler's state); its
        scalar tensors' bytes are added to `fills`."""
        def scalar(value: float) -> pt_write.Tensor:
            tensor, raw = _scalar(value)
            fills.append((tensor, lambda: raw))
            return tensor

        if self._distributed:
            part = {"optimizer": {"param_groups": groups}, "param_state_sharding_type": "fully_reshardable"}
        else:  # the plain optimizer's: the step shared by every parameter, torch's state dict nested for 16 bits
            inner = {"state": {"common_step": scalar(float(self._optim["step"]))}, "param_groups": groups}
            part = {"optimizer": inner} if self._has_master else inner
        if self._optim["scaler"] and (self._distributed or self._has_master):
            part["grad_scaler"] = {k: scalar(v) if k == "scale" else v for k, v in self._optim["scaler"].items()}
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

    def megatron_lm_flags(self) -> str:
        """What Megatron-LM needs to continue from this output (megatron_lm_write.megatron_lm_flags)."""
        return megatron_lm_flags("torch_dist", bool(self._optim), bool(self._optim) and self._distributed,
                                 self.source.out_divisor)

    def _args(self) -> argparse.Namespace:
        """Megatron-LM's model arguments for this model at the target layout (what --use-checkpoint-args reads)."""
        return model_args(self.dims, self.source.config, *self.layout, self.source.out_divisor, self.dtype_name,
                          "torch_dist", self.ep, run_args(self.source))
