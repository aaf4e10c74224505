"""Checkpoint conversion speed and memory against `cp -r` of the same bytes, measured in the same run.

    python bench/convert.py                       # 1.1B and 3.0B Llama shapes (bf16), medians of 3: ~40 minutes
    python bench/convert.py --sizes 1b --json out.json
    python bench/convert.py --sizes tiny --reps 1 # seconds; what the test suite runs so the script cannot rot
    python bench/convert.py --sizes 1b --cold     # root: every run (cp too) reads its source from the disk
    python bench/convert.py --direct-io           # also --no-verify with TOOLKIT_DIRECT_IO=1 (O_DIRECT writes)

For each size it writes a random Llama-shaped Hugging Face checkpoint (streamed, never whole in memory), then
runs, each `--reps` times in a fresh process, and reports the median of each figure:
  cp        cp -r of the Hugging Face folder, then sync of the copied files (the converter fsyncs what it
            writes); run first and last, and the ratios are taken against the mean of the two
  hf->tp2pp2, tp2pp2->tp4pp1, tp4pp1->hf   `toolkit convert --quiet --verbose`, first with --no-verify, then
            with the default verification (the bit-exact read-back and the layer-by-layer logit check)
  hf->torch_dist, torch_dist->megatron_lm, megatron_lm->hf, torch_dist->hf   the same two modes: Megatron-Core's
            torch_dist (written at TP2 x PP2), read into Megatron-LM's legacy layout at TP2 x PP2, each read back
            to Hugging Face
and prints wall time, its ratio to cp's wall time (the targets: 1.3 with --no-verify, 2 verified), CPU seconds
(user + system, wait4: less sensitive to a shared machine than wall time), the 1-minute load average at its end,
the throughput ratio to cp, the GiB copied file to file (os.copy_file_range, and gathered from a map for tensors
of many small ranges), the GiB written past the page cache (O_DIRECT, --direct-io), peak RSS (wait4's ru_maxrss),
peak anonymous memory (RssAnon from /proc, sampled every 10 ms) and the converter's phases (read, split, write, hash,
close/fsync/manifest, verify; seconds).
Wall time includes Python start-up and imports: about 3 s here for a verified conversion (torch and transformers),
and a fraction of a second for a --no-verify one that takes the file-to-file path (no torch import).
The machine is shared and noisy: compare ratios within one run, not absolute numbers across runs. On a VM that
hands freed memory back to its host (virtio-balloon free page reporting, as the development VM does), a page the
kernel has not reused recently costs a host fault: a run writing into memory just freed by the previous one is
several times faster than one that is not (`cp` of 2 GiB: 1.6 s against 8.2 s). Each rep deletes its output just
before the next, so use --reps 3 (the default): with --reps 1 each step runs on whatever the previous one left.
Before each run every folder but the run's source is evicted from the page cache (posix_fadvise DONTNEED), and the
source is read through once: each run, cp's too, reads a cached source and has the same memory free to write into.
Without the evictions, at 3B the outputs of earlier steps filled the page cache and the kernel evicted some steps'
sources to make room; without the read, a step whose source an earlier step had evicted (hf -> torch_dist reads
the Hugging Face folder again) read it from the disk in its first run, and a reclaimer that drops pages left cold
for a minute (this VM's DAMON) could do the same to any source (2026-12-06: before then, sources were not read).
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
    "7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=32, vocab_size=32000),  # Llama-2-7B's shape: 6.7B, 12.6 GiB in bf16
    # Llama-2-70B's shapes with 2 (4) of its 80 decoder layers: what one layer and the embeddings cost at 70B, in
    # time and memory, on a disk that cannot hold 70B's 129 GiB eight times over (docs/performance.md)
    "70b-2l": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=2, num_attention_heads=64,
                   num_key_value_heads=8, vocab_size=32000),
    "70b-4l": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=4, num_attention_heads=64,
                   num_key_value_heads=8, vocab_size=32000),
}


STEPS = ("hf->tp2pp2", "tp2pp2->tp4pp1", "tp4pp1->hf", "hf->torch_dist", "torch_dist->megatron_lm",
         "megatron_lm->hf", "torch_dist->hf")
"""The conversions bench_size runs, in order (--steps names a subset)."""


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


def _anon_kib(pid: int) -> int:
    """The process's resident anonymous memory now (RssAnon, KiB), 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return int(re.search(r"RssAnon:\s+(\d+)", f.read())[1])
    except (OSError, TypeError):
        return 0


def measure(cmd: list[str], env: dict | None = None) -> dict:
    """Run cmd in a fresh process: wall seconds, its peak RSS (MiB, wait4's ru_maxrss; this parent never imports
    torch, so the fork does not inflate it), its peak anonymous memory (RssAnon from /proc, sampled every 10 ms),
    and the phases its --verbose output reports."""
    with tempfile.TemporaryFile("w+") as out:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, **(env or {})})
        peak_anon = 0
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)  # reap it ourselves: this child's own rusage
            if pid:
                break
            peak_anon = max(peak_anon, _anon_kib(proc.pid))
            time.sleep(0.01)
        wall = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        text = out.read()
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{text[-3000:]}")
    stream = re.search(r"wrote [\d.,]+ (?:GiB|MiB|KiB|bytes) in ([\d.]+) s", text)
    copied = re.search(r"copied file to file: ([\d.]+) MiB by copy_file_range, ([\d.]+) MiB by gathering", text)
    direct = re.search(r"([\d.]+) MiB of them written past the page", text)
    names = r"(manifest-hash|import-wait|read|split|write|hash|verify|close/fsync/manifest)"
    phases = {k: float(v) for k, v in re.findall(names + r" ([\d.]+) s", " ".join(line for line in text.splitlines()
                                                             if line.startswith("phases:")))}
    return {"wall_s": wall, "cpu_s": usage.ru_utime + usage.ru_stime, "load": os.getloadavg()[0],
            "peak_rss_mib": usage.ru_maxrss / 1024, "peak_anon_mib": peak_anon / 1024,
            "stream_s": float(stream[1]) if stream else None, "phases": phases,
            "copied_gib": float(copied[1]) / 1024 if copied else None,
            "gathered_gib": float(copied[2]) / 1024 if copied else None,
            "direct_gib": float(direct[1]) / 1024 if direct else None}


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def evict(folder: Path) -> None:
    """Drop the (written back) pages of every file under `folder` from the page cache (posix_fadvise DONTNEED; no
    root needed): the memory they held is free for the next step, as if the files had been written long ago."""
    os.sync()
    for p in folder.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def warm(folder: Path) -> None:
    """Read every file under `folder` once, so that the run after this reads it from the page cache."""
    for p in folder.rglob("*"):
        if p.is_file():
            with p.open("rb", buffering=0) as f:
                while f.read(16 * 2**20):
                    pass


def _median(rows: list[dict], key: str):
    values = sorted(r[key] for r in rows if r.get(key) is not None)
    return values[len(values) // 2] if values else None


def drop_caches() -> None:
    """Write everything back, then have the kernel drop its clean page cache (root only): the next run reads its
    source from the disk, as a conversion of a checkpoint that is not in memory does (--cold)."""
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def bench_size(name: str, work: Path, dtype: str, reps: int, only: list[str] | None = None,
               cold: bool = False, direct: bool = False) -> list[dict]:
    root = work / name
    t0 = time.perf_counter()
    subprocess.run([sys.executable, __file__, "--generate", str(root / "hf"), name, dtype], check=True)
    params = int((root / "hf" / "params.txt").read_text())
    (root / "hf" / "params.txt").unlink()
    # the folders that stay (hf, tp2pp2, tp4pp1, td, mlm) and at most one more at a time: say so now, not when cp
    # of the last step finds the disk full
    need, free = 7 * folder_bytes(root / "hf") + 2**30, shutil.disk_usage(root).free + folder_bytes(root / "hf")
    if free < need:
        shutil.rmtree(root)
        raise SystemExit(f"bench/convert.py: {name} needs about {need / 2**30:.0f} GiB free under {work}, and "
                         f"{free / 2**30:.0f} GiB are: free some, or choose another --workdir")
    count = f"{params / 1e9:.2f}B" if params >= 1e8 else f"{params / 1e6:.2f}M"  # tiny printed "0.00B"
    size = folder_bytes(root / "hf")
    size = f"{size / 2**30:.2f} GiB" if size >= 2**30 / 100 else f"{size / 2**20:.1f} MiB"
    print(f"\n{name}: {count} parameters, {size} "
          f"({dtype}), generated in {time.perf_counter() - t0:.0f} s; medians of {reps}", flush=True)
    cp = f"cp -r {root / 'hf'} {{out}} && sync {{out}}/*"
    convert = [sys.executable, "-m", "toolkit", "convert", "--quiet", "--verbose"]
    steps = [("hf->tp2pp2", "hf", "tp2pp2", ["--to", "megatron", "--tp", "2", "--pp", "2"]),
             ("tp2pp2->tp4pp1", "tp2pp2", "tp4pp1", ["--to", "megatron", "--tp", "4"]),
             ("tp4pp1->hf", "tp4pp1", "back", ["--to", "hf"]),
             ("hf->torch_dist", "hf", "td", ["--to", "torch_dist", "--tp", "2", "--pp", "2"]),
             ("torch_dist->megatron_lm", "td", "mlm", ["--to", "megatron_lm", "--tp", "2", "--pp", "2",
                                                      "--vocab-size", str(SIZES[name]["vocab_size"])]),
             ("megatron_lm->hf", "mlm", "back2", ["--to", "hf", "--vocab-size", str(SIZES[name]["vocab_size"])]),
             ("torch_dist->hf", "td", "back3", ["--to", "hf", "--vocab-size", str(SIZES[name]["vocab_size"])])]
    assert tuple(s[0] for s in steps) == STEPS
    steps = [s for s in steps if not only or s[0] in only]
    plan = [("cp", "hf", ["bash", "-c", cp.format(out=root / "copy")], root / "copy", None)]
    modes = [("no-verify", ["--no-verify"], None), ("verify", [], None)]
    if direct:  # TOOLKIT_DIRECT_IO=1 (docs/convert.md): the targets it applies to, after the same steps without it
        modes.insert(1, ("no-verify O_DIRECT", ["--no-verify"], {"TOOLKIT_DIRECT_IO": "1"}))
    for mode, flag, env in modes:
        for label, src, dst, args in steps:
            if env and args[1] == "megatron":  # a toolkit checkpoint reads its bytes back: always through the cache
                continue
            plan.append((f"{label} {mode}", src, [*convert, *flag, str(root / src), str(root / dst), *args],
                         root / dst, env))
    plan.append(("cp (again)", "hf", ["bash", "-c", cp.format(out=root / "copy")], root / "copy", None))
    rows = []
    for label, src, cmd, out, env in plan:
        runs = []
        for _ in range(reps):
            shutil.rmtree(out, ignore_errors=True)
            os.sync()  # each run starts with nothing of the previous one still being written back
            if cold:
                drop_caches()
            else:  # only its source stays cached: every run, cp's too, has the same memory free to write into
                for other in root.iterdir():
                    if other.is_dir() and other.name != src:
                        evict(other)
                warm(root / src)
            runs.append(measure(cmd, env))
        r = {"size": name, "params": params, "step": label, "gib": folder_bytes(out) / 2**30, "reps": len(runs)}
        for key in ("wall_s", "cpu_s", "load", "peak_rss_mib", "peak_anon_mib", "stream_s", "copied_gib",
                    "gathered_gib", "direct_gib"):
            r[key] = _median(runs, key)
        r["phases"] = {k: _median([x["phases"] for x in runs], k) for k in runs[0]["phases"]}
        r["gib_per_s"] = r["gib"] / r["wall_s"]
        rows.append(r)
        if label.startswith("cp") or out.name.startswith("back"):  # no later step reads it
            shutil.rmtree(out)
    # the baseline: cp before and after the conversions, so drift of the machine shows and is averaged out
    cp_wall = (rows[0]["wall_s"] + rows[-1]["wall_s"]) / 2
    cp_rate = (rows[0]["gib_per_s"] + rows[-1]["gib_per_s"]) / 2
    for r in rows:
        r["vs_cp"] = r["gib_per_s"] / cp_rate
        r["wall_vs_cp"] = r["wall_s"] / cp_wall  # the targets: <= 1.3 (--no-verify), <= 2 (verified)
        r["stream_vs_cp"] = r["gib"] / max(r["stream_s"], 1e-3) / cp_rate if r["stream_s"] is not None else None
        phases = ", ".join(f"{k} {v:.1f}" for k, v in r["phases"].items())
        print(f"  {r['step']:<33} {r['gib']:6.2f} GiB  wall {r['wall_s']:6.1f} s  x{r['wall_vs_cp']:.2f} cp wall  "
              f"cpu {r['cpu_s']:5.1f} s  load {r['load']:4.1f}  "
              f"x{r['vs_cp']:.2f} of cp  peak RSS {r['peak_rss_mib']:6.0f} MiB  anon {r['peak_anon_mib']:6.0f} MiB"
              + (f"  copy_file_range {r['copied_gib']:.2f} GiB" if r["copied_gib"] is not None else "")
              + (f"  gathered from a map {r['gathered_gib']:.2f} GiB" if r["gathered_gib"] else "")
              + (f"  past the page cache {r['direct_gib']:.2f} GiB" if r["direct_gib"] else "")
              + (f"  phases (s): {phases}" if phases else ""), flush=True)
    shutil.rmtree(root)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1b,3b", help=f"comma-separated, from {', '.join(SIZES)} (default 1b,3b)")
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16", help="checkpoint dtype (default bf16)")
    ap.add_argument("--workdir", default=None, help="where to write (default: a temporary folder; needs ~7x the "
                    "checkpoint size free)")
    ap.add_argument("--json", default=None, help="also write the rows to this JSON file")
    ap.add_argument("--reps", type=int, default=3, help="runs of each step; the median is reported (default 3)")
    ap.add_argument("--steps", default=None, help="comma-separated conversions to run (default all), e.g. "
                    "hf->tp2pp2,tp2pp2->tp4pp1,tp4pp1->hf: the three the issue's targets name")
    ap.add_argument("--cold", action="store_true", help="drop the page cache before every run (root): each reads "
                    "its source from the disk, cp included; the default reads sources the previous step just wrote")
    ap.add_argument("--direct-io", action="store_true", help="also run the --no-verify steps whose targets take it "
                    "with TOOLKIT_DIRECT_IO=1 (writes past the page cache, docs/convert.md)")
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
    only = [s.strip() for s in args.steps.split(",")] if args.steps else None
    if only and set(only) - set(STEPS):  # e.g. a shell that took "->" for a redirection
        ap.error(f"unknown step(s) {sorted(set(only) - set(STEPS))}; choose from {', '.join(STEPS)} (quote them)")
    if args.workdir is not None and not Path(args.workdir).is_dir():
        ap.error(f"--workdir {args.workdir} is not a folder; create it first (it holds a temporary folder, removed "
                 "at the end)")
    if args.cold and not os.access("/proc/sys/vm/drop_caches", os.W_OK):
        ap.error("--cold drops the page cache through /proc/sys/vm/drop_caches, which needs root")
    print(f"bench/convert.py: {os.cpu_count()} CPUs; sizes {sizes}" + ("; page cache dropped before every run"
                                                                      if args.cold else ""))
    with tempfile.TemporaryDirectory(dir=args.workdir, prefix="bench_convert_") as work:
        rows = [r for s in sizes for r in bench_size(s, Path(work), dtype, args.reps, only, args.cold,
                                                     args.direct_io)]
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
