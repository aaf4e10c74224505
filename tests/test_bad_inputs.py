"""The corpus of broken inputs: each must exit non-zero with its exact message and write nothing.

tests/bad_inputs/cases.yaml holds broken checkpoints and command lines (`toolkit convert`, `toolkit inspect`, and
the resume choice of a training run); tests/bad_recipes/cases.yaml the broken recipes, which run here through
`toolkit validate`. Every case runs in a folder of its own: a copy of its source checkpoint, damaged as the case
says, is taken, the folder is fingerprinted, the command runs, and the folder must be byte-for-byte as it was (no
partial output, no hidden scratch folder, no file created by a planted pickle).

Commands run in-process through toolkit.cli.main (fast); cases marked `subprocess: true` run as a real
`python -m toolkit` process (exit code and no traceback as a user sees them). `run: [resume, ...]` cases ask
toolkit.train.checkpoint what a training run would (find_resume, then the layout and model checks of load)."""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from conftest import REPO, run_ranks

from toolkit import cli
from toolkit.format import manifest
from toolkit.errors import ToolkitError

HERE = Path(__file__).parent
CASES = yaml.safe_load((HERE / "bad_inputs" / "cases.yaml").read_text())
RECIPES = yaml.safe_load((HERE / "bad_recipes" / "cases.yaml").read_text())


def test_corpus_is_large_enough():
    assert len(CASES) + len(RECIPES) >= 40 and len(CASES) >= 30
    assert len({c["name"] for c in CASES}) == len(CASES)


# ------------------------------------------------------------------ sources (built once per session)
_SOURCES: dict[str, Path] = {}


def _convert(src: Path, dst: Path, **layout) -> Path:
    from toolkit.checkpoint.convert import convert

    return convert(src, dst, "megatron", **layout, progress=False, log=lambda *_: None)


def _deepspeed_run(root: Path) -> Path:
    """A real ZeRO-1 checkpoint: one step of tiny_zero1 in a world of one (about 8 s)."""
    out = root / "ds_run"
    sets = [f"output_dir={out}", "parallel.world_size=1", "model.preset=tiny", "training.steps=1",
            "checkpoint.interval=1", "training.schedule.warmup_steps=0", "logging.sample_prompt="]
    proc = run_ranks(["recipes/train.py", "--recipe", "tiny_zero1", *[a for s in sets for a in ("--set", s)]], 1,
                     dict(os.environ), "python")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out / "checkpoints"


@pytest.fixture(scope="module")
def source(tmp_path_factory, tiny_hf_checkpoint, tiny4l_hf_checkpoint):
    def get(name: str) -> Path:
        if name not in _SOURCES:
            root = tmp_path_factory.mktemp(f"src_{name}")
            if name == "hf":
                _SOURCES[name] = tiny_hf_checkpoint
            elif name == "megatron":  # the tiny HF model at TP2 x PP2 (weights only)
                _SOURCES[name] = _convert(tiny_hf_checkpoint, root / "ckpt", tp=2, pp=2)
            elif name == "other_megatron":  # another model (4 layers, hidden 128) at the same layout
                _SOURCES[name] = _convert(tiny4l_hf_checkpoint, root / "ckpt", tp=2, pp=2)
            elif name == "megatron_lm":
                from test_convert import hf_model_for, write_megatron_lm

                write_megatron_lm(root / "mlm", hf_model_for())
                _SOURCES[name] = root / "mlm"
            elif name == "deepspeed":
                _SOURCES[name] = _deepspeed_run(root)
            else:
                raise KeyError(name)
        return _SOURCES[name]

    return get


# ------------------------------------------------------------------ damage
def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


class _Payload:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _plant(path: Path, marker: Path) -> None:
    state = torch.load(path, weights_only=False)  # the fixture's own file: trusted
    state["note"] = _Payload(str(marker))
    torch.save(state, path)


def _rehash(tag_dir: Path) -> None:
    meta = json.loads((tag_dir / "toolkit_meta.json").read_text())
    meta["files"] = manifest.complete(tag_dir, {})
    (tag_dir / "toolkit_meta.json").write_text(json.dumps(meta))


def _edit_meta(tag_dir: Path, changes: dict) -> None:
    meta = json.loads((tag_dir / "toolkit_meta.json").read_text())
    for where, value in changes.items():  # "files/NAME/bytes": keys joined by "/" (file names hold dots)
        *path, last = where.split("/")
        node = meta
        for key in path:
            node = node[key]
        node[last] = value
    (tag_dir / "toolkit_meta.json").write_text(json.dumps(meta))


def _set_header(path: Path, text: str | None = None, length: int | None = None) -> None:
    """Replace a safetensors header by `text` (padded to the same length), or its declared length by `length`."""
    data = bytearray(path.read_bytes())
    (old,) = struct.unpack("<Q", data[:8])
    if length is not None:
        data[:8] = struct.pack("<Q", length)
    else:
        data[8:8 + old] = text.encode().ljust(old)[:old]
    path.write_bytes(bytes(data))


def apply(step: dict, src: Path, folder: Path, source) -> None:
    (op, arg), *rest = step.items()
    opts = dict(rest)
    path = src / arg if isinstance(arg, str) else None
    if op == "truncate":
        path.write_bytes(path.read_bytes()[:-opts["by"]] if "by" in opts else path.read_bytes()[:opts["to"]])
    elif op == "delete":
        path.unlink()
    elif op == "flip":
        _flip(path)
    elif op == "write":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(opts["text"])
    elif op == "plant":
        _plant(path, folder / "pwned")
    elif op == "rehash":
        _rehash(path)
    elif op == "edit_meta":
        _edit_meta(path, opts["set"])
    elif op == "copy_from":
        shutil.copyfile(source(opts["source"]) / arg, path)
    elif op == "header":
        _set_header(path, text=opts.get("text"), length=opts.get("length"))
    elif op == "mkdir":
        path = folder / arg
        path.mkdir(parents=True)
    else:
        raise ValueError(f"unknown damage {op!r}")


# ------------------------------------------------------------------ running
def fingerprint(folder: Path) -> dict:
    """Every path under `folder` (hidden ones included) with its content hash; folders as None."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else None
            for p in sorted(folder.rglob("*"))}


def _fill(text: str, folder: Path) -> str:
    """Paths, and sizes that differ between runs (DeepSpeed's pickles): {bytes:FILE} its size now, {manifest:STEP/
    FILE} the size its manifest records, {total:STEP} the manifest's total (with thousands separators)."""
    src = folder / "src"

    def size(m: re.Match) -> str:
        kind, where = m.group(1), m.group(2)
        if kind == "bytes":
            return str((src / where).stat().st_size)
        step, _, name = where.partition("/")
        files = json.loads((src / step / "toolkit_meta.json").read_text())["files"]
        return str(files[name]["bytes"]) if kind == "manifest" else f"{manifest.total_bytes(files):,}"

    text = re.sub(r"\{(bytes|manifest|total):([^}]+)\}", size, text)
    return text.replace("{src}", str(src)).replace("{tmp}", str(folder))


def _resume(argv: list[str]) -> int:
    """`resume PATH [--layout k=v,...] [--model tiny-4l]`: what a training run does before loading anything."""
    from test_checkpoint_integrity import StandIn

    from toolkit.model import to_hf_config
    from toolkit.recipe import load_recipe
    from toolkit.train import checkpoint as ckpt

    ap = argparse.ArgumentParser()
    ap.add_argument("path")
    ap.add_argument("--layout", default="")
    ap.add_argument("--model", default=None)
    args = ap.parse_args(argv)
    tag_dir = ckpt.find_resume(Path(args.path), args.path)
    layout = {k: int(v) for k, v in (kv.split("=") for kv in args.layout.split(",") if kv)}
    backend = StandIn()
    if args.model:
        backend.hf_config = to_hf_config(load_recipe("tiny_zero0", [f"model.preset={args.model}"]).model).to_dict()
    ckpt.load(backend, tag_dir, layout or ckpt.manifest.read_meta(tag_dir)["layout"])
    return 0


def run_in_process(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        code = _resume(argv[1:]) if argv[0] == "resume" else cli.main(argv)
    except ToolkitError as e:  # what recipes/train.py prints for a training run
        print(f"error: {e}", file=sys.stderr)
        code = e.exit_code
    except SystemExit as e:  # argparse
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def _readonly_prefix(folder: Path) -> list[str]:
    """A command prefix under which `folder` is read-only, even for root (a read-only bind mount in a private mount
    namespace); as another user, plain permissions do."""
    if os.geteuid() != 0:
        folder.chmod(0o555)
        return []
    probe = subprocess.run(["unshare", "-m", "sh", "-c", f"mount --bind -o ro {folder} {folder}"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a read-only folder as root here (unshare -m + mount: {probe.stderr.strip()})")
    return ["unshare", "-m", "sh", "-c", 'mount --bind -o ro "$0" "$0" && shift && exec "$@"', str(folder), "--"]


def run_subprocess(argv: list[str], folder: Path, readonly: str | None) -> tuple[int, str, str]:
    prefix = _readonly_prefix(folder / readonly) if readonly else []
    proc = subprocess.run([*prefix, sys.executable, "-m", "toolkit", *argv], capture_output=True, text=True, cwd=REPO)
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc.returncode, proc.stdout, proc.stderr


def _params():
    for case in CASES:
        marks = [pytest.mark.slow] if case.get("slow") else []
        yield pytest.param(case, id=case["name"], marks=marks)


@pytest.mark.parametrize("case", list(_params()))
def test_broken_input_gives_its_exact_message_and_writes_nothing(case, source, tmp_path, capsys, monkeypatch):
    folder = tmp_path / "case"
    folder.mkdir()
    if case.get("source"):
        shutil.copytree(source(case["source"]), folder / "src")
    for step in case.get("damage", []):
        apply(step, folder / "src", folder, source)
    if "free_bytes" in case:  # a disk that is (nearly) full
        monkeypatch.setattr(manifest, "free_bytes", lambda f: case["free_bytes"])
    before = fingerprint(folder)
    argv = [_fill(a, folder) for a in case["run"]]
    if case.get("subprocess") or case.get("readonly"):
        code, out, err = run_subprocess(argv, folder, case.get("readonly"))
    else:
        code, out, err = run_in_process(argv, capsys)
    try:
        assert code == case.get("exit", 2)
        expect = [_fill(line, folder) for line in ([case["expect"]] if isinstance(case["expect"], str)
                                                     else case["expect"])]
        if case.get("stdout"):  # `toolkit inspect` reports problems on stdout and exits 1
            assert set(expect) <= set(out.splitlines()), out
        elif case.get("argparse"):  # argparse's own error: its last line
            assert err.splitlines()[-1:] == expect, err
        else:  # "error: " + the message; for a list of problems, the heading and the first problem lines
            assert err.splitlines()[:len(expect)] == [f"error: {expect[0]}", *expect[1:]], err
    finally:
        if case.get("readonly") and os.geteuid() != 0:
            (folder / case["readonly"]).chmod(0o755)
    assert fingerprint(folder) == before, "the command wrote or changed files"


@pytest.mark.parametrize("case", RECIPES, ids=[c["name"] for c in RECIPES])
def test_broken_recipe_exits_2_with_its_first_problem_and_writes_nothing(case, tmp_path, capsys):
    from test_bad_recipes import _write_case

    path = _write_case(case, tmp_path)
    before = fingerprint(tmp_path)
    argv = ["validate", "--recipe", str(path)] + (["--world-size", str(case["world_size"])]
                                                  if case.get("world_size") else [])
    code, out, err = run_in_process(argv, capsys)
    assert code == 2 and out == ""
    lines = err.splitlines()
    assert lines[0].startswith("error: recipe ") and lines[1] == f"  1. {case['expect'][0]}".replace("{dir}",
                                                                                                     str(tmp_path))
    assert fingerprint(tmp_path) == before
