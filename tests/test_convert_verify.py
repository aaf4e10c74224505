"""`toolkit convert`'s default verification: memory that does not grow with the model, and a mapping mistake (q and
k swapped, gate and up swapped) caught by the logit check, with nothing written at DST."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys

import pytest
import torch
from conftest import REPO

from toolkit.checkpoint import verify as verify_mod
from toolkit.checkpoint.convert import convert
from toolkit.checkpoint.sources import open_source
from toolkit.checkpoint.verify import verify_logits
from toolkit.errors import ToolkitError
from toolkit.families import llama, qwen2
from toolkit.families.entries import iter_entries
from toolkit.families.registry import dims_from_hf
from toolkit.format import safetensors_stream as st


def _write_hf(folder, layers: int, hidden: int, ffn: int, heads: int, kv_heads: int, dtype=torch.float32,
              family: str = "llama") -> int:
    """A random Llama (or Qwen2: the same plus q/k/v biases) checkpoint; returns the bytes of one decoder layer."""
    arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[family]
    config = {"architectures": [arch], "model_type": family, "hidden_size": hidden,
              "intermediate_size": ffn, "num_hidden_layers": layers, "num_attention_heads": heads,
              "num_key_value_heads": kv_heads, "vocab_size": 500, "max_position_embeddings": 64,
              "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False, "hidden_act": "silu",
              "torch_dtype": str(dtype).replace("torch.", "")}
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    gen = torch.Generator().manual_seed(0)
    tensors = {n: torch.randn(s, generator=gen).to(dtype) * 0.05 + (1.0 if "norm" in n else 0.0)
               for e in iter_entries(dims_from_hf(config), 1, 1) for n, s in zip(e.hf_names, e.hf_shapes)}
    st.save(tensors, folder / "model.safetensors", {"format": "pt"})
    return sum(t.nbytes for n, t in tensors.items() if n.startswith("model.layers.0."))


_HWM = ("import re, sys, threading, time\nfrom toolkit.cli import main\npeak = [0]\n"
        "def anon():\n    return int(re.search(r'RssAnon:\\s+(\\d+)', open('/proc/self/status').read())[1])\n"
        "def sample():\n    while True:\n        peak[0] = max(peak[0], anon())\n        time.sleep(0.002)\n"
        "threading.Thread(target=sample, daemon=True).start()\nrc = main(sys.argv[1:])\n"
        "print('VmHWM', re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read())[1])\n"
        "print('RssAnon', max(peak[0], anon()))\nsys.exit(rc)")


def _peak_rss_mib(args: list[str], anon: bool = False) -> float:
    """`toolkit ARGS` in a fresh process; its peak resident memory as its kernel counts it (VmHWM, read at its end;
    not the parent's wait4 ru_maxrss, which also counts the parent's own memory at the time of the fork), or with
    anon=True its peak anonymous memory (RssAnon, sampled every 2 ms in the process: what memory-mapped file pages,
    which the kernel can drop, do not count in)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", _HWM, *args], cwd=REPO, env=env, capture_output=True, text=True)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "verified: transformers' LlamaForCausalLM gives the source's logits" in out, out[-2000:]
    return int(out.split("RssAnon " if anon else "VmHWM ")[1].split()[0]) / 1024


@pytest.mark.slow
@pytest.mark.parametrize("to", [["megatron", "--tp", "2"], ["megatron_lm", "--tp", "1", "--pp", "1"]],
                         ids=["megatron-tp2", "megatron_lm-one-file"])
def test_verification_memory_does_not_grow_with_layers(tmp_path, to):
    """Two models that differ only in layer count (2 vs 16, 11 MiB per fp32 layer) convert from HF with the default
    verification in fresh processes; their peak RSS differs by far less than the 14 extra layers (a whole-model load,
    as the check did before, would add them at least once). The same for Megatron-LM's legacy layout written as one
    rank file, a single pickle of the whole model (its writer once held the stage in memory: now pt_write), in
    anonymous memory: the read-back maps that file, whose pages count in its RSS."""
    peaks = {}
    for layers in (2, 16):
        layer_bytes = _write_hf(tmp_path / f"hf{layers}", layers, hidden=512, ffn=1376, heads=8, kv_heads=4)
        peaks[layers] = _peak_rss_mib(["convert", str(tmp_path / f"hf{layers}"), str(tmp_path / f"mg{layers}"),
                                       "--to", *to, "--quiet"], anon=to[0] == "megatron_lm")
    extra_layers_mib = 14 * layer_bytes / 2**20
    bound = 32
    assert extra_layers_mib > 4 * bound  # the bound would catch the layers being held, even once
    print(f"peak RSS {peaks} MiB; 14 extra layers are {extra_layers_mib:.0f} MiB")
    assert peaks[16] - peaks[2] < bound, (peaks, f"14 extra layers are {extra_layers_mib:.0f} MiB")


def _swapped(what: str, real):
    """A family's layer map with q and k (weights or biases), or gate and up, exchanged: the mistake the logit check
    must catch."""

    def layer(d):
        maps = real(d)
        for i, pm in enumerate(maps):
            names = list(pm.hf_names)
            if what == "qk" and pm.megatron_name.endswith("linear_qkv.weight"):
                names[0], names[1] = names[1], names[0]
            if what == "qk_bias" and pm.megatron_name.endswith("linear_qkv.bias"):
                names[0], names[1] = names[1], names[0]
            if what == "gate_up" and pm.megatron_name.endswith("linear_fc1.weight"):
                names[0], names[1] = names[1], names[0]
            maps[i] = dataclasses.replace(pm, hf_names=tuple(names))
        return maps

    return layer


@pytest.mark.parametrize("family, mistake", [(llama, "qk"), (llama, "gate_up"), (qwen2, "qk_bias")],
                         ids=["llama-qk", "llama-gate_up", "qwen2-qk_bias"])
def test_mapping_mistake_is_caught_by_default_verification(tmp_path, family, mistake):
    """HF -> Megatron (the mistake goes into the written files) and Megatron -> HF (the mistake goes into the
    folder): both round trips through the same wrong map would read back bit-exactly through the map, so only a read
    by the family's separate modules table can catch it. The default verification's logit check reads the Megatron
    side that way, and each of its tensors must hash as the other side's of that name: it names the first swapped
    tensor, and DST stays absent. Without the hashes the hidden states themselves disagree after the first layer."""
    hf = tmp_path / "hf"
    name = family.FAMILY.name  # q and k of one shape, so a swap is silent
    _write_hf(hf, layers=2, hidden=64, ffn=128, heads=4, kv_heads=4, family=name)
    good_mg = convert(hf, tmp_path / "good_mg", "megatron", tp=2, progress=False, log=lambda *_: None)
    real = family.FAMILY.layer
    swapped = {"qk": r"self_attn\.[qk]_proj\.weight", "gate_up": r"mlp\.(gate|up)_proj\.weight",
               "qk_bias": r"self_attn\.[qk]_proj\.(weight|bias)"}[mistake]
    object.__setattr__(family.FAMILY, "layer", _swapped(mistake, real))  # a frozen dataclass; restored below
    try:
        for src, dst, to in ((hf, tmp_path / "bad_mg", "megatron"), (good_mg, tmp_path / "bad_hf", "hf")):
            with pytest.raises(ToolkitError, match=rf"verification failed: model\.layers\.0\.{swapped} \(weight\) "
                                                   r"reads back different from the source's"):
                convert(src, dst, to, tp=2 if to == "megatron" else 1, progress=False, log=lambda *_: None)
            assert not dst.exists()
            assert sorted(p.name for p in tmp_path.iterdir()) == ["good_mg", "hf"]  # no scratch folder left
        # without the check the same conversion succeeds: nothing else in the pipeline notices the mistake
        unchecked = convert(hf, tmp_path / "unchecked", "megatron", tp=2, verify=False, progress=False,
                            log=lambda *_: None)
        # and the logit comparison alone (no digests to hash against) catches it too
        reference, output = open_source(hf), open_source(unchecked)
        try:
            with pytest.raises(ToolkitError, match=r"verification failed: after decoder layer 0 \(model.layers.0\)"):
                verify_logits(reference, output, torch.float32, hf, lambda *_: None)
        finally:
            reference.close()
            output.close()
    finally:
        object.__setattr__(family.FAMILY, "layer", real)


def test_verification_reads_the_output_once_and_proves_every_tensor(tmp_path, monkeypatch):
    """The bit-exact read-back of the weights is done on the logit check's own reads: each output tensor is read
    once (it was read twice before), the weights the copy path never read are read once from the source, and a
    tensor corrupted on disk after it was written still fails, naming it."""
    hf = tmp_path / "hf"
    _write_hf(hf, layers=2, hidden=64, ffn=128, heads=4, kv_heads=4)
    reads: dict[tuple[str, str], int] = {}
    real_get = st.Reader.get

    def counting(self, name):
        key = (str(self.path.relative_to(tmp_path)), name)
        reads[key] = reads.get(key, 0) + 1
        return real_get(self, name)

    monkeypatch.setattr(st.Reader, "get", counting)
    lines = []
    convert(hf, tmp_path / "mg", "megatron", tp=2, progress=False, log=lines.append)
    out = {k: n for k, n in reads.items() if k[0].startswith(".")}  # the scratch folder, renamed to mg after
    assert out and set(out.values()) == {1}, out
    assert any("all 21 tensors read back bit-exactly" in line for line in lines), lines

    # a byte of one written tensor flipped between the write and the check: the read-back names it
    def corrupt_then_verify(*args, _real=verify_mod.verify_output):
        folder = args[1]
        reader = st.Reader(next(folder.rglob("*.safetensors")))
        name = next(k for k in reader.keys() if "linear_fc2" in k)
        fd, offset, _ = reader.span(name)
        os.pwrite(fd_w := os.open(reader.path, os.O_WRONLY), b"\x7f", offset + 5)
        os.close(fd_w)
        reader.close()
        return _real(*args)

    monkeypatch.setattr(verify_mod, "verify_output", corrupt_then_verify)
    with pytest.raises(ToolkitError, match=r"verification failed: model\.layers\.\d\.mlp\.down_proj\.weight "
                                           r"\(weight\) reads back different from the source's"):
        convert(hf, tmp_path / "bad", "megatron", tp=2, progress=False, log=lambda *_: None)
    assert not (tmp_path / "bad").exists()


def test_mapped_reads_equal_positioned_reads_and_a_truncated_file_is_one_line(tmp_path):
    """Reader.get within mapped(): the same tensors as positioned reads, writable (copy-on-write: the file is not
    changed), and a file cut short after it was opened is refused in one line, never a fault on touch."""
    path = tmp_path / "t.safetensors"
    tensors = {"a": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.arange(5, dtype=torch.bfloat16),
               "c": torch.zeros(0)}
    st.save(tensors, path)
    before = path.read_bytes()
    reader = st.Reader(path)
    with st.mapped():
        got = {k: reader.get(k) for k in tensors}
    assert all(torch.equal(got[k], tensors[k]) for k in tensors)
    got["a"].add_(1)  # a private copy of the page
    assert path.read_bytes() == before and torch.equal(reader.get("a"), tensors["a"])
    os.truncate(path, len(before) - 4)
    with st.mapped(), pytest.raises(ToolkitError, match=r"short read of b: the file was truncated while converting"):
        reader.get("b")
    reader.close()


def test_default_verification_runs_the_output_once_and_hashes_the_source(tmp_path, monkeypatch):
    """With the weights hashed (the default), each module runs once, with the output's weights: the source's are
    read and hashed, and since each must equal the output's tensor of that name in bytes, shape and dtype, the
    source's forward would repeat the output's bit for bit. The hash-free comparison (the API's
    hash_weights=False) still runs both sides."""
    from transformers.models.llama import modeling_llama

    hf = tmp_path / "hf"
    _write_hf(hf, layers=2, hidden=64, ffn=128, heads=4, kv_heads=2)
    runs = []
    real = modeling_llama.LlamaDecoderLayer.forward

    def counting(self, *args, **kwargs):
        runs.append(self)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(modeling_llama.LlamaDecoderLayer, "forward", counting)
    lines = []
    mg = convert(hf, tmp_path / "mg", "megatron", tp=2, progress=False, log=lines.append)
    assert len(runs) == 2, len(runs)  # one run per decoder layer
    assert any("each of the 21 weights it loaded is bit-identical in the source and the output" in line
               for line in lines), lines
    lines.clear()  # with --dtype the source proved equal is the cast one: the lines said "the source" regardless
    convert(hf, tmp_path / "bf16", "megatron", dtype="bf16", progress=False, log=lines.append)
    assert any("gives the source's logits (its weights cast to bfloat16, as --dtype asks)" in line and
               "bit-identical in the cast source and the output" in line for line in lines), lines
    assert any("against the source's cast to bfloat16" in line for line in lines), lines
    runs.clear()
    reference, output = open_source(hf), open_source(mg)
    try:
        assert verify_logits(reference, output, torch.float32, hf, lambda *_: None) == set()
    finally:
        reference.close()
        output.close()
    assert len(runs) == 4, len(runs)  # both sides, compared after each layer


def test_hashed_weights_must_agree_in_shape_and_dtype_too():
    """The bytes alone are not the tensor: the same bytes under another shape, or read as another dtype, fail the
    check, so equal records really mean an equal forward."""
    from toolkit.checkpoint.verify_hash import Hashed as _Hashed

    t = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    for other in (t.reshape(6, 4), t.view(torch.int32)):
        hashed = _Hashed(None)
        hashed.check("w", t, output=False)
        hashed.check("w", other, output=True)  # hashed in the background; compared when settled
        with pytest.raises(ToolkitError, match=r"verification failed: w \(weight\) reads back different"):
            hashed.settle()
        hashed.close()
    hashed = _Hashed(None)
    hashed.check("w", t, output=False)
    hashed.check("w", t.clone(), output=True)
    hashed.settle()
    hashed.close()
    assert hashed.proved == {("w", "weight")}


def test_merge_buffers_are_reused_module_after_module_and_never_shared():
    """A Megatron side's merges go into reused buffers (toolkit.families.rules.merged_into): equal to fresh merges,
    distinct buffers within one module (gate and up have one shape), the same memory for the next module's merge
    of that shape, and a new shape drops the free buffers (memory stays one module's merges)."""
    from toolkit.checkpoint.verify import _Buffers
    from toolkit.families.rules import QKV, GatedMLP, RowParallel, merged_into, views

    gen = torch.Generator().manual_seed(0)
    gate, up = torch.randn(8, 6, generator=gen), torch.randn(8, 6, generator=gen)
    shards = GatedMLP().split((gate, up), 2)
    buffers = _Buffers()
    with views(), merged_into(buffers):
        g, u = GatedMLP().merge(shards)
    assert torch.equal(g, gate) and torch.equal(u, up) and g.data_ptr() != u.data_ptr()
    first = {g.data_ptr(), u.data_ptr()}
    del g, u
    buffers.recycle()
    gate2, up2 = gate + 1, up + 1
    with views(), merged_into(buffers):
        g, u = GatedMLP().merge(GatedMLP().split((gate2, up2), 2))
    assert torch.equal(g, gate2) and torch.equal(u, up2) and {g.data_ptr(), u.data_ptr()} == first
    del g, u
    buffers.recycle()
    row = torch.randn(6, 8, generator=gen)
    with views(), merged_into(buffers):
        merged = RowParallel().merge(RowParallel().split(row, 2))
    assert torch.equal(merged, row)
    del merged
    buffers.recycle()
    with views(), merged_into(buffers):
        merged = RowParallel().merge(RowParallel().split(row + 1, 2))
    assert torch.equal(merged, row + 1)
    assert {b.data_ptr() for v in buffers.free.values() for b, _ in v} == first  # unused for one module: kept
    del merged
    buffers.recycle()
    with views(), merged_into(buffers):
        merged = RowParallel().merge(RowParallel().split(row.T.contiguous(), 2))  # a shape not seen before
    assert {k[0] for k in buffers.free} == {(6, 8)}  # gate and up's, unused by the last module: dropped
    del merged
    buffers.recycle()
    qkv = QKV(num_heads=4, num_kv_heads=2, head_dim=2)
    q, k, v = torch.randn(8, 6, generator=gen), torch.randn(4, 6, generator=gen), torch.randn(4, 6, generator=gen)
    with views(), merged_into(buffers):
        got = qkv.merge(qkv.split((q, k, v), 2))
    assert all(torch.equal(a, b) for a, b in zip(got, (q, k, v)))
    # without the block, merges make fresh tensors as before
    g, u = GatedMLP().merge(shards)
    assert torch.equal(g, gate) and g.data_ptr() not in first


@pytest.mark.parametrize("heads,kv,tp", [(8, 4, 2), (8, 4, 4), (8, 2, 4), (8, 8, 2), (6, 3, 3)])
def test_qkv_merged_into_buffers_is_the_fresh_merge(heads, kv, tp):
    """Within merged_into, shards holding whole kv groups are copied straight into q, k and v buffers (once); shards
    that split a group (tp > kv heads) go the joined way. Either way q, k and v come back by name: a shard's k rows
    taken for v, or one group's rows for another's, fails."""
    from toolkit.checkpoint.verify import _Buffers
    from toolkit.families.rules import QKV, merged_into, views

    gen = torch.Generator().manual_seed(heads * 10 + tp)
    qkv, d = QKV(num_heads=heads, num_kv_heads=kv, head_dim=2), 2
    q, k, v = (torch.randn(n * d, 5, generator=gen) for n in (heads, kv, kv))
    shards = qkv.split((q, k, v), tp)
    with views(), merged_into(_Buffers()):
        got = dict(zip("qkv", qkv.merge(shards)))
    assert {name: torch.equal(got[name], t) for name, t in zip("qkv", (q, k, v))} == dict.fromkeys("qkv", True)
    assert got["q"].data_ptr() != got["k"].data_ptr() != got["v"].data_ptr()


def test_merge_buffers_serve_two_sides_and_layers_that_alternate():
    """The two sides of the check share one set of buffers and take turns: a side that merged nothing (a Hugging
    Face folder) keeps the other's, and shapes that come every other layer (a torch_dist checkpoint's tensors at odd
    offsets) find theirs; what is held stays bounded. Before, each turn dropped them: a 3B torch_dist -> Hugging Face
    check allocated 3.8 GB of fresh buffers, 157 of 157 (docs/performance.md)."""
    from toolkit.checkpoint.verify import _Buffers

    buffers, fresh = _Buffers(), set()
    sets = [[(64, 32), (32, 32)], [(16, 32), (64, 64)]]  # the shapes layer after layer, every other layer alike
    for layer in range(8):
        got = [buffers(shape, torch.bfloat16) for shape in sets[layer % 2]]
        fresh |= {t.data_ptr() for t in got}
        del got
        buffers.recycle()  # the source side's turn is over
        buffers.recycle()  # the output side (a Hugging Face folder) merged nothing
        held = sum(b.numel() for v in buffers.free.values() for b, _ in v)
        assert held <= sum(math.prod(shape) for group in sets for shape in group)  # both layers' sets, no more
    assert len(fresh) == 4  # each shape allocated once, in the first two layers
    buffers((128, 128), torch.bfloat16)  # the output layer's shape: those the last layer did not use go
    assert {k[0] for k in buffers.free} == set(sets[1])


def mapped_reads_equal_loads(it_dir, monkeypatch):
    """Every tensor of the torch_dist checkpoint at it_dir, read as the verification reads it (within mapped() and
    merged_into: maps of the bytes torch.load reads, or copies from them at odd offsets, assembled in reused
    buffers), equals the plain read (torch.load of each chunk); within mapped() no chunk's bytes are loaded. Returns
    the open Reader (the caller closes it)."""
    from toolkit.checkpoint import torch_dist
    from toolkit.checkpoint.verify import _Buffers
    from toolkit.families.rules import merged_into

    reader = torch_dist.Reader(it_dir)
    buffers = _Buffers()
    real_load = torch_dist.safe_load.load_buffer

    def meta_only(*args, **kwargs):  # within mapped(), only the records' pickles are loaded, never their bytes
        assert not st.mapping() or kwargs.get("map_location") == "meta", "a chunk was loaded, not mapped"
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch_dist.safe_load, "load_buffer", meta_only)
    for fqn in reader.tensor_names():
        loaded = reader.get(fqn)
        assert not st.mapping()
        with st.mapped(), merged_into(buffers):
            got = reader.get(fqn)
            assert torch.equal(got, loaded), fqn
        del got
        buffers.recycle()
    return reader


def test_torch_dist_reads_within_mapped_equal_loads_and_a_truncated_file_is_one_line(tmp_path, monkeypatch):
    """The verification reads torch_dist chunks as maps of the bytes torch.load reads (Reader.locate; copied from
    the map into a merge buffer where they start at an offset their dtype cannot be viewed at), and a tensor of
    several chunks is assembled in the merge buffers: the same tensors as torch.load of each chunk into fresh
    memory (for Megatron-Core's own files: test_megatron_torch_dist), and a .distcp cut short after it was opened is
    refused in one line, never a fault on touch."""
    from toolkit.checkpoint import torch_dist, torch_dist_write

    hf = tmp_path / "hf"
    _write_hf(hf, layers=2, hidden=64, ffn=128, heads=4, kv_heads=2, dtype=torch.bfloat16)
    convert(hf, tmp_path / "aligned", "torch_dist", tp=2, pp=2, verify=False, progress=False, log=lambda *_: None)
    reader = torch_dist.Reader(next((tmp_path / "aligned").glob("iter_*")))
    try:  # the toolkit's own items: every tensor's bytes on 64 bytes
        assert {reader.locate(f, key)[1] % 64 for f in reader.tensor_names() for *_, key in reader.chunks(f)} == {0}
    finally:
        reader.close()
    monkeypatch.setattr(torch_dist_write, "ITEM_ALIGN", 1)  # items back to back, as torch's FileSystemWriter writes
    convert(hf, tmp_path / "td", "torch_dist", tp=2, pp=2, verify=False, progress=False, log=lambda *_: None)
    it_dir = next((tmp_path / "td").glob("iter_*"))
    reader = mapped_reads_equal_loads(it_dir, monkeypatch)
    try:  # both kinds were there: bytes that can be viewed in place, and bytes at odd offsets
        assert {reader.locate(f, key)[1] % 2 for f in reader.tensor_names() for *_, key in reader.chunks(f)} == {0, 1}
        distcp = sorted(it_dir.glob("*.distcp"))[-1]
        os.truncate(distcp, distcp.stat().st_size // 2)
        last = max((info.offset, key[0]) for key, info in reader._where.items()
                   if info.relative_path == distcp.name and key[1] is not None)[1]  # its last tensor
        with st.mapped(), pytest.raises(ToolkitError, match=r"\.distcp \(bytes \d+\.\.\d+, .*\): short read: the file "
                                                            r"was truncated while converting"):
            reader.get(last)
    finally:
        reader.close()
