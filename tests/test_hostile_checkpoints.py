"""Hostile checkpoints and destinations for `toolkit convert` (and `toolkit inspect`): safetensors headers whose
byte ranges lie, paths that lead out of the folder the user named (links, ../ in an index, a manifest or a
pointer, a link that loops), destinations the toolkit must not replace, and checkpoints `inspect` used to call
complete that `convert` refuses.

Every case runs the CLI (toolkit.cli.main, in-process; the read-only case as a real process) in a folder of its
own and asserts: a non-zero exit, no traceback, exactly one line on stderr (the problem and the fix), nothing on
stdout, and the whole case folder (source, files outside it, the destination's parent: paths, kinds, sizes,
mtimes, bytes, link targets) unchanged."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
from pathlib import Path

import pytest
from test_convert import hf_model_for, write_megatron_lm
from test_foreign_checkpoint_dir import snapshot

from toolkit import cli

_BUILT: dict[str, Path] = {}


@pytest.fixture(scope="module")
def built(tmp_path_factory, tiny_hf_checkpoint):
    """Sources built once: the tiny HF folder, it as a toolkit Megatron checkpoint directory, as a Megatron-LM
    checkpoint, and a finished `toolkit convert` output (a destination the toolkit wrote)."""
    from toolkit.checkpoint.convert import convert

    def get(name: str) -> Path:
        if name not in _BUILT:
            root = tmp_path_factory.mktemp(name)
            if name == "hf":
                _BUILT[name] = tiny_hf_checkpoint
            elif name == "megatron":
                _BUILT[name] = convert(tiny_hf_checkpoint, root / "ckpt", "megatron", progress=False,
                                       log=lambda *_: None)
            elif name == "output":
                _BUILT[name] = convert(tiny_hf_checkpoint, root / "out", "megatron", progress=False,
                                       log=lambda *_: None)
            elif name == "deepspeed":  # a real ZeRO-1 run of one step (about 8 s)
                from test_bad_inputs import _deepspeed_run

                _BUILT[name] = _deepspeed_run(root)
            elif name == "megatron_lm":
                write_megatron_lm(root / "mlm", hf_model_for())
                _BUILT[name] = root / "mlm"
        return _BUILT[name]

    return get


# ------------------------------------------------------------------ damage helpers
def _header(path: Path) -> tuple[dict, bytes]:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + n]), data[8 + n:]


def _write(path: Path, header: dict, body: bytes, length: int | None = None) -> None:
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 8)
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + body)


def _tensors(header: dict) -> list[tuple[str, dict]]:
    return sorted(((k, v) for k, v in header.items() if k != "__metadata__"), key=lambda kv: kv[1]["data_offsets"])


def _same_shape_pair(header: dict) -> tuple[str, str]:
    """Two tensors of one shape and dtype, the second stored later and not last."""
    items = _tensors(header)[:-1]
    for i, (a, ia) in enumerate(items):
        for b, ib in items[i + 1:]:
            if ia["shape"] == ib["shape"] and ia["dtype"] == ib["dtype"]:
                return a, b
    raise AssertionError("no two tensors of one shape")


def st_overlap(src: Path) -> None:
    header, body = _header(src / "model.safetensors")
    a, b = _same_shape_pair(header)
    header[b]["data_offsets"] = list(header[a]["data_offsets"])  # b reads a's bytes; b's own are left unclaimed
    _write(src / "model.safetensors", header, body)


def st_named_twice(src: Path) -> None:
    header, body = _header(src / "model.safetensors")
    a, b = _same_shape_pair(header)
    raw = json.dumps(header, separators=(",", ":")).replace(f'"{b}":', f'"{a}":').encode()
    raw += b" " * (-(8 + len(raw)) % 8)
    (src / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + body)


def st_gap(src: Path) -> None:
    header, body = _header(src / "model.safetensors")
    for _, info in _tensors(header):
        info["data_offsets"] = [o + 8 for o in info["data_offsets"]]
    _write(src / "model.safetensors", header, b"\0" * 8 + body)  # 8 bytes no tensor claims


def st_out_of_range(src: Path) -> None:
    header, body = _header(src / "model.safetensors")
    _, info = _tensors(header)[0]
    size = info["data_offsets"][1] - info["data_offsets"][0]
    info["data_offsets"] = [len(body), len(body) + size]
    _write(src / "model.safetensors", header, body)


def st_inverted(src: Path) -> None:
    header, body = _header(src / "model.safetensors")
    _, info = _tensors(header)[1]
    info["data_offsets"] = info["data_offsets"][::-1]
    _write(src / "model.safetensors", header, body)


def st_length_lies(src: Path) -> None:
    header, body = _header(src / "model.safetensors")
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 8)
    _write(src / "model.safetensors", header, body, length=len(raw) + 64)  # the header swallows tensor bytes


def st_length_huge(src: Path) -> None:
    header, body = _header(src / "model.safetensors")
    _write(src / "model.safetensors", header, body, length=2**40)


def st_dtype_size(src: Path) -> None:
    header, body = _header(src / "model.safetensors")
    _tensors(header)[0][1]["dtype"] = "F16"  # half the bytes its range holds
    _write(src / "model.safetensors", header, body)


def st_shape_size(src: Path) -> None:
    header, body = _header(src / "model.safetensors")
    info = _tensors(header)[0][1]
    info["shape"] = [*info["shape"][:-1], info["shape"][-1] * 2]
    _write(src / "model.safetensors", header, body)


def st_not_a_tensor(src: Path) -> None:
    header, body = _header(src / "model.safetensors")
    header["model.extra"] = [1, 2, 3]
    _write(src / "model.safetensors", header, body)


def st_header_a_list(src: Path) -> None:
    _, body = _header(src / "model.safetensors")
    _write(src / "model.safetensors", [], body)


def _outside(case: Path, name: str, data: bytes = b"root:x:0:0:secret\n") -> Path:
    path = case / "outside" / name
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(data)
    return path


def tok_symlink_out(src: Path) -> None:
    (src / "tokenizer.json").symlink_to(_outside(src.parent, "secret.json", b'{"secret": true}'))


def weights_a_fifo(src: Path) -> None:
    """A named pipe where the weights go: reading it waited forever, in inspect and convert (a trial of
    2026-12-07)."""
    (src / "model.safetensors").unlink()
    os.mkfifo(src / "model.safetensors")


def config_symlink_out(src: Path) -> None:
    target = _outside(src.parent, "config.json", (src / "config.json").read_bytes())
    (src / "config.json").unlink()
    (src / "config.json").symlink_to(target)


def weights_symlink_out(src: Path) -> None:
    target = _outside(src.parent, "model.safetensors", (src / "model.safetensors").read_bytes())
    (src / "model.safetensors").unlink()
    (src / "model.safetensors").symlink_to(target)


def weight_map_dotdot(src: Path) -> None:
    header, _ = _header(src / "model.safetensors")
    weight_map = {k: "model.safetensors" for k in header if k != "__metadata__"}
    weight_map[next(iter(weight_map))] = "../../../etc/passwd"
    (src / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def pointer_dotdot(src: Path) -> None:
    shutil.copytree(src, src.parent / "elsewhere")  # a valid checkpoint, but not the one the user named
    for p in src.glob("step_*"):
        shutil.rmtree(p)
    (src / "latest_complete").write_text("../elsewhere/step_00000000")


def manifest_dotdot(src: Path) -> None:
    secret = _outside(src.parent, "secret.bin")
    meta_path = src / "step_00000000" / "toolkit_meta.json"
    meta = json.loads(meta_path.read_text())
    data = secret.read_bytes()
    meta["files"]["../../outside/secret.bin"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    meta_path.write_text(json.dumps(meta))


def megatron_file_symlink_out(src: Path) -> None:
    f = src / "step_00000000" / "model_tp00_pp000.safetensors"
    target = _outside(src.parent, f.name, f.read_bytes())  # same bytes: the manifest still matches
    f.unlink()
    f.symlink_to(target)


def deepspeed_file_symlink_out(src: Path) -> None:
    f = src / "step_00000001" / "mp_rank_00_model_states.pt"
    target = _outside(src.parent, f.name, f.read_bytes())  # same bytes: the manifest still matches
    f.unlink()
    f.symlink_to(target)


def tracker_dotdot(src: Path) -> None:
    (src / "latest_checkpointed_iteration.txt").write_text("../../../etc")


def rank_dir_symlink_out(src: Path) -> None:
    rank = src / "iter_0000007" / "mp_rank_00_000"
    shutil.copytree(rank, src.parent / "outside" / rank.name)
    shutil.rmtree(rank)
    rank.symlink_to(src.parent / "outside" / rank.name, target_is_directory=True)


def hf_config_disagrees(src: Path) -> None:
    config = json.loads((src / "config.json").read_text())
    config["intermediate_size"] += 8  # the weights are of another shape
    (src / "config.json").write_text(json.dumps(config))


def meta_layout_disagrees(src: Path) -> None:
    meta_path = src / "step_00000000" / "toolkit_meta.json"
    meta = json.loads(meta_path.read_text())
    meta["layout"]["tp"] = 2  # no tp01 files; the manifest (which lists the files there are) still verifies
    meta_path.write_text(json.dumps(meta))


def _config(**fields):
    def damage(src: Path) -> None:
        config = json.loads((src / "config.json").read_text())
        (src / "config.json").write_text(json.dumps({**config, **fields}))
    return damage


# (name, source, damage, extra args, phrases the one line must hold: the problem, then the fix)
CONVERT_CASES = [
    ("a family the converter does not know", "hf", _config(model_type="gpt2"),
     ["--to", "megatron"], ["model family 'gpt2' is not supported; supported: llama, mistral, qwen2, qwen3",
                            "toolkit/families/"]),
    ("sliding-window attention", "hf", _config(sliding_window=4096), ["--to", "megatron"],
     ["sets sliding_window: 4096", "convert a model without sliding-window attention"]),
    ("an activation the map does not target", "hf", _config(hidden_act="gelu"), ["--to", "megatron"],
     ["sets hidden_act: gelu", "convert a model whose MLP uses silu"]),
    ("overlapping byte ranges", "hf", st_overlap, [], ["overlaps", "two tensors would share bytes",
                                                       "re-copy or re-save this file"]),
    ("a tensor named twice", "hf", st_named_twice, [], ["names the tensor ", "twice in its header",
                                                        "re-copy or re-save this file"]),
    ("a gap between tensors", "hf", st_gap, [], ["leaves bytes [0, 8) before", "unclaimed by any tensor",
                                                 "re-copy or re-save this file"]),
    ("a range past the end", "hf", st_out_of_range, [], ["but its header describes", "the file is truncated",
                                                         "re-copy or re-save this file"]),
    ("begin after end", "hf", st_inverted, [], ["which is not a range", "re-copy or re-save this file"]),
    ("header length too long", "hf", st_length_lies, [], ["has a header that is not valid JSON",
                                                          "re-copy or re-save this file"]),
    ("header length past the file", "hf", st_length_huge, [], ["declares a 1099511627776-byte header",
                                                               "re-copy or re-save this file"]),
    ("dtype size mismatch", "hf", st_dtype_size, [], ["bytes for shape", "F16", "re-copy or re-save this file"]),
    ("shape size mismatch", "hf", st_shape_size, [], ["bytes for shape", "re-copy or re-save this file"]),
    ("an entry that is not a tensor", "hf", st_not_a_tensor, [], ["describes model.extra as [1, 2, 3], not a tensor",
                                                                  "re-copy or re-save this file"]),
    ("a header that is a list", "hf", st_header_a_list, [], ["has a header that is a JSON list, not an object",
                                                             "re-copy or re-save this file"]),
    ("tokenizer link out of the folder", "hf", tok_symlink_out, [], ["(its tokenizer file) names tokenizer.json",
                                                                     "outside", "copy the file into"]),
    ("config link out of the folder", "hf", config_symlink_out, [], ["names config.json", "outside",
                                                                     "copy the file into"]),
    ("weights link out of the folder", "hf", weights_symlink_out, [], ["names model.safetensors", "outside",
                                                                       "copy the file into"]),
    ("../ in weight_map", "hf", weight_map_dotdot, [], ["model.safetensors.index.json names ../../../etc/passwd",
                                                        "outside", "copy the file into"]),
    ("pointer naming ../", "megatron", pointer_dotdot, [], ["latest_complete names ../elsewhere/step_00000000",
                                                            "outside", "copy the file into"]),
    ("manifest naming ../", "megatron", manifest_dotdot, [], ["toolkit_meta.json names ../../outside/secret.bin",
                                                              "outside", "copy the file into"]),
    ("Megatron file link out", "megatron", megatron_file_symlink_out, [], ["names model_tp00_pp000.safetensors",
                                                                           "outside", "copy the file into"]),
    ("DeepSpeed file link out", "deepspeed", deepspeed_file_symlink_out, [], [
        "toolkit_meta.json names mp_rank_00_model_states.pt", "outside", "copy the file into"]),
    ("tracker naming ../", "megatron_lm", tracker_dotdot, ["--vocab-size", "500"], [
        "latest_checkpointed_iteration.txt holds '../../../etc', not an iteration number",
        "write the number of the iteration"]),
    ("Megatron-LM rank folder link out", "megatron_lm", rank_dir_symlink_out, ["--vocab-size", "500"], [
        "names iter_0000007/mp_rank_00_000/model_optim_rng.pt", "outside", "copy the file into"]),
]


def run(argv: list[str], capsys) -> tuple[int, str, str]:
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line(code: int, out: str, err: str, phrases: list[str]) -> str:
    assert code != 0 and code is not None, (code, err)
    assert "Traceback" not in out + err, err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for phrase in phrases:
        assert phrase in lines[0], (phrase, lines[0])
    return lines[0]


@pytest.mark.parametrize("name,source,damage,args,phrases", CONVERT_CASES, ids=[c[0] for c in CONVERT_CASES])
def test_hostile_source_is_refused_in_one_line_and_nothing_is_written(name, source, damage, args, phrases, built,
                                                                      tmp_path, capsys):
    case = tmp_path / "case"
    case.mkdir()
    src = case / "src"
    shutil.copytree(built(source), src, symlinks=True)
    damage(src)
    before = snapshot(case)
    code, out, err = run(["convert", str(src), str(case / "dst"), "--to", "hf", *args], capsys)
    assert_one_line(code, out, err, phrases)
    assert out == ""
    assert snapshot(case) == before


def test_a_named_pipe_in_the_source_is_refused_not_waited_on(built, tmp_path, capsys):
    case = tmp_path / "case"
    case.mkdir()
    src = case / "src"
    shutil.copytree(built("hf"), src, symlinks=True)
    weights_a_fifo(src)
    for argv in (["convert", str(src), str(case / "dst"), "--to", "megatron"], ["inspect", str(src)]):
        code, out, err = run(argv, capsys)
        said = out + err
        assert code in (1, 2) and "model.safetensors is a named pipe (FIFO), not a regular file" in said, said
    assert sorted(p.name for p in case.iterdir()) == ["src"]


def test_a_link_that_loops_is_refused_as_source_and_as_destination(built, tmp_path, capsys):
    case = tmp_path / "case"
    case.mkdir()
    (case / "loop").symlink_to(case / "loop")
    shutil.copytree(built("hf"), case / "src")
    before = snapshot(case)
    code, out, err = run(["convert", str(case / "loop"), str(case / "dst"), "--to", "hf"], capsys)
    assert_one_line(code, out, err, [f"{case / 'loop'} is a symbolic link that cannot be followed",
                                     "point it at a real file or folder"])
    code, out, err = run(["convert", str(case / "src"), str(case / "loop"), "--to", "hf", "--overwrite"], capsys)
    assert_one_line(code, out, err, [f"{case / 'loop'} is a symbolic link", "not one"])
    code, out, err = run(["inspect", str(case / "loop")], capsys)
    assert_one_line(code, out, err, ["is a symbolic link that cannot be followed"])
    assert snapshot(case) == before


# ------------------------------------------------------------------ destinations
def dst_exists(case: Path, built) -> tuple[Path, list[str], list[str]]:
    (case / "dst").mkdir()
    (case / "dst" / "notes.txt").write_text("mine")
    return case / "dst", [], ["already exists", "pass --overwrite"]


def dst_foreign_overwrite(case: Path, built):
    (case / "dst").mkdir()
    (case / "dst" / "notes.txt").write_text("mine")
    return case / "dst", ["--overwrite"], ["holds notes.txt, which toolkit convert did not write",
                                           "move it away yourself or choose another destination"]


def dst_output_plus_user_file(case: Path, built):
    shutil.copytree(built("output"), case / "dst")  # the toolkit wrote it; then the user added a file
    (case / "dst" / "README.md").write_text("my notes on this run")
    return case / "dst", ["--overwrite"], ["holds README.md, which toolkit convert did not write"]


def dst_a_file(case: Path, built):
    (case / "dst").write_text("a user's file")
    return case / "dst", ["--overwrite"], ["is a file; a checkpoint is a folder: choose another destination"]


def dst_a_link(case: Path, built):
    shutil.copytree(built("output"), case / "real")
    (case / "dst").symlink_to(case / "real", target_is_directory=True)
    return case / "dst", ["--overwrite"], ["is a symbolic link", "choose a destination that is not one"]


def dst_inside_source(case: Path, built):
    return case / "src" / "converted", [], ["overlaps the source", "write the conversion somewhere else"]


def dst_holds_source(case: Path, built):
    return case, ["--overwrite"], ["overlaps the source", "write the conversion somewhere else"]


DST_CASES = [dst_exists, dst_foreign_overwrite, dst_output_plus_user_file, dst_a_file, dst_a_link,
             dst_inside_source, dst_holds_source]


@pytest.mark.parametrize("make", DST_CASES, ids=[f.__name__ for f in DST_CASES])
def test_destination_is_refused_in_one_line_and_left_alone(make, built, tmp_path, capsys):
    case = tmp_path / "case"
    case.mkdir()
    shutil.copytree(built("hf"), case / "src")
    dst, args, phrases = make(case, built)
    before, around = snapshot(case), snapshot(tmp_path)
    code, out, err = run(["convert", str(case / "src"), str(dst), "--to", "megatron", *args], capsys)
    assert_one_line(code, out, err, phrases)
    assert snapshot(case) == before and snapshot(tmp_path) == around


def test_a_destination_the_toolkit_wrote_is_replaced_with_overwrite(built, tmp_path, capsys):
    """The other side of the rule: --overwrite still replaces a folder toolkit convert wrote."""
    shutil.copytree(built("output"), tmp_path / "dst")
    old = (tmp_path / "dst" / ".toolkit_output.json").stat().st_ino
    code, _, err = run(["convert", str(built("hf")), str(tmp_path / "dst"), "--to", "hf", "--overwrite"], capsys)
    assert code == 0, err
    assert (tmp_path / "dst" / "config.json").is_file() and not (tmp_path / "dst" / "step_00000000").exists()
    assert (tmp_path / "dst" / ".toolkit_output.json").stat().st_ino != old
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dst"]  # no scratch or old folder left


def test_a_hugging_face_cache_snapshot_converts_but_a_link_out_of_its_repository_does_not(built, tmp_path, capsys):
    """The hub cache's own layout (snapshots/REV/* are links to ../../blobs/HASH) is read; a link from a snapshot to
    anywhere else is not."""
    repo = tmp_path / "hub" / "models--org--tiny"
    snap = repo / "snapshots" / "abc123"
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for f in sorted(built("hf").iterdir()):
        blob = repo / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copyfile(f, blob)
        (snap / f.name).symlink_to(Path("../../blobs") / blob.name)
    code, _, err = run(["convert", str(snap), str(tmp_path / "out"), "--to", "megatron"], capsys)
    assert code == 0, err
    (snap / "tokenizer.json").symlink_to(_outside(tmp_path, "secret.json", b"{}"))
    before = snapshot(tmp_path)
    code, out, err = run(["convert", str(snap), str(tmp_path / "out2"), "--to", "hf"], capsys)
    assert_one_line(code, out, err, ["(its tokenizer file) names tokenizer.json", "outside"])
    assert snapshot(tmp_path) == before


def test_training_reads_no_weights_linked_from_outside_the_model_folder(built, tmp_path):
    """model.hf_path: the weights a run loads come from inside the folder the recipe names."""
    from toolkit.checkpoint.hf_io import LazyHFState
    from toolkit.errors import ToolkitError

    src = tmp_path / "src"
    shutil.copytree(built("hf"), src)
    with LazyHFState(src) as state:
        assert "model.embed_tokens.weight" in state
    weights_symlink_out(src)
    with pytest.raises(ToolkitError, match=r"names model.safetensors, which resolves to .*outside"), LazyHFState(src):
        pass


def test_the_deepspeed_backend_reads_no_weights_linked_from_outside_the_model_folder(built, tmp_path):
    """The DeepSpeed backend's loader (toolkit.model.load_hf_weights) keeps to the folder too."""
    import json

    from transformers import LlamaConfig, LlamaForCausalLM

    from toolkit.errors import ToolkitError
    from toolkit.model import load_hf_weights

    src = tmp_path / "src"
    shutil.copytree(built("hf"), src)
    config = json.loads((src / "config.json").read_text())
    model = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in config.items() if k not in ("dtype", "torch_dtype")}))
    load_hf_weights(model, src, zero3=False)
    weights_symlink_out(src)
    with pytest.raises(ToolkitError, match=r"model.hf_path names model.safetensors, which resolves to .*outside"):
        load_hf_weights(model, src, zero3=False)


def test_a_read_only_parent_is_refused_before_anything_is_written(built, tmp_path):
    from test_bad_inputs import run_subprocess

    case = tmp_path / "case"
    case.mkdir()
    shutil.copytree(built("hf"), case / "src")
    (case / "ro").mkdir()
    before = snapshot(case)
    code, out, err = run_subprocess(["convert", str(case / "src"), str(case / "ro" / "dst"), "--to", "megatron"],
                                    case, "ro")
    try:
        assert_one_line(code, out, err, [f"cannot write {case / 'ro' / 'dst'}", "does not take new folders",
                                         "choose a destination you can write to"])
    finally:
        if os.geteuid() != 0:
            (case / "ro").chmod(0o755)
    assert snapshot(case) == before


# ------------------------------------------------------------------ inspect and convert agree
def pointer_names_a_damaged_step(src: Path) -> None:
    shutil.copytree(src / "step_00000000", src / "step_00000001")
    f = src / "step_00000001" / "model_tp00_pp000.safetensors"
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF
    f.write_bytes(bytes(data))
    (src / "latest_complete").write_text("step_00000001")


DISAGREED = [("hf", hf_config_disagrees, "does not match its config.json"),
             ("megatron", meta_layout_disagrees, "model_tp01_pp000.safetensors"),
             ("megatron", pointer_names_a_damaged_step, "model_tp00_pp000.safetensors does not match its xxh3_128")]


@pytest.mark.parametrize("source,damage,phrase", DISAGREED, ids=[d[1].__name__ for d in DISAGREED])
def test_inspect_calls_complete_only_what_convert_reads(source, damage, phrase, built, tmp_path, capsys):
    """These checkpoints pass inspect's own checks (headers against file sizes, the manifest), and inspect used to
    call them complete; convert refuses them. Both now ask sources.refusal."""
    from toolkit.checkpoint.inspect import inspect

    src = tmp_path / "src"
    shutil.copytree(built(source), src)
    damage(src)
    target = src if damage is not meta_layout_disagrees else src / "step_00000000"
    before = snapshot(tmp_path)
    code, out, err = run(["convert", str(target), str(tmp_path / "dst"), "--to", "hf"], capsys)
    assert code == 2 and phrase in err and "Traceback" not in err
    report = inspect(target)
    assert not report["complete"] and any(phrase in p for p in report["problems"]), report["problems"]
    code, out, err = run(["inspect", str(target)], capsys)
    assert code == 1 and "INCOMPLETE" in out.splitlines()[0] and "Traceback" not in out + err
    if damage is meta_layout_disagrees:  # the directory too: its newest intact step is the one convert refuses
        code, out, err = run(["inspect", str(src)], capsys)
        assert code == 1 and "INCOMPLETE" in out.splitlines()[0] and "Traceback" not in out + err, out
    assert snapshot(tmp_path) == before
