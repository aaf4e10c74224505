"""The manifest digests `toolkit convert` takes while it writes (safetensors_stream.Writer.track_hash, caught up on
a thread as the file grows) must equal what manifest.file_entry reads from the finished file, whatever order the
tensors were written in; and a Megatron source whose checksums are checked in the background while the conversion
reads it (convert._SourceCheck) must still be refused in its one line, with nothing written."""
from __future__ import annotations

import shutil

import pytest
import torch
from test_convert_copy_range import _write_hf

from toolkit.checkpoint.convert import convert
from toolkit.errors import ToolkitError
from toolkit.format import manifest
from toolkit.format import safetensors_stream as st


def test_digest_taken_while_writing_equals_the_finished_files(tmp_path):
    specs = {"a": ((3, 5), torch.bfloat16), "b": ((7,), torch.float32), "c": ((2, 2), torch.int64)}
    values = {k: torch.arange(torch.Size(s).numel()).reshape(s).to(d) for k, (s, d) in specs.items()}
    w = st.Writer(tmp_path / "x.safetensors", specs, {"format": "pt"})
    w.track_hash(manifest.DIGEST)
    w.catch_up()  # only the header so far
    w.write("b", values["b"])  # out of order: the hash waits for "a"
    w.catch_up()
    w.write("a", values["a"])
    w.catch_up()
    with pytest.raises(ToolkitError, match="not hashed to its end"):
        w.manifest_entry()
    w.write("c", values["c"])
    w.close()
    assert w.manifest_entry() == manifest.file_entry(tmp_path / "x.safetensors")


def test_megatron_output_manifest_and_a_damaged_source_checked_in_the_background(tmp_path):
    _write_hf(tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "mg", "megatron", tp=2, pp=2, verify=False, progress=False, log=lambda *_: 0)
    tag = tmp_path / "mg" / "step_00000000"
    assert manifest.verify(tag) == []  # the digests taken while writing match the files
    bad = tmp_path / "bad"
    shutil.copytree(tmp_path / "mg", bad)
    path = bad / "step_00000000" / "model_tp01_pp001.safetensors"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF  # a tensor byte, not the header: the source opens, only its checksum tells
    path.write_bytes(bytes(data))
    with pytest.raises(ToolkitError) as e:
        convert(bad, tmp_path / "out", "megatron", tp=4, verify=False, progress=False, log=lambda *_: 0)
    assert str(e.value) == (f"{bad / 'step_00000000'} is not a complete checkpoint: model_tp01_pp001.safetensors "
                            "does not match its xxh3_128 in the manifest (the file or the manifest changed after the "
                            "save)")
    assert not (tmp_path / "out").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["bad", "hf", "mg"]
