"""Two claims docs/convert.md makes about `toolkit convert`, measured on a model big enough to tell them apart.

The model: a random fp32 Llama (hidden 512, 20 layers, vocabulary 20,480, untied) of 320 MiB whose largest
parameter, the embedding (and the output layer of the same shape), is 40 MiB: the model is 8 times its largest
parameter, and the largest parameter is above glibc's largest mmap threshold (32 MiB) as in real models, so it is
returned to the kernel when freed.

- Progress: "A progress line shows GiB written, rate and ETA." On a terminal (a pty here) it is one line updated
  in place; elsewhere a line every 10 s and a last one. Its numbers are checked against the bytes really written
  (the tensors in the output's safetensors files) and against the clock (a fake one, in process, so that the
  intermediate lines are deterministic).
- Memory: "Peak memory is a few times the largest parameter (the embedding), not the model." Measured by the
  kernel in a fresh process: after a tiny warm-up conversion of the same kind (so that lazy imports are not
  counted), the peak resident set is reset (/proc/self/clear_refs), then the conversion runs through the CLI with
  --no-verify --quiet (as bench/convert.py runs it) and VmHWM minus the resident set before it is its peak extra
  memory. Verification (on by default) is not part of this claim: it runs after the write and holds more (the
  read-back compares a parameter from both sides; for Hugging Face targets the logits check loads the model).
"""
from __future__ import annotations

import json
import os
import pty
import re
import select
import struct
import subprocess
import sys
import time
from itertools import pairwise
from pathlib import Path

import pytest
import torch
from conftest import REPO

from toolkit.checkpoint.convert import Progress, convert

MIB, GIB = 2**20, 2**30
SHAPE = {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 20, "num_attention_heads": 8,
         "num_key_value_heads": 4, "vocab_size": 20480}
TINY = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 500}
# The claim, stated: peak extra memory of the streaming write <= 5 x the largest parameter. Measured on a 2-core
# machine (5 to 13 runs each): 2.3-2.7x for the split (HF -> TP2 x PP2) and the merge (TP2 x PP2 -> HF), 2.4-3.7x
# for the relayout (TP2 x PP2 -> TP4 x PP1), which varies with how far reading runs ahead of the background writer.
# Holding the whole model would be at least 8x.
PEAK_K = 5
LINE = re.compile(r"converting: (\d+\.\d\d) / (\d+\.\d\d) GiB, (\d+) MiB/s, ETA (\d+) s")


def _random_hf(folder: Path, shape: dict) -> dict[str, int]:
    """A random untied Llama Hugging Face folder (fp32); returns each parameter's bytes."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**shape, max_position_embeddings=256, tie_word_embeddings=False, dtype=torch.float32)
    with torch.device("meta"):
        names = {n: p.shape for n, p in LlamaForCausalLM(config).state_dict().items()}
    gen = torch.Generator().manual_seed(0)
    folder.mkdir(parents=True)
    save_file({n: torch.randn(s, generator=gen) * 0.02 for n, s in names.items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    config.save_pretrained(folder)
    return {n: s.numel() * 4 for n, s in names.items()}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    """The big and the tiny model, each as a Hugging Face folder and converted to TP2 x PP2."""
    root = tmp_path_factory.mktemp("claims_convert")
    sizes = _random_hf(root / "big_hf", SHAPE)
    _random_hf(root / "tiny_hf", TINY)
    for name in ("big", "tiny"):
        convert(root / f"{name}_hf", root / f"{name}_tp2pp2", "megatron", tp=2, pp=2, verify=False, progress=False,
                log=lambda *_: None)
    largest, model = max(sizes.values()), sum(sizes.values())
    assert sizes["model.embed_tokens.weight"] == largest == 40 * MIB and model >= 8 * largest  # as designed
    return {"root": root, "largest": largest, "model": model}


def _tensor_bytes(folder: Path) -> int:
    """The bytes of every tensor in the folder's safetensors files (read from their headers), checking that each
    file is exactly its header and its tensors."""
    total = 0
    for f in sorted(folder.rglob("*.safetensors")):
        with open(f, "rb") as fh:
            n = struct.unpack("<Q", fh.read(8))[0]
            header = json.loads(fh.read(n))
        spans = [v["data_offsets"] for k, v in header.items() if k != "__metadata__"]
        assert f.stat().st_size == 8 + n + max(end for _, end in spans), f
        total += sum(end - begin for begin, end in spans)
    assert total > 0
    return total


def _parse(text: str) -> list[tuple[float, float, int, int]]:
    return [(float(a), float(b), int(r), int(e)) for a, b, r, e in LINE.findall(text)]


def _check_numbers(lines: list, times: list[float] | None, written: int, begin: float = 0.0, slack: float = 0.0) -> None:
    """The numbers of the progress lines against the bytes written and, when the times the lines were printed
    are known, against the clock: each line's rate must be its bytes over the time since one common start, after
    the conversion began (`begin`) and before the first line (within the printed rounding: 0.005 GiB, 0.5 MiB/s,
    and `slack` on the times), and its ETA the bytes left at that rate."""
    want_total = f"{written / GIB:.2f}"
    assert lines and all(f"{total:.2f}" == want_total for _, total, _, _ in lines), (lines, want_total)
    done = [d for d, _, _, _ in lines]
    assert done == sorted(done) and f"{done[-1]:.2f}" == want_total  # GiB written: up to all of it
    assert lines[-1][3] == 0  # nothing left
    lo_start, hi_start = -float("inf"), float("inf")
    for i, (d, _, rate, eta) in enumerate(lines):
        assert rate > 0
        d_lo, d_hi = max(d - 0.005, 0) * GIB, (d + 0.005) * GIB
        if i == len(lines) - 1:
            d_lo = d_hi = written  # the last line is at the very end
        r_lo, r_hi = (rate - 0.5) * MIB, (rate + 0.5) * MIB
        left_lo, left_hi = max(written - d_hi, 0), written - d_lo
        assert left_lo / r_hi - 0.5 <= eta <= left_hi / r_lo + 0.5, (lines[i], written)
        if times is not None:  # start = time - elapsed, elapsed = bytes / rate
            lo_start = max(lo_start, times[i] - d_hi / r_lo - slack)
            hi_start = min(hi_start, times[i] - d_lo / r_hi + slack)
    if times is not None:
        assert lo_start <= hi_start, "the rates do not fit one start time: they are not bytes over elapsed time"
        assert hi_start >= begin and lo_start <= times[0], (lo_start, hi_start, begin, times[0])


# ---- progress -----------------------------------------------------------------------------------------------------

def test_progress_line_on_a_terminal(models, tmp_path):
    """The CLI with its stderr (and stdout) on a terminal, default options (verification included): the progress
    line is rewritten in place (\\r) and ends with a newline; its last state shows every byte of the output's tensors
    written, a rate no slower than the bytes over the write time the converter logs, and ETA 0."""
    dst = tmp_path / "m"
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "toolkit", "convert", str(models["root"] / "big_hf"), str(dst),
                             "--to", "megatron", "--tp", "2", "--pp", "2"], cwd=REPO, stdin=slave, stdout=slave,
                            stderr=slave, close_fds=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    os.close(slave)
    chunks, deadline = [], time.monotonic() + 300
    try:
        while time.monotonic() < deadline:
            if select.select([master], [], [], 1)[0]:
                try:
                    data = os.read(master, 65536)
                except OSError:  # EIO: the child closed the terminal
                    break
                if not data:
                    break
                chunks.append(data)
            elif proc.poll() is not None:
                break
    finally:
        os.close(master)
        rc = proc.wait(timeout=60)
    text = b"".join(chunks).decode().replace("\r\n", "\n")  # the terminal turns \n into \r\n
    assert rc == 0, text[-3000:]
    lines = _parse(text)
    segments = re.findall(r"\rconverting: [^\r\n]*", text)
    assert len(segments) == len(lines) >= 1, text  # every state of the line rewrites it in place
    assert text.count("\nconverting: ") == 0 and re.search(r"\rconverting: [^\r\n]*ETA 0 s\n", text), text
    written = _tensor_bytes(dst)
    _check_numbers(lines, None, written)
    took = float(re.search(r"wrote [\d.,]+ (?:GiB|MiB|KiB|bytes) in ([\d.]+) s", text).group(1))
    assert (lines[-1][2] + 0.5) * MIB >= written / (took + 0.05), (lines[-1], took)  # bytes over at most `took`
    assert "verified:" in text


class _FakeClock:
    """time.monotonic for the module that draws the progress line: advances a fixed step at every reading."""

    def __init__(self, step: float):
        self.t, self.step = 1000.0, step

    def monotonic(self) -> float:
        self.t += self.step
        return self.t


class _Stderr:
    """sys.stderr that is (or is not) a terminal, recording the clock's time of every write."""

    def __init__(self, clock: _FakeClock, tty: bool):
        self.clock, self.tty, self.writes = clock, tty, []

    def isatty(self) -> bool:
        return self.tty

    def write(self, s: str) -> int:
        self.writes.append((s, self.clock.t))
        return len(s)

    def flush(self) -> None:
        pass


@pytest.mark.parametrize("tty,step,every", [(True, 0.1, 0.5), (False, 0.25, 10.0)], ids=["terminal", "log"])
def test_progress_numbers_follow_bytes_and_clock(models, tmp_path, monkeypatch, tty, step, every):
    """A real conversion with a fake clock (a fixed step per reading), so that the intermediate lines are
    deterministic: on a terminal a line at most every 0.5 s, rewritten in place; in a log a line at most every
    10 s, each its own line. Every line's GiB, rate and ETA must agree with the bytes written and the clock."""
    clock = _FakeClock(step)
    stderr, begin = _Stderr(clock, tty), clock.t
    monkeypatch.setattr(sys.modules[Progress.__module__], "time", clock)
    monkeypatch.setattr(sys, "stderr", stderr)
    dst = convert(models["root"] / "big_hf", tmp_path / "m", "megatron", tp=2, pp=2, verify=False, progress=True,
                  log=lambda *_: None)
    text = "".join(s for s, _ in stderr.writes)
    written = _tensor_bytes(dst)
    lines = _parse(text)
    times = [t for s, t in stderr.writes if LINE.search(s)]
    assert len(times) == len(lines) and len(lines) >= (4 if tty else 3), text  # intermediate lines, then the last
    if tty:
        assert text.count("\rconverting: ") == len(lines) and text.count("\n") == 1 and text.endswith("ETA 0 s\n")
    else:
        assert "\r" not in text and text.count("\n") == len(lines) and text.endswith("ETA 0 s\n")
    gaps = [b - a for a, b in pairwise(times[:-1])]  # the last line is printed whenever the write ends
    assert all(g > every for g in gaps), gaps
    _check_numbers(lines, times, written, begin=begin, slack=step)


# ---- memory -------------------------------------------------------------------------------------------------------

CHILD = r'''
import json, sys
from toolkit.cli import main

def status():
    d = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return {k: int(d[k].split()[0]) * 1024 for k in ("VmHWM", "VmRSS")}

tiny_src, big_src, tiny_dst, big_dst, *args = sys.argv[1:]
assert main(["convert", tiny_src, tiny_dst, *args]) == 0  # warm-up: lazy imports, first-call caches
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset the peak resident set (VmHWM) to the current one
before = status()
assert before["VmHWM"] - before["VmRSS"] < 2**20, before
assert main(["convert", big_src, big_dst, *args]) == 0
after = status()
print("PEAK " + json.dumps({"extra": after["VmHWM"] - before["VmRSS"], "rss_before": before["VmRSS"],
                            "hwm": after["VmHWM"]}))
'''

CASES = {"hf->tp2pp2": ("hf", ["--to", "megatron", "--tp", "2", "--pp", "2"]),
         "tp2pp2->hf": ("tp2pp2", ["--to", "hf"]),
         "tp2pp2->tp4pp1": ("tp2pp2", ["--to", "megatron", "--tp", "4", "--pp", "1"])}


@pytest.mark.parametrize("path", ["copied", "streamed"])
@pytest.mark.parametrize("case", list(CASES))
def test_streaming_peak_memory_is_a_few_times_the_largest_parameter(models, tmp_path, case, path):
    """Peak extra resident memory of `toolkit convert --no-verify --quiet` (split, merge, and merge + split) is at
    most PEAK_K x the largest parameter, well under the model's size: copied file to file without torch
    (toolkit/checkpoint/copy_only.py), and streamed through memory (TOOLKIT_NO_COPY_RANGE=1, as a conversion that
    casts or carries optimizer state is)."""
    src, args = CASES[case]
    root = models["root"]
    proc = subprocess.run([sys.executable, "-c", CHILD, str(root / f"tiny_{src}"), str(root / f"big_{src}"),
                           str(tmp_path / "tiny_out"), str(tmp_path / "big_out"), *args, "--no-verify", "--quiet"],
                          cwd=REPO, capture_output=True, text=True, timeout=300, check=False,
                          env={**os.environ, "OMP_NUM_THREADS": "1",
                               "TOOLKIT_NO_COPY_RANGE": "1" if path == "streamed" else ""})
    assert proc.returncode == 0, proc.stderr[-3000:]
    peak = json.loads(proc.stdout.split("PEAK ", 1)[1])
    largest, model = models["largest"], models["model"]
    print(f"{case}: peak extra {peak['extra'] / MIB:.1f} MiB = {peak['extra'] / largest:.2f} x the largest parameter "
          f"({largest / MIB:.0f} MiB), {peak['extra'] / model:.2f} x the model ({model / MIB:.0f} MiB); "
          f"resident before {peak['rss_before'] / MIB:.0f} MiB")
    assert _tensor_bytes(tmp_path / "big_out") >= model  # the whole model really went through
    assert peak["extra"] <= PEAK_K * largest
    assert peak["extra"] < 0.75 * model
