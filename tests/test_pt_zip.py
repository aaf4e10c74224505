"""The torch-free reader of torch.save files (toolkit/format/pt_zip.py): where each tensor's bytes lie, as torch.load
reads them; an allow-list that never goes past torch's weights-only one and the toolkit's records; and every file
it does not take refused before anything in it is called (the full path, torch's loader, then reads or refuses it).
Files come from torch.save itself, and the DCP `.metadata` from torch's own dcp.save."""
from __future__ import annotations

import argparse
import collections
import io
import os
import pickle
import subprocess
import sys
import zipfile

import pytest
import torch
from conftest import REPO
from test_dcp_metadata import _fields

from toolkit.format import pt_zip, safe_load


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def test_tensor_refs_give_the_bytes_torch_load_reads(tmp_path):
    """Every dtype, views into a shared storage (offset and length), a transposed view (no span: not row-major),
    and the plain objects around them (Megatron-LM's args with a torch dtype, BytesIO _extra_state)."""
    base = torch.arange(60, dtype=torch.bfloat16).reshape(6, 10)
    tensors = {"bf16": base, "rows": base[2:4], "col": base[:, 3], "t": base.t(),
               "f32": torch.randn(3, 5), "f16": torch.randn(7).half(), "i64": torch.arange(9), "b": torch.ones(4) > 0,
               "u8": torch.arange(5, dtype=torch.uint8), "empty": torch.zeros(0, 4), "scalar": torch.tensor(3.0)}
    obj = {"args": argparse.Namespace(tp=2, params_dtype=torch.bfloat16), "iteration": 7,
           "model": collections.OrderedDict(**tensors, **{"x._extra_state": io.BytesIO(b"te")})}
    torch.save(obj, tmp_path / "f.pt")
    got = pt_zip.load(tmp_path / "f.pt")
    assert got["iteration"] == 7 and got["args"].tp == 2 and got["args"].params_dtype == pt_zip.TorchName("bfloat16")
    assert got["model"]["x._extra_state"].getvalue() == b"te"
    raw = (tmp_path / "f.pt").read_bytes()
    names = {torch.bfloat16: "BF16", torch.float32: "F32", torch.float16: "F16", torch.int64: "I64",
             torch.bool: "BOOL", torch.uint8: "U8"}
    for name, want in tensors.items():
        ref = got["model"][name]
        assert (ref.dtype, ref.shape, ref.nbytes) == (names[want.dtype], tuple(want.shape), want.nbytes), name
        span = ref.span()
        if name in ("t", "col"):
            assert span is None, name  # strided: its bytes are not one range
            continue
        at, n = span
        assert raw[at:at + n] == _bytes(want), name


def test_an_item_inside_a_larger_file_is_read_at_its_offsets(tmp_path):
    """A torch DCP item: a torch.save written through a file object after other bytes."""
    t = torch.randn(4, 8).bfloat16()
    with open(tmp_path / "items", "wb") as f:
        f.write(b"\x00" * 1001)
        start = f.tell()
        torch.save(t, f)
        end = f.tell()
        f.write(b"\xff" * 99)
    ref = pt_zip.load(tmp_path / "items", start, end - start)
    at, n = ref.span()
    assert (tmp_path / "items").read_bytes()[at:at + n] == _bytes(t)
    with pytest.raises(pt_zip.NotReadHere, match="outside the file"):
        pt_zip.load(tmp_path / "items", start, 10**9)


def test_the_allow_list_never_goes_past_torchs_weights_only_one():
    """Each global this reader takes is allowed by torch.load(weights_only=True) itself or named in the toolkit's
    allow-list for it (safe_load.allowed); each one of `.metadata` by the toolkit's DCP loader."""
    from torch._weights_only_unpickler import _get_allowed_globals  # torch's own list, for comparison only

    torchs = set(_get_allowed_globals())
    ours = {(r[1] if isinstance(r, tuple) else f"{r.__module__}.{r.__qualname__}") for r in safe_load.allowed(False)}
    assert sorted(set(pt_zip.GLOBALS) - torchs - ours) == []
    assert sorted(set(pt_zip.DCP_GLOBALS) - set(safe_load._dcp_classes())) == []


@pytest.mark.parametrize("make", ["planted", "compressed", "legacy_format", "not_a_zip", "big_endian",
                                  "storage_size", "past_storage"])
def test_files_it_does_not_take_are_refused_before_anything_runs(tmp_path, make):
    f, marker = tmp_path / "f.pt", tmp_path / "pwned"
    t = torch.arange(16, dtype=torch.float32)
    if make == "planted":
        torch.save({"w": t, "x": _Payload(marker)}, f)
    elif make == "legacy_format":
        torch.save({"w": t}, f, _use_new_zipfile_serialization=False)
    elif make == "not_a_zip":
        f.write_bytes(b"PK\x03\x04 not really")
    else:
        torch.save({"w": t}, f)
        with zipfile.ZipFile(f) as z:
            records = {i.filename: z.read(i) for i in z.infolist()}
        pkl = next(n for n in records if n.endswith("/data.pkl"))
        if make == "big_endian":
            records[pkl.replace("data.pkl", "byteorder")] = b"big"
        elif make == "storage_size":  # the pickle says 16 floats, the record holds 8
            key = next(n for n in records if "/data/" in n)
            records[key] = records[key][:32]
        elif make == "past_storage":  # a tensor of 17 elements in a storage of 16
            assert records[pkl].count(b"K\x10\x85") == 1  # the size (16,): BININT1 16, TUPLE1
            records[pkl] = records[pkl].replace(b"K\x10\x85", b"K\x11\x85")
        with zipfile.ZipFile(f, "w", zipfile.ZIP_DEFLATED if make == "compressed" else zipfile.ZIP_STORED) as z:
            for name, data in records.items():
                z.writestr(name, data)
    with pytest.raises(pt_zip.NotReadHere):
        pt_zip.load(f)
    assert not marker.exists()


def test_a_tensor_past_its_storage_or_with_hooks_is_refused():
    storage = pt_zip.Storage("F32", 16, 0, 64)
    assert pt_zip._rebuild_tensor_v2(storage, 4, (3, 4), (4, 1), False, collections.OrderedDict()).span() == (16, 48)
    for args in [(storage, 5, (3, 4), (4, 1)), (storage, 0, (17,), (1,)), (storage, -1, (2,), (1,)),
                 (storage, 0, (2,), (1,), True), (storage, 0, (2,), (1,), False, {"h": 1}), ("storage", 0, (2,), (1,))]:
        with pytest.raises(pickle.UnpicklingError):
            pt_zip._rebuild_tensor_v2(*args)


def test_dcp_metadata_reads_as_the_torch_loader_reads_it_without_torch(tmp_path):
    """torch's own dcp.save: the same fields as safe_load's reader (sizes as tuples, dtypes by name), in a fresh
    interpreter that never imports torch; a planted global is refused before it is called."""
    import torch.distributed.checkpoint as dcp  # torch's own writer, for the fixture only

    dcp.save({"w": torch.arange(12, dtype=torch.bfloat16).reshape(3, 4), "b": torch.ones(5),
              "extra": {"note": b"\x00\x01"}}, checkpoint_id=str(tmp_path), no_dist=True)
    ours, torchs = pt_zip.load_dcp_metadata(tmp_path / ".metadata"), safe_load.load_dcp_metadata(tmp_path / ".metadata")

    def plain(m):
        got = _fields(m)
        got["tensors"] = {k: (s, str(d).removeprefix("torch."), c) for k, (s, d, c) in got["tensors"].items()}
        return got

    assert plain(ours) == plain(torchs)
    code = ("import sys; from toolkit.format.pt_zip import load_dcp_metadata as l; "
            f"m = l({str(tmp_path / '.metadata')!r}); print(len(m.state_dict_metadata), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert out.split() == [str(len(torchs.state_dict_metadata)), "False"]
    meta = pickle.loads((tmp_path / ".metadata").read_bytes())
    meta.planner_data = {"evil": _Payload(tmp_path / "pwned")}
    (tmp_path / ".metadata").write_bytes(pickle.dumps(meta))
    with pytest.raises(pt_zip.NotReadHere, match="posix.system"):
        pt_zip.load_dcp_metadata(tmp_path / ".metadata")
    assert not (tmp_path / "pwned").exists()


def _zip_of(path, pkl: bytes) -> None:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("f/data.pkl", pkl)
        z.writestr("f/byteorder", b"little")


@pytest.mark.parametrize("target", ["argparse\nNamespace", "torch\nbfloat16", "torch._utils\n_rebuild_tensor_v2"])
def test_a_pickle_cannot_set_the_state_of_an_allowed_class_or_function(tmp_path, target):
    """BUILD (set an object's attributes) on the allowed class argparse.Namespace itself, on a shared dtype stand-in
    or on the rebuild function is refused, and nothing of theirs changes; on an instance of Namespace it is how
    Megatron-LM's args load."""
    import argparse

    module, name = target.split("\n")
    before = dict(vars(pt_zip.GLOBALS[f"{module}.{name}"])) if hasattr(pt_zip.GLOBALS[f"{module}.{name}"],
                                                                         "__dict__") else None
    pkl = b"\x80\x02c" + target.encode() + b"\n}X\x03\x00\x00\x00fooK\x01sb."  # GLOBAL, {"foo": 1}, BUILD
    _zip_of(tmp_path / "f.pt", pkl)
    with pytest.raises(pt_zip.NotReadHere, match="BUILD of a"):
        pt_zip.load(tmp_path / "f.pt")
    obj = pt_zip.GLOBALS[f"{module}.{name}"]
    assert not hasattr(obj, "foo") and (before is None or dict(vars(obj)) == before)
    assert not hasattr(argparse.Namespace, "foo")
    (tmp_path / ".metadata").write_bytes(b"\x80\x02ctorch\nSize\n}X\x03\x00\x00\x00fooK\x01sb.")
    with pytest.raises(pt_zip.NotReadHere, match="BUILD of a"):
        pt_zip.load_dcp_metadata(tmp_path / ".metadata")
    _zip_of(tmp_path / "g.pt", b"\x80\x02cargparse\nNamespace\n)\x81}X\x03\x00\x00\x00fooK\x01sb.")  # an instance
    assert pt_zip.load(tmp_path / "g.pt").foo == 1
