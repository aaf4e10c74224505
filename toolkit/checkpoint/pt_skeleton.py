"""torch.save files around tensors whose bytes come later, on the torch side.

slots(obj) hands an object with torch tensors (the optimizer state a Megatron-LM legacy rank file holds beside the
model) to the torch-free writer of torch.save files (toolkit/format/pt_write.py), which lays the file out and writes
those tensors' bytes when it is finished. bytes_around(template, file) gives the bytes torch.save itself writes
around one tensor's data (torch's skip_data: the data left as a hole), for the writer that copies a tensor's bytes
into a torch.save file of DeepSpeed's objects (save_pool.save_ranges, the universal checkpoint's files). torch.load
does not check the records' CRC-32, which skip_data leaves those of the empty records.
"""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from toolkit.format import pt_write, safe_load
from toolkit.format.safetensors_stream import dtype_name


def tensors(obj, path: tuple = ()) -> Iterator[tuple[tuple, torch.Tensor]]:
    """(path, tensor) of every tensor in nested dicts, lists and tuples, in pickling order."""
    if torch.is_tensor(obj):
        yield path, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from tensors(v, (*path, k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from tensors(v, (*path, i))


def bytes_around(template, file: Path) -> tuple[bytes, bytes, torch.Tensor | None]:
    """(the bytes torch.save writes before the data of `template`'s one tensor, those after it, that tensor as a
    map_location="meta" load gives it back; None when it holds not exactly one). `template` is saved under skip_data
    into `file` (a hole where the data goes: no memory, unlike an in-memory buffer), by its path: the zip's folder
    is then the file's name, as in a universal checkpoint's files. Its other objects may be any torch.save takes
    (DeepSpeed's records: what toolkit/format/pt_write.py does not write)."""
    with torch.serialization.skip_data():
        torch.save(template, file)
    found = [t for _, t in tensors(safe_load.load(file, deepspeed=False, map_location="meta"))]
    at = getattr(found[0].untyped_storage(), "_checkpoint_offset", None) if len(found) == 1 else None
    if not isinstance(at, int):
        return b"", b"", None
    with open(file, "rb") as f:
        head = f.read(at)
        f.seek(at + found[0].numel() * found[0].element_size())
        tail = f.read()
    return head, tail, found[0] if len(head) == at else None


def slots(obj) -> tuple[object, list]:
    """obj for pt_write (a torch.save file written without torch.save) with each torch tensor in it a pt_write.Tensor:
    the same view of a pt_write.Storage (tensors sharing a storage share it, as torch.save keeps them), and for each
    storage, (a tensor over all of it, a function giving its bytes) for pt_write.Skeleton to write at its finish
    (small tensors, memory-mapped optimizer buffers filled meanwhile). Dicts, lists and tuples are walked; other
    objects are left as they are."""
    made: dict[tuple[int, int], pt_write.Storage] = {}
    fills: list = []
    seen: dict[int, tuple] = {}  # id(tensor) -> (it, its pt_write.Tensor): one object listed twice stays one

    def convert(x):
        if torch.is_tensor(x) and id(x) in seen:
            return seen[id(x)][1]
        if torch.is_tensor(x):
            storage = x.untyped_storage()
            key = (storage.data_ptr(), storage.nbytes())
            if key not in made or not key[1]:
                made[key] = pt_write.Storage(dtype_name(x.dtype), storage.nbytes() // x.element_size())
                whole = pt_write.Tensor(made[key], 0, (made[key].numel,), (1,))
                fills.append((whole, lambda s=storage: torch.empty(0, dtype=torch.uint8).set_(s).numpy()))
            elif made[key].dtype != dtype_name(x.dtype):
                raise RuntimeError(f"internal: a storage viewed as {made[key].dtype} and {x.dtype}")
            seen[id(x)] = (x, pt_write.Tensor(made[key], x.storage_offset(), tuple(x.shape), tuple(x.stride())))
            return seen[id(x)][1]
        if isinstance(x, dict):
            return type(x)((k, convert(v)) for k, v in x.items())
        if isinstance(x, (list, tuple)):
            return type(x)(convert(v) for v in x)
        return x

    return convert(obj), fills
