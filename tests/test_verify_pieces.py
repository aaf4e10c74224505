"""The verification hashes a weight stored in pieces (a Megatron side's TP shards, merged by the family's modules
table; a torch_dist tensor's chunks) from its files' byte ranges, without assembling it
(toolkit/checkpoint/verify_hash.py). Its record must be the assembled tensor's, for every rule (q/k/v, gate/up,
row- and column-parallel, the padded vocabulary) and every format; a flipped byte in a piece must fail it; and the
logit check must run the side that needs no merge."""
from __future__ import annotations

import os

import pytest
import torch
from test_convert_verify import _write_hf

from toolkit.checkpoint import verify
from toolkit.checkpoint.convert import convert
from toolkit.checkpoint.sources import open_source
from toolkit.checkpoint.verify_hash import Hashed, digest, hash_ranges, pieces
from toolkit.errors import ToolkitError
from toolkit.families.entries import iter_entries
from toolkit.families.rules import Replicated
from toolkit.format import row_gather


@pytest.fixture(scope="module")
def layouts(tmp_path_factory) -> dict:
    """A tiny bf16 Llama (vocabulary 500: padded at TP 2 and 4) in a Hugging Face folder, the toolkit's layout at
    TP2 x PP2 and TP4, torch_dist TP2 x PP2 and Megatron-LM's legacy files TP2 x PP2."""
    root = tmp_path_factory.mktemp("pieces")
    hf = root / "hf"
    _write_hf(hf, layers=2, hidden=64, ffn=128, heads=4, kv_heads=4, dtype=torch.bfloat16)
    quiet = dict(verify=False, progress=False, log=lambda *_: None)
    out = {"hf": hf, "tp2pp2": convert(hf, root / "tp2pp2", "megatron", tp=2, pp=2, **quiet),
           "tp4": convert(hf, root / "tp4", "megatron", tp=4, **quiet),
           "torch_dist": convert(hf, root / "td", "torch_dist", tp=2, pp=2, **quiet)}
    out["megatron_lm"] = convert(out["torch_dist"], root / "mlm", "megatron_lm", tp=2, pp=2, vocab_size=500, **quiet)
    return out


def pieces_hash_as_merges(src) -> set[str]:
    """Every weight of the source, hashed in place (hash_only) as the output side of the check, has the record of
    the same weight read and assembled (get) as the reference side: the check passes for all of them. Returns the
    names that were hashed in place."""
    names = [n for e in iter_entries(src.dims(), 1, 1) for n in e.hf_names]
    hashed = Hashed(None)
    reference, output = verify.side(src, None, hashed), verify.side(src, None, hashed, output=True)
    in_place = set()
    try:
        for name in names:
            reference.get([name])
            if output._hash_pieces(name):
                in_place.add(name)
            else:
                output.get([name])
            hashed.settle()
            reference.done()
    finally:
        hashed.close()
    assert hashed.proved == {(n, "weight") for n in names}
    return in_place


@pytest.mark.parametrize("layout", ["tp2pp2", "tp4", "torch_dist", "megatron_lm"])
def test_a_weight_hashed_in_its_files_has_the_assembled_weights_record(layouts, layout):
    src = open_source(layouts[layout], 500)
    try:
        in_place = pieces_hash_as_merges(src)
    finally:
        src.close()
    names = {n for e in iter_entries(src.dims(), 1, 1) for n in e.hf_names}
    # all of them, but for the TP copies of a Megatron layout's norms: those are compared by value, so merged
    assert in_place == {n for n in names if "norm" not in n or layout == "torch_dist"}, sorted(names - in_place)


def test_row_parallel_pieces_are_gathered_in_periods_and_a_flipped_byte_is_caught(layouts):
    """down_proj at TP4: one range per shard row, hashed by gathering whole periods (row_gather); the same digest as the
    merged tensor, and a byte flipped in one shard's file changes it."""
    src = open_source(layouts["tp4"], 500)
    try:
        side = verify.side(src, None)
        name = "model.layers.1.mlp.down_proj.weight"
        ranges = side._stored(name)[0]
        assert row_gather.periodic(*zip(*ranges)) is not None and len({fd for fd, _, _ in ranges}) == 4
        merged = side.get([name])[name]
        assert hash_ranges(ranges) == digest(merged)
        fd, at, n = ranges[-1]
        path = os.readlink(f"/proc/self/fd/{fd}")
        byte = os.pread(fd, 1, at + n - 1)
        with open(path, "r+b") as f:
            try:
                f.seek(at + n - 1)
                f.write(bytes([byte[0] ^ 1]))
                f.flush()
                assert hash_ranges(ranges) != digest(merged)
            finally:  # the module's checkpoint, as it was
                f.seek(at + n - 1)
                f.write(byte)
    finally:
        src.close()


@pytest.mark.parametrize("src, dst, to, runs", [
    ("hf", "tp2", ["megatron", 2], "source"), ("tp2pp2", "hf", ["hf", 1], "output"),
    ("torch_dist", "mlm", ["megatron_lm", 2], "source"), ("tp2pp2", "tp4", ["megatron", 4], "output")])
def test_the_logit_check_runs_the_side_that_needs_no_merge(layouts, tmp_path, monkeypatch, src, dst, to, runs):
    """A Hugging Face folder's weights are views of its files; a torch_dist tensor is one whole chunk or a few; a
    Megatron side's are merged from its TP shards. The forward runs the cheapest (the output on a tie); the other
    side is only hashed, and what is stored in pieces is hashed in place: no split parameter of it is merged."""
    merged = []
    real = verify._Megatron.get

    def counting(self, names):
        merged.extend(n for n in names if "norm" not in n)
        return real(self, names)

    monkeypatch.setattr(verify._Megatron, "get", counting)
    lines = []
    convert(layouts[src], tmp_path / dst, to[0], tp=to[1], vocab_size=500, progress=False, log=lines.append)
    assert any(f"it ran the {runs}'s weights" in line for line in lines), lines
    # a Megatron side that runs merges each of its weights once (2 layers of 7, the embeddings and the output
    # layer); one that is only hashed merges none
    assert len(merged) == (16 if src == "tp2pp2" and to[0] == "megatron" else 0), merged


def test_a_cast_conversion_hashes_the_cast_source(layouts, tmp_path):
    """With --dtype the source's bytes are not the output's: its weights are read and cast before they are
    hashed (not hashed in place), and the conversion still verifies."""
    lines = []
    convert(layouts["tp2pp2"], tmp_path / "fp32", "hf", dtype="fp32", progress=False, log=lines.append)
    assert any("bit-identical in the cast source and the output" in line for line in lines), lines
    with pytest.raises(ToolkitError, match="must be cast before it is hashed"):
        Hashed(torch.float32).check_ranges("w", [], (1,), torch.bfloat16, output=False)


def test_ranges_hash_as_their_bytes_joined_mapped_or_read_and_a_truncated_file_is_one_line(tmp_path, monkeypatch):
    """hash_ranges is the digest of the ranges' bytes joined, in order, across files, from maps or (where a file
    cannot be mapped) from positioned reads; a file cut short since its ranges were planned is one line."""
    from xxhash import xxh3_128

    data = [os.urandom(5000), os.urandom(3000)]
    fds = []
    for i, d in enumerate(data):
        (tmp_path / f"f{i}").write_bytes(d)
        fds.append(os.open(tmp_path / f"f{i}", os.O_RDONLY))
    try:
        ranges = [(fds[1], 10, 100), (fds[0], 4096, 900), (fds[1], 2000, 1000), (fds[0], 0, 7)]
        want = xxh3_128(data[1][10:110] + data[0][4096:4996] + data[1][2000:3000] + data[0][:7]).hexdigest()
        assert hash_ranges(ranges) == want

        def refuse(*args, **kwargs):
            raise OSError("no maps here")

        with monkeypatch.context() as m:
            m.setattr(row_gather.mmap, "mmap", refuse)
            assert hash_ranges(ranges) == want
        os.truncate(tmp_path / "f1", 2500)
        with pytest.raises(ToolkitError, match="a file was truncated while it was checked; nothing was written"):
            hash_ranges(ranges)
    finally:
        for fd in fds:
            os.close(fd)


def test_what_cannot_be_hashed_in_place_is_left_to_the_sides_own_read(layouts):
    """pieces() declines (None), so the side reads and merges the weight itself, naming any problem in its own
    line: a tensor the file does not hold, and TP copies of a norm (their merge compares them by value)."""
    src = open_source(layouts["tp4"], 500)
    try:
        inputs = [src.shard_input(0, t, "chunk0.decoder.final_layernorm.weight") for t in range(4)]
        assert pieces(inputs, Replicated().merge) is None
        assert pieces([(inputs[0][0], "chunk0.no.such.tensor")], list) is None
    finally:
        src.close()
