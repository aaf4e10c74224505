"""File-to-file copies for `toolkit convert`: the output tensors whose bytes are whole byte ranges of the source
files (replicated tensors, dim-0 splits and merges of row-major tensors, q/k/v and gate/up blocks, tensors a
relayout only renames or moves) are copied with os.copy_file_range (safetensors_stream.Writer.write_ranges),
never read into this process.

Which bytes go where is not worked out by hand per rule: the conversion's own rules compute it. Each source tensor
is stood in for by a small int64 "address" array (numpy: planning needs no torch, toolkit/checkpoint/copy_only.py)
of the same rows, whose every element names one block of the
real tensor's bytes (a row, or 1/B of a row where B is the lowest common multiple of the TP sizes, so column splits
stay exact). The source's own merge (Megatron shards -> Hugging Face tensors) and the target's own split (the same
target.writes the streaming path calls) run on the addresses; each output piece's addresses, read in row-major
order, then list the source byte ranges that make it up. Padding rows that a rule creates (zeros) stay 0. The TP
copies of a replicated tensor (a norm) are compared byte for byte first: equal, they get the same addresses, so the
rule's own check that they agree passes; different, the rule refuses them, as it does their values. Where an
address array cannot go (a shape the block does not divide), or where the ranges would be tiny (row-parallel
splits leave one range per row, MIN_RANGE; the torch-free path takes them anyway), the parameter takes the
streaming path instead.

Verification does not use the ranges planned here: each side's records come from that side's own files. It uses the
same address arithmetic (addresses, ranges_of) to hash a weight stored in pieces where it lies, running the side's
own merge (a Megatron side's through the family's modules table) in the direction of reading
(toolkit/checkpoint/verify_hash.py pieces); tests check those records against the merged tensors'.
"""
from __future__ import annotations

import math
import os
import threading

import numpy as np

from toolkit.errors import ToolkitError
from toolkit.families.rules import Replicated, views
from toolkit.format.safetensors_stream import dtype_name

ENABLED = os.environ.get("TOOLKIT_NO_COPY_RANGE", "") in ("", "0")
"""TOOLKIT_NO_COPY_RANGE=1 sends every byte through the streaming path (for comparing the two)."""
MIN_RANGE = 512
"""Below this average range size (bytes) a parameter takes the streaming path (a syscall per tiny range). Rows of
row-parallel shards (1-6 KiB at 1.1B) are above it: copying them one range per row took less CPU time than the
streaming path here (2.5 vs 5 s of system time for HF -> TP2 x PP2 at 1.1B)."""
_COMPARE_BELOW = 64 * 2**20  # replicated copies up to this size are compared byte for byte (norms: KiB)
_SHIFT = 40  # address = (input index + 1) << _SHIFT | block index; 0 is a padding block
_PLANNING = threading.local()


def addressing() -> bool:
    """True while plan() runs a target's writes() on address tensors: a target that casts what it writes (torch_dist:
    the optimizer state to fp32) must not cast them (plan() itself refuses a parameter whose declared dtype is not
    the source's)."""
    return getattr(_PLANNING, "on", False)


def plan(source, target, entry, field: str, cast, weight: str = "weight", min_range: int | None = None):
    """[(writer, key, ranges)] that write this parameter's output tensors by copying source byte ranges, or None
    when it must be read and written through memory. `cast`: the weights' target dtype (torch's or a safetensors
    name), None to keep the source's. `min_range`: see MIN_RANGE (its default)."""
    if not ENABLED or not getattr(target, "raw_bytes", False):
        return None
    spans = source.spans(entry.hf_names, field)
    if spans is None:
        return None
    inputs, merge = spans
    dtypes = {r.dtype_name(k) for r, k in inputs}
    if len(dtypes) != 1:
        return None
    dtype = dtypes.pop()
    if field == weight and cast is not None and dtype_name(cast) != dtype:
        return None  # a cast changes the bytes
    block = math.lcm(source.layout[0] if source.layout else 1, getattr(target, "layout", (1,))[0])
    stood_in = addresses(inputs, block)
    if stood_in is None:
        return None
    stand_ins, unit = stood_in
    if len(inputs) > 1 and isinstance(entry.rule, Replicated) and _same_bytes(inputs):
        stand_ins = [stand_ins[0]] * len(inputs)
    try:
        with views():
            _PLANNING.on = True
            pieces = target.writes(entry, field, merge(stand_ins))
    except ToolkitError:  # a rule that compares values (replicated copies must agree): the streaming path checks it
        return None
    finally:
        _PLANNING.on = False
    if pieces is None:  # the target takes this field through memory (megatron_lm_write: the optimizer's buffers)
        return None
    out, total, count = [], 0, 0
    for writer, key, piece in pieces:
        if piece is None:  # a write of the target's own, in order with the others (megatron_lm_write: a stage's end)
            out.append((writer, key, piece))
            continue
        _, declared_dtype, size = writer.declared(key)
        ranges = ranges_of(piece, inputs, unit)
        if dtype_name(declared_dtype) != dtype or sum(n for _, _, n in ranges) != size:
            return None
        out.append((writer, key, ranges))
        total, count = total + size, count + len(ranges)
    if count and total / count < (MIN_RANGE if min_range is None else min_range):
        return None
    return out


def addresses(inputs, block: int) -> tuple[list, int] | None:
    """An address array for each (reader, key) input (its blocks: a row split in `block`, or an element of a 1-D
    tensor) and the bytes of one block, or None where the inputs' shapes or block sizes do not allow it."""
    out, units = [], set()
    for i, (reader, key) in enumerate(inputs):
        shape = reader.shape(key)
        if len(shape) == 1:
            per_row = 1
        elif len(shape) == 2 and shape[1] % block == 0:
            per_row = block
        else:
            return None
        blocks = shape[0] * per_row
        if blocks == 0:
            return None
        units.add(reader.nbytes(key) // blocks)
        ids = np.arange(blocks, dtype=np.int64) + ((i + 1) << _SHIFT)
        out.append(ids.reshape(shape[0], per_row) if len(shape) == 2 else ids)
    return (out, units.pop()) if len(units) == 1 else None


def _same_bytes(inputs) -> bool:
    """Whether the (reader, key) tensors all hold the same bytes (small ones only: False above _COMPARE_BELOW)."""
    first = None
    for reader, key in inputs:
        fd, offset, n = reader.span(key)
        if n > _COMPARE_BELOW:
            return False
        data = os.pread(fd, n, offset)
        if len(data) != n or (first is not None and data != first):
            return False
        first = data if first is None else first
    return True


def ranges_of(piece, inputs, unit: int) -> list[tuple[int | None, int, int]]:
    """The source byte ranges (fd, offset, count; None for zeros) that an address array's blocks, in row-major
    order, make up, adjacent ones joined (also across inputs that lie back to back in one file). Vectorized: a
    row-parallel split is one range per row, hundreds of thousands at 1B."""
    ids = np.ascontiguousarray(piece).reshape(-1)
    if ids.size == 0:
        return []
    prev = np.concatenate([np.full(1, -2, dtype=ids.dtype), ids[:-1]])
    joined = ((ids == prev + 1) & (prev != 0)) | ((ids == 0) & (prev == 0))
    starts = np.flatnonzero(~joined)
    firsts = ids[starts]
    counts = np.diff(np.append(starts, ids.size)) * unit
    spans = [reader.span(key) for reader, key in inputs]
    which = firsts >> _SHIFT  # the input each range is from, 1-based; 0: zeros
    fds = np.array([-1] + [fd for fd, _, _ in spans], dtype=np.int64)[which]
    offsets = np.where(which == 0, 0, np.array([0] + [at for _, at, _ in spans], dtype=np.int64)[which]
                       + (firsts & ((1 << _SHIFT) - 1)) * unit)
    back_to_back = (fds[1:] == fds[:-1]) & ((fds[1:] == -1) | (offsets[1:] == offsets[:-1] + counts[:-1]))
    first = np.flatnonzero(np.concatenate([[True], ~back_to_back]))
    return [(None if fd < 0 else fd, at, n) for fd, at, n in
            zip(fds[first].tolist(), offsets[first].tolist(), np.add.reduceat(counts, first).tolist())]
