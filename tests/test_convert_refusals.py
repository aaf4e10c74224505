"""Inputs a second new-user trial broke (2026-12-07), each now refused with nothing written: a tied config with its
own lm_head and model.safetensors beside an index of other files (both converted "verified" to what transformers
does not load), weights of two dtypes, config values of the wrong type, JSON nested too deep, pointer files that
name no folder, options that do not apply, damaged Megatron-LM optimizer state, torch_dist metadata that is not
DCP metadata or of another backend version, a huge chunk list, and rank folders of another layout. The trial of
2026-12-06 is in test_convert_hardening.py, whose fixtures and helpers these share."""
from __future__ import annotations

import json
import pickle
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from test_convert_hardening import _legacy_case, legacy, listing, one_line, run, sources  # noqa: F401 - fixtures

from toolkit import cli
from toolkit.checkpoint.dist_keys import tiling_problem


def _copy_hf(sources, tmp_path: Path, name: str) -> Path:
    import shutil

    folder = tmp_path / name
    shutil.copytree(sources / "hf", folder)
    return folder


def _edit_config(folder: Path, **fields) -> None:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **fields}))


def _tensors(folder: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(folder / "model.safetensors")


def _save(tensors: dict, folder: Path, name: str = "model.safetensors") -> None:
    from safetensors.torch import save_file

    save_file(tensors, folder / name, {"format": "pt"})


def test_a_tied_config_with_its_own_lm_head_is_refused(sources, tmp_path, capsys):
    """tie_word_embeddings true, and an lm_head.weight that differs from the embeddings: transformers loads it untied,
    but the conversion dropped lm_head and said "verified" (the output's logits were another model's)."""
    src = _copy_hf(sources, tmp_path, "src")
    _edit_config(src, tie_word_embeddings=True)
    tensors = _tensors(src)
    _save({**tensors, "lm_head.weight": tensors["model.embed_tokens.weight"] + 1}, src)
    before = listing(tmp_path)
    code = cli.main(["convert", "--quiet", str(src), str(tmp_path / "out"), "--to", "hf"])
    err = capsys.readouterr().err
    assert code == 2 and "lm_head.weight: differs from model.embed_tokens.weight, yet config.json ties them" in err
    assert listing(tmp_path) == before
    _save({**tensors, "lm_head.weight": tensors["model.embed_tokens.weight"].clone()}, src)  # the same bytes: fine
    assert cli.main(["convert", "--quiet", str(src), str(tmp_path / "out"), "--to", "hf"]) == 0
    assert "lm_head.weight" not in _tensors(tmp_path / "out")


def test_a_folder_with_model_safetensors_and_an_index_of_other_files_is_refused(sources, tmp_path, capsys):
    """transformers loads model.safetensors when both are there; the converter read the index's shards and said
    "verified" for weights transformers never loads from that folder."""
    src = _copy_hf(sources, tmp_path, "src")
    tensors = _tensors(src)
    _save(tensors, src, "model-00001-of-00001.safetensors")
    (src / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: "model-00001-of-00001.safetensors" for n in tensors}}))
    _save({n: t * 2 for n, t in tensors.items()}, src)
    before = listing(tmp_path)
    code, text = run(["convert", "--quiet", str(src), str(tmp_path / "out"), "--to", "hf"], capsys)
    one_line(code, text, "holds both model.safetensors and model.safetensors.index.json, which names other files")
    assert listing(tmp_path) == before


def test_weights_of_two_dtypes_need_dtype(sources, tmp_path, capsys):
    src = _copy_hf(sources, tmp_path, "src")
    tensors = _tensors(src)
    _save({**tensors, "model.norm.weight": tensors["model.norm.weight"].float()}, src)
    before = listing(tmp_path)
    for to in ("hf", "megatron"):
        code, text = run(["convert", "--quiet", str(src), str(tmp_path / "out"), "--to", to], capsys)
        one_line(code, text, "holds weights of more than one dtype (20 BF16, 1 F32); pass --dtype bf16, fp16 or fp32")
    assert listing(tmp_path) == before
    # inspect calls it complete (it is) and says what convert needs (it said nothing until 2026-12-07)
    assert cli.main(["inspect", str(src)]) == 0
    assert "note: weights of more than one dtype: toolkit convert writes them in one, with --dtype" in \
        capsys.readouterr().out
    assert cli.main(["convert", "--quiet", str(src), str(tmp_path / "out"), "--to", "hf", "--dtype", "bf16"]) == 0
    assert {t.dtype for t in _tensors(tmp_path / "out").values()} == {torch.bfloat16}


def _quantize(tensors: dict, how: str) -> dict:
    """A quantized release's tensors, as each method stores them: FP8 weights with a weight_scale_inv beside them,
    bitsandbytes int8 weights with SCB and weight_format, GPTQ's packed qweight with scales instead of weight, or
    integer weights under the weight names alone (a hand-made file)."""
    out = {}
    for name, t in tensors.items():
        if not name.endswith("proj.weight"):
            out[name] = t
        elif how == "fp8":
            out[name] = t.float().to(torch.float8_e4m3fn)
            out[name.replace("weight", "weight_scale_inv")] = torch.ones(1, 1)
        elif how in ("bitsandbytes", "int8"):
            out[name] = (t.float() * 100).to(torch.int8)
            if how == "bitsandbytes":
                out[name.replace("weight", "SCB")] = torch.ones(t.shape[0])
                out[name.replace("weight", "weight_format")] = torch.zeros(1, dtype=torch.uint8)
        else:
            out[name.replace("weight", "qweight")] = torch.zeros(t.shape[1] // 8, t.shape[0], dtype=torch.int32)
            out[name.replace("weight", "scales")] = torch.ones(1, t.shape[0], dtype=torch.float16)
    return out


@pytest.mark.parametrize("how, config, phrase", [
    ("fp8", True, "describes a quantized model (quantization_config, quant_method: fp8)"),
    ("bitsandbytes", True, "describes a quantized model (quantization_config, quant_method: bitsandbytes)"),
    ("gptq", True, "describes a quantized model (quantization_config, quant_method: gptq)"),
    ("fp8", False, "as F8_E4M3, an 8-bit float of a quantized model"),
    ("int8", False, "down_proj.weight and 13 more as I8, not a floating-point dtype"),
])
def test_a_quantized_model_is_refused_as_one(sources, tmp_path, capsys, how, config, phrase):
    """Quantized releases (FP8, bitsandbytes, GPTQ) were refused as unknown tensors, with a fix pointing at the
    family's map, or as missing tensors, or as a file to re-copy; integer weights under the weight names were cast
    to floats by --dtype without a word (until 2026-12-07). Each is now one line that says what the folder is."""
    src = _copy_hf(sources, tmp_path, "src")
    _save(_quantize(_tensors(src), how), src)
    if config:
        _edit_config(src, quantization_config={"quant_method": how})
    before = listing(tmp_path)
    for to, extra in (("hf", []), ("megatron", ["--dtype", "fp32"])):
        code, text = run(["convert", "--quiet", str(src), str(tmp_path / "out"), "--to", to, *extra], capsys)
        one_line(code, text, phrase)
        assert "unquantized" in text
    assert listing(tmp_path) == before


def test_a_recipe_on_a_quantized_model_is_refused(sources, tmp_path):
    from toolkit.recipe.presets import read_hf_config

    src = _copy_hf(sources, tmp_path, "src")
    _edit_config(src, quantization_config={"quant_method": "awq", "bits": 4})
    _, problems = read_hf_config(src / "config.json")
    assert [p.key for p in problems] == ["model.hf_path"]
    assert "quantized model (quantization_config, quant_method: awq)" in problems[0].message


@pytest.mark.parametrize("field, value", [("num_attention_heads", 4.0), ("hidden_size", "64"), ("num_key_value_heads", True),
                                          ("rms_norm_eps", "1e-5")])
def test_a_config_value_of_the_wrong_type_is_refused(sources, tmp_path, capsys, field, value):
    """4.0 heads reached the output's safetensors header as the shape [64.0, 64] (unloadable) with --no-verify; a
    string eps crashed the check with a transformers traceback. `inspect` called both complete."""
    src = _copy_hf(sources, tmp_path, "src")
    _edit_config(src, **{field: value})
    before = listing(tmp_path)
    code, text = run(["convert", "--quiet", "--no-verify", str(src), str(tmp_path / "out"), "--to", "hf"], capsys)
    one_line(code, text, f"llama config gives {field} = {value!r}: sizes must be positive whole numbers")
    assert listing(tmp_path) == before
    assert cli.main(["inspect", str(src), "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["complete"] is False


@pytest.mark.parametrize("where", ["config.json", "model.safetensors.index.json", "header"])
def test_json_nested_too_deep_is_one_line(sources, tmp_path, capsys, where):
    """Nested 100,000 deep: a RecursionError traceback of 40 lines before."""
    import struct

    src = _copy_hf(sources, tmp_path, "src")
    deep = "[" * 100_000 + "]" * 100_000
    if where == "header":
        raw = (src / "model.safetensors").read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        text = deep.encode().ljust(n)
        (src / "model.safetensors").write_bytes(raw[:8].replace(raw[:8], struct.pack("<Q", len(text))) + text
                                                + raw[8 + n:])
    else:
        (src / where).write_text(deep)
    before = listing(tmp_path)
    code, text = run(["convert", "--quiet", str(src), str(tmp_path / "out"), "--to", "hf"], capsys)
    one_line(code, text, "maximum recursion depth exceeded")
    assert listing(tmp_path) == before


@pytest.mark.parametrize("content", [b"\xff\xfe\x00", b"a" * 300], ids=["binary", "long"])
def test_a_pointer_file_that_names_no_folder_is_one_line(sources, tmp_path, capsys, content):
    """A checkpoint's pointer file (here a toolkit Megatron latest_complete; DeepSpeed's latest, Megatron-LM's tracker
    and latest_universal are read the same way) holding NUL bytes crashed with "embedded null byte", and a 50 MB one
    with "File name too long" after reading it whole."""
    import shutil

    assert cli.main(["convert", "--quiet", "--no-verify", str(sources / "hf"), str(tmp_path / "mg"), "--to",
                     "megatron"]) == 0
    src = tmp_path / "src"
    shutil.copytree(tmp_path / "mg", src)
    (src / "latest_complete").write_bytes(content)
    capsys.readouterr()
    before = listing(tmp_path)
    code, text = run(["convert", "--quiet", str(src), str(tmp_path / "out"), "--to", "hf"], capsys)
    one_line(code, text, "latest_complete holds ")
    assert listing(tmp_path) == before


@pytest.mark.parametrize("option", [["--config", "x"], ["--dp", "4"], ["--fp32"], ["--vocab-size", "300"],
                                    ["--verify", "--no-verify"]])
def test_an_option_that_does_not_apply_is_refused_not_ignored(sources, tmp_path, capsys, option):
    """HF -> HF with --config qwen2 --fp32 --dp 4 exited 0 with a llama bf16 output: each option was ignored."""
    before = listing(tmp_path)
    code, text = run(["convert", "--quiet", str(sources / "hf"), str(tmp_path / "out"), "--to", "hf", *option], capsys)
    one_line(code, text, f"{option[0]} ")
    assert listing(tmp_path) == before


@pytest.mark.parametrize("to,option", [("deepspeed", ["--dtype", "bf16"]), ("deepspeed", ["--weights-only"]),
                                       ("deepspeed", ["--tp", "2"]), ("universal", ["--config", "x"]),
                                       ("universal", ["--vocab-size", "500"])])
def test_an_option_that_a_deepspeed_target_does_not_apply_is_refused(sources, tmp_path, capsys, to, option):
    """--to deepspeed and --to universal rewrite DeepSpeed's own files as they are: `--dp 1 --dtype bf16` wrote the
    fp32 state, exit 0. tests/test_deepspeed_plain.py refuses them on DeepSpeed's own files too."""
    before = listing(tmp_path)
    code, text = run(["convert", "--quiet", str(sources / "hf"), str(tmp_path / "out"), "--to", to,
                      *(["--dp", "1"] if to == "deepspeed" else []), *option], capsys)
    one_line(code, text, "does not apply to it; drop it")
    assert f": {option[0]}" in text
    assert listing(tmp_path) == before


def test_inspect_of_a_torch_dist_folder_missing_a_file_is_an_incomplete_report(sources, tmp_path, capsys):
    """A missing .distcp file is an incomplete checkpoint (exit 1, the reader's line as its problem), as a legacy
    checkpoint's missing rank file is; it was an error (exit 2) until 2026-12-07."""
    import shutil

    td = shutil.copytree(sources / "td", tmp_path / "td")
    victim = next(td.glob("iter_*/*.distcp"))
    victim.unlink()
    code, text = run(["inspect", str(td)], capsys)
    assert code == 1 and "megatron torch_dist checkpoint, INCOMPLETE" in text, text
    assert f"problem: {victim} is missing: the torch_dist checkpoint is incomplete" in text, text


def test_inspect_of_a_config_that_is_not_json_is_one_line(sources, tmp_path, capsys):
    src = _copy_hf(sources, tmp_path, "src")
    (src / "config.json").write_text("{broken")
    code, text = run(["inspect", str(src)], capsys)
    one_line(code, text, "config.json is not a Hugging Face config.json")


def _plain_optimizer_on_rank0(a, b) -> None:
    a["optimizer"] = {"optimizer": {"state": {}, "param_groups": []}}


def _distributed_optimizer(a, b) -> None:
    for state in (a, b):
        state["args"].use_distributed_optimizer = True
        state["optimizer"] = {"optimizer": {"param_groups": []}}


@pytest.mark.parametrize("change, phrase", [
    (_plain_optimizer_on_rank0, "mp_rank_01/model_optim_rng.pt: holds no optimizer state, though the other ranks'"),
    (_distributed_optimizer, "mp_rank_00/distrib_optim.pt: is not a regular file"),
], ids=["plain optimizer on one rank", "distrib_optim.pt a folder"])
def test_legacy_optimizer_state_that_is_damaged_is_not_taken_for_none(legacy, tmp_path, capsys, change, phrase):
    """One rank's plain optimizer state missing, or a folder where distrib_optim.pt goes: both converted "weights
    only" with exit 0 (and a note blaming chained optimizers, or --no-save-optim) instead of saying what is wrong."""
    src = _legacy_case(legacy, tmp_path, change)
    if change is _distributed_optimizer:
        (src / "iter_0000000" / "mp_rank_00" / "distrib_optim.pt").mkdir()
    code, text = run(["convert", "--quiet", str(src), str(tmp_path / "o"), "--to", "megatron", "--vocab-size", "500"],
                     capsys)
    assert code == 2 and phrase in text and "Traceback" not in text, text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mlm"]
    assert cli.main(["convert", "--quiet", "--weights-only", str(src), str(tmp_path / "o"), "--to", "megatron",
                     "--vocab-size", "500"]) == 0  # the fix it names


def test_torch_dist_metadata_that_is_not_dcp_metadata_is_one_line(sources, tmp_path, capsys):
    """A .metadata that unpickles to an int: an AttributeError traceback before; a tensor of 5,002 dimensions whose
    chunks have 2: a numpy ValueError traceback."""
    import shutil

    src = tmp_path / "td"
    shutil.copytree(sources / "td", src)
    meta = next(src.glob("iter_*")) / ".metadata"
    original = meta.read_bytes()
    meta.write_bytes(pickle.dumps(5))
    code, text = run(["convert", "--quiet", str(src), str(tmp_path / "o"), "--to", "hf", "--vocab-size", "500"], capsys)
    one_line(code, text, ".metadata holds a pickled int, not torch DCP metadata")
    code, text = run(["inspect", str(src)], capsys)  # an incomplete report, exit 1
    assert code == 1 and ".metadata holds a pickled int, not torch DCP metadata" in text.splitlines()[1], text
    assert tiling_problem((4, 8), [SimpleNamespace(offsets=(0,) * 5002, sizes=(4,) * 5002)]) == (
        "has a chunk of 5002 dimensions (sizes: 5002), but its shape has 2")
    meta.write_bytes(original)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["td"]


def test_tiling_is_checked_in_n_log_n_for_grids_and_refused_past_a_bound_otherwise():
    """A .metadata listing 200,000 chunks of one tensor: the pair-by-pair check ran for minutes (it never finished).
    A grid (what every save writes) is checked by sorting; other tilings pair by pair up to PAIRWISE_MAX chunks."""
    import time

    from toolkit.checkpoint.dist_keys import PAIRWISE_MAX

    chunk = SimpleNamespace
    n = 200_000
    t0 = time.monotonic()
    assert tiling_problem((n,), [chunk(offsets=(i,), sizes=(1,)) for i in range(n)]) is None
    grid = [chunk(offsets=(r, c), sizes=(2, 3)) for r in range(0, 400, 2) for c in range(0, 300, 3)]  # 20,000
    assert tiling_problem((400, 300), grid) is None
    assert tiling_problem((400, 300), grid[:-1]) == (  # one missing: no longer a grid, and over the bound
        "has 19999 chunks that do not tile it as a grid (each dimension cut into the same pieces), as every save does")
    small = [chunk(offsets=(r, c), sizes=(2, 3)) for r in range(0, 40, 2) for c in range(0, 30, 3)]
    assert tiling_problem((40, 30), small[:-1]) == "has chunks that cover 1194 of its 1200 values"  # within it
    assert tiling_problem((400, 300), [*grid[:-1], chunk(offsets=(398, 296), sizes=(2, 4))]) == (
        "has 20000 chunks that do not tile it as a grid (each dimension cut into the same pieces), as every save does")
    assert time.monotonic() - t0 < 30  # seconds here; minutes to hours before
    # not a grid, within the bound: checked pair by pair, and a tiling that is not a grid still passes
    rows = [chunk(offsets=(0, 0), sizes=(2, 2)), chunk(offsets=(0, 2), sizes=(2, 2)), chunk(offsets=(2, 0), sizes=(2, 4))]
    assert len(rows) <= PAIRWISE_MAX and tiling_problem((4, 4), rows) is None
    assert tiling_problem((4, 4), [*rows[:2], chunk(offsets=(1, 0), sizes=(3, 4))]) == (
        "has chunks at [0, 0] and [1, 0] that overlap")


def test_a_tracker_of_too_many_digits_is_one_line(legacy, tmp_path, capsys):
    """251-255 digits made iter_<digits> a name too long for the file system: an OSError traceback."""
    import shutil

    src = tmp_path / "mlm"
    shutil.copytree(legacy, src)
    (src / "latest_checkpointed_iteration.txt").write_text("9" * 251)
    code, text = run(["convert", str(src), str(tmp_path / "o"), "--to", "hf", "--vocab-size", "500"], capsys)
    one_line(code, text, "not an iteration number or 'release'")


def test_dst_equal_to_src_is_called_an_overlap_before_it_is_called_taken(sources, capsys):
    """Without --overwrite it said "already exists; pass --overwrite", and with it "overlaps the source"."""
    code, text = run(["convert", str(sources / "hf"), str(sources / "hf"), "--to", "hf"], capsys)
    one_line(code, text, "overlaps the source")


def test_a_destination_through_a_folder_that_does_not_exist_leaves_no_folder_behind(sources, tmp_path):
    """`convert SRC a/new/../out`: the output was written to a/out, and an empty a/new was left behind."""
    assert cli.main(["convert", "--quiet", "--no-verify", str(sources / "hf"), str(tmp_path / "new" / ".." / "out"),
                     "--to", "hf"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_rank_folders_of_another_layout_are_refused(legacy, tmp_path, capsys):
    """A TP2 save with a third rank's folder beside it (a TP4 save copied over it): the extra folder was skipped."""
    import shutil

    src = tmp_path / "mlm"
    shutil.copytree(legacy, src)
    shutil.copytree(src / "iter_0000000" / "mp_rank_01", src / "iter_0000000" / "mp_rank_02")
    code, text = run(["convert", str(src), str(tmp_path / "o"), "--to", "hf", "--vocab-size", "500"], capsys)
    one_line(code, text, "holds mp_rank_02, which its args' layout (tp=2 pp=1) does not use")


@pytest.mark.parametrize("field, value", [("sharded_backend_version", 99), ("common_backend", "zarr")])
def test_a_torch_dist_backend_this_reader_does_not_know_is_refused(sources, tmp_path, capsys, field, value):
    """metadata.json's versions were not read: a backend version 99 or a zarr common state was converted as if known."""
    import shutil

    src = tmp_path / "td"
    shutil.copytree(sources / "td", src)
    meta = next(src.glob("iter_*")) / "metadata.json"
    meta.write_text(json.dumps({**json.loads(meta.read_text()), field: value}))
    code, text = run(["convert", str(src), str(tmp_path / "o"), "--to", "hf", "--vocab-size", "500"], capsys)
    one_line(code, text, "metadata.json gives sharded_backend_version ")
    assert repr(value) in text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["td"]


def test_a_safetensors_header_listing_too_many_tensors_is_refused_before_it_is_parsed(sources, tmp_path, capsys,
                                                                                       monkeypatch):
    """A 98 MiB header of 1.5 million one-byte tensors took 2.35 GB to parse before it was refused; the tensors are
    now counted in the raw header first (the bound lowered here, so that the file stays small)."""
    from toolkit.format import safetensors_stream as st

    folder = _copy_hf(sources, tmp_path, "many")
    _save({f"t{i}": torch.zeros(1, dtype=torch.uint8) for i in range(11)}, folder, "extra.safetensors")
    monkeypatch.setattr(st, "_MAX_TENSORS", 10)
    for argv in (["convert", str(folder), str(tmp_path / "o"), "--to", "hf"], ["inspect", str(folder)]):
        code, text = run(argv, capsys)
        assert code != 0 and "extra.safetensors lists 11 tensors, more than the 10 this toolkit reads" in text, text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["many"]
    monkeypatch.setattr(st, "_MAX_TENSORS", 11)
    with st.Reader(folder / "extra.safetensors") as reader:
        assert len(reader.keys()) == 11


def test_torch_dist_files_past_the_open_file_limit_raise_it_or_say_what_to_raise(tmp_path):
    """locate() keeps every .distcp file open: a save of more files than `ulimit -n` would have failed with EMFILE
    part way through a conversion. Run in a child process, whose limits this test may lower."""
    import subprocess
    import sys

    code = f"""
import resource
from pathlib import Path
from toolkit.checkpoint.torch_dist import _descriptors
from toolkit.errors import ToolkitError
resource.setrlimit(resource.RLIMIT_NOFILE, (300, 2000))
_descriptors(1000, Path("x"))
assert resource.getrlimit(resource.RLIMIT_NOFILE) == (1256, 2000)
resource.setrlimit(resource.RLIMIT_NOFILE, (300, 300))
try:
    _descriptors(1000, Path("{tmp_path}"))
except ToolkitError as e:
    print(e)
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == (f"{tmp_path} holds 1000 .distcp files, more than this process may open (ulimit -n: "
                                   "hard limit 300); raise it to at least 1256 (ulimit -Hn as root, or the job's "
                                   "limits) and rerun")


def test_a_megatron_folder_without_its_tracker_names_the_iteration_to_pass(legacy, tmp_path, capsys):
    """It listed every format this toolkit reads, Megatron-LM's among them, as if the folder were none of them."""
    import shutil

    src = tmp_path / "mlm"
    shutil.copytree(legacy, src)
    (src / "latest_checkpointed_iteration.txt").unlink()
    for argv in (["convert", str(src), str(tmp_path / "o"), "--to", "hf", "--vocab-size", "500"], ["inspect", str(src)]):
        code, text = run(argv, capsys)
        one_line(code, text, f"{src} holds Megatron iter_* folders (1) but no latest_checkpointed_iteration.txt naming "
                             f"the one to read: pass that folder itself, e.g. {src / 'iter_0000000'}")
    assert cli.main(["convert", "--quiet", str(src / "iter_0000000"), str(tmp_path / "o"), "--to", "hf",
                     "--vocab-size", "500"]) == 0


def test_ep_on_a_dense_model_says_it_has_no_experts(sources, tmp_path, capsys):
    """It said "ep: no experts do not split over ep = 2 expert-parallel ranks" (a trial of 2026-12-07)."""
    code, text = run(["convert", "--quiet", str(sources / "hf"), str(tmp_path / "out"), "--to", "megatron",
                      "--ep", "2"], capsys)
    assert code == 2 and "ep: a dense model has no experts to split over ep = 2 expert-parallel ranks" in text, text
    assert not (tmp_path / "out").exists()


def test_a_tp_above_the_key_value_heads_is_said(sources, tmp_path, capsys):
    """Megatron-Core 0.16 takes tp > num_query_groups (a plain row split of the fused q/k/v, which its attention
    all-gathers), so convert writes it; the toolkit's own training refuses it, which convert did not say."""
    assert cli.main(["convert", "--no-verify", str(sources / "hf"), str(tmp_path / "tp4"), "--to", "megatron", "--tp",
                     "4"]) == 0
    assert "tensor parallelism: tp=4 is more than the model's 2 key/value heads, so each query group's q, k and v " \
           "rows are split over 2 ranks" in capsys.readouterr().out
    assert cli.main(["convert", "--no-verify", str(sources / "hf"), str(tmp_path / "tp2"), "--to", "megatron", "--tp",
                     "2"]) == 0
    assert "tensor parallelism" not in capsys.readouterr().out


@pytest.mark.parametrize("to", ["hf", "megatron"])
def test_a_cast_to_fp16_that_overflows_is_refused_not_verified(sources, tmp_path, capsys, to):
    """A weight of 1e6 in a bf16 or fp32 model is infinity in float16: the output's logits were NaN, and the
    verification, which compares the output with the cast source, said "verified" (a trial of 2026-12-07)."""
    from safetensors.torch import save_file

    folder = _copy_hf(sources, tmp_path, "big")
    tensors = _tensors(folder)
    tensors["model.layers.0.mlp.down_proj.weight"][0, :3] = torch.tensor([1e6, -7e4, 1.0])
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    before = listing(tmp_path)
    code, text = run(["convert", "--quiet", str(folder), str(tmp_path / "out"), "--to", to, "--dtype", "fp16"],
                     capsys)
    errors = [line for line in text.splitlines() if line.startswith("error: ")]  # found while writing: after the
    assert code == 2 and len(errors) == 1 and errors[0] == text.splitlines()[-1], text  # "converting" lines
    assert ("--dtype fp16: 2 values of model.layers.0.mlp.down_proj.weight (up to 9.994e+05, in bfloat16) are beyond "
            "float16's range (65504)") in errors[0]
    assert listing(tmp_path) == before
    assert run(["convert", "--quiet", str(folder), str(tmp_path / "out"), "--to", to, "--dtype", "bf16"],
               capsys)[0] == 0


@pytest.mark.parametrize("prefix", ["./", "weights/"])
def test_index_entries_from_pretrained_loads_are_read(sources, tmp_path, capsys, prefix):
    """`./model-1.safetensors` and shards in a subfolder, which from_pretrained loads, were refused as "not where it
    says" (a trial of 2026-12-07). A `../` entry is still refused (test_hostile_checkpoints.py)."""
    from safetensors.torch import save_file

    folder = _copy_hf(sources, tmp_path, "sharded")
    tensors = _tensors(folder)
    (folder / "model.safetensors").unlink()
    (folder / prefix).mkdir(exist_ok=True)
    names = sorted(tensors)
    parts = {"model-1.safetensors": names[::2], "model-2.safetensors": names[1::2]}
    for file, keys in parts.items():
        save_file({k: tensors[k] for k in keys}, str(folder / prefix / file), metadata={"format": "pt"})
    weight_map = {k: prefix + file for file, keys in parts.items() for k in keys}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    code, text = run(["convert", "--quiet", str(folder), str(tmp_path / "out"), "--to", "hf"], capsys)
    assert code == 0, text
    assert all(torch.equal(_tensors(tmp_path / "out")[k], tensors[k]) for k in tensors)
    from toolkit.checkpoint.inspect import inspect

    report = inspect(folder)
    assert report["complete"] and report["parameters"] == sum(t.numel() for t in tensors.values()), report
