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


def test_save_ranges_fills_a_torch_save_file_file_to_file_and_refuses_wrong_bytes(tmp_path):
    """A universal-checkpoint file filled in the kernel from byte ranges of memory-mapped rank files (pt_ranges):
    torch.load gives the concatenation of the pieces, as a bare tensor (ZeRO-3) and as {"cat_dim", "param"} of the
    parameter's shape (ZeRO-1/2); ranges that are not the pieces' own bytes are caught by the read-back."""
    from toolkit.checkpoint.pt_ranges import FileRanges, ranges_of
    from toolkit.format import safe_load

    torch.save({"a": torch.arange(10, dtype=torch.float32), "b": torch.arange(100, 112, dtype=torch.float32)},
               tmp_path / "rank.pt")
    mapped = safe_load.load(tmp_path / "rank.pt", mmap=True, deepspeed=True)
    meta = safe_load.load(tmp_path / "rank.pt", deepspeed=True, map_location="meta")
    ranges = FileRanges(tmp_path / "rank.pt", [mapped["a"], mapped["b"]], [meta["a"], meta["b"]])
    pieces = [mapped["a"][6:], mapped["b"][:2]]
    where = ranges_of(pieces, [ranges])
    assert where is not None and [n for _, _, n in where] == [16, 8]
    with save_pool.SavePool(threads=2) as pool:
        pool.submit_ranges(tmp_path / "flat.pt", lambda: torch.empty(6), where, pieces)
        pool.submit_ranges(tmp_path / "shaped.pt", lambda: {"cat_dim": 0, "param": torch.empty(2, 3)}, where, pieces)
    want = torch.tensor([6.0, 7, 8, 9, 100, 101])
    assert torch.equal(torch.load(tmp_path / "flat.pt", weights_only=True), want)
    shaped = torch.load(tmp_path / "shaped.pt", weights_only=True)
    assert shaped["cat_dim"] == 0 and torch.equal(shaped["param"], want.view(2, 3))
    wrong = [(fd, at + 4, n) for fd, at, n in where]  # each range one element off
    with pytest.raises(ToolkitError, match="reads back different from what was copied"):
        save_pool.save_ranges(torch.empty(6), tmp_path / "wrong.pt", wrong, pieces)
    ranges.close()


def test_save_ranges_reuses_the_bytes_around_the_tensor_and_writes_what_torch_save_would(tmp_path, monkeypatch):
    """After the first file of a (name, template), save_ranges writes the kept bytes around the copied tensor: no
    torch.save. Each file is byte for byte the one written without that reuse; another template or name is saved on
    its own; a template it cannot describe (a list) is never reused."""
    from toolkit.checkpoint.pt_ranges import FileRanges, ranges_of
    from toolkit.format import safe_load

    torch.save({"a": torch.arange(40, dtype=torch.float32)}, tmp_path / "rank.pt")
    mapped = safe_load.load(tmp_path / "rank.pt", mmap=True, deepspeed=True)
    meta = safe_load.load(tmp_path / "rank.pt", deepspeed=True, map_location="meta")
    source = FileRanges(tmp_path / "rank.pt", [mapped["a"]], [meta["a"]])
    monkeypatch.setattr(save_pool, "_AROUND", {})
    saves, real_save = [], torch.save
    monkeypatch.setattr(torch, "save", lambda obj, f, *a, **k: (saves.append(str(f)), real_save(obj, f, *a, **k)))
    jobs = [("one/fp32.pt", lambda: torch.empty(6), 0), ("two/fp32.pt", lambda: torch.empty(6), 10),
            ("three/fp32.pt", lambda: torch.empty(6), 20), ("one/exp_avg.pt", lambda: torch.empty(6), 30),
            ("four/fp32.pt", lambda: torch.empty(5), 30),
            ("one/step.pt", lambda: {"param": torch.empty(6), "extra": [1]}, 0),
            ("two/step.pt", lambda: {"param": torch.empty(6), "extra": [1]}, 0)]
    for name, template, start in jobs:
        (tmp_path / "reused" / name).parent.mkdir(parents=True, exist_ok=True)
        n = template()["param"].numel() if isinstance(template(), dict) else template().numel()
        pieces = [mapped["a"][start:start + n]]
        save_pool.save_ranges(template(), tmp_path / "reused" / name, ranges_of(pieces, [source]), pieces)
    assert [s.split("reused/")[1] for s in saves] == ["one/fp32.pt", "one/exp_avg.pt", "four/fp32.pt",
                                                      "one/step.pt", "two/step.pt"]
    monkeypatch.setattr(save_pool, "_signature", lambda obj: None)
    for name, template, start in jobs:
        (tmp_path / "alone" / name).parent.mkdir(parents=True, exist_ok=True)
        n = template()["param"].numel() if isinstance(template(), dict) else template().numel()
        pieces = [mapped["a"][start:start + n]]
        save_pool.save_ranges(template(), tmp_path / "alone" / name, ranges_of(pieces, [source]), pieces)
        assert (tmp_path / "reused" / name).read_bytes() == (tmp_path / "alone" / name).read_bytes(), name
        back = torch.load(tmp_path / "reused" / name, weights_only=True)
        back = back["param"] if isinstance(back, dict) else back
        assert torch.equal(back, torch.arange(start, start + n, dtype=torch.float32)), name
    source.close()
