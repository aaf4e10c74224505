"""Loading pickled checkpoint files without running code hidden in them.

Every .pt file the toolkit reads goes through torch.load(weights_only=True): torch's restricted unpickler, which
builds tensors and plain containers and refuses any other class or function. The only other objects allowed are
the records DeepSpeed and Megatron-LM store (`allowed()` below). Megatron's own classes that a real Megatron-LM run
pickles into `args` (enums such as AttnBackend, configs) are never imported: each name is mapped to an inert
stand-in (`Record`, toolkit/format/records.py) that only keeps the values it is given, so loading runs no Megatron
code either. DeepSpeed's engine and Megatron's distributed optimizer call torch.load themselves (DeepSpeed with
weights_only=False); `weights_only_everywhere` forces those calls through the same unpickler while a checkpoint is
loaded (TORCH_FORCE_WEIGHTS_ONLY_LOAD).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import pickle
import re
import sys
from contextlib import contextmanager
from pathlib import Path, PosixPath

import torch

from toolkit.errors import ToolkitError
from toolkit.format.records import DCP_CLASSES, DCPUnpickler, is_dcp_metadata, megatron_lm_records, numpy_records

REFUSED = "refused rather than unpickled"


def _deepspeed_records() -> list:
    """The non-tensor objects DeepSpeed 0.19 pickles into its checkpoint files (records, no code). Its first import
    logs "Setting accelerator to CPU" to stdout on a machine without a GPU, which broke `toolkit inspect --json`'s
    output and added a line to every conversion's: that line is dropped, and DeepSpeed's logger writes to stdout
    afterwards as it would have."""
    quiet = io.StringIO()
    with contextlib.redirect_stdout(quiet):
        from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler  # lazy: DeepSpeed paths only
        from deepspeed.runtime.zero.config import ZeroStageEnum  # lazy: DeepSpeed paths only
        from deepspeed.utils.tensor_fragment import fragment_address  # lazy: DeepSpeed paths only
    for handler in logging.getLogger("DeepSpeed").handlers:  # made during the import: bound to `quiet`
        if isinstance(handler, logging.StreamHandler) and handler.stream is quiet:
            handler.setStream(sys.stdout)

    return [ZeroStageEnum, LossScaler, DynamicLossScaler, fragment_address]


def allowed(deepspeed: bool | None = None) -> list:
    """The allow-list: Megatron-LM's arguments (argparse.Namespace and the records it holds), numpy RNG state and
    dtypes, and with `deepspeed` (default: when DeepSpeed is already imported) DeepSpeed's records."""
    if deepspeed is None:  # a file naming DeepSpeed's records makes load() import DeepSpeed and retry
        deepspeed = "deepspeed" in sys.modules
    return [argparse.Namespace, *megatron_lm_records(), *numpy_records(), *(_deepspeed_records() if deepspeed else [])]


def refusal(path: Path, error: BaseException) -> ToolkitError:
    """The error for a file torch.load could not (or would not) read."""
    text = str(error)
    unsafe = re.search(r"GLOBAL ([\w.]+)", text) or re.search(r"but got <class '([\w.]+)'>", text)
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
        if path.exists():  # a pipe, a device or a folder: opening it could block
            raise ToolkitError(f"{path} is not a regular file; replace it with the file the checkpoint was saved with")
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


def _dcp_classes() -> dict[tuple[str, str], object]:
    """What torch DCP's `.metadata` pickle names: its own dataclasses and enums (as DCPRecords), torch.Size, dtypes
    and layouts."""
    out: dict[tuple[str, str], object] = dict(DCP_CLASSES)
    out[("torch", "Size")] = torch.Size
    out[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    out[("pathlib", "PosixPath")] = PosixPath  # StorageMeta.checkpoint_id of a plain dcp.save: a path, no I/O
    out.update({("torch", n): getattr(torch, n) for n in dir(torch)
                if isinstance(getattr(torch, n, None), (torch.dtype, torch.layout, torch.memory_format))})
    return out


def load_dcp_metadata(path: Path):
    """A torch DCP `.metadata` file (a plain pickle), unpickled with only DCP's own record classes allowed: any other
    global is refused before anything is called."""
    path = Path(path)
    if not path.is_file():
        if path.exists():  # as load()
            raise ToolkitError(f"{path} is not a regular file; replace it with the file the checkpoint was saved with")
        raise ToolkitError(f"{path} is missing: the torch_dist checkpoint is incomplete (its save did not finish)")
    try:
        with open(path, "rb") as f:
            meta = DCPUnpickler(f, _dcp_classes()).load()
    except Exception as e:  # noqa: BLE001 - pickle raises many kinds of error on damaged input
        raise refusal(path, e if isinstance(e, pickle.UnpicklingError) else EOFError(str(e) or type(e).__name__)) \
            from None
    if not is_dcp_metadata(meta):
        raise ToolkitError(f"{path} holds a pickled {type(meta).__name__}, not torch DCP metadata (its "
                           "state_dict_metadata and storage_data); the checkpoint is damaged: re-copy it")
    return meta
