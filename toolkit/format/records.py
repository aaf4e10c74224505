"""The records a Megatron-LM checkpoint pickles besides tensors, and how they are read: inert stand-ins for
Megatron's own classes (`Record`), the stdlib and numpy objects allowed beside them. Both loaders use these lists:
torch's weights-only unpickler (toolkit/format/safe_load.py) and the torch-free one that `toolkit convert
--no-verify` reads Megatron's pickles with (toolkit/format/pt_zip.py). No torch here."""
from __future__ import annotations

import io
import pickle
import signal
import types
from pathlib import PosixPath

import numpy as np


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


def megatron_lm_records() -> list:
    """What Megatron-LM's `args` and common state hold besides tensors: stdlib records (Signals is an enum, BytesIO
    and PosixPath hold bytes and a path) and the Megatron classes above as Records."""

    return [signal.Signals, io.BytesIO, PosixPath, types.SimpleNamespace,
            *[(cls, name) for name, cls in _RECORDS.items()]]


def numpy_records() -> list:
    """numpy's RNG state (Megatron-LM stores np.random.get_state() as arrays), arrays and numbers of plain dtypes."""

    multiarray = np._core.multiarray if hasattr(np, "_core") else np.core.multiarray
    dtypes = [type(np.dtype(t)) for t in (np.uint32, np.int64, np.float64, np.float32, np.int32, np.float16, np.uint8,
                                          np.int8, np.bool_)]
    # numpy 1.x wrote the same functions under their old module name. `scalar` rebuilds a number (np.float64(1.5),
    # common in a DeepSpeed client_state) from its dtype, one of the plain ones above, and its bytes
    return [multiarray._reconstruct, (multiarray._reconstruct, "numpy.core.multiarray._reconstruct"),
            multiarray.scalar, (multiarray.scalar, "numpy.core.multiarray.scalar"), np.ndarray, np.dtype, *dtypes]


def by_name(records: list) -> dict[str, object]:
    """{"module.name": object} of a list in torch.serialization.safe_globals' form (objects, or (object, name))."""
    return {(r[1] if isinstance(r, tuple) else f"{r.__module__}.{r.__qualname__}"):
            (r[0] if isinstance(r, tuple) else r) for r in records}


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


DCP_CLASSES: dict[tuple[str, str], type] = {
    (module, n): type(n, (DCPRecord,), {"name": f"{module}.{n}", "__module__": __name__, **_DCP_DEFAULTS.get(n, {})})
    for module, names in DCP_RECORDS.items() for n in names}
"""(module, name) -> the DCPRecord class that stands in for it."""


class GuardedUnpickler(pickle._Unpickler):
    """Python's own (pure-Python) unpickler, with BUILD, which sets an object's state, allowed only on instances of
    the record classes (`buildable`): a pickle cannot set attributes of an allowed class or function itself (such as
    argparse.Namespace's), nor of a reader's shared stand-ins, as torch's weights-only unpickler refuses it too.
    Subclasses add find_class."""

    dispatch = dict(pickle._Unpickler.dispatch)
    buildable: tuple[type, ...] = ()

    def _guarded_build(self) -> None:
        inst = self.stack[-2]  # the state is on top
        if not isinstance(inst, self.buildable):
            raise pickle.UnpicklingError(f"BUILD of a {type(inst).__name__}, whose state this reader does not set")
        pickle._Unpickler.load_build(self)

    dispatch[pickle.BUILD[0]] = _guarded_build


class DCPUnpickler(GuardedUnpickler):
    """A `.metadata` unpickler that knows `classes` ({(module, name): object}) and no other global, and no
    persistent id; it sets the state of DCP's records only."""

    buildable = (DCPRecord,)

    def __init__(self, file, classes: dict):
        super().__init__(file)
        self.classes = classes

    def find_class(self, module: str, name: str):
        if (module, name) not in self.classes:
            raise pickle.UnpicklingError(f"GLOBAL {module}.{name} is not allowed")
        return self.classes[(module, name)]

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("persistent ids are not allowed")


def is_dcp_metadata(meta) -> bool:
    """Whether an unpickled `.metadata` has DCP's Metadata fields: what both its readers (safe_load's, with torch;
    pt_zip's, without) check first."""
    return (isinstance(getattr(meta, "state_dict_metadata", None), dict)
            and isinstance(getattr(meta, "storage_data", None), dict))
