"""`toolkit convert --no-verify` between Hugging Face folders, toolkit Megatron layouts, Megatron-LM's legacy layout
and Megatron-Core's torch_dist copies bytes without loading torch (toolkit/checkpoint/copy_only.py). It must write
byte for byte what the full, verified path writes;
decline every conversion that needs tensors; hand a parameter it cannot copy to the full path with nothing left
behind; and let the full path report a damaged source in its own words."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tiny_hf import write_llama
from toolkit.checkpoint import byte_ranges, copy_only
from toolkit.checkpoint.convert import CopyCheck, convert
from toolkit.cli import main
from toolkit.format import manifest
from toolkit.format import safetensors_stream as st
from toolkit.format.names import META, model_file

REPO = Path(__file__).resolve().parents[1]
# each step's source is an earlier step's output: split, merge + split across stages and virtual chunks, merge; then
# Megatron-LM's legacy layout and Megatron-Core's torch_dist (pickles and torch.save zips: toolkit/format/pt_write.py
# writes them, pt_zip.py reads them) and back
STEPS = [("hf", "tp2pp2", ["--to", "megatron", "--tp", "2", "--pp", "2"]),
         ("tp2pp2", "tp1pp2vpp2", ["--to", "megatron", "--tp", "1", "--pp", "2", "--vpp", "2"]),
         ("tp1pp2vpp2", "tp4", ["--to", "megatron", "--tp", "4", "--pp", "1"]),
         ("tp4", "back", ["--to", "hf"]),
         ("tp2pp2", "mlm", ["--to", "megatron_lm", "--tp", "1", "--pp", "2", "--vpp", "2"]),
         ("mlm", "mlm_tp2", ["--to", "megatron_lm", "--tp", "2", "--vocab-size", "500"]),
         ("mlm_tp2", "mlm_back", ["--to", "hf", "--vocab-size", "500"]),
         ("tp4", "td", ["--to", "torch_dist", "--tp", "2", "--pp", "2"]),
         ("td", "td_mlm", ["--to", "megatron_lm", "--tp", "2", "--pp", "2", "--vocab-size", "500"]),
         ("td_mlm", "td_back", ["--to", "hf", "--vocab-size", "500"])]
CHILD = r'''
import json, sys
from toolkit.cli import main
root, *steps = sys.argv[1:]
codes = [main(["convert", f"{root}/{src}", f"{root}/{dst}", *json.loads(args), "--no-verify", "--quiet"])
         for src, dst, args in zip(steps[0::3], steps[1::3], steps[2::3])]
print("RESULT " + json.dumps({"codes": codes, "loaded": [m for m in ("torch", "transformers", "pydantic")
                                                         if m in sys.modules]}))
'''


def _write_hf(folder: Path, tied: bool) -> None:
    write_llama(folder, layers=4, tied=tied, seed=1, tokenizer=True)


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module", params=["untied", "tied"])
def chain(request, tmp_path_factory) -> tuple[Path, Path]:
    """The chain made by `toolkit convert --no-verify` in a fresh interpreter (copied, without torch, transformers
    or the recipe schema's pydantic), and the same chain made in this process by the full path with verification."""
    root = tmp_path_factory.mktemp(f"copy_only_{request.param}")
    fast, full = root / "fast", root / "full"
    _write_hf(fast / "hf", request.param == "tied")
    _write_hf(full / "hf", request.param == "tied")
    argv = [x for src, dst, args in STEPS for x in (src, dst, json.dumps(args))]
    proc = subprocess.run([sys.executable, "-c", CHILD, str(fast), *argv], cwd=REPO, capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.split("RESULT ", 1)[1])
    assert result == {"codes": [0] * len(STEPS), "loaded": []}, (result, proc.stderr[-2000:])  # nor the recipe schema
    with pytest.MonkeyPatch.context() as mp:  # verified, and through memory: the full path
        mp.setattr(copy_only, "convert_by_copy", lambda *a, **kw: (None, False))
        for src, dst, args in STEPS:
            assert main(["convert", str(full / src), str(full / dst), *args, "--quiet"]) == 0
    return fast, full


@pytest.mark.parametrize("step", [dst for _, dst, _ in STEPS])
def test_copied_without_torch_byte_for_byte_as_the_full_path_writes(chain, step):
    """Every file (tensors, headers, index, config, tokenizer, toolkit_meta.json with its manifest, the pointer)."""
    fast, full = chain
    got, want = _files(fast / step), _files(full / step)
    assert sorted(got) == sorted(want)
    assert [name for name in want if got[name] != want[name]] == []


def test_the_chain_comes_back_bit_exact(chain):
    fast, _ = chain
    for back in ("back", "mlm_back", "td_back"):
        assert (fast / back / "model.safetensors").read_bytes() == (fast / "hf" / "model.safetensors").read_bytes()


@pytest.mark.parametrize("kw", [dict(verify=True), dict(dtype="fp32"), dict(vocab_size=512), dict(to="deepspeed"),
                                dict(to="torch_dist", dtype="fp32"), dict(to="megatron_lm", dtype="fp32"),
                                dict(to="hf", tp=2)], ids=str)
def test_conversions_that_need_tensors_are_declined_untouched(tmp_path, kw):
    """(verify=True with no `verifier`: convert() and the command give one, the test below.)"""
    _write_hf(tmp_path / "hf", False)
    args = dict(to="megatron", verify=False, progress=False, log=lambda *_: None) | kw
    to = args.pop("to")
    assert copy_only.convert_by_copy(tmp_path / "hf", tmp_path / "out", to, **args) == (None, False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_optimizer_state_is_left_to_the_full_path(tmp_path):
    """A toolkit source with optimizer files converts --to megatron with them (the full path); --weights-only and
    --to hf copy its weights."""
    _write_hf(tmp_path / "hf", False)
    convert(tmp_path / "hf", tmp_path / "tp2", "megatron", tp=2, verify=False, progress=False, log=lambda *_: None)
    tag = tmp_path / "tp2" / (tmp_path / "tp2" / "latest_complete").read_text().strip()
    (tag / "optim_tp00_pp000.safetensors").write_bytes(b"")  # enough to decline; the full path would refuse it
    meta = json.loads((tag / "toolkit_meta.json").read_text())  # listed, as a save lists every file it writes
    meta["files"]["optim_tp00_pp000.safetensors"] = manifest.file_entry(tag / "optim_tp00_pp000.safetensors")
    (tag / "toolkit_meta.json").write_text(json.dumps(meta))
    quiet = dict(verify=False, progress=False, log=lambda *_: None)
    assert copy_only.convert_by_copy(tmp_path / "tp2", tmp_path / "a", "megatron", tp=1, **quiet) == (None, False)
    assert copy_only.convert_by_copy(tmp_path / "tp2", tmp_path / "b", "megatron", tp=1, weights_only=True,
                                     **quiet) == (tmp_path / "b", True)
    assert copy_only.convert_by_copy(tmp_path / "tp2", tmp_path / "c", "hf", **quiet) == (tmp_path / "c", True)


def test_a_parameter_it_cannot_copy_goes_to_the_full_path_with_nothing_left_behind(tmp_path, monkeypatch):
    _write_hf(tmp_path / "hf", False)
    lines: list[str] = []
    quiet = dict(verify=False, progress=False, log=lines.append, verbose=True)
    real = byte_ranges.plan

    def refuse_the_last(source, target, entry, *args, **kw):
        return None if entry.megatron_name == "decoder.final_layernorm.weight" else real(source, target, entry,
                                                                                          *args, **kw)

    monkeypatch.setattr(byte_ranges, "plan", refuse_the_last)
    assert copy_only.convert_by_copy(tmp_path / "hf", tmp_path / "out", "megatron", tp=2, pp=2, **quiet) == (None,
                                                                                                           True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # the partial output is gone
    assert lines[-1] == ("decoder.final_layernorm.weight is not a copy of source byte ranges: converting through "
                         "memory instead")
    assert convert(tmp_path / "hf", tmp_path / "out", "megatron", tp=2, pp=2, **quiet) == tmp_path / "out"
    monkeypatch.setattr(byte_ranges, "plan", real)
    assert convert(tmp_path / "hf", tmp_path / "ref", "megatron", tp=2, pp=2, verify=True, progress=False,
                   log=lambda *_: None, copy=False) == tmp_path / "ref"
    assert _files(tmp_path / "out") == _files(tmp_path / "ref")


def test_replicated_copies_that_differ_are_refused_by_the_full_path_in_one_line(tmp_path, capsys):
    """TP rank 1's copy of a norm changed (its manifest made to match, so only the values tell): the byte planner
    gives the two copies their own addresses, the rule refuses them, and the full path says why, writing nothing."""
    _write_hf(tmp_path / "hf", False)
    convert(tmp_path / "hf", tmp_path / "tp2", "megatron", tp=2, verify=False, progress=False, log=lambda *_: None)
    tag = tmp_path / "tp2" / (tmp_path / "tp2" / "latest_complete").read_text().strip()
    tensors, metadata = st.load(model_file(tag, 1, 0))
    tensors["chunk0.decoder.layers.1.input_layernorm.weight"] += 1
    st.save(tensors, model_file(tag, 1, 0), metadata)
    meta = json.loads((tag / META).read_text())
    meta["files"] = manifest.complete(tag, {})
    (tag / META).write_text(json.dumps(meta))
    capsys.readouterr()
    assert main(["convert", str(tmp_path / "tp2"), str(tmp_path / "out"), "--to", "hf", "--no-verify", "--quiet"]) != 0
    out, err = capsys.readouterr()
    err = err.strip().splitlines()
    assert len(err) == 1 and "replicated tensor differs between tp rank 0 and tp rank 1" in err[0], err
    assert out.count("converting toolkit Megatron") == 1, out  # the copy path's line; the full path says no more
    assert "not a copy of source byte ranges" not in out  # said with --verbose only: the error is the one line
    assert not (tmp_path / "out").exists()


def test_a_folder_transformers_saved_copies_as_the_full_path_writes(tiny4l_hf_checkpoint, tmp_path):
    """A Hugging Face folder from transformers' own save_pretrained (its config, its safetensors header and
    metadata, generation_config.json) goes the torch-free way and comes out as the verified path writes it."""
    quiet = dict(progress=False, log=lambda *_: None)
    for to, kw in (("megatron", dict(tp=2, pp=2, vpp=2)), ("hf", {})):
        copied, begun = copy_only.convert_by_copy(tiny4l_hf_checkpoint, tmp_path / f"copied_{to}", to,
                                                  verify=False, **kw, **quiet)
        assert (copied, begun) == (tmp_path / f"copied_{to}", True)
        convert(tiny4l_hf_checkpoint, tmp_path / f"full_{to}", to, **kw, **quiet, copy=False)  # verified
        assert _files(tmp_path / f"copied_{to}") == _files(tmp_path / f"full_{to}")


@pytest.mark.parametrize("to", [["torch_dist", "--tp", "2", "--pp", "2"], ["hf"]], ids=["torch_dist", "hf"])
def test_a_verified_conversion_copies_then_runs_the_full_paths_check(tmp_path, capsys, to):
    """Without --no-verify the bytes still go file to file (torch loads on a background thread meanwhile), then the
    full path's verification runs on the output: the same files as the full path, the same checks passed."""
    _write_hf(tmp_path / "hf", False)
    src = tmp_path / "hf"
    if to[0] == "hf":  # from a Megatron layout back to Hugging Face, so the check merges TP shards
        convert(src, tmp_path / "tp2", "megatron", tp=2, verify=False, progress=False, log=lambda *_: None)
        src = tmp_path / "tp2"
    capsys.readouterr()
    assert main(["convert", str(src), str(tmp_path / "out"), "--to", *to, "--quiet", "--verbose"]) == 0
    out = capsys.readouterr().out
    assert "file to file, verified after)" in out and "torch-free" not in out, out
    assert "verified: transformers' LlamaForCausalLM gives the source's logits" in out, out
    assert "tensors read back bit-exactly" in out and "phases: import-wait " in out and "; verify " in out, out
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(copy_only, "convert_by_copy", lambda *a, **kw: (None, False))
        assert main(["convert", str(src), str(tmp_path / "full"), "--to", *to, "--quiet"]) == 0
    assert _files(tmp_path / "out") == _files(tmp_path / "full")


def test_a_verified_conversion_it_cannot_copy_goes_to_the_full_path_which_verifies(tmp_path, monkeypatch):
    _write_hf(tmp_path / "hf", False)
    lines: list[str] = []
    real = byte_ranges.plan

    def refuse_the_last(source, target, entry, *args, **kw):
        return None if entry.megatron_name == "decoder.final_layernorm.weight" else real(source, target, entry,
                                                                                          *args, **kw)

    monkeypatch.setattr(byte_ranges, "plan", refuse_the_last)
    assert copy_only.convert_by_copy(tmp_path / "hf", tmp_path / "out", "megatron", tp=2, pp=2, progress=False,
                                     log=lines.append, verifier=lambda: CopyCheck) == (None, True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # the partial output is gone, nothing was checked
    assert not any(line.startswith("verified") for line in lines), lines
    assert convert(tmp_path / "hf", tmp_path / "out", "megatron", tp=2, pp=2, progress=False, log=lines.append,
                   copy=False, announced=True) == tmp_path / "out"
    assert any("read back bit-exactly" in line for line in lines), lines
