"""`toolkit convert` copies the byte ranges a conversion leaves contiguous file to file (os.copy_file_range,
toolkit/checkpoint/byte_ranges.py). Every kind of conversion routed that way must write byte for byte what the
streaming path writes, also when the kernel refuses the copy (EXDEV, ENOSYS, no copy_file_range at all, or a
refusal halfway through) and the bytes go through a buffer instead; a real I/O error fails in one line with nothing
written; and the read-back hash catches a range copied from the wrong place."""
from __future__ import annotations

import ctypes
import errno
import io
import json
import os
import shutil
import zlib
from pathlib import Path

import pytest
import torch

from tiny_hf import write_llama
from toolkit.checkpoint import byte_ranges
from toolkit.checkpoint import verify as verify_mod
from toolkit.checkpoint.convert import convert
from toolkit.errors import ToolkitError
from toolkit.families.entries import iter_entries
from toolkit.format import file_copy as fc
from toolkit.format import manifest
from toolkit.format import row_gather
from toolkit.format import safetensors_stream as st
from toolkit.format.names import model_file, optim_file
from toolkit.format.pt_write import Skeleton

# (source, destination, options): HF -> Megatron (split), a relayout with optimizer state (merge + split, moves
# between pipeline stages), Megatron -> HF (merge), HF -> HF (whole tensors moved)
STEPS = {"hf->tp2pp2": ("hf", "tp2pp2", dict(to="megatron", tp=2, pp=2)),
         "tp2pp2+optim->tp4": ("tp2pp2_optim", "tp4", dict(to="megatron", tp=4)),
         "tp4->hf": ("tp4", "back", dict(to="hf")),
         "hf->hf": ("hf", "hf_copy", dict(to="hf")),
         "megatron_lm->hf": ("mlm", "back_mlm", dict(to="hf", vocab_size=500)),
         "hf->megatron_lm": ("hf", "mlm_copy", dict(to="megatron_lm", tp=2, pp=2)),
         "megatron_lm->megatron_lm": ("mlm", "mlm_tp1", dict(to="megatron_lm", tp=1, pp=2, vocab_size=500)),
         "torch_dist->hf": ("td", "td_hf", dict(to="hf", vocab_size=500)),
         "torch_dist->megatron_lm": ("td", "td_mlm", dict(to="megatron_lm", tp=2, pp=1, vocab_size=500))}
# (Megatron-LM legacy TP2 x PP2 rank files and a torch_dist TP2 x PP2 checkpoint, written by the toolkit in the
# fixture: the legacy weights' offsets come from a map_location="meta" load of the pickles, megatron_sources._RankFile;
# the torch_dist chunks' from one of each chunk's record, torch_dist.Reader.locate. Megatron-LM legacy outputs are
# written into their rank files' skeletons, pt_write.Skeleton.write_ranges.)


def _write_hf(folder: Path) -> None:
    write_llama(folder)


def _add_optimizer_state(tag_dir: Path, tp: int, pp: int) -> None:
    """exp_avg beside every weight, as the Megatron backend saves it, so the relayout copies optimizer files too
    (the same on every TP rank, as a replicated tensor's must be)."""
    for p in range(pp):
        for t in range(tp):
            model = st.load(model_file(tag_dir, t, p))[0]
            seeded = {k: torch.Generator().manual_seed(zlib.crc32(k.encode())) for k in model}
            st.save({f"{k}:exp_avg": torch.randn(v.shape, generator=seeded[k]) for k, v in model.items()},
                    optim_file(tag_dir, t, p), {"step": "0"})
    meta = json.loads((tag_dir / "toolkit_meta.json").read_text())  # listed, as a save lists every file it writes
    meta["files"] = manifest.complete(tag_dir, {})
    (tag_dir / "toolkit_meta.json").write_text(json.dumps(meta))


def _quiet(**kw):
    return dict(verify=False, progress=False, log=lambda *_: None, **kw)


@pytest.fixture(scope="module")
def ref(tmp_path_factory) -> Path:
    """The source checkpoints and what the streaming path (no copy_file_range) writes from them."""
    root = tmp_path_factory.mktemp("copy_range")
    _write_hf(root / "hf")
    enabled, byte_ranges.ENABLED = byte_ranges.ENABLED, False
    try:
        convert(root / "hf", root / "mlm", to="megatron_lm", tp=2, pp=2, **_quiet())
        convert(root / "hf", root / "td", to="torch_dist", tp=2, pp=2, **_quiet())
        for src, dst, opts in STEPS.values():
            convert(root / src, root / dst, **opts, **_quiet())
            if dst == "tp2pp2":
                shutil.copytree(root / dst, root / "tp2pp2_optim")
                _add_optimizer_state(root / "tp2pp2_optim" / "step_00000000", 2, 2)
    finally:
        byte_ranges.ENABLED = enabled
    return root


def _same_files(a: Path, b: Path) -> None:
    files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    for f in files:
        assert (a / f).read_bytes() == (b / f).read_bytes(), f"{f} differs from the streaming path's"


def _refuse(code: int):
    def refuse(*_args):
        raise OSError(code, os.strerror(code))
    return refuse


@pytest.mark.parametrize("kernel", ["copy_file_range", "EXDEV", "ENOSYS", "missing", "refused halfway",
                                    "pwritev from a map", "pwritev, short writes", "pwritev, no map"])
@pytest.mark.parametrize("step", list(STEPS))
def test_copied_ranges_write_what_the_streaming_path_writes(ref, tmp_path, monkeypatch, step, kernel):
    """The first five: every range by copy_file_range (or the buffer it falls back to); the last three: every
    tensor of more than one range gathered from a map of its sources (fc.GATHER_BELOW: whole rows into a buffer
    where they are periodic, else pwritev), also when the kernel writes less than asked each time, or when a
    source cannot be mapped (then range by range, as before)."""
    src, dst, opts = STEPS[step]
    real = os.copy_file_range
    gathered = []
    monkeypatch.setattr(fc, "GATHER_BELOW", 2**62 if kernel.startswith("pwritev") else 0)
    several = []  # the bytes of every tensor written from more than one range (merges, splits)
    for writer in (st.Writer, Skeleton):
        monkeypatch.setattr(writer, "write_ranges", lambda w, name, ranges, real=writer.write_ranges: (
            several.append(sum(n for fd, _, n in ranges if fd is not None))
            if sum(fd is not None for fd, _, _ in ranges) > 1 else None)
            or real(w, name, ranges))
    if kernel.startswith("pwritev"):
        real_gather = fc._gather
        monkeypatch.setattr(fc, "_gather", lambda dst, copies, *a: real_gather(dst, copies, *a) and
                            not gathered.append(sum(c[-1] for c in copies)))
    if kernel == "pwritev, short writes":  # at most 7 bytes of the first iovec a call: the rest is written after
        def short(fd, iov, count, at):
            base, length = (ctypes.c_uint64 * 2).from_address(iov)
            return os.pwrite(fd, ctypes.string_at(base, min(7, length)), at)
        monkeypatch.setattr(fc, "_pwritev", short)
        real_pwrite = os.pwrite  # and rows gathered into a buffer (row_gather) written 4 KiB a call
        monkeypatch.setattr(os, "pwrite", lambda fd, data, at: real_pwrite(fd, memoryview(data)[:4096], at))
    elif kernel == "pwritev, no map":
        def no_map(*_a, **_k):
            raise OSError(errno.ENODEV, os.strerror(errno.ENODEV))
        monkeypatch.setattr(row_gather.mmap, "mmap", no_map)
    if kernel in ("EXDEV", "ENOSYS"):
        monkeypatch.setattr(os, "copy_file_range", _refuse(getattr(errno, kernel)))
    elif kernel == "missing":
        monkeypatch.delattr(os, "copy_file_range")
    elif kernel == "refused halfway":  # a short copy first, then the kernel refuses: the rest goes through a buffer
        calls = []

        def halfway(src_fd, dst_fd, n, src_off, dst_off):
            calls.append(n)
            if len(calls) % 2 == 0:
                raise OSError(errno.EXDEV, "cross-device")
            return real(src_fd, dst_fd, max(1, n // 2), src_off, dst_off)
        monkeypatch.setattr(os, "copy_file_range", halfway)
    copied = []
    real_copy = fc.copy_range
    monkeypatch.setattr(fc, "copy_range", lambda *a: copied.append((a[-1], real_copy(*a))) or copied[-1][1])
    monkeypatch.setattr(byte_ranges, "MIN_RANGE", 0)  # every parameter the ranges can express goes file to file
    # the full path (copy=False): its sources find the ranges through torch's own loads (the torch-free path,
    # which reads the zips' headers itself, is tests/test_copy_only.py's)
    convert(ref / src, tmp_path / dst, **opts, **_quiet(), copy=False)
    _same_files(tmp_path / dst, ref / dst)
    total, kernel_bytes = sum(n for n, _ in copied) + sum(gathered), sum(k for _, k in copied) + sum(gathered)
    written = sum(p.stat().st_size for p in (tmp_path / dst).rglob("*") if p.suffix in (".safetensors", ".pt"))
    assert total > written / 2, f"only {total} of {written} bytes were copied as ranges"
    if kernel in ("pwritev from a map", "pwritev, short writes"):
        assert sum(gathered) == sum(several), f"only {sum(gathered)} of {sum(several)} bytes went by pwritev"
        assert several or step == "hf->hf"  # a move of whole tensors is one range each
    elif kernel == "pwritev, no map":
        assert not gathered and kernel_bytes == total
    if kernel == "copy_file_range" or kernel.startswith("pwritev"):
        assert kernel_bytes == total
    elif kernel == "refused halfway":
        assert 0 < kernel_bytes < total
    else:
        assert kernel_bytes == 0


def test_ranges_follow_the_rules(ref, tmp_path, monkeypatch):
    """TP2 x PP2 -> TP4: gate/up of a target rank are two ranges (one block each, from one source rank); a
    row-parallel shard is one range per row, here of 32 bytes, so at the default MIN_RANGE it takes the streaming
    path; the TP copies of a norm are compared byte for byte, and copied from rank 0 when they agree (else the
    streaming path refuses them)."""
    from toolkit.checkpoint.convert import MegatronTarget
    from toolkit.checkpoint.sources import open_source

    source = open_source(ref / "tp2pp2")
    target = MegatronTarget(tmp_path / "probe", source, 4, 1, 1, None, True)
    try:
        entries = {e.megatron_name: e for e in iter_entries(target.dims, 1, 1)}
        fc1 = entries["decoder.layers.0.mlp.linear_fc1.weight"]
        proj = entries["decoder.layers.0.self_attention.linear_proj.weight"]
        assert byte_ranges.plan(source, target, proj, "weight", None) is None  # 64 ranges of 32 bytes
        monkeypatch.setattr(byte_ranges, "MIN_RANGE", 0)
        assert [len(r) for _, _, r in byte_ranges.plan(source, target, fc1, "weight", None)] == [2, 2, 2, 2]
        assert [len(r) for _, _, r in byte_ranges.plan(source, target, proj, "weight", None)] == [64] * 4
        norm = entries["decoder.layers.0.input_layernorm.weight"]
        rank0 = source.spans(norm.hf_names, "weight")[0][0]
        fd, at, n = rank0[0].span(rank0[1])
        assert [r for _, _, r in byte_ranges.plan(source, target, norm, "weight", None)] == [[(fd, at, n)]] * 4
        monkeypatch.setattr(byte_ranges.os, "pread", lambda fd, n, at: bytes([fd % 251]) * n)  # the copies differ
        assert byte_ranges.plan(source, target, norm, "weight", None) is None
        assert byte_ranges.plan(source, target, fc1, "weight", torch.float32) is None  # a cast changes the bytes
    finally:
        for w in target.writers.values():
            w._f.close()
        source.close()


def test_read_back_catches_a_range_copied_from_the_wrong_place(ref, tmp_path, monkeypatch):
    """The source's hash comes from read(), the output's from its own reader: a wrong range fails verification."""
    monkeypatch.setattr(byte_ranges, "MIN_RANGE", 0)
    monkeypatch.setattr(verify_mod, "import_early", lambda *_: None)
    monkeypatch.setattr(verify_mod, "verify_logits", lambda *a: None)  # the logit check: test_convert_verify.py
    lines = []
    convert(ref / "tp2pp2", tmp_path / "good", "megatron", tp=4, progress=False, log=lines.append)
    assert any("read back bit-exactly" in line for line in lines), lines
    real_copy = fc.copy_range
    monkeypatch.setattr(fc, "copy_range", lambda s, off, d, doff, n: real_copy(s, off - 2, d, doff, n))
    with pytest.raises(ToolkitError, match="reads back different from what was written"):
        convert(ref / "tp2pp2", tmp_path / "bad", "megatron", tp=4, progress=False, log=lines.append)
    assert not (tmp_path / "bad").exists()


def test_an_io_error_in_the_copy_fails_in_one_line_and_writes_nothing(ref, tmp_path, monkeypatch):
    monkeypatch.setattr(byte_ranges, "MIN_RANGE", 0)
    monkeypatch.setattr(os, "copy_file_range", _refuse(errno.EIO))
    with pytest.raises(ToolkitError, match="Input/output error.*nothing was written"):
        convert(ref / "hf", tmp_path / "out", "megatron", tp=2, **_quiet())
    assert not (tmp_path / "out").exists() and not list(tmp_path.iterdir())


def test_small_ranges_from_a_source_truncated_after_it_was_opened_fail_in_one_line(tmp_path):
    """The pwritev path reads its sources through a map; a source cut short after it was opened would fault the
    process when its missing pages were touched. Its size is checked first: one line instead."""
    src = tmp_path / "src.bin"
    src.write_bytes(bytes(range(256)) * 16)  # 4 KiB
    writer = st.Writer(tmp_path / "out.safetensors", {"t": ((16, 64), torch.uint8)})
    with src.open("rb") as f:
        good = [(f.fileno(), 128 * i, 64) for i in range(16)]  # every other 64 bytes of the first 2 KiB
        writer.write_ranges("t", good)
        writer.close()
        assert st.load(tmp_path / "out.safetensors")[0]["t"].flatten().tolist() == \
            [b for i in range(16) for b in (bytes(range(256)) * 16)[128 * i:128 * i + 64]]
        os.truncate(src, 1024)
        late = st.Writer(tmp_path / "late.safetensors", {"t": ((16, 64), torch.uint8)})
        with pytest.raises(ToolkitError, match="truncated while converting"):
            late.write_ranges("t", good)
        late._f.close()


@pytest.mark.parametrize("kernel", ["copy_file_range", "EXDEV"])
@pytest.mark.parametrize("src", ["hf", "tp2pp2"])
def test_torch_dist_items_copied_file_to_file_hold_what_the_streaming_path_writes(ref, tmp_path, monkeypatch, src,
                                                                                  kernel):
    """--to torch_dist: each item of the .distcp whose bytes are source byte ranges is torch.save's bytes around the
    tensor with the tensor copied in. The metadata (every chunk) equals the streaming path's, every item loads as
    the same tensor, most bytes go file to file, and a kernel that refuses the copy sends them through a buffer."""
    import pickle

    def items(root: Path) -> tuple[dict, dict]:
        tag = next(root.glob("iter_*"))
        meta = pickle.loads((tag / ".metadata").read_bytes())
        data = {f.name: f.read_bytes() for f in tag.glob("*.distcp")}
        return meta.state_dict_metadata, {
            (i.fqn, tuple(i.offset or ())): torch.load(__import__("io").BytesIO(
                data[s.relative_path][s.offset:s.offset + s.length]), weights_only=True)
            for i, s in meta.storage_data.items()}

    opts = dict(to="torch_dist", tp=2, pp=2)
    enabled, byte_ranges.ENABLED = byte_ranges.ENABLED, False
    try:
        convert(ref / src, tmp_path / "streamed", **opts, **_quiet())
    finally:
        byte_ranges.ENABLED = enabled
    copied = []
    real_copy = fc.copy_range
    monkeypatch.setattr(fc, "copy_range", lambda *a: copied.append((a[-1], real_copy(*a))) or copied[-1][1])
    real_gather, gathered = fc._gather, []  # row-parallel shards of tp2pp2: small ranges, by pwritev from a map
    monkeypatch.setattr(fc, "_gather", lambda dst, copies, *a: real_gather(dst, copies, *a) and
                        not gathered.append(sum(c[-1] for c in copies)))
    if kernel == "EXDEV":
        monkeypatch.setattr(os, "copy_file_range", _refuse(errno.EXDEV))
    monkeypatch.setattr(byte_ranges, "MIN_RANGE", 0)
    convert(ref / src, tmp_path / "copied", **opts, **_quiet())
    (want_meta, want), (got_meta, got) = items(tmp_path / "streamed"), items(tmp_path / "copied")
    assert got_meta == want_meta
    assert got.keys() == want.keys()
    for key, tensor in want.items():
        if torch.is_tensor(tensor):
            assert got[key].dtype == tensor.dtype and torch.equal(got[key], tensor), key
    size = sum(f.stat().st_size for f in next((tmp_path / "copied").glob("iter_*")).glob("*.distcp"))
    ranges = sum(n for n, _ in copied) + sum(gathered)
    assert ranges > size / 2, f"only {ranges} of {size} bytes were ranges"
    assert gathered or src != "tp2pp2"  # its row-parallel shards go by pwritev
    assert sum(k for _, k in copied) == (sum(n for n, _ in copied) if kernel == "copy_file_range" else 0)


def test_torch_save_bytes_around_a_large_tensor_take_no_memory_and_leave_no_file(tmp_path):
    """The bytes torch.save writes around a tensor's data (a torch_dist item's) are laid out without the tensor
    (pt_write.item_around: 250 MiB here), in a process that does not import torch, and no file is made; torch.load
    reads a small one filled in."""
    import subprocess
    import sys

    code = ("import resource, sys; from pathlib import Path; "
            "from toolkit.checkpoint.torch_dist_write import _around; "
            "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss; "
            "head, tail = _around((1, 32000, 4096), 'BF16'); "
            "grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before; "
            "assert 0 < len(head) < 4096 and 0 < len(tail) < 4096, (len(head), len(tail)); "
            "assert 'torch' not in sys.modules; print(grew // 1024)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert int(proc.stdout.split()[-1]) < 32, f"RSS grew {proc.stdout.split()[-1]} MiB"
    assert list(tmp_path.iterdir()) == []
    from toolkit.checkpoint.torch_dist_write import _around

    head, tail = _around((2, 3), "F32")
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    assert torch.equal(torch.load(io.BytesIO(head + t.numpy().tobytes() + tail), weights_only=True), t)
