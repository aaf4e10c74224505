"""Checkpoint conversion speed and memory against `cp -r` of the same bytes, measured in the same run.

    python bench/convert.py                       # 1.1B and 3.0B Llama shapes (bf16), about 5 minutes, ~35 GB disk
    python bench/convert.py --sizes 1b --json out.json
    python bench/convert.py --sizes tiny          # seconds; what the test suite runs so the script cannot rot

For each size it writes a random Llama-shaped Hugging Face checkpoint (streamed, never whole in memory), then
times, each in a fresh process whose peak resident memory is read from the kernel (wait4):
  cp        cp -r of the Hugging Face folder, then sync of the copied files (the converter fsyncs what it
            writes); run first and last, and the ratio is taken against the mean of the two
  hf->tp2pp2, tp2pp2->tp4pp1, tp4pp1->hf   `toolkit convert --no-verify --quiet`
  hf->torch_dist, torch_dist->megatron_lm, megatron_lm->hf   Megatron-Core's torch_dist (written at TP2 x PP2),
            read into Megatron-LM's legacy layout at TP2 x PP2, read back to Hugging Face
and prints wall time, GiB/s, the throughput ratio to cp (higher is better; 1.0 = as fast as cp), and peak RSS.
The ratio in brackets is the streaming phase's alone (GiB / stream s against cp), leaving out start-up.
Wall time includes Python start-up and imports (about 3 s here); `stream s` is the converter's own streaming phase.
The machine is shared and noisy: compare ratios within one run, not absolute numbers across runs.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SIZES = {  # Llama-shaped configs; parameter counts are printed by the run
    "tiny": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=4, vocab_size=1000),
    "1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
               num_key_value_heads=4, vocab_size=32000),  # TinyLlama-1.1B's shape
    "3b": dict(hidden_size=3200, intermediate_size=8640, num_hidden_layers=26, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=32000),  # OpenLLaMA-3B's shape with GQA 32/8: 3.0B
}


def write_random_hf(folder: Path, shape: dict, dtype_name: str) -> int:
    """A random Llama checkpoint written one tensor at a time; returns its parameter count. Runs in a child
    process (--generate): the parent must not import torch, or every child's peak RSS would start at its size."""
    import torch

    from toolkit.families import dims_from_hf, iter_entries
    from toolkit.format import safetensors_stream as st

    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "max_position_embeddings": 4096,
              "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False, "hidden_act": "silu",
              "torch_dtype": dtype_name, **shape}
    dtype = getattr(torch, dtype_name)
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    specs = {n: (s, dtype) for e in iter_entries(dims_from_hf(config), 1, 1) for n, s in zip(e.hf_names, e.hf_shapes)}
    writer = st.Writer(folder / "model.safetensors", specs, {"format": "pt"})
    gen = torch.Generator().manual_seed(0)
    for name, (s, d) in specs.items():
        writer.write(name, (torch.randn(s, generator=gen) * 0.02).to(d))
    writer.close()
    params = sum(torch.Size(s).numel() for s, _ in specs.values())
    (folder / "params.txt").write_text(str(params))
    return params


def measure(cmd: list[str]) -> dict:
    """Run cmd in a fresh process: wall seconds, that process's own peak RSS (MiB, from wait4), its output."""
    with tempfile.TemporaryFile("w+") as out:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, text=True)
        _, status, usage = os.wait4(proc.pid, 0)  # reap it ourselves: wait4 gives this child's own rusage
        wall = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        text = out.read()
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{text[-3000:]}")
    stream = re.search(r"wrote [\d.]+ GiB in ([\d.]+) s", text)
    return {"wall_s": wall, "peak_rss_mib": usage.ru_maxrss / 1024, "stream_s": float(stream[1]) if stream else None}


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def bench_size(name: str, work: Path, dtype: str) -> list[dict]:
    root = work / name
    t0 = time.perf_counter()
    subprocess.run([sys.executable, __file__, "--generate", str(root / "hf"), name, dtype], check=True)
    params = int((root / "hf" / "params.txt").read_text())
    (root / "hf" / "params.txt").unlink()
    print(f"\n{name}: {params / 1e9:.2f}B parameters, {folder_bytes(root / 'hf') / 2**30:.2f} GiB "
          f"({dtype}), generated in {time.perf_counter() - t0:.0f} s", flush=True)
    convert = [sys.executable, "-m", "toolkit", "convert", "--no-verify"]
    cp = f"cp -r {root / 'hf'} {{out}} && sync {{out}}/*"
    steps = [
        ("cp", ["bash", "-c", cp.format(out=root / "copy1")], root / "copy1"),
        ("hf->tp2pp2", [*convert, str(root / "hf"), str(root / "tp2pp2"), "--to", "megatron", "--tp", "2",
                        "--pp", "2"], root / "tp2pp2"),
        ("tp2pp2->tp4pp1", [*convert, str(root / "tp2pp2"), str(root / "tp4pp1"), "--to", "megatron", "--tp", "4"],
         root / "tp4pp1"),
        ("tp4pp1->hf", [*convert, str(root / "tp4pp1"), str(root / "back"), "--to", "hf"], root / "back"),
        ("hf->torch_dist", [*convert, str(root / "hf"), str(root / "td"), "--to", "torch_dist", "--tp", "2", "--pp",
                            "2"], root / "td"),
        ("torch_dist->megatron_lm", [*convert, str(root / "td"), str(root / "mlm"), "--to", "megatron_lm", "--tp", "2",
                                     "--pp", "2", "--vocab-size", str(SIZES[name]["vocab_size"])], root / "mlm"),
        ("megatron_lm->hf", [*convert, str(root / "mlm"), str(root / "back2"), "--to", "hf", "--vocab-size",
                             str(SIZES[name]["vocab_size"])], root / "back2"),
        ("cp (again)", ["bash", "-c", cp.format(out=root / "copy2")], root / "copy2"),
    ]
    rows = []
    for label, cmd, out in steps:
        os.sync()  # each step starts with nothing of the previous one still being written back
        r = measure(cmd)
        r.update(size=name, params=params, step=label, gib=folder_bytes(out) / 2**30)
        r["gib_per_s"] = r["gib"] / r["wall_s"]
        rows.append(r)
    # the baseline: cp before and after the conversions, so drift of the machine shows and is averaged out
    cp_rate = (rows[0]["gib_per_s"] + rows[-1]["gib_per_s"]) / 2
    for r in rows:
        r["vs_cp"] = r["gib_per_s"] / cp_rate
        r["stream_vs_cp"] = r["gib"] / max(r["stream_s"], 1e-3) / cp_rate if r["stream_s"] is not None else None
        stream = (f"stream {r['stream_s']:5.1f} s (x{r['stream_vs_cp']:.2f})" if r["stream_s"] is not None
                  else "stream     -          ")
        print(f"  {r['step']:<23} {r['gib']:6.2f} GiB  wall {r['wall_s']:6.1f} s  {r['gib_per_s']:5.2f} GiB/s  "
              f"x{r['vs_cp']:.2f} of cp  {stream}  peak RSS {r['peak_rss_mib']:6.0f} MiB", flush=True)
    shutil.rmtree(root)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1b,3b", help=f"comma-separated, from {', '.join(SIZES)} (default 1b,3b)")
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16", help="checkpoint dtype (default bf16)")
    ap.add_argument("--workdir", default=None, help="where to write (default: a temporary folder; needs ~6x the "
                    "checkpoint size free)")
    ap.add_argument("--json", default=None, help="also write the rows to this JSON file")
    ap.add_argument("--generate", nargs=3, metavar=("FOLDER", "SIZE", "DTYPE"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.generate:
        folder, size, dtype_name = args.generate
        write_random_hf(Path(folder), SIZES[size], {"bf16": "bfloat16", "fp32": "float32"}[dtype_name])
        return 0
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        ap.error(f"unknown size(s) {unknown}; choose from {', '.join(SIZES)}")
    dtype = args.dtype
    print(f"bench/convert.py: {os.cpu_count()} CPUs; sizes {sizes}")
    with tempfile.TemporaryDirectory(dir=args.workdir, prefix="bench_convert_") as work:
        rows = [r for s in sizes for r in bench_size(s, Path(work), dtype)]
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
