"""The torch-free writer of torch.save files (toolkit/format/pt_write.py): its pickle is byte for byte the one
torch.save writes for the same object, torch.load reads its files (memory-mapped or not, weights only), ZIP64 past
4 GiB, and a Skeleton's tensors come from byte ranges, from memory or from fills, each checked to come."""
from __future__ import annotations

import argparse
import io
import os
import zipfile

import pytest
import torch

from toolkit.checkpoint.pt_skeleton import slots
from toolkit.format import pt_write, pt_zip, safe_load


def _megatron_like(t, dtype):
    """What a Megatron-LM rank file holds: args with a torch dtype, the version, and a model with views that share a
    storage, a tensor listed twice, and _extra_state entries of None."""
    return {"args": argparse.Namespace(tensor_model_parallel_size=2, params_dtype=dtype, bf16=True, rotary_base=10000,
                                       virtual_pipeline_model_parallel_size=None, norm_epsilon=1e-5),
            "checkpoint_version": 3.0, "iteration": 7, "num_floating_point_operations_so_far": 0,
            "model": {"a.weight": t["w"], "a._extra_state": None, "b.weight": t["rows"], "c.weight": t["rest"],
                      "tied": t["w"], "norm": t["norm"]}}


def _torch_tensors():
    flat = torch.arange(40, dtype=torch.bfloat16)
    return {"w": torch.arange(24, dtype=torch.bfloat16).reshape(4, 6), "rows": flat[:16].view(4, 4),
            "rest": flat[16:].view(2, 12), "norm": torch.ones(6, dtype=torch.float32)}


def _file(tmp_path, name="model_optim_rng.pt"):
    """The torch-free writer's file of _megatron_like, filled, and the torch tensors it must hold."""
    real = _torch_tensors()
    obj, fills = slots(_megatron_like(real, torch.bfloat16))
    sk = pt_write.Skeleton(tmp_path / name, obj, [], fills)
    sk.finish()
    return sk, real


def test_the_pickle_is_the_one_torch_save_writes(tmp_path):
    sk, real = _file(tmp_path)
    torch.save(_megatron_like(real, torch.bfloat16), tmp_path / "ref.pt")
    with zipfile.ZipFile(tmp_path / "ref.pt") as a, zipfile.ZipFile(sk.path) as b:
        assert b.read("model_optim_rng/data.pkl") == a.read("ref/data.pkl")
        assert [n.split("/", 1)[1] for n in b.namelist()] == [n.split("/", 1)[1] for n in a.namelist()]
    # the same pickle without torch: args.params_dtype named by pt_write, the tensors as slots
    flat = pt_write.Storage("BF16", 40)
    slotted = {"w": pt_write.Tensor.empty((4, 6), "BF16"), "rows": pt_write.Tensor(flat, 0, (4, 4), (4, 1)),
               "rest": pt_write.Tensor(flat, 16, (2, 12), (12, 1)), "norm": pt_write.Tensor.empty((6,), "F32")}
    data, storages = pt_write.dumps(_megatron_like(slotted, pt_write.torch_dtype("BF16")))
    assert data == zipfile.ZipFile(tmp_path / "ref.pt").read("ref/data.pkl")
    assert [k for k, _ in storages] == ["0", "1", "2"]


@pytest.mark.parametrize("mmap", [False, True])
def test_torch_load_reads_it(tmp_path, mmap):
    sk, real = _file(tmp_path)
    got = safe_load.load(sk.path, mmap=mmap, deepspeed=False)
    assert got["args"].params_dtype is torch.bfloat16 and got["iteration"] == 7
    assert got["model"]["a._extra_state"] is None
    want = _megatron_like(real, None)["model"]
    assert all(torch.equal(got["model"][k], v) for k, v in want.items() if v is not None)
    assert got["model"]["tied"] is got["model"]["a.weight"]  # one object, as torch.save keeps it
    storage = got["model"]["b.weight"].untyped_storage().data_ptr()
    assert got["model"]["c.weight"].untyped_storage().data_ptr() == storage
    ref = pt_zip.load(sk.path)["model"]["a.weight"]  # and the torch-free reader finds the bytes where they were put
    at, n = ref.span()
    assert sk.path.read_bytes()[at:at + n] == real["w"].view(torch.uint8).numpy().tobytes() and at % pt_write.ALIGN == 0


def test_a_skeletons_tensors_come_from_ranges_memory_and_fills_and_each_must_come(tmp_path):
    src = tmp_path / "src.bin"
    src.write_bytes(bytes(range(256)) * 4)
    a, b = pt_write.Tensor.empty((8, 16), "U8"), pt_write.Tensor.empty((3,), "F32")
    small = pt_write.Tensor.empty((2,), "I64")
    fd = os.open(src, os.O_RDONLY)
    try:
        sk = pt_write.Skeleton(tmp_path / "f.pt", {"a": a, "b": b, "s": small}, [a, b],
                               [(small, lambda: torch.tensor([5, 6]).numpy())])
        assert sk.declared(a) == ((8, 16), "U8", 128)
        assert sk.write_ranges(a, [(fd, 100, 64), (None, 0, 64)]) == 128  # None: zeros
        with pytest.raises(RuntimeError, match="internal"):
            sk.write(b, torch.ones(4).numpy())  # 16 bytes for a 12-byte tensor
        sk.write(b, torch.tensor([1.0, 2.0, 3.0]).numpy())
        sk.finish()
    finally:
        os.close(fd)
    got = torch.load(tmp_path / "f.pt", weights_only=True)
    assert got["a"].flatten().tolist() == list(range(100, 164)) + [0] * 64
    assert got["b"].tolist() == [1.0, 2.0, 3.0] and got["s"].tolist() == [5, 6]
    sk = pt_write.Skeleton(tmp_path / "g.pt", {"a": a}, [a])
    with pytest.raises(RuntimeError, match="1 tensors of .* were never written"):
        sk.finish()


def test_zip64_past_4_gib(tmp_path):
    """A storage of 4 GiB + 1 KiB (a sparse file here): its record, offsets and the central directory take ZIP64's
    fields, and torch.load (memory-mapped) and Python's zipfile read it."""
    big = pt_write.Tensor.empty((2**32 + 1024,), "U8")
    after = pt_write.Tensor.empty((4,), "F32")  # a record past 4 GiB: its offset too
    f = pt_write.File(tmp_path / "big.pt", {"big": big, "after": after})
    assert f.size > 2**32
    fd = os.open(f.path, os.O_RDWR)
    try:
        os.pwrite(fd, b"\x07", f.offset(big) + 2**32 + 1000)
        os.pwrite(fd, torch.tensor([1.0, 2.0, 3.0, 4.0]).numpy().tobytes(), f.offset(after))
    finally:
        os.close(fd)
    with zipfile.ZipFile(f.path) as z:
        assert z.getinfo("big/data/0").file_size == 2**32 + 1024
    got = torch.load(f.path, weights_only=True, mmap=True)
    assert got["big"].shape == (2**32 + 1024,) and int(got["big"][2**32 + 1000]) == 7
    assert got["after"].tolist() == [1.0, 2.0, 3.0, 4.0]
    assert pt_zip.load(f.path)["after"].span()[0] == f.offset(after)


def test_torch_dist_files_pickle_as_torchs_own_classes_pickle(tmp_path):
    """What `--to torch_dist` writes without torch: `.metadata` loaded with torch DCP's own classes and pickled
    again gives the same bytes (the dataclasses are named and built as Python pickles them), and so do common.pt's
    pickle through torch.save and each `.distcp` item's, a standalone torch.save zip holding one tensor."""
    import pickle

    from tiny_hf import write_llama
    from toolkit.checkpoint.convert import convert

    write_llama(tmp_path / "hf")
    out = convert(tmp_path / "hf", tmp_path / "td", "torch_dist", tp=2, pp=2, verify=False, progress=False,
                  log=lambda *_: None)
    it = out / "iter_0000000"
    ours = (it / ".metadata").read_bytes()
    real = pickle.loads(ours)  # torch's classes: the file is this test's own
    assert type(real).__module__ == "torch.distributed.checkpoint.metadata"
    assert pickle.dumps(real, protocol=2) == ours
    common = torch.load(it / "common.pt", weights_only=False)
    torch.save(common, tmp_path / "common.pt")
    with zipfile.ZipFile(it / "common.pt") as a, zipfile.ZipFile(tmp_path / "common.pt") as b:
        assert a.read("common/data.pkl") == b.read("common/data.pkl")
    index, info = next((i, s) for i, s in real.storage_data.items() if i.fqn == "embedding.word_embeddings.weight")
    item = (it / info.relative_path).read_bytes()[info.offset:info.offset + info.length]
    tensor = torch.load(io.BytesIO(item), weights_only=True)
    buf = io.BytesIO()
    torch.save(tensor, buf)
    with zipfile.ZipFile(io.BytesIO(item)) as a, zipfile.ZipFile(buf) as b:
        assert a.read("archive/data.pkl") == b.read("archive/data.pkl")
        assert [n for n in a.namelist()] == [n for n in b.namelist()]


def test_meta_loads_find_every_storage_where_it_lies(tmp_path):
    """torch.load(map_location="meta") works the storages' offsets out from miniz's layout (data descriptors, "FB"
    padding) without reading the headers: every offset it gives is where the bytes are, also past 4 GiB."""
    sk, _ = _file(tmp_path)
    meta = safe_load.load(sk.path, deepspeed=False, map_location="meta")
    refs = pt_zip.load(sk.path)
    for name in ("a.weight", "b.weight", "c.weight", "norm"):
        assert meta["model"][name].untyped_storage()._checkpoint_offset == refs["model"][name].span()[0] - (
            refs["model"][name].storage_offset * pt_zip.ITEMSIZE[refs["model"][name].dtype]), name
    big = pt_write.Tensor.empty((2**32 + 1024,), "U8")
    files = [pt_write.Tensor.empty((4,), "F32") for _ in range(3)]
    f = pt_write.File(tmp_path / "big.pt", {"small": files[0], "big": big, "after": files[1], "last": files[2]})
    meta = torch.load(f.path, weights_only=True, map_location="meta")
    for name, t in (("small", files[0]), ("big", big), ("after", files[1]), ("last", files[2])):
        assert meta[name].untyped_storage()._checkpoint_offset == f.offset(t), name
