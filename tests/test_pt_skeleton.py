"""Files written before their bytes: a torch.save skeleton filled in place (toolkit/format/pt_write.py with
toolkit/checkpoint/pt_skeleton.py's slots for torch's tensors, how Megatron-LM legacy rank files are written in
bounded memory), and the safetensors writer's parallel file-to-file
copies (file_copy._run_copies). Tiny tensors; well under a second."""
from __future__ import annotations

import argparse
import errno
import os

import pytest
import torch

from toolkit.checkpoint.pt_skeleton import slots
from toolkit.format import file_copy as fc
from toolkit.format import pt_write
from toolkit.format.safetensors_stream import dtype_name


def test_a_skeleton_filled_in_place_loads_as_the_object_saved_whole(tmp_path):
    """Weights written in any order, a small tensor and views of one shared buffer (torch tensors, through
    pt_skeleton.slots) written by finish(): torch.load gives what torch.save of the filled object gives, views still
    sharing one storage; a weight never written, or of the wrong size, is refused."""
    weights = {"b": torch.randn(3, 5), "a": torch.randn(7).to(torch.bfloat16)}
    buffer = torch.arange(12, dtype=torch.float32)
    full = {"args": argparse.Namespace(tp=2), "model": {**weights, "x._extra_state": None},
            "optimizer": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": buffer[:4].view(2, 2)},
                                    1: {"exp_avg": buffer[4:]}}}}
    later = {k: pt_write.Tensor.empty(v.shape, dtype_name(v.dtype)) for k, v in weights.items()}
    obj, fills = slots({**full, "model": {**later, "x._extra_state": None}})
    assert len(fills) == 2  # the step's storage and the buffer's, once: its two views share it
    file = pt_write.Skeleton(tmp_path / "rank.pt", obj, list(later.values()), fills)
    for k in ("a", "b"):
        raw = weights[k].reshape(-1).view(torch.uint8).numpy()
        assert file.write(later[k], raw) == weights[k].nbytes
    file.finish()
    got = torch.load(tmp_path / "rank.pt", weights_only=False)
    assert got["args"] == full["args"] and got["model"]["x._extra_state"] is None
    for k, v in weights.items():
        assert got["model"][k].dtype == v.dtype and torch.equal(got["model"][k], v)
    state = got["optimizer"]["state"]
    assert torch.equal(state[0]["step"], torch.tensor(3.0))
    assert torch.equal(state[0]["exp_avg"], buffer[:4].view(2, 2)) and torch.equal(state[1]["exp_avg"], buffer[4:])
    assert state[0]["exp_avg"].untyped_storage().data_ptr() == state[1]["exp_avg"].untyped_storage().data_ptr()

    slot = pt_write.Tensor.empty((4,), "F32")
    half = pt_write.Skeleton(tmp_path / "half.pt", *slots({"w": slot, "v": torch.empty(2)})[:1], [slot])
    with pytest.raises(RuntimeError, match="1 tensors of .* were never written"):
        half.finish()
    with pytest.raises(RuntimeError, match="20 bytes for a"):
        pt_write.Skeleton(tmp_path / "shape.pt", {"w": slot}, [slot]).write(slot, torch.zeros(5).numpy())


def test_parallel_copies_write_every_range_and_raise_a_failure_after_all_finish(tmp_path, monkeypatch):
    """Ranges cut into many batches (a 64-byte batch size) on several threads give the same file as one copy; a
    failing range is raised (once every batch has finished: _run_copies waits for all)."""
    src = tmp_path / "src.bin"
    data = os.urandom(4096)
    src.write_bytes(data)
    monkeypatch.setattr(fc, "_COPY_CHUNK", 64)
    monkeypatch.setattr(fc, "COPY_THREADS", 3)
    ranges = [(1000, 300), (0, 1000), (3000, 1096), (1300, 1700)]
    fd = os.open(src, os.O_RDONLY)
    out = os.open(tmp_path / "out.bin", os.O_RDWR | os.O_CREAT)
    try:
        copies, at = [], 0
        for off, n in ranges:
            copies += [(fd, off + d, at + d, min(64, n - d)) for d in range(0, n, 64)]
            at += n
        assert sum(k for k, _ in fc._run_copies(out, copies)) == 4096
        assert os.pread(out, 4096, 0) == b"".join(data[o:o + n] for o, n in ranges)

        real, calls = fc.copy_range, []

        def failing(s, so, d, do, n):
            calls.append(so)
            if so == 640:
                raise OSError(errno.EIO, "Input/output error")
            return real(s, so, d, do, n)
        monkeypatch.setattr(fc, "copy_range", failing)
        with pytest.raises(OSError, match="Input/output"):
            fc._run_copies(out, copies)
        assert len(calls) > 1 and 640 in calls
    finally:
        os.close(fd)
        os.close(out)
