"""The parallel writer of universal checkpoints (toolkit/checkpoint/save_pool.py) and the safetensors writer's
no-copy path (Writer.write_pieces): every file written equals what was given, the tensors alive at once stay
within the byte budget, and a failure anywhere is raised, not lost. Tiny tensors; well under a second."""
from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from toolkit.checkpoint import save_pool
from toolkit.errors import ToolkitError
from toolkit.format import safetensors_stream as st


def test_pool_writes_every_file_equal_and_keeps_bytes_in_flight_under_budget(tmp_path, monkeypatch):
    alive, peak, lock = [0], [0], threading.Lock()
    real = save_pool.save_checked

    def counted(obj, file):
        real(obj, file)
        time.sleep(0.005)  # files take time: without the budget, four threads would hold four tensors at once
        with lock:
            alive[0] -= obj.numel() * obj.element_size()

    def maker(i, n):
        def make():
            t = torch.arange(n, dtype=torch.float32) + i
            with lock:
                alive[0] += t.numel() * t.element_size()
                peak[0] = max(peak[0], alive[0])
            return t
        return make

    monkeypatch.setattr(save_pool, "save_checked", counted)
    sizes = [100, 300, 50, 400, 250, 150] * 4
    with save_pool.SavePool(threads=4, budget=2000) as pool:
        for i, n in enumerate(sizes):
            pool.submit(tmp_path / f"{i}.pt", maker(i, n), 4 * n)
    assert 1600 <= peak[0] <= 2000
    for i, n in enumerate(sizes):
        assert torch.equal(torch.load(tmp_path / f"{i}.pt", weights_only=True), torch.arange(n, dtype=torch.float32) + i)


def test_pool_raises_the_first_failure(tmp_path):
    def bad():
        raise ToolkitError("made up failure")

    with pytest.raises(ToolkitError, match="made up failure"):
        with save_pool.SavePool(threads=2, budget=100) as pool:
            pool.submit(tmp_path / "a.pt", lambda: torch.zeros(3), 12)
            pool.submit(tmp_path / "b.pt", bad, 12)
            for i in range(20):  # later submissions see the failure (or close() raises it)
                pool.submit(tmp_path / f"c{i}.pt", lambda: torch.zeros(3), 12)


def test_save_checked_refuses_a_file_that_reads_back_different(tmp_path, monkeypatch):
    monkeypatch.setattr(save_pool.safe_load, "load_tensors", lambda f: torch.ones(3))
    with pytest.raises(ToolkitError, match="reads back different"):
        save_pool.save_checked(torch.zeros(3), tmp_path / "x.pt")


def test_write_pieces_writes_the_concatenation_and_refuses_wrong_bytes(tmp_path):
    full = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    flat = full.reshape(-1)
    w = st.Writer(tmp_path / "a.safetensors", {"x": ((3, 4), torch.float32), "y": ((2,), torch.float32)})
    with pytest.raises(ToolkitError, match="pieces to write hold"):
        w.write_pieces("y", [flat[:3]])
    with pytest.raises(ToolkitError, match="pieces to write hold"):
        w.write_pieces("y", [flat[:2].double()])
    w.write_pieces("x", [flat[:5], flat[5:7], flat[7:]])
    w.write("y", flat[:2])
    w.close()
    tensors, _ = st.load(tmp_path / "a.safetensors")
    assert torch.equal(tensors["x"], full) and torch.equal(tensors["y"], flat[:2])


def test_file_ranges_point_at_the_tensors_bytes_and_refuse_offsets_that_do_not_check_out(tmp_path):
    from toolkit.checkpoint import pt_ranges

    groups = [torch.arange(5000, dtype=torch.float32), torch.arange(3000, dtype=torch.float32) * -1]
    torch.save({"osd": {"flat": groups, "other": torch.ones(7)}}, tmp_path / "o.pt")
    mapped = torch.load(tmp_path / "o.pt", weights_only=True, mmap=True)["osd"]["flat"]
    files = pt_ranges.optimizer_ranges(tmp_path / "o.pt", mapped, "flat", "osd")
    pieces = [mapped[0][4000:], mapped[1][:10]]
    got = pt_ranges.ranges_of(pieces, [files])
    assert got is not None
    data = b"".join(os.pread(fd, n, at) for fd, at, n in got)
    assert data == torch.cat(pieces).numpy().tobytes()
    assert pt_ranges.ranges_of([torch.zeros(3)], [files]) is None  # not a view of the file: no range
    files.close()
    meta = torch.load(tmp_path / "o.pt", weights_only=True, map_location="meta")["osd"]["flat"]
    meta[1].untyped_storage()._checkpoint_offset += 4  # a wrong offset: its bytes are not the tensor's
    wrong = pt_ranges.FileRanges(tmp_path / "o.pt", mapped, list(meta))
    assert wrong.fd is None and pt_ranges.ranges_of(pieces, [wrong]) is None
