"""torch DCP's `.metadata` pickle, read with only DCP's own records allowed, each as an inert stand-in
(safe_load.DCPRecord): what torch's own `dcp.save` writes reads back field for field as torch reads it, nothing of
torch.distributed.checkpoint is imported to read it, and any other global is refused before it is called."""
from __future__ import annotations

import os
import pickle
import subprocess
import sys

import pytest
import torch
from conftest import REPO

from toolkit.errors import ToolkitError
from toolkit.format.safe_load import load_dcp_metadata


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _fields(m) -> dict:
    """What the torch_dist reader uses of a Metadata, as plain values."""
    tensors = {fqn: (tuple(t.size), t.properties.dtype, [(tuple(c.offsets), tuple(c.sizes)) for c in t.chunks])
               for fqn, t in m.state_dict_metadata.items() if hasattr(t, "chunks")}
    where = sorted((i.fqn, None if i.offset is None else tuple(i.offset), i.index, s.relative_path, s.offset,
                    s.length, getattr(s, "transform_descriptors", None)) for i, s in m.storage_data.items())
    items = sorted(k for k, t in m.state_dict_metadata.items() if not hasattr(t, "chunks"))
    return {"tensors": tensors, "bytes": items, "where": where}


def test_dcp_save_reads_back_as_torch_reads_it_without_importing_dcp(tmp_path):
    """A `.metadata` written by torch's own dcp.save (tensors of two dtypes, a bytes item) gives the same fields
    through the stand-ins as through torch's classes; a fresh interpreter reading it never imports
    torch.distributed.checkpoint."""
    import torch.distributed.checkpoint as dcp  # torch's own writer, for the fixture only

    state = {"w": torch.arange(12, dtype=torch.bfloat16).reshape(3, 4), "b": torch.ones(5),
             "extra": {"note": b"\x00\x01"}}
    dcp.save(state, checkpoint_id=str(tmp_path), no_dist=True)
    with open(tmp_path / ".metadata", "rb") as f:
        real = pickle.load(f)  # torch's classes: the file is our fixture
    ours = load_dcp_metadata(tmp_path / ".metadata")
    assert _fields(ours) == _fields(real)
    assert _fields(ours)["tensors"]["w"][:2] == ((3, 4), torch.bfloat16)
    code = ("import sys; from toolkit.format.safe_load import load_dcp_metadata as l; "
            f"m = l({str(tmp_path / '.metadata')!r}); print(len(m.state_dict_metadata), "
            "'torch.distributed.checkpoint' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert out.split() == [str(len(real.state_dict_metadata)), "False"]


def test_dcp_metadata_unpickler_allows_only_dcp_records(tmp_path):
    """A `.metadata` naming any global outside DCP's records (here os.system) is refused before it is called; one
    whose record carries a state other than its fields too."""
    import torch.distributed.checkpoint.metadata as md  # torch's own records, for the fixture only

    good = md.Metadata(state_dict_metadata={"w": md.TensorStorageMetadata(
        md.TensorProperties(dtype=torch.bfloat16), torch.Size([2, 3]), [md.ChunkStorageMetadata(torch.Size([0, 0]),
                                                                                               torch.Size([2, 3]))])},
        storage_data={})  # as every save fills it (load_dcp_metadata refuses a Metadata without it)
    (tmp_path / "good").write_bytes(pickle.dumps(good))
    assert load_dcp_metadata(tmp_path / "good").state_dict_metadata["w"].properties.dtype == torch.bfloat16
    good.planner_data = _Payload(tmp_path / "pwned")
    (tmp_path / "bad").write_bytes(pickle.dumps(good))
    with pytest.raises(ToolkitError, match=r"holds a pickled posix\.system, .* refused rather than unpickled"):
        load_dcp_metadata(tmp_path / "bad")
    assert not (tmp_path / "pwned").exists()
    odd = md.Metadata(state_dict_metadata={}, storage_data={})
    odd.__dict__["__class__"] = "not a field"
    (tmp_path / "odd").write_bytes(pickle.dumps(odd))
    with pytest.raises(ToolkitError, match="Metadata holds a state that is not its fields"):
        load_dcp_metadata(tmp_path / "odd")
