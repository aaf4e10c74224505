"""Megatron checkpoints as Megatron-Core writes them, converted by `toolkit convert`.

One 2-rank launch of tests/megatron_native_writer.py builds real GPTModels (local spec, CPU shim) from two tiny
Hugging Face Llamas and saves (a) a Megatron-LM legacy checkpoint at TP1 x PP2 x VPP2 with tied embeddings, whose
`args` holds what a real run's args hold (AttnBackend, signal.Signals, numpy RNG state), and (b) a torch_dist
checkpoint at TP2 through Megatron-Core's own `dist_checkpointing.save`; the same launch loads a torch_dist checkpoint
that `toolkit convert --to torch_dist` wrote with Megatron-Core's own `dist_checkpointing.load` at TP2 and at
TP1 x PP2, and loads the Megatron-LM legacy checkpoints `toolkit convert --to megatron_lm` wrote into GPTModels with
strict=True. The same launch saves torch_dist checkpoints with the optimizer state of Megatron-Core's own
optimizer (plain and distributed) after two Adam steps, and the live optimizer's state beside them. Both
Megatron-written checkpoints must convert to the Hugging Face
weights they were built from, bit for bit; planted pickles must never run; damaged folders give one line and write
nothing.
"""
from __future__ import annotations

import json
import os
import pickle
import pickletools
import re
import shutil
import subprocess
import sys
import zipfile

import pytest
import torch
from conftest import REPO, run_ranks
from safetensors.torch import load_file
from test_families import CONFIGS, tiny_model

from toolkit.checkpoint import torch_dist
from toolkit.checkpoint.convert import convert, convert_to_hf
from toolkit.checkpoint.inspect import inspect
from toolkit.errors import ToolkitError

VOCAB = 500
WRITER = REPO / "tests" / "megatron_native_writer.py"
# the globals a real Megatron-LM core_v0.16.1 save_checkpoint pickles (/work/shared/FACTS.md), bar the bf16 ones
REAL_GLOBALS = {"argparse Namespace", "collections OrderedDict", "megatron.core.transformer.enums AttnBackend",
                "signal Signals", "numpy dtype", "numpy ndarray", "numpy._core.multiarray _reconstruct",
                "_codecs encode", "torch FloatStorage", "torch ByteStorage", "torch._utils _rebuild_tensor_v2"}


def _hf(folder, tied: bool, layers: int, seed: int, hidden: int = 64, intermediate: int = 96):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=intermediate,
                                 num_hidden_layers=layers,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                 tie_word_embeddings=tied)).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def native(tmp_path_factory):
    """{"tied", "untied": HF folders, "legacy", "torch_dist": checkpoint roots written by Megatron-Core's code}."""
    root = tmp_path_factory.mktemp("native")
    tied, untied = _hf(root / "hf_tied", True, 4, 11), _hf(root / "hf_untied", False, 2, 12)
    odd = _hf(root / "hf_odd", False, 2, 13, hidden=48, intermediate=80)
    for family in ("qwen2", "qwen3"):  # random biases and q/k norms, qwen2 tied (test_families.tiny_model)
        tiny_model(family).save_pretrained(root / f"hf_{family}")
    quiet = dict(vocab_size=VOCAB, progress=False, log=lambda *_: None)
    ours = convert(untied, root / "ours", "torch_dist", tp=2, **quiet)
    lm_tied = convert(tied, root / "lm_tied", "megatron_lm", tp=1, pp=2, vpp=2, **quiet)
    lm_untied = convert(untied, root / "lm_untied", "megatron_lm", tp=2, **quiet)
    proc = run_ranks([str(WRITER), str(tied), str(untied), str(root / "out"), str(ours / "iter_0000000"), str(lm_tied),
                      str(lm_untied), str(root / "hf_qwen2"), str(root / "hf_qwen3"), str(odd)], 2, dict(os.environ),
                     timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return {"tied": tied, "untied": untied, "legacy": root / "out" / "legacy",
            "torch_dist": root / "out" / "torch_dist", "ours": ours, "lm_tied": lm_tied, "lm_untied": lm_untied, "stdout": proc.stdout,
            "hf_qwen2": root / "hf_qwen2", "hf_qwen3": root / "hf_qwen3",
            "legacy_qwen2": root / "out" / "legacy_qwen2", "torch_dist_qwen3": root / "out" / "torch_dist_qwen3",
            **{k: root / "out" / k for k in ("optim_plain", "optim_distopt", "optim_dp_reshardable", "fps_distopt",
                                             "fps_dp_reshardable",
                                             "dp_reshardable_buckets", "dp_reshardable_tp2",
                                             "dp_reshardable_pp2_vpp2", "legacy_distopt", "legacy_distopt_buckets",
                                             "legacy_distopt_tp2", "legacy_distopt_pp2_vpp2", "legacy_plain_tp2",
                                             "legacy_plain_pp2_vpp2", "legacy_plain_qwen2")}}


@pytest.mark.slow
@pytest.mark.parametrize("family,kind", [("qwen2", "legacy_qwen2"), ("qwen3", "torch_dist_qwen3")])
def test_real_qwen_checkpoints_convert_to_their_family_bit_exact(family, kind, native, tmp_path):
    """Megatron-LM's args name the family: --add-qkv-bias (Qwen2, legacy at TP2, tied) and --qk-layernorm (Qwen3,
    torch_dist at TP1 x PP2, head_dim 32 != hidden 64 / 4 heads). Each converts to its own transformers class with
    the weights and logits it was built from, bit for bit, and to the toolkit's layout (TP2) and back."""
    from transformers import AutoModelForCausalLM

    hf = native[f"hf_{family}"]
    out = convert_to_hf(native[kind], tmp_path / "hf", vocab_size=VOCAB)
    _equal_to(out, hf)
    got, want = (AutoModelForCausalLM.from_pretrained(f, dtype=torch.float32).eval() for f in (out, hf))
    assert type(got).__name__ == CONFIGS[family][1]
    assert getattr(got.config, "head_dim", None) == getattr(want.config, "head_dim", None)
    assert got.config.tie_word_embeddings == want.config.tie_word_embeddings
    ids = torch.randint(0, VOCAB, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(got(ids).logits, want(ids).logits)
    m = convert(native[kind], tmp_path / "m", "megatron", tp=2, vocab_size=VOCAB, progress=False, log=lambda *_: None)
    _equal_to(convert_to_hf(m, tmp_path / "hf2"), hf)


def _copy(native, kind, tmp_path):
    return shutil.copytree(native[kind], tmp_path / kind)


def _equal_to(out, hf_folder):
    got, want = load_file(str(out / "model.safetensors")), load_file(str(hf_folder / "model.safetensors"))
    assert set(got) == set(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k


def _pickle_globals(pt_file) -> set[str]:
    with zipfile.ZipFile(pt_file) as z:
        data = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
    return {str(arg) for op, arg, _ in pickletools.genops(data) if op.name == "GLOBAL"}


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _refused(src, tmp_path, marker, what="refused rather than unpickled"):
    """Refused verified, and with --no-verify, where the torch-free reader (toolkit/format/pt_zip.py) opens the files
    first and hands what it does not take to the full path."""
    for verify in (True, False):
        with pytest.raises(ToolkitError, match=what):
            convert(src, tmp_path / "hf", "hf", vocab_size=VOCAB, verify=verify, progress=False, log=lambda *_: None)
        assert not marker.exists() and not (tmp_path / "hf").exists()


@pytest.mark.slow
def test_real_legacy_checkpoint_converts_bit_exact(native, tmp_path):
    """TP1 x PP2 x VPP2 (model0, model1 per rank), tied embeddings (the last stage keeps its output_layer copy), args
    with the objects a real run pickles: converts to the weights the GPTModels were built from, and the records load
    as inert stand-ins without importing Megatron."""
    f = native["legacy"] / "iter_0000003" / "mp_rank_00_001" / "model_optim_rng.pt"
    assert REAL_GLOBALS <= _pickle_globals(f)
    out = convert_to_hf(native["legacy"], tmp_path / "hf", vocab_size=VOCAB)
    _equal_to(out, native["tied"])
    probe = ("import sys, signal; from toolkit.format.safe_load import load; from toolkit.format.records import Record; a = load(sys.argv[1])['args']; "
             "assert isinstance(a.attention_backend, Record) and a.attention_backend.value == 5, a; "
             "assert a.exit_signal is signal.SIGTERM and 'megatron' not in sys.modules; print('ok')")
    proc = subprocess.run([sys.executable, "-c", probe, str(f)], cwd=REPO, capture_output=True, text=True)
    assert proc.stdout.strip() == "ok", proc.stderr[-2000:]
    back = convert(native["legacy"], tmp_path / "m", "megatron", tp=2, pp=1, vocab_size=VOCAB, progress=False,
                   log=lambda *_: None)
    _equal_to(convert_to_hf(back, tmp_path / "hf2"), native["tied"])
    from toolkit.checkpoint.megatron_sources import MegatronLMSource

    source = MegatronLMSource(native["legacy"], VOCAB)  # the weights' offsets are found in the real rank files,
    try:  # so those conversions copied them file to file (tests/test_convert_copy_range.py: the same bytes)
        assert all(source.spans(names) is not None for names in source._entries)
    finally:
        source.close()


NO_TORCH = r'''
import json, sys
from toolkit.cli import main
out, *pairs = sys.argv[1:]
codes = [main(["convert", src, f"{out}/{name}", "--to", "hf", "--vocab-size", "%d", "--no-verify", "--quiet"])
         for src, name in zip(pairs[0::2], pairs[1::2])]
print("RESULT " + json.dumps({"codes": codes, "loaded": [m for m in ("torch", "transformers") if m in sys.modules]}))
''' % VOCAB


@pytest.mark.slow
def test_real_megatron_checkpoints_convert_without_torch_as_the_full_path_does(native, tmp_path):
    """`--no-verify` to Hugging Face reads what Megatron-Core's own code wrote without importing torch
    (toolkit/checkpoint/pickled_copy.py): a legacy checkpoint whose args hold AttnBackend, Signals and numpy RNG
    state (TP1 x PP2 x VPP2, tied), Qwen2's legacy one (TP2), torch_dist from dist_checkpointing.save (TP2; Qwen3 at
    TP1 x PP2), and checkpoints with Megatron's optimizer state (not carried to Hugging Face). Each output is byte
    for byte what the verified full path writes."""
    kinds = ["legacy", "legacy_qwen2", "torch_dist", "torch_dist_qwen3", "legacy_distopt", "optim_distopt"]
    proc = subprocess.run([sys.executable, "-c", NO_TORCH, str(tmp_path / "fast"),
                           *[x for k in kinds for x in (str(native[k]), k)]], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.split("RESULT ", 1)[1]) == {"codes": [0] * len(kinds), "loaded": []}, proc.stderr
    assert proc.stdout.count("file to file, torch-free") == len(kinds), proc.stdout  # none went through memory
    for k in kinds:
        full = convert(native[k], tmp_path / "full" / k, "hf", vocab_size=VOCAB, progress=False, log=lambda *_: None)
        fast = tmp_path / "fast" / k
        assert sorted(p.name for p in fast.iterdir()) == sorted(p.name for p in full.iterdir())
        assert [p.name for p in full.iterdir() if p.read_bytes() != (fast / p.name).read_bytes()] == [], k


@pytest.mark.slow
def test_planted_pickle_in_a_real_legacy_file_never_runs(native, tmp_path):
    src = _copy(native, "legacy", tmp_path)
    f = src / "iter_0000003" / "mp_rank_00_000" / "model_optim_rng.pt"
    state = torch.load(f, weights_only=False)  # written by this test's own writer: trusted
    state["args"].evil = _Payload(tmp_path / "pwned")
    torch.save(state, f)
    _refused(src, tmp_path, tmp_path / "pwned")


@pytest.mark.slow
def test_planted_pickle_in_a_real_distrib_optim_file_never_runs(native, tmp_path):
    """distrib_optim.pt is read through the same allow-list: a payload planted in it is refused before it is called,
    and nothing is written; a conversion that does not carry optimizer state (--to hf) never opens the file."""
    src = _copy(native, "legacy_distopt", tmp_path)
    f = src / "iter_0000002" / "mp_rank_00" / "distrib_optim.pt"
    state = torch.load(f, weights_only=False)  # written by this test's own writer: trusted
    state["evil"] = _Payload(tmp_path / "pwned")
    torch.save(state, f)
    with pytest.raises(ToolkitError, match="refused rather than unpickled"):
        convert(src, tmp_path / "m", "megatron", vocab_size=VOCAB, progress=False, log=lambda *_: None)
    assert not (tmp_path / "pwned").exists() and not (tmp_path / "m").exists()
    convert_to_hf(src, tmp_path / "hf", vocab_size=VOCAB)
    assert not (tmp_path / "pwned").exists()


@pytest.mark.slow
def test_torch_dist_converts_bit_exact_to_hf_and_any_layout(native, tmp_path):
    """dist_checkpointing.save at TP2 -> HF equals the HF weights bit for bit; -> toolkit TP1 x PP2 -> HF too."""

    report = inspect(native["torch_dist"])
    assert report["format"] == "megatron torch_dist" and report["complete"] and report["step"] == 5
    assert report["layout"] == {"tp": 2, "pp": 1, "vpp": 1}
    it = native["torch_dist"] / "iter_0000005"
    assert sorted(p.name for p in it.iterdir()) == [".metadata", "__0_0.distcp", "__0_1.distcp", "__1_0.distcp",
                                                    "__1_1.distcp", "common.pt", "metadata.json"]
    _equal_to(convert_to_hf(native["torch_dist"], tmp_path / "hf", vocab_size=VOCAB), native["untied"])
    m = convert(it, tmp_path / "m", "megatron", tp=1, pp=2, vocab_size=VOCAB, progress=False, log=lambda *_: None)
    _equal_to(convert_to_hf(m, tmp_path / "hf2"), native["untied"])
    lm = convert(it, tmp_path / "lm", "megatron_lm", tp=1, pp=2, vocab_size=VOCAB, progress=False,
                 log=lambda *_: None)
    _equal_to(convert_to_hf(lm, tmp_path / "hf3", vocab_size=VOCAB), native["untied"])
    from toolkit.checkpoint.megatron_sources import TorchDistSource

    source = TorchDistSource(it, VOCAB)  # every weight's bytes are located in the real .distcp files (so those
    try:  # conversions copied them file to file): the bytes there, merged, are the weights read through memory
        most = 0
        for names in source._entries:
            inputs, merge = source.spans(names)
            most = max(most, len(inputs))
            located = []
            for reader, key in inputs:
                fd, at, n = reader.span(key)
                located.append(torch.frombuffer(bytearray(os.pread(fd, n, at)), dtype=reader.dtype(key))
                               .reshape(reader.shape(key)))
            assert all(torch.equal(a, b) for a, b in zip(merge(located), source.read(names), strict=True)), names
        assert most >= 2  # TP2 shards: a parameter from several chunks
    finally:
        source.close()


@pytest.mark.slow
def test_planted_pickles_in_torch_dist_never_run(native, tmp_path):
    """In common.pt, in the DCP .metadata, and inside a .distcp tensor item: refused, nothing runs, nothing written."""
    import torch.distributed.checkpoint.filesystem as fs

    src = _copy(native, "torch_dist", tmp_path)
    it = src / "iter_0000005"
    common = torch.load(it / "common.pt", weights_only=False)  # trusted: this test's own writer
    common["args"].evil = _Payload(tmp_path / "pwned1")
    torch.save(common, it / "common.pt")
    _refused(src, tmp_path, tmp_path / "pwned1")
    shutil.copy(native["torch_dist"] / "iter_0000005" / "common.pt", it / "common.pt")

    meta = pickle.loads((it / ".metadata").read_bytes())
    meta.planner_data = {"evil": _Payload(tmp_path / "pwned2")}
    (it / ".metadata").write_bytes(pickle.dumps(meta))
    _refused(src, tmp_path, tmp_path / "pwned2")

    meta = pickle.loads((native["torch_dist"] / "iter_0000005" / ".metadata").read_bytes())
    index = next(i for i in meta.storage_data if i.fqn == "embedding.word_embeddings.weight")
    info = meta.storage_data[index]
    item = tmp_path / "item.pt"
    torch.save({"t": torch.zeros(1), "x": _Payload(tmp_path / "pwned3")}, item)
    distcp = it / info.relative_path
    start = distcp.stat().st_size
    with open(distcp, "ab") as f:
        f.write(item.read_bytes())
    meta.storage_data[index] = fs._StorageInfo(info.relative_path, start, item.stat().st_size)
    (it / ".metadata").write_bytes(pickle.dumps(meta))
    _refused(src, tmp_path, tmp_path / "pwned3")


@pytest.mark.slow
@pytest.mark.parametrize("damage, message", [
    ("missing_distcp", r"__1_0\.distcp is missing: the torch_dist checkpoint is incomplete"),
    ("truncated_distcp", r"\.metadata disagrees with the files: it places .* of __0_1\.distcp, which has"),
    ("tracker", r"latest_checkpointed_iteration\.txt points at iter_0000009, which does not exist"),
    ("overlapping_chunks", r"\.metadata disagrees with itself: .* has chunks at .* that overlap"),
    ("metadata_not_dcp", r"\.metadata holds a pickled int, not torch DCP metadata"),
    ("backend_version", r"metadata\.json gives sharded_backend_version 99 and common_backend 'torch'"),
    ("record_dtype", r"__0_0\.distcp \(bytes .*embedding\.word_embeddings\.weight\) holds .*torch\.float32\), but "
                     r".*\.metadata says .* torch\.float16: the metadata disagrees with the files"),
    ("missing_storage", r"\.metadata lists a chunk of embedding\.word_embeddings\.weight at \[0, 0\] but no file"),
    ("complex_dtype", r"\.metadata gives embedding\.word_embeddings\.weight the dtype torch\.complex64, which no"),
])
def test_damaged_torch_dist_gives_one_line_and_writes_nothing(native, tmp_path, damage, message):
    src = _copy(native, "torch_dist", tmp_path)
    it = src / "iter_0000005"
    if damage in ("record_dtype", "missing_storage", "complex_dtype"):  # the metadata against its own files
        import torch.distributed.checkpoint  # noqa: F401 - DCP's classes, to unpickle this test's own file

        meta = pickle.loads((it / ".metadata").read_bytes())
        emb = "embedding.word_embeddings.weight"
        if damage == "missing_storage":
            del meta.storage_data[next(i for i in meta.storage_data if i.fqn == emb and not any(i.offset))]
        else:
            meta.state_dict_metadata[emb].properties.dtype = (torch.float16 if damage == "record_dtype"
                                                              else torch.complex64)
        (it / ".metadata").write_bytes(pickle.dumps(meta))
        report = inspect(src)  # `inspect` does not call it complete: it says the same, as its problem
        assert not report["complete"] and re.search(message, report["problems"][0]), report["problems"]
    if damage == "missing_distcp":
        (it / "__1_0.distcp").unlink()
    elif damage == "truncated_distcp":
        (it / "__0_1.distcp").write_bytes((it / "__0_1.distcp").read_bytes()[:5000])
    elif damage == "overlapping_chunks":  # as many values as the tensor, but two chunks at the same place, a gap
        import torch.distributed.checkpoint  # noqa: F401 - DCP's classes, to unpickle this test's own file

        meta = pickle.loads((it / ".metadata").read_bytes())
        chunks = next(m.chunks for m in meta.state_dict_metadata.values() if len(getattr(m, "chunks", [])) == 2)
        chunks[1] = type(chunks[0])(offsets=chunks[0].offsets, sizes=chunks[1].sizes)
        (it / ".metadata").write_bytes(pickle.dumps(meta))
    elif damage == "metadata_not_dcp":
        (it / ".metadata").write_bytes(pickle.dumps(5))
    elif damage == "backend_version":
        (it / "metadata.json").write_text(json.dumps({**json.loads((it / "metadata.json").read_text()),
                                                      "sharded_backend_version": 99}))
    elif damage == "tracker":
        (src / "latest_checkpointed_iteration.txt").write_text("9")
    for verify in (True, False):  # --no-verify: the torch-free reader declines it, the full path says why
        with pytest.raises(ToolkitError, match=message) as e:
            convert(src, tmp_path / "hf", "hf", vocab_size=VOCAB, verify=verify, progress=False, log=lambda *_: None)
        assert "\n" not in str(e.value) and not (tmp_path / "hf").exists()
    if damage != "missing_distcp":
        return
    proc = subprocess.run([sys.executable, "-m", "toolkit", "convert", str(src), str(tmp_path / "hf"), "--to", "hf",
                           "--vocab-size", str(VOCAB)], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode != 0 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not (tmp_path / "hf").exists()


@pytest.mark.slow
@pytest.mark.parametrize("kind, damage, message", [
    ("legacy", "iteration", r"mixes two saves: .*mp_rank_00_001/model_optim_rng\.pt is iteration 4"),
    ("legacy", "args", r"mixes two saves: .*args differ from .* \(num_layers 6 against 4\)"),
    ("legacy_plain_tp2", "rows", r"mp_rank_00/model_optim_rng\.pt: chunk0\.decoder\.layers\.0\.mlp\.linear_fc1\.weight is"),
    ("legacy", "chunks", r"mp_rank_00_001/model_optim_rng\.pt holds the model chunks \['model0'\], but its args' layout"),
    ("legacy", "extra rank", r"holds mp_rank_00_002, which its args' layout \(tp=1 pp=2\) does not use"),
])
def test_real_legacy_rank_files_of_two_saves_are_refused(native, tmp_path, kind, damage, message):
    """Megatron-Core's own rank files, one of them changed as a copy from another save would be: another iteration,
    other args, or shards whose sizes add up but whose rows moved between TP ranks. Refused, nothing written."""
    src = _copy(native, kind, tmp_path)
    files = sorted(src.glob("iter_*/mp_rank_*/model_optim_rng.pt"))
    states = [torch.load(f, weights_only=False) for f in files]  # trusted: this test's own writer
    if damage == "iteration":
        states[1]["iteration"] = states[0]["iteration"] + 1
    elif damage == "args":
        states[1]["args"].num_layers = 6
    elif damage == "chunks":  # the second virtual chunk gone from one rank file
        del states[1]["model1"]
    elif damage == "extra rank":  # a third pipeline stage's folder, as a PP3 save copied over this one would leave
        shutil.copytree(files[1].parent, files[1].parent.with_name("mp_rank_00_002"))
    else:
        key = next(k for k in states[0]["model"] if k.endswith("layers.0.mlp.linear_fc1.weight"))
        a, b = states[0]["model"][key], states[1]["model"][key]
        states[0]["model"][key], states[1]["model"][key] = torch.cat([a, b[:8]]).clone(), b[8:].clone()
    for f, state in zip(files, states):
        torch.save(state, f)
    for verify in (True, False):
        with pytest.raises(ToolkitError, match=message):
            convert(src, tmp_path / "hf", "hf", vocab_size=VOCAB, verify=verify, progress=False, log=lambda *_: None)
        assert not (tmp_path / "hf").exists() and sorted(p.name for p in tmp_path.iterdir()) == [kind]


@pytest.mark.slow
def test_torch_dist_written_by_the_toolkit_loads_in_megatron_core_at_any_layout(native, tmp_path):
    """`toolkit convert HF --to torch_dist --tp 2`: Megatron-Core's dist_checkpointing.load fills real GPTModels at
    TP2 and at TP1 x PP2 with exactly the weights the HF mapping gives (the probe checks every rank); the toolkit
    reads it back, and re-writes Megatron's own torch_dist checkpoint at another TP, bit-exactly."""
    assert "loaded 2x1x1" in native["stdout"] and "loaded 1x2x1" in native["stdout"]
    _equal_to(convert_to_hf(native["ours"], tmp_path / "hf", vocab_size=VOCAB), native["untied"])
    again = convert(native["torch_dist"], tmp_path / "td1", "torch_dist", tp=1, vocab_size=VOCAB, progress=False,
                    log=lambda *_: None)
    _equal_to(convert_to_hf(again, tmp_path / "hf1", vocab_size=VOCAB), native["untied"])
    tied = convert(native["legacy"], tmp_path / "td_tied", "torch_dist", tp=1, pp=2, vpp=2, vocab_size=VOCAB,
                   progress=False, log=lambda *_: None)  # keeps output_layer.weight, as Megatron does at pp > 1
    _equal_to(convert_to_hf(tied, tmp_path / "hf_tied", vocab_size=VOCAB), native["tied"])


@pytest.mark.slow
def test_megatron_lm_legacy_written_by_the_toolkit_loads_into_gptmodel_chunks(native, tmp_path):
    """`--to megatron_lm` at TP1 x PP2 x VPP2 (tied) and TP2 (untied): every rank file holds exactly the keys of its
    GPTModel chunks' state_dict_for_save_checkpoint() (model0/model1 with virtual chunks, _extra_state entries) and
    loads into them with strict=True, giving the HF mapping's weights; args describe the new layout; and a Megatron-
    written legacy checkpoint re-laid out this way converts back to HF bit-exactly."""
    from toolkit.format.safe_load import load

    assert "loaded legacy 1x2x2" in native["stdout"] and "loaded legacy 2x1x1" in native["stdout"]
    args = load(native["lm_tied"] / "iter_0000000" / "mp_rank_00_001" / "model_optim_rng.pt")["args"]
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
            args.virtual_pipeline_model_parallel_size, args.untie_embeddings_and_output_weights) == (1, 2, 2, False)
    out = convert(native["legacy"], tmp_path / "lm", "megatron_lm", tp=2, pp=2, vocab_size=VOCAB, progress=False,
                  log=lambda *_: None)
    _equal_to(convert_to_hf(out, tmp_path / "hf", vocab_size=VOCAB), native["tied"])


def _optim_by_name(tag):
    """{local-spec name:field: tensor} of a toolkit Megatron checkpoint at TP1 x PP1, and its optimizer metadata."""
    from toolkit.format import safetensors_stream as st

    tensors, meta = st.load(tag / "optim_tp00_pp000.safetensors")
    assert all(k.startswith("chunk0.") for k in tensors)
    return {k.removeprefix("chunk0."): v for k, v in tensors.items()}, meta


@pytest.mark.slow
@pytest.mark.parametrize("kind,tp,pp", [("optim_plain", 1, 2), ("optim_distopt", 2, 1), ("fps_distopt", 2, 1)])
def test_torch_dist_optimizer_state_converts_by_name_to_another_layout(kind, tp, pp, native, tmp_path):
    """Megatron-Core's own optimizer state (plain at TP2 / distributed at DP2 as fully_reshardable, bf16) converts
    with the weights to another TP x PP: every parameter's exp_avg, exp_avg_sq and fp32 main weights equal the live
    optimizer's, by name, and the step is kept. The live tensors are pairwise distinct, so swapping two fields or two
    parameters' states would fail."""
    import json

    from safetensors.torch import load_file

    quiet = dict(vocab_size=VOCAB, progress=False, log=lambda *_: None)
    moved = convert(native[kind], tmp_path / "moved", "megatron", tp=tp, pp=pp, **quiet)
    tag = moved / "step_00000002"
    assert json.loads((tag / "toolkit_meta.json").read_text())["layout"]["tp"] == tp
    assert sorted(p.name for p in tag.glob("optim_*")) == [f"optim_tp{t:02d}_pp{p:03d}.safetensors"
                                                          for t in range(tp) for p in range(pp)]
    # back to one rank (the toolkit's own relayout, tested elsewhere) to compare whole tensors by name
    got, meta = _optim_by_name(convert(moved, tmp_path / "one", "megatron", **quiet) / "step_00000002")
    assert meta["step"] == "2"
    live = load_file(str(native[kind] / "live.safetensors"))
    assert set(got) == set(live) and {k.split(":")[1] for k in live} == {"exp_avg", "exp_avg_sq", "master"}
    for k, want in live.items():
        rows = VOCAB if k.startswith(("embedding.", "output_layer.")) else None  # vocabulary padding is dropped
        assert torch.equal(got[k][:rows], want[:rows]), k
    items = list(live.items())
    for i, (a, x) in enumerate(items):  # a swap of any two would be caught by the equality above
        assert x.abs().sum() > 0, a
        assert not any(x.shape == y.shape and torch.equal(x, y) for b, y in items[i + 1:]), a


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["optim_dp_reshardable", "fps_dp_reshardable", "dp_reshardable_buckets",
                                  "dp_reshardable_tp2",
                                  "dp_reshardable_pp2_vpp2", "legacy_distopt", "legacy_distopt_buckets",
                                  "legacy_distopt_tp2", "legacy_distopt_pp2_vpp2"])
def test_flat_distributed_optimizer_state_converts_by_name(kind, native, tmp_path):
    """The distributed optimizer's flat buffers, where each parameter lies not saved, convert with the weights:
    Megatron-LM's default torch_dist format (dp_reshardable, per-bucket buffers) and its legacy distrib_optim.pt
    (save_parameter_state: the buckets coalesced, their cuts not saved either). The layout is recomputed from the
    model and proved (toolkit/checkpoint/megatron_flat.py), and every parameter's exp_avg, exp_avg_sq and fp32 main
    weights equal the live optimizer's, by name: at DP2 in one bucket and in several (legacy: a bucket per parameter,
    of a model whose norms end off the alignment), at TP2, and at PP2 x VPP2 with tied embeddings (fp32: no mains)."""
    quiet = dict(vocab_size=VOCAB, progress=False, log=lambda *_: None)
    if kind.startswith("legacy"):  # toolkit inspect says what it holds
        from toolkit.checkpoint.inspect import inspect_megatron_lm

        n = len(list((native[kind] / "iter_0000002").glob("mp_rank_*")))
        report = inspect_megatron_lm(native[kind])
        assert report["optimizer_state"] == (
            f"distributed optimizer, distrib_optim.pt on {n} of {n} model-parallel ranks")
        # the weights' dtype from the records of Megatron-Core's own rank files (inspect said none before 2026-12-07)
        assert report["dtypes"] == {"F32" if kind.endswith("pp2_vpp2") else "BF16": report["parameters"]}
    got, meta = _optim_by_name(convert(native[kind], tmp_path / "one", "megatron", **quiet) / "step_00000002")
    assert meta["step"] == "2"
    live = load_file(str(native[kind] / "live.safetensors"))
    if kind.endswith("pp2_vpp2"):  # fp32: the main weights are the weights
        live = {k: v for k, v in live.items() if not k.endswith(":master")}
    assert set(got) == set(live) and len(live) >= 2 * 9
    for k, want in live.items():
        rows = VOCAB if k.startswith(("embedding.", "output_layer.")) else None  # vocabulary padding is dropped
        assert torch.equal(got[k][:rows], want[:rows]), k


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["legacy_plain_tp2", "legacy_plain_pp2_vpp2", "legacy_plain_qwen2"])
def test_plain_optimizer_state_of_legacy_checkpoints_converts_by_name(kind, native, tmp_path):
    """Megatron-LM's default optimizer, the plain one: its state_dict in model_optim_rng.pt keys each parameter's
    state by position in the param groups. The positions are recomputed from the checkpoint's own registration order
    and Megatron's weight-decay groups, matched by wd_mult, and proved (toolkit/checkpoint/megatron_plain.py): every
    parameter's exp_avg, exp_avg_sq and fp32 main weights equal the live optimizer's, by name, at TP2 (bf16), at
    PP2 x VPP2 with tied embeddings (fp32: the last stage's copy of the embeddings holds a position of its own) and
    for Qwen2 (its q/k/v biases in the no-weight-decay group)."""
    from toolkit.checkpoint.inspect import inspect_megatron_lm

    assert inspect_megatron_lm(native[kind])["optimizer_state"] == "plain optimizer, in model_optim_rng.pt"
    quiet = dict(vocab_size=VOCAB, progress=False, log=lambda *_: None)
    got, meta = _optim_by_name(convert(native[kind], tmp_path / "one", "megatron", **quiet) / "step_00000002")
    assert meta["step"] == "2"
    live = load_file(str(native[kind] / "live.safetensors"))
    if kind.endswith("pp2_vpp2"):  # fp32: the main weights are the weights
        live = {k: v for k, v in live.items() if not k.endswith(":master")}
    assert set(got) == set(live) and len(live) >= 2 * 9
    if kind.endswith("qwen2"):
        assert any(k.endswith("linear_qkv.bias:exp_avg") for k in live)
    for k, want in live.items():
        rows = VOCAB if k.startswith(("embedding.", "output_layer.")) else None  # vocabulary padding is dropped
        assert torch.equal(got[k][:rows], want[:rows]), k


def _swap_states(s):
    state = s["optimizer"]["optimizer"]["state"]
    state[0], state[1] = state[1], state[0]


@pytest.mark.slow
@pytest.mark.parametrize("damage, change, message", [
    ("a group one parameter short", lambda s: s["optimizer"]["optimizer"]["param_groups"][1]["params"].pop(),
     r"param group 1 \(wd_mult 0\.0\) holds 4 parameters, this model 5 on this rank"),
    ("other weight-decay groups", lambda s: s["optimizer"]["optimizer"]["param_groups"][1].update(wd_mult=0.5),
     r"has param groups with wd_mult \[1\.0, 0\.5\], but Megatron's standard groups of this model give"),
    ("two states swapped", _swap_states, r"state 0 is not shaped as embedding\.word_embeddings\.weight \(256, 64\), the parameter its position"),
    ("one main weight moved", lambda s: s["optimizer"]["fp32_from_fp16_params"][0][-1].add_(0.5),
     r"plain optimizer's state does not line up with the weights at output_layer\.weight .*--weights-only"),
    ("one rank's state missing", lambda s: s.pop("optimizer"),
     r"mp_rank_01/model_optim_rng\.pt: holds no optimizer state, though the other ranks' files do"),
])
def test_plain_optimizer_state_that_does_not_fit_is_refused(damage, change, message, native, tmp_path):
    """A plain optimizer's state whose positions the model does not give is refused in one line naming the rank file
    and the problem, and nothing is written: a param group one parameter short, groups of other weight-decay
    multipliers, two parameters' states swapped (caught by their shapes), and one fp32 main weight that is not its
    saved weight (caught as it is read). --weights-only still converts the weights."""
    src = tmp_path / "src"
    shutil.copytree(native["legacy_plain_tp2"], src)
    _resave(src / "iter_0000002" / "mp_rank_01" / "model_optim_rng.pt", change)
    quiet = dict(vocab_size=VOCAB, progress=False, log=lambda *_: None)
    with pytest.raises(ToolkitError, match=message) as e:
        convert(src, tmp_path / "out", "megatron", **quiet)
    assert len(str(e.value).splitlines()) <= 3  # one line, or the checks' heading, its one problem and the fix
    assert "mp_rank_01" in str(e.value) or damage == "one main weight moved"
    assert not (tmp_path / "out").exists()
    weights = convert(src, tmp_path / "w", "megatron", weights_only=True, **quiet)
    assert not list((weights / "step_00000002").glob("optim_*"))


@pytest.mark.slow
def test_dp_reshardable_buffers_that_do_not_line_up_are_refused(native, tmp_path):
    """A layout that fits the buckets' lengths and chunks but not their data is caught, and nothing is kept: with one
    bucket's `param` values changed (every main weight there then differs from its saved weight), the conversion
    stops with one line naming the parameter and the way out, and leaves no output; --weights-only still converts."""
    import io

    src = tmp_path / "src"
    shutil.copytree(native["optim_dp_reshardable"], src)
    r = torch_dist.Reader(src / "iter_0000002")
    fqn = next(n for n in r.tensor_names() if n.endswith("bucket_idx_0.param"))
    for (name, _), info in r._where.items():  # each saved chunk of that bucket, rewritten in place, same length
        if name == fqn:
            f = src / "iter_0000002" / info.relative_path
            data = f.read_bytes()
            t = torch.load(io.BytesIO(data[info.offset:info.offset + info.length]), weights_only=True)
            buf = io.BytesIO()
            torch.save(t.add_(0.5), buf)
            assert len(buf.getvalue()) == info.length
            f.write_bytes(data[:info.offset] + buf.getvalue() + data[info.offset + info.length:])
    with pytest.raises(ToolkitError, match=r"do not line up with the weights at .*--weights-only"):
        convert(src, tmp_path / "out", "megatron", vocab_size=VOCAB, progress=False, log=lambda *_: None)
    assert not (tmp_path / "out").exists()
    weights = convert(src, tmp_path / "w", "megatron", vocab_size=VOCAB, weights_only=True, progress=False,
                      log=lambda *_: None)
    assert not list((weights / "step_00000002").glob("optim_*"))


def _resave(pt_file, change) -> None:
    """Rewrite one of the test's own Megatron-LM files with `change` applied to its contents."""
    state = torch.load(pt_file, weights_only=False)
    change(state)
    torch.save(state, pt_file)


@pytest.mark.slow
@pytest.mark.parametrize("kind, damage, message", [
    ("legacy_distopt_buckets", "bucket size", r"holds \d+ elements, which no layout of Megatron's parameter orders"),
    ("legacy_distopt_tp2", "one rank's file", r"mp_rank_01/distrib_optim\.pt: is missing, though other ranks"),
    ("legacy_distopt_tp2", "a folder", r"mp_rank_01/distrib_optim\.pt: is not a regular file"),
    ("legacy_distopt", "its data", r"do not line up with the saved weights \(the norms'\)"),
    ("legacy_distopt", "one weight's data", r"do not line up with the weights at output_layer\.weight .*--weights-only"),
])
def test_legacy_distributed_optimizer_state_that_does_not_fit_is_refused(kind, damage, message, native, tmp_path):
    """A distrib_optim.pt that the model and its args do not place is refused in one line, and nothing is written:
    args whose ddp_bucket_size is not the one the run used (the buckets then add up to another length), a rank's
    file missing, and buffers whose main weights are not the saved weights: every one moved by 0.5 (caught as the
    norms tell Megatron's two parameter orders apart), or only output_layer's (caught as it is read). --weights-only
    still converts the weights."""
    src = tmp_path / "src"
    shutil.copytree(native[kind], src)
    it = src / "iter_0000002"
    if damage == "bucket size":
        _resave(it / "mp_rank_00" / "model_optim_rng.pt", lambda s: setattr(s["args"], "ddp_bucket_size", None))
    elif damage == "one rank's file":
        from toolkit.checkpoint.inspect import inspect_megatron_lm

        (it / "mp_rank_01" / "distrib_optim.pt").unlink()
        assert "distrib_optim.pt on 1 of 2 model-parallel ranks" in inspect_megatron_lm(src)["optimizer_state"]
    elif damage == "a folder":  # where the file goes: it was taken for no optimizer state ("weights only")
        (it / "mp_rank_01" / "distrib_optim.pt").unlink()
        (it / "mp_rank_01" / "distrib_optim.pt").mkdir()
    else:  # the buffer's start holds the last parameter registered, output_layer.weight, in either order
        end = None if damage == "its data" else 64
        _resave(it / "mp_rank_00" / "distrib_optim.pt", lambda s: s[0][next(iter(s[0]))]["param"][:end].add_(0.5))
    quiet = dict(vocab_size=VOCAB, progress=False, log=lambda *_: None)
    with pytest.raises(ToolkitError, match=message) as e:
        convert(src, tmp_path / "out", "megatron", **quiet)
    assert len(str(e.value).splitlines()) <= 3  # one line, or the checks' heading, its one problem and the fix
    assert not (tmp_path / "out").exists()
    weights = convert(src, tmp_path / "w", "megatron", weights_only=True, **quiet)
    assert not list((weights / "step_00000002").glob("optim_*"))


@pytest.mark.slow
def test_distributed_optimizer_state_written_loads_in_megatron_core_at_other_layouts(native, tmp_path):
    """--to megatron_lm and --to torch_dist of a Megatron-LM checkpoint with the distributed optimizer write its state
    too, and Megatron-Core's own DistributedOptimizer loads it at another layout, with the scheduler's state.
    Legacy (distrib_optim.pt and the optimizer's state_dict), loaded as Megatron-LM's load_checkpoint does
    (load_state_dict, load_parameter_state) at the layout written: from TP2 to TP1 x PP2 and to one model-parallel
    rank at DP2 (bf16), from PP2 x VPP2 tied to TP2 and to PP2 (fp32: the last stage's copy of the embeddings in a
    bucket of its own, first in its buffer), and from Megatron-LM's torch_dist (dp_reshardable at DP2 to TP2,
    fully_reshardable to TP1 x PP2). torch_dist (fully_reshardable), loaded through dist_checkpointing.load at a
    layout other than the one written: TP2 written at TP1 x PP2, dp_reshardable written at TP2 loaded at DP2, and
    PP2 x VPP2 tied written at PP2 x VPP1. Every loaded moment and main weight equals the live optimizer's the
    source was saved from, by name, with its step (tests/megatron_legacy_optim_probe.py); each conversion's own
    read-back already checked the optimizer fields bit for bit through the output's reader. The plain optimizer's
    state (Megatron-LM legacy at TP2, PP2 x VPP2 tied in fp32, Qwen2 with biases; torch_dist at TP2) is written as the
    plain optimizer's (its state_dict by position in model_optim_rng.pt; per parameter in torch_dist) and loaded by
    Megatron-Core's own plain optimizer: legacy at the layout written (TP1 x PP2, TP2), torch_dist written at
    TP1 x PP2 and loaded at TP2."""
    quiet = dict(vocab_size=VOCAB, progress=False, log=lambda *_: None)
    cases = (("legacy_distopt_tp2", "pp2", "megatron_lm", (1, 2), (1, 2), "untied", "bf16"),
             ("legacy_distopt_tp2", "dp2", "megatron_lm", (1, 1), (1, 1), "untied", "bf16"),
             ("legacy_distopt_pp2_vpp2", "tp2", "megatron_lm", (2, 1), (2, 1), "tied", "fp32"),
             ("legacy_distopt_pp2_vpp2", "pp2_tied", "megatron_lm", (1, 2), (1, 2), "tied", "fp32"),
             ("optim_dp_reshardable", "from_dp_reshardable", "megatron_lm", (2, 1), (2, 1), "untied", "bf16"),
             ("optim_distopt", "from_fully_reshardable", "megatron_lm", (1, 2), (1, 2), "untied", "bf16"),
             ("legacy_distopt_tp2", "td_from_legacy", "torch_dist", (1, 2), (2, 1), "untied", "bf16"),
             ("optim_dp_reshardable", "td_from_dp_reshardable", "torch_dist", (2, 1), (1, 1), "untied", "bf16"),
             ("legacy_distopt_pp2_vpp2", "td_tied", "torch_dist", (1, 2), (1, 2), "tied", "fp32"),
             # the plain optimizer's: loaded by Megatron-Core's Float16OptimizerWithFloat16Params / FP32Optimizer
             ("legacy_plain_tp2", "plain_pp2", "megatron_lm", (1, 2), (1, 2), "untied", "bf16"),
             ("legacy_plain_pp2_vpp2", "plain_tp2_tied", "megatron_lm", (2, 1), (2, 1), "tied", "fp32"),
             ("legacy_plain_qwen2", "plain_qwen2_tp2", "megatron_lm", (2, 1), (2, 1), "hf_qwen2", "bf16"),
             ("optim_plain", "plain_from_torch_dist", "megatron_lm", (1, 2), (1, 2), "untied", "bf16"),
             ("legacy_plain_tp2", "td_plain", "torch_dist", (1, 2), (2, 1), "untied", "bf16"),
             ("legacy_plain_pp2_vpp2", "td_plain_tied", "torch_dist", (1, 2), (2, 1), "tied", "fp32"))
    specs = []
    for kind, out, to, (tp, pp), (load_tp, load_pp), hf, precision in cases:
        root = convert(native[kind], tmp_path / out, to, tp=tp, pp=pp, **quiet)
        files = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
        if to == "megatron_lm":
            ranks = [f"mp_rank_{t:02d}" + ("" if pp == 1 else f"_{p:03d}") for p in range(pp) for t in range(tp)]
            per_rank = ("model_optim_rng.pt",) + (("distrib_optim.pt",) if "plain" not in kind else ())
            assert files == sorted([".toolkit_output.json", "latest_checkpointed_iteration.txt"]
                                   + [f"iter_0000002/{r}/{f}" for r in ranks for f in per_rank]), files
        else:
            names = torch_dist.Reader(root / "iter_0000002").tensor_names()
            assert sum(n.startswith("optimizer.state.exp_avg.") for n in names) >= 9, names
        specs.append(",".join([str(root), str(native[hf]), str(native[kind] / "live.safetensors"), precision,
                               f"{load_tp}x{load_pp}x1"]))
    proc = run_ranks([str(REPO / "tests" / "megatron_legacy_optim_probe.py"), *specs], 2, dict(os.environ),
                     timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    for kind, out, to, _, (load_tp, load_pp), _, _ in cases:
        what = ("legacy plain" if "plain" in kind else "legacy") if to == "megatron_lm" else "torch_dist"
        assert f"loaded {what} optim {out} {load_tp}x{load_pp}x1" in proc.stdout, proc.stdout[-2000:]
    weights = convert(native["legacy_distopt_tp2"], tmp_path / "w", "megatron_lm", weights_only=True, **quiet)
    assert not list(weights.rglob("distrib_optim.pt"))
    assert "optimizer" not in torch.load(next(weights.rglob("model_optim_rng.pt")), weights_only=False)


@pytest.mark.slow
@pytest.mark.parametrize("change", [{"rotary_interleaved": True}, {"apply_layernorm_1p": True},
                                    {"rotary_seq_len_interpolation_factor": 4}, {"mtp_num_layers": 1},
                                    {"apply_residual_connection_post_layernorm": True}])
def test_megatron_lm_args_that_change_the_model_are_refused(change, native, tmp_path):
    """Each of these args was ignored: the checkpoint converted to a plain Llama, "verified", whose logits are not
    the model Megatron-LM trained. `--rotary-seq-len-interpolation-factor 1` (what conversion scripts pass) still
    converts."""
    src = tmp_path / "src"
    shutil.copytree(native["legacy"], src)
    files = sorted(src.rglob("model_optim_rng.pt"))
    for f in files:
        _resave(f, lambda s: [setattr(s["args"], k, v) for k, v in change.items()])
    (name, value), = change.items()
    with pytest.raises(ToolkitError, match=f"none of the families \\({name}={value!r}\\)"):
        convert(src, tmp_path / "hf", "hf", vocab_size=VOCAB, progress=False, log=lambda *_: None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
    if name == "rotary_seq_len_interpolation_factor":
        for f in files:
            _resave(f, lambda s: setattr(s["args"], name, 1))
        convert(src, tmp_path / "hf", "hf", vocab_size=VOCAB, progress=False, log=lambda *_: None)


@pytest.mark.slow
def test_megatron_lm_rope_scaling_args_are_llama31s(native, tmp_path):
    """--use-rope-scaling --rope-scaling-factor 8 (Megatron-Core's Llama 3.1 scaling) was read as no scaling."""
    src = tmp_path / "src"
    shutil.copytree(native["legacy"], src)
    for f in sorted(src.rglob("model_optim_rng.pt")):
        _resave(f, lambda s: (setattr(s["args"], "use_rope_scaling", True), setattr(s["args"], "rope_scaling_factor", 8.0)))
    out = convert(src, tmp_path / "hf", "hf", vocab_size=VOCAB, progress=False, log=lambda *_: None)
    assert json.loads((out / "config.json").read_text())["rope_scaling"] == {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}


@pytest.mark.slow
def test_megatron_lms_default_fully_parallel_save_reads_as_the_plain_one(native, tmp_path):
    """Megatron-LM 0.16 saves torch_dist through FullyParallelSaveStrategyWrapper unless told
    --no-ckpt-fully-parallel-save: at DP2 each data-parallel rank writes part of the replicated shards. The same two
    training steps saved so (fps_distopt) and without it (optim_distopt) give the same weights, bit for bit, and their
    files really differ in who wrote what (the second rank's .distcp holds model weights only in the first)."""
    from safetensors.torch import load_file

    from toolkit.checkpoint import torch_dist

    quiet = dict(vocab_size=VOCAB, progress=False, log=lambda *_: None)
    a = load_file(str(convert(native["fps_distopt"], tmp_path / "a", "hf", **quiet) / "model.safetensors"))
    b = load_file(str(convert(native["optim_distopt"], tmp_path / "b", "hf", **quiet) / "model.safetensors"))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)

    def weight_files(kind: str) -> set[str]:
        r = torch_dist.Reader(native[kind] / "iter_0000002")
        return {info.relative_path for index, info in r.metadata.storage_data.items()
                if not index.fqn.startswith("optimizer.")}

    assert len(weight_files("fps_distopt")) > len(weight_files("optim_distopt"))
