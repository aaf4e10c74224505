"""Inputs a new user's trial broke (2026-12-06): a file added inside an earlier output's subfolder (--overwrite
deleted it), a tracker file linked out of the checkpoint (read and echoed), a torch_dist `.metadata` whose chunks
overlap (converted to zeros, verification passing), a pipe where common.pt goes (a hang), and --dtype leaving
transformers 5's "dtype" in config.json. Each now gets one line and writes nothing, or the right config."""
from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from tiny_hf import write_llama

from toolkit import cli
from toolkit.checkpoint.dist_keys import tiling_problem


def run(argv: list[str], capsys) -> tuple[int, str]:
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out + err


def one_line(code: int, text: str, phrase: str) -> None:
    assert code not in (0, None), text
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and phrase in lines[0], text


def listing(root: Path) -> list[tuple[str, int]]:
    return sorted((str(p.relative_to(root)), p.lstat().st_size) for p in root.rglob("*"))


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("hardening")
    write_llama(root / "hf")
    assert cli.main(["convert", "--quiet", "--no-verify", str(root / "hf"), str(root / "td"), "--to", "torch_dist",
                     "--tp", "2"]) == 0
    return root


@pytest.mark.parametrize("to", ["torch_dist", "megatron_lm", "megatron"])
def test_overwrite_keeps_a_file_added_inside_an_output_subfolder(sources, tmp_path, capsys, to):
    dst = tmp_path / "out"
    extra = ["--vocab-size", "500"] if to == "megatron_lm" else []
    argv = ["convert", "--quiet", "--no-verify", str(sources / "hf"), str(dst), "--to", to, *extra]
    assert cli.main(argv) == 0
    capsys.readouterr()
    sub = next(p for p in sorted(dst.rglob("*")) if p.is_dir())
    (sub / "my_notes.txt").write_text("mine")
    before = listing(tmp_path)
    code, text = run([*argv, "--overwrite"], capsys)
    one_line(code, text, f"holds {(sub / 'my_notes.txt').relative_to(dst).as_posix()}, which toolkit convert did")
    assert listing(tmp_path) == before and (sub / "my_notes.txt").read_text() == "mine"
    (sub / "my_notes.txt").unlink()
    assert cli.main([*argv, "--overwrite"]) == 0  # the toolkit's own output is still replaced


def test_overwrite_refuses_subfolders_an_old_mark_cannot_vouch_for(sources, tmp_path, capsys):
    """A mark written before marks listed every path names only the top-level entries: their contents are unknown."""
    dst = tmp_path / "out"
    argv = ["convert", "--quiet", "--no-verify", str(sources / "hf"), str(dst), "--to", "torch_dist"]
    assert cli.main(argv) == 0
    mark = json.loads((dst / ".toolkit_output.json").read_text())
    (dst / ".toolkit_output.json").write_text(json.dumps({k: v for k, v in mark.items() if k != "paths"}))
    capsys.readouterr()
    before = listing(tmp_path)
    code, text = run([*argv, "--overwrite"], capsys)
    one_line(code, text, "holds iter_0000000/, whose files its mark (from a toolkit before 2026-12-06) does not")
    assert listing(tmp_path) == before


def test_a_tracker_file_linked_out_of_the_checkpoint_is_not_read(sources, tmp_path, capsys):
    import shutil

    src = tmp_path / "td"
    shutil.copytree(sources / "td", src)
    (src / "latest_checkpointed_iteration.txt").unlink()
    secret = tmp_path / "secret.txt"
    secret.write_text("SECRET=1")
    os.symlink(secret, src / "latest_checkpointed_iteration.txt")
    convert = ["convert", str(src), str(tmp_path / "o"), "--to", "hf", "--vocab-size", "500"]
    for argv in (convert, ["inspect", str(src)]):
        code, text = run(argv, capsys)
        one_line(code, text, "latest_checkpointed_iteration.txt, which resolves to")
        assert "SECRET" not in text and not (tmp_path / "o").exists()


def _rewrite_metadata(it_dir: Path, change) -> None:
    import torch.distributed.checkpoint  # noqa: F401 - DCP's record classes, for the test's own unpickling

    with open(it_dir / ".metadata", "rb") as f:
        metadata = pickle.load(f)  # the test's own file, just written by the toolkit's writer
    change(metadata)
    with open(it_dir / ".metadata", "wb") as f:
        pickle.dump(metadata, f)


@pytest.mark.parametrize("verify", [True, False], ids=["verified", "no-verify"])
def test_torch_dist_chunks_that_overlap_and_leave_a_gap_are_refused(sources, tmp_path, capsys, verify):
    """The chunks' values add up to the tensor's, but two of them are the same rows and no chunk holds the others:
    counting values took that for a whole tensor and left zeros in the output."""
    import shutil

    src = tmp_path / "td"
    shutil.copytree(sources / "td", src)

    def overlap(metadata) -> None:
        fqn = next(k for k, m in metadata.state_dict_metadata.items() if len(getattr(m, "chunks", [])) == 2)
        chunks = metadata.state_dict_metadata[fqn].chunks
        chunks[1] = type(chunks[0])(offsets=chunks[0].offsets, sizes=chunks[1].sizes)

    _rewrite_metadata(src / "iter_0000000", overlap)
    argv = ["convert", str(src), str(tmp_path / "o"), "--to", "hf", "--vocab-size", "500"]
    code, text = run(argv + ([] if verify else ["--no-verify"]), capsys)
    one_line(code, text, "disagrees with itself")
    assert "overlap" in text and not (tmp_path / "o").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["td"]


def test_tiling_problem_names_overlaps_gaps_and_strays():
    def c(off, size):
        return SimpleNamespace(offsets=off, sizes=size)

    assert tiling_problem((4, 6), [c((0, 0), (4, 3)), c((0, 3), (4, 3))]) is None
    assert tiling_problem((4, 6), [c((0, 3), (4, 3)), c((0, 0), (4, 3)), c((1, 2), (0, 3))]) is None  # empty chunk
    assert "overlap" in tiling_problem((4, 6), [c((0, 0), (4, 3)), c((0, 2), (4, 3)), c((0, 5), (4, 1))])
    assert "cover 12 of its 24" in tiling_problem((4, 6), [c((0, 0), (4, 3))])
    assert "reaching past" in tiling_problem((4, 6), [c((0, 0), (4, 3)), c((0, 4), (4, 3))])
    assert "overlap" in tiling_problem((8,), [c((0,), (4,)), c((2,), (4,)), c((6,), (2,))])
    assert tiling_problem((0, 5), []) is None and "no saved chunk" in tiling_problem((2,), [])


def test_a_pipe_where_common_pt_goes_is_refused_not_waited_on(sources, tmp_path, capsys):
    import shutil

    src = tmp_path / "td"
    shutil.copytree(sources / "td", src)
    (src / "iter_0000000" / "common.pt").unlink()
    os.mkfifo(src / "iter_0000000" / "common.pt")  # opening it for reading would wait for a writer forever
    proc = subprocess.run([sys.executable, "-m", "toolkit", "convert", str(src), str(tmp_path / "o"), "--to", "hf",
                           "--vocab-size", "500"], capture_output=True, text=True, timeout=120)  # a hang fails
    one_line(proc.returncode, proc.stdout + proc.stderr, "common.pt is a named pipe (FIFO), not a regular file")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("keys", [("dtype",), ("torch_dtype",), ("dtype", "torch_dtype"), ()])
def test_dtype_rewrites_every_dtype_key_of_the_config(sources, tmp_path, capsys, keys):
    """transformers 5 saves "dtype"; from_pretrained(dtype="auto") then loads what that says, whatever else is
    there. Before, only "torch_dtype" was written: a bf16 output loaded as float32."""
    import shutil

    from transformers import AutoModelForCausalLM

    src = tmp_path / "hf"
    shutil.copytree(sources / "hf", src)
    config = json.loads((src / "config.json").read_text())
    config = {k: v for k, v in config.items() if k not in ("dtype", "torch_dtype")} | {k: "float32" for k in keys}
    (src / "config.json").write_text(json.dumps(config))
    assert cli.main(["convert", "--quiet", str(src), str(tmp_path / "o"), "--to", "hf", "--dtype", "fp16"]) == 0
    written = json.loads((tmp_path / "o" / "config.json").read_text())
    assert {k: written[k] for k in ("dtype", "torch_dtype") if k in written} == {k: "float16" for k in keys or
                                                                                ("torch_dtype",)}
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "o", dtype="auto")
    assert model.dtype == torch.float16


def test_a_manifest_that_leaves_out_a_file_on_disk_is_refused(tmp_path, capsys):
    """The manifest lists every file it saved: a rank file it does not list was added, or its entry removed, and was
    read unchecked (a flipped byte in it converted as 'verified')."""
    write_llama(tmp_path / "hf")
    assert cli.main(["convert", "--quiet", "--no-verify", str(tmp_path / "hf"), str(tmp_path / "mg"), "--to",
                     "megatron", "--tp", "2", "--pp", "2"]) == 0
    meta_file = tmp_path / "mg" / "step_00000000" / "toolkit_meta.json"
    meta = json.loads(meta_file.read_text())
    del meta["files"]["model_tp01_pp001.safetensors"]
    meta_file.write_text(json.dumps(meta))
    capsys.readouterr()
    code, text = run(["convert", str(tmp_path / "mg"), str(tmp_path / "o"), "--to", "hf"], capsys)
    one_line(code, text, "model_tp01_pp001.safetensors is not in the manifest")
    meta["files"] = {}
    meta_file.write_text(json.dumps(meta))
    code, text = run(["convert", str(tmp_path / "mg"), str(tmp_path / "o"), "--to", "hf"], capsys)
    one_line(code, text, "lists no files")
    assert not (tmp_path / "o").exists()


def test_sigterm_stops_a_conversion_and_removes_its_partial_output(tmp_path):
    """scancel, a time limit or docker stop send SIGTERM: it ends the conversion as Ctrl-C does. The verification's
    imports take seconds, so the process is still converting when the signal comes."""
    import signal
    import time

    from toolkit.format import safetensors_stream as st

    src = tmp_path / "hf"
    write_llama(src, layers=8)
    config = json.loads((src / "config.json").read_text())
    config.update(hidden_size=512, intermediate_size=2048, num_attention_heads=8, num_key_value_heads=4,
                  vocab_size=16000)
    (src / "config.json").write_text(json.dumps(config))
    from toolkit.families.entries import iter_entries
    from toolkit.families.registry import dims_from_hf

    st.save({n: torch.zeros(s, dtype=torch.bfloat16) for e in iter_entries(dims_from_hf(config), 1, 1)
             for n, s in zip(e.hf_names, e.hf_shapes)}, src / "model.safetensors", {"format": "pt"})
    (tmp_path / "dst").mkdir()
    dst = tmp_path / "dst" / "out"
    proc = subprocess.Popen([sys.executable, "-m", "toolkit", "convert", "--quiet", str(src), str(dst), "--to",
                             "megatron", "--tp", "2", "--pp", "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().startswith("converting")
    time.sleep(0.3)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, (out, err)
    one_line(1, err, "interrupted (SIGTERM)")
    assert list((tmp_path / "dst").iterdir()) == []  # no .out.partial-PID left behind


@pytest.fixture(scope="module")
def legacy(sources):
    """A Megatron-LM legacy checkpoint at TP2 (the toolkit's writer; each test damages a copy)."""
    out = sources / "mlm"
    assert cli.main(["convert", "--quiet", "--no-verify", str(sources / "td"), str(out), "--to", "megatron_lm", "--tp",
                     "2", "--vocab-size", "500"]) == 0
    return out


def _edit_ranks(root: Path, change) -> None:
    """change(rank 0's state, rank 1's state) on the test's own files, saved back with torch.save."""
    files = [root / "iter_0000000" / f"mp_rank_0{r}" / "model_optim_rng.pt" for r in (0, 1)]
    states = [torch.load(f, weights_only=False) for f in files]  # written by the toolkit just above
    change(*states)
    for f, state in zip(files, states):
        torch.save(state, f)


def _legacy_case(legacy: Path, tmp_path: Path, change) -> Path:
    import shutil

    src = tmp_path / "mlm"
    shutil.copytree(legacy, src)
    _edit_ranks(src, change)
    return src


def _more_rows_on_rank0(a, b) -> None:
    key = next(k for k in a["model"] if k.endswith("mlp.linear_fc1.weight"))
    x, y = a["model"][key], b["model"][key]
    a["model"][key], b["model"][key] = torch.cat([x, y[:16]]).clone(), y[16:].clone()


def _other_iteration(a, b) -> None:
    b["iteration"] = 77


def _other_ffn(a, b) -> None:
    b["args"].ffn_hidden_size = 700


def _no_model(a, b) -> None:
    del b["model"]


def _chunks_of_vpp2(a, b) -> None:
    b["model0"] = b.pop("model")


@pytest.mark.parametrize("change, phrase", [
    (_more_rows_on_rank0, "mp_rank_00/model_optim_rng.pt: chunk0.decoder.layers.0.mlp.linear_fc1.weight is"),
    (_other_iteration, "mixes two saves: "),
    (_other_ffn, "args differ from"),
    (_no_model, "mp_rank_01/model_optim_rng.pt holds the model chunks none, but its args' layout"),
    (_chunks_of_vpp2, "mp_rank_01/model_optim_rng.pt holds the model chunks ['model0'], but its args' layout"),
], ids=["rows moved between ranks", "another iteration", "other args", "no model", "model0 at vpp 1"])
@pytest.mark.parametrize("verify", [True, False], ids=["verified", "no-verify"])
def test_legacy_rank_files_that_are_not_one_save_are_refused(legacy, tmp_path, capsys, change, phrase, verify):
    """Shards whose sizes still add up (rank 0 holding 16 of rank 1's rows) converted 'verified' with gate and up
    mixed; a rank file of another iteration or other args was read as if it were the first one's."""
    src = _legacy_case(legacy, tmp_path, change)
    argv = ["convert", str(src), str(tmp_path / "o"), "--to", "hf", "--vocab-size", "500"]
    code, text = run(argv + ([] if verify else ["--no-verify"]), capsys)
    assert code not in (0, None) and phrase in text, text
    assert text.startswith("error: ") and "Traceback" not in text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mlm"]


def test_vpp_without_pipeline_parallelism_is_refused(sources, tmp_path, capsys):
    code, text = run(["convert", str(sources / "hf"), str(tmp_path / "o"), "--to", "megatron", "--vpp", "2"], capsys)
    one_line(code, text, "--vpp 2 virtual chunks need pipeline parallelism, but --pp is 1")
    assert not (tmp_path / "o").exists()


def test_tokenizer_and_generation_config_survive_a_trip_through_megatron(tmp_path, capsys):
    """HF -> toolkit Megatron -> another layout -> HF lost tokenizer files and generation_config.json (a Llama-3
    Instruct's eos_token_id list: generate() then ran past the end of a turn)."""
    src = tmp_path / "hf"
    write_llama(src, tokenizer=True)
    (src / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7], "bos_token_id": 1}))
    (src / "chat_template.jinja").write_text("{{ messages }}")
    # left out until 2026-12-07: named chat templates (transformers 5 saves them so), the license, the model card
    carried = ("generation_config.json", "chat_template.jinja", "tokenizer_config.json",
               "additional_chat_templates/tool_use.jinja", "added_tokens.json", "LICENSE", "README.md",
               "configuration_custom.py")  # custom code that config.json's auto_map names: dropped until then too
    (src / "additional_chat_templates").mkdir()
    for name in carried[3:]:
        (src / name).write_text(f"{name}\n")
    steps = [(src, "mg", ["--to", "megatron", "--tp", "2"]), ("mg", "mg2", ["--to", "megatron", "--pp", "2"]),
             ("mg2", "back", ["--to", "hf"])]
    for a, b, how in steps:
        assert cli.main(["convert", "--quiet", str(tmp_path / a), str(tmp_path / b), *how]) == 0
    for name in carried:
        assert (tmp_path / "back" / name).read_bytes() == (src / name).read_bytes(), name
    meta = json.loads((tmp_path / "mg2" / "step_00000000" / "toolkit_meta.json").read_text())
    assert "generation_config.json" in meta["files"]  # listed and hashed like the tensors' files
    # --tokenizer names the tokenizer; the model's own files still come from SRC (it replaced them until 2026-12-07)
    other = tmp_path / "other_tokenizer"
    write_llama(other, tokenizer=True)
    assert cli.main(["convert", "--quiet", str(src), str(tmp_path / "named"), "--to", "hf", "--tokenizer",
                     str(other)]) == 0
    for name in ("generation_config.json", "LICENSE", "README.md", "configuration_custom.py"):
        assert (tmp_path / "named" / name).read_bytes() == (src / name).read_bytes(), name
    assert (tmp_path / "named" / "tokenizer_config.json").read_bytes() == (other / "tokenizer_config.json").read_bytes()
    assert not (tmp_path / "named" / "additional_chat_templates").exists()  # the named tokenizer has none
    big = tmp_path / "big_tokenizer"  # ids past the model's rows: accepted without a word until 2026-12-07
    big.mkdir()
    (big / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {"a": 0, "b": 1}},
                                                    "added_tokens": [{"id": 99_999, "content": "<x>"}]}))
    before = listing(tmp_path)
    capsys.readouterr()
    code, text = run(["convert", "--quiet", str(src), str(tmp_path / "too_big"), "--to", "hf", "--tokenizer",
                      str(big)], capsys)
    one_line(code, text, "big_tokenizer: its token ids go up to 99,999, but the model has 500 vocabulary rows")
    assert listing(tmp_path) == before


def test_a_training_runs_tokenizer_is_copied_only_when_named(tmp_path, capsys):
    """A training checkpoint's recipe names data.tokenizer, a path of the run's machine and working folder: convert
    read it (relative paths from the toolkit's install folder), outside SRC, and could copy another folder's files
    or none without a word (a trial of 2026-12-07). Now --tokenizer names the folder; without it, one line says
    the tokenizer was left out."""
    src, secret = tmp_path / "hf", tmp_path / "elsewhere"
    write_llama(src, tokenizer=True)
    secret.mkdir()
    (secret / "tokenizer_config.json").write_text('{"SECRET": "private"}')
    assert cli.main(["convert", "--quiet", str(src), str(tmp_path / "mg"), "--to", "megatron"]) == 0
    tag = tmp_path / "mg" / "step_00000000"
    for name in [p.name for p in tag.iterdir() if p.name.startswith(("tokenizer", "special"))]:
        (tag / name).unlink()  # as a training run's checkpoint: no tokenizer files in it
    meta = json.loads((tag / "toolkit_meta.json").read_text())
    meta["files"] = {k: v for k, v in meta["files"].items() if not k.startswith(("tokenizer", "special"))}
    meta["recipe"] = {"data": {"tokenizer": str(secret)}}
    (tag / "toolkit_meta.json").write_text(json.dumps(meta))
    capsys.readouterr()
    assert cli.main(["convert", "--quiet", str(tmp_path / "mg"), str(tmp_path / "a"), "--to", "hf"]) == 0
    out = capsys.readouterr().out
    assert not (tmp_path / "a" / "tokenizer_config.json").exists()
    assert f"tokenizer: not copied: the checkpoint holds none, and its run's data.tokenizer ({secret}) is outside " \
           f"SRC; add --tokenizer {secret}" in out, out
    assert cli.main(["convert", "--quiet", str(tmp_path / "mg"), str(tmp_path / "b"), "--to", "hf", "--tokenizer",
                     str(src)]) == 0
    assert (tmp_path / "b" / "tokenizer_config.json").read_bytes() == (src / "tokenizer_config.json").read_bytes()
    for args, says in ((["--to", "megatron", "--tokenizer", str(src)], "--to megatron writes no tokenizer: drop it"),
                       (["--to", "hf", "--tokenizer", str(tmp_path / "none")], "not a folder holding tokenizer")):
        assert cli.main(["convert", "--quiet", str(tmp_path / "mg"), str(tmp_path / "c"), *args]) == 2
        assert says in capsys.readouterr().err
    assert not (tmp_path / "c").exists()


def test_a_signal_during_the_final_renames_waits_until_dst_is_in_place(tmp_path, monkeypatch):
    """Between moving the old DST aside and the new one in, DST does not exist: a SIGTERM there would leave the old
    output hidden as .DST.old-PID and no DST. It now stops the conversion only once both renames and the old copy's
    removal are done (output.stop_on_signals)."""
    import signal

    from toolkit.checkpoint import output

    dst, tmp = tmp_path / "out", tmp_path / ".out.partial"
    for folder, text in ((dst, "old"), (tmp, "new")):
        folder.mkdir()
        (folder / "weights").write_text(text)
    output.mark(dst)  # an earlier output of toolkit convert, which --overwrite replaces
    real, sent = os.rename, []

    def replace_and_signal(a, b):
        real(a, b)
        if not sent:  # the old DST just moved aside
            sent.append(sorted(p.name for p in tmp_path.iterdir()))
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(output.os, "rename", replace_and_signal)
    with output.stop_on_signals() as got, pytest.raises(KeyboardInterrupt):
        output.replace(tmp, dst, overwrite=True)
    assert sent and sent[0] != ["out"] and got == [signal.SIGTERM]  # it came mid-way, and stopped the rest after
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"] and (dst / "weights").read_text() == "new"
    assert signal.getsignal(signal.SIGTERM) is not None and not output._held["on"]


def test_a_conversion_the_copy_path_hands_on_prints_its_lines_once(sources, tmp_path, capsys, monkeypatch):
    """The copy path announces a conversion, then finds a parameter it cannot copy and hands it to the full path:
    the "converting" and "optimizer state" lines were printed twice, with the hand-over line between (2026-12-06)."""
    from toolkit.checkpoint import byte_ranges

    real = byte_ranges.plan

    def refuse_the_norm(source, target, entry, *args, **kw):
        return None if entry.megatron_name == "decoder.final_layernorm.weight" else real(source, target, entry,
                                                                                          *args, **kw)

    monkeypatch.setattr(byte_ranges, "plan", refuse_the_norm)
    assert cli.main(["convert", "--quiet", str(sources / "td"), str(tmp_path / "out"), "--to", "megatron",
                     "--vocab-size", "500"]) == 0
    out = capsys.readouterr().out
    assert out.count("optimizer state:") == 1 and out.count("converting ") == 1, out
    assert "not a copy of source byte ranges" not in out, out  # said with --verbose
    assert cli.main(["convert", "--quiet", "--verbose", "--no-verify", str(sources / "td"), str(tmp_path / "v"),
                     "--to", "megatron", "--vocab-size", "500"]) == 0
    out = capsys.readouterr().out
    assert "decoder.final_layernorm.weight is not a copy of source byte ranges" in out, out
    assert out.count("optimizer state:") == 1, out


def test_what_a_killed_conversion_left_beside_dst_is_named_and_kept(sources, tmp_path, capsys):
    """SIGKILL cannot be caught: a conversion killed while writing leaves .DST.partial-PID (the size of the model),
    and one killed between replace()'s two renames leaves DST's old copy as .DST.old-PID with no DST. The next
    conversion to DST names each, with what to do, and removes nothing (another node may be writing it)."""
    gone = 4194999  # above Linux's largest pid_max (2**22): no process has it
    partial, old = tmp_path / f".out.partial-{gone}", tmp_path / f".out.old-{gone}"
    for folder in (partial, old):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"\0" * 2**20)
    alive = subprocess.Popen(["sleep", "60"])
    try:
        running = tmp_path / f".out.partial-{alive.pid}"
        running.mkdir()
        before = listing(tmp_path)
        assert cli.main(["convert", "--quiet", "--no-verify", str(sources / "hf"), str(tmp_path / "out"),
                         "--to", "megatron"]) == 0
    finally:
        alive.kill()
        alive.wait()
    err = capsys.readouterr().err
    notes = [line for line in err.splitlines() if line.startswith("note: ")]
    assert len(notes) == 3, err
    assert any(f"{tmp_path / 'out'} is missing and {old} is its earlier copy" in n and f"`mv {old} " in n
               for n in notes), err
    assert any(f"{partial} (1.0 MiB) is the unfinished output of a conversion to" in n and f"process {gone}" in n
               and f"`rm -r {partial}`" in n for n in notes), err
    assert any(f"{running} is being written by process {alive.pid}" in n for n in notes), err
    assert [p for p in listing(tmp_path) if not p[0].startswith("out")] == before  # all three kept as they were
    # DST now exists: the old copy is named as one to remove, not to move back
    capsys.readouterr()
    assert cli.main(["convert", "--quiet", "--no-verify", "--overwrite", str(sources / "hf"), str(tmp_path / "out"),
                     "--to", "megatron"]) == 0
    err = capsys.readouterr().err
    assert f"{old} (1.0 MiB) is an earlier copy of {tmp_path / 'out'}" in err, err



def test_dst_named_as_the_working_folder_and_empty_paths(sources, tmp_path, capsys, monkeypatch):
    """`convert SRC . --overwrite` from inside an earlier output ended in a traceback (`PosixPath('.') has an empty
    name`), and an empty SRC was read as the working folder (a trial of 2026-12-07)."""
    out = tmp_path / "out"
    assert cli.main(["convert", "--quiet", "--no-verify", str(sources / "hf"), str(out), "--to", "hf"]) == 0
    monkeypatch.chdir(out)
    assert cli.main(["convert", "--quiet", "--no-verify", str(sources / "hf"), ".", "--to", "megatron",
                     "--overwrite"]) == 0
    assert (out / "step_00000000").is_dir() and not (out / "model.safetensors").exists()
    capsys.readouterr()
    for argv in (["", str(tmp_path / "x")], [str(sources / "hf"), " "]):
        code, text = run(["convert", *argv, "--to", "hf"], capsys)
        one_line(code, text, "is empty; give the checkpoint folder's path")
    assert not (tmp_path / "x").exists()


def test_tensors_stored_without_the_model_prefix_convert_as_transformers_loads_them(tmp_path, capsys):
    """A folder whose tensors are named `layers.0...`, `embed_tokens.weight` (a base model's save_pretrained; some
    exporters): from_pretrained adds the prefix, and so does the converter (all missing, refused until 2026-12-07).
    Both paths (file to file, and a dtype cast) give the prefixed folder's tensors."""
    from safetensors.torch import load_file, save_file

    full, bare = tmp_path / "full", tmp_path / "bare"
    write_llama(full)
    bare.mkdir()
    (bare / "config.json").write_bytes((full / "config.json").read_bytes())
    weights = load_file(str(full / "model.safetensors"))
    save_file({n.removeprefix("model."): t for n, t in weights.items()}, str(bare / "model.safetensors"),
              {"format": "pt"})
    for out, extra, dtype in (("out", [], torch.bfloat16), ("fp32", ["--dtype", "fp32"], torch.float32)):
        assert cli.main(["convert", str(bare), str(tmp_path / out), "--to", "hf", *extra]) == 0
        assert "tensors stored without the model. prefix" in capsys.readouterr().out
        got = load_file(str(tmp_path / out / "model.safetensors"))
        assert got.keys() == weights.keys() and all(torch.equal(got[n], weights[n].to(dtype)) for n in weights)
    # an untied model saved without its output layer: transformers would make one up; refused, naming it
    save_file({n.removeprefix("model."): t for n, t in weights.items() if n != "lm_head.weight"},
              str(bare / "model.safetensors"), {"format": "pt"})
    before = listing(tmp_path)
    assert cli.main(["convert", "--quiet", str(bare), str(tmp_path / "headless"), "--to", "hf"]) == 2
    assert "lm_head.weight: is missing" in capsys.readouterr().err and listing(tmp_path) == before
