"""Loading pickled checkpoint files without running code hidden in them.

Every .pt file the toolkit reads goes through torch.load(weights_only=True): torch's restricted unpickler, which
builds tensors and plain containers and refuses any other class or function. The only other objects allowed are
the records DeepSpeed and Megatron-LM store (`allowed()` below). Megatron's own classes that a real Megatron-LM run
pickles into `args` (enums such as AttnBackend, configs) are never imported: each name is mapped to an inert
stand-in (`Record`) that only keeps the values it is given, so loading runs no Megatron code either. DeepSpeed's engine and Megatron's distributed
optimizer call torch.load themselves (DeepSpeed with weights_only=False); `weights_only_everywhere` forces those
calls through the same unpickler while a checkpoint is loaded (TORCH_FORCE_WEIGHTS_ONLY_LOAD).
"""
from __future__ import annotations

import argparse
import io
import os
import pickle
import re
import signal
import sys
import types
from contextlib import contextmanager
from pathlib import Path, PosixPath

import numpy as np
import torch

from toolkit.errors import ToolkitError

REFUSED = "refused rather than unpickled"


class Record:
    """An inert stand-in for a Megatron class named in a pickle (an enum member such as AttnBackend.auto, or a config
    object): it keeps the constructor arguments (`args`, `value`) and the pickled state (`state`) and runs nothing."""

    name = "?"

    def __new__(cls, *args):
        self = object.__new__(cls)
        self.args, self.state = args, None
        return self

    def __setstate__(self, state) -> None:
        self.state = state

    @property
    def value(self):
        return self.args[0] if len(self.args) == 1 else self.args

    def __eq__(self, other) -> bool:
        return type(other) is type(self) and (other.args, other.state) == (self.args, self.state)

    def __hash__(self) -> int:
        return hash((self.name, repr(self.args)))

    def __repr__(self) -> str:
        return f"<{self.name} {self.value!r}>"


MEGATRON_RECORDS = ("megatron.core.transformer.enums.AttnBackend", "megatron.core.transformer.enums.CudaGraphScope",
                    "megatron.core.transformer.enums.AttnMaskType", "megatron.core.transformer.enums.ModelType",
                    "megatron.core.transformer.enums.LayerType", "megatron.core.enums.ModelType",
                    "megatron.core.enums.Fp8Recipe", "megatron.core.enums.Fp4Recipe",
                    "megatron.core.optimizer.optimizer_config.OptimizerConfig",
                    "megatron.core.rerun_state_machine.RerunDiagnostic", "megatron.core.rerun_state_machine.RerunMode",
                    "megatron.core.rerun_state_machine.RerunState")
"""The Megatron-Core 0.16 classes that Megatron-LM checkpoints pickle (Megatron's own list of checkpoint classes,
megatron/core/safe_globals.py), each read as a Record."""
_RECORDS = {name: type(name.rsplit(".", 1)[1], (Record,), {"name": name, "__module__": __name__})
            for name in MEGATRON_RECORDS}


def _megatron_lm_records() -> list:
    """What Megatron-LM's `args` and common state hold besides tensors: stdlib records (Signals is an enum, BytesIO
    and PosixPath hold bytes and a path) and the Megatron classes above as Records."""

    return [signal.Signals, io.BytesIO, PosixPath, types.SimpleNamespace,
            *[(cls, name) for name, cls in _RECORDS.items()]]


def _numpy_records() -> list:
    """numpy's RNG state (Megatron-LM stores np.random.get_state() as arrays)."""

    reconstruct = np._core.multiarray._reconstruct if hasattr(np, "_core") else np.core.multiarray._reconstruct
    dtypes = [type(np.dtype(t)) for t in (np.uint32, np.int64, np.float64, np.float32, np.int32, np.float16, np.uint8, np.int8, np.bool_)]
    # numpy 1.x wrote the same function under its old module name
    return [reconstruct, (reconstruct, "numpy.core.multiarray._reconstruct"), np.ndarray, np.dtype, *dtypes]


def _deepspeed_records() -> list:
    """The non-tensor objects DeepSpeed 0.19 pickles into its checkpoint files (records, no code)."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler  # lazy: DeepSpeed paths only
    from deepspeed.runtime.zero.config import ZeroStageEnum  # lazy: DeepSpeed paths only
    from deepspeed.utils.tensor_fragment import fragment_address  # lazy: DeepSpeed paths only

    return [ZeroStageEnum, LossScaler, DynamicLossScaler, fragment_address]


def allowed(deepspeed: bool | None = None) -> list:
    """The allow-list: Megatron-LM's arguments (argparse.Namespace and the records it holds), numpy RNG state and
    dtypes, and with `deepspeed` (default: when DeepSpeed is already imported) DeepSpeed's records."""
    if deepspeed is None:  # a file naming DeepSpeed's records makes load() import DeepSpeed and retry
        deepspeed = "deepspeed" in sys.modules
    return [argparse.Namespace, *_megatron_lm_records(), *_numpy_records(), *(_deepspeed_records() if deepspeed else [])]


def refusal(path: Path, error: BaseException) -> ToolkitError:
    """The error for a file torch.load could not (or would not) read."""
    text = str(error)
    unsafe = re.search(r"GLOBAL ([\w.]+)", text)
    if isinstance(error, pickle.UnpicklingError) and unsafe:
        return ToolkitError(f"{path} holds a pickled {unsafe.group(1)}, which is neither a tensor nor a known "
                            f"checkpoint record: {REFUSED} (loading it could run code). Use checkpoints from "
                            "sources you trust, or re-save this one from its original training run")
    first = next((line.strip() for line in text.splitlines() if line.strip()), type(error).__name__)
    first = first.split(". ")[0].rstrip(".")  # torch's first sentence; the rest is advice that does not apply
    return ToolkitError(f"cannot read {path}: the file is truncated or damaged ({first}); re-copy it, or resume "
                        "from another checkpoint")


def load(path: Path, mmap: bool = False, deepspeed: bool | None = None, map_location="cpu"):
    """torch.load(path) as weights only, with the allow-list; a ToolkitError naming the file when refused."""
    path = Path(path)
    if not path.is_file():
        raise ToolkitError(f"{path} is missing: the checkpoint is incomplete (a rank did not save, or the file was "
                           "removed)")
    try:
        with torch.serialization.safe_globals(allowed(deepspeed)):
            return torch.load(path, weights_only=True, map_location=map_location, mmap=mmap)
    except RuntimeError as e:
        if mmap and "_use_new_zipfile_serialization" in str(e):  # a legacy-format file cannot be mapped: read it
            return load(path, mmap=False, deepspeed=deepspeed, map_location=map_location)
        raise refusal(path, e) from None
    except pickle.UnpicklingError as e:
        if deepspeed is None and "GLOBAL deepspeed." in str(e):  # DeepSpeed's records: allowed, once imported
            return load(path, mmap=mmap, deepspeed=True, map_location=map_location)
        raise refusal(path, e) from None
    except Exception as e:  # noqa: BLE001 - torch raises EOFError, ValueError, ... here
        raise refusal(path, e) from None


def load_tensors(path: Path):
    """torch.load(path) as weights only, memory-mapped, with nothing added to torch's own allow-list (tensors and
    plain containers only): safe to call from several threads at once, as load() is not (torch's safe_globals
    context is process-wide)."""
    path = Path(path)
    try:
        return torch.load(path, weights_only=True, map_location="cpu", mmap=True)
    except Exception as e:  # noqa: BLE001 - torch raises UnpicklingError, RuntimeError, EOFError, ... here
        raise refusal(path, e) from None


def check_file(path: Path) -> str | None:
    """None when `path` unpickles as weights only, else why not. Memory-mapped: only the pickle is read."""
    try:
        load(path, mmap=True)
    except ToolkitError as e:
        return str(e)
    return None


@contextmanager
def weights_only_everywhere(folder: Path, names: list[str] | None = None):
    """Every torch.load inside the block is weights only, with the allow-list, whatever its caller passes. A refusal
    becomes a ToolkitError that names the file (found by checking `names` in `folder`, or every *.pt there)."""
    old = os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD")
    os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
    try:
        with torch.serialization.safe_globals(allowed()):
            yield
    except pickle.UnpicklingError as e:
        for name in names if names is not None else sorted(p.name for p in Path(folder).glob("*.pt")):
            why = check_file(Path(folder) / name)
            if why:
                raise ToolkitError(why) from None
        raise refusal(Path(folder), e) from None
    finally:
        if old is None:
            os.environ.pop("TORCH_FORCE_WEIGHTS_ONLY_LOAD", None)
        else:
            os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = old


def load_buffer(data, where: str, map_location="cpu"):
    """torch.load of a torch.save file in memory (bytes) or in a file-like object (one tensor item of a torch DCP
    `.distcp` file) as weights only, with the allow-list; `where` names the item in errors. With map_location="meta"
    only the pickle is read, and each storage records its offset in the file (`_checkpoint_offset`)."""
    try:
        with torch.serialization.safe_globals(allowed(False)):
            return torch.load(io.BytesIO(data) if isinstance(data, (bytes, bytearray)) else data, weights_only=True,
                              map_location=map_location)
    except Exception as e:  # noqa: BLE001 - torch raises UnpicklingError, RuntimeError, EOFError, ... here
        raise refusal(where, e) from None


class DCPRecord:
    """An inert stand-in for one of torch DCP's `.metadata` records (its dataclasses and enums): the pickled fields
    become attributes (`.fqn`, `.chunks`, `.relative_path`, ...), an enum member keeps its value, and nothing of
    torch.distributed.checkpoint is imported (0.9 s of start-up here) or run."""

    name = "?"
    fields: tuple[str, ...] = ()  # a record pickled as a tuple (TensorProperties), its fields in order

    def __init__(self, *args):  # an enum member is unpickled as Class(value); a dataclass skips __init__
        self.args = args

    @property
    def value(self):
        return self.args[0] if len(getattr(self, "args", ())) == 1 else getattr(self, "args", ())

    def __setstate__(self, state) -> None:
        if isinstance(state, tuple) and self.fields and len(state) == len(self.fields):
            state = dict(zip(self.fields, state))
        elif isinstance(state, tuple) and len(state) == 2 and all(x is None or isinstance(x, dict) for x in state):
            state = {**(state[0] or {}), **(state[1] or {})}  # (dict, slots)
        if not isinstance(state, dict) or not all(isinstance(k, str) and k.isidentifier() and not k.startswith("__")
                                                  for k in state):
            raise pickle.UnpicklingError(f"{self.name} holds a state that is not its fields")
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"<{self.name} {self.__dict__!r}>"


DCP_RECORDS = {
    "torch.distributed.checkpoint.metadata": ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                              "ChunkStorageMetadata", "TensorProperties", "MetadataIndex",
                                              "StorageMeta", "_MEM_FORMAT_ENCODING"),
    "torch.distributed.checkpoint.planner": ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData"),
    "torch.distributed.checkpoint.filesystem": ("_StorageInfo",)}
"""The torch DCP classes a `.metadata` pickle names (torch 2.13), each read as a DCPRecord."""
_DCP_DEFAULTS = {"_StorageInfo": {"transform_descriptors": None},  # its __getstate__ leaves out None fields
                 "MetadataIndex": {"offset": None, "index": None},  # its __init__ leaves out a None offset
                 "Metadata": {"planner_data": None, "storage_data": None, "storage_meta": None, "version": None},
                 "TensorProperties": {"fields": ("dtype", "layout", "requires_grad", "memory_format_encoding",
                                                 "pin_memory")}}


def _dcp_classes() -> dict[tuple[str, str], object]:
    """What torch DCP's `.metadata` pickle names: its own dataclasses and enums (as DCPRecords), torch.Size, dtypes
    and layouts."""
    out: dict[tuple[str, str], object] = {
        (module, n): type(n, (DCPRecord,), {"name": f"{module}.{n}", "__module__": __name__,
                                            **_DCP_DEFAULTS.get(n, {})})
        for module, names in DCP_RECORDS.items() for n in names}
    out[("torch", "Size")] = torch.Size
    out[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    out[("pathlib", "PosixPath")] = PosixPath  # StorageMeta.checkpoint_id of a plain dcp.save: a path, no I/O
    out.update({("torch", n): getattr(torch, n) for n in dir(torch)
                if isinstance(getattr(torch, n, None), (torch.dtype, torch.layout, torch.memory_format))})
    return out


class _DCPUnpickler(pickle.Unpickler):
    def __init__(self, file, classes: dict):
        super().__init__(file)
        self.classes = classes

    def find_class(self, module: str, name: str):
        if (module, name) not in self.classes:
            raise pickle.UnpicklingError(f"GLOBAL {module}.{name} is not allowed")
        return self.classes[(module, name)]

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("persistent ids are not allowed")


def load_dcp_metadata(path: Path):
    """A torch DCP `.metadata` file (a plain pickle), unpickled with only DCP's own record classes allowed: any other
    global is refused before anything is called."""
    path = Path(path)
    if not path.is_file():
        raise ToolkitError(f"{path} is missing: the torch_dist checkpoint is incomplete (its save did not finish)")
    try:
        with open(path, "rb") as f:
            return _DCPUnpickler(f, _dcp_classes()).load()
    except Exception as e:  # noqa: BLE001 - pickle raises many kinds of error on damaged input
        raise refusal(path, e if isinstance(e, pickle.UnpicklingError) else EOFError(str(e) or type(e).__name__)) \
            from None
