"""A plain DeepSpeed ZeRO-3 checkpoint to Hugging Face: `toolkit convert --fp32` against DeepSpeed's own
`zero_to_fp32.py` (the copy `engine.save_checkpoint` leaves beside the checkpoint) and `cp -r`, measured in the same
run.

    python bench/convert_plain_deepspeed.py                  # a 0.13B Llama, ZeRO-3 bf16 on 2 CPU ranks
    python bench/convert_plain_deepspeed.py --size 0.7b      # 0.74B (needs ~16 GB RAM to train the checkpoint)
    python bench/convert_plain_deepspeed.py --size tiny      # seconds; the test suite's smoke run
    python bench/convert_plain_deepspeed.py --checkpoint WORK/ckpt   # time a checkpoint an earlier run trained
    python bench/convert_plain_deepspeed.py --size 0.7b --reps 3   # each step three times, medians

The checkpoint is written by tests/plain_deepspeed_train.py (plain `deepspeed.initialize` + `engine.save_checkpoint`,
no toolkit code; one training step). Then, each in a fresh process whose peak resident memory is read from the
kernel (wait4; it counts the rank files' memory-mapped pages the converter touches, which the kernel can drop) and
whose peak anonymous memory (RssAnon, summed over the process and its children, e.g. ds_to_universal.py's workers,
sampled every 50 ms) is what the issue bounds:
  cp             cp -r of the checkpoint's tag folder, then sync
  zero_to_fp32   python CKPT/zero_to_fp32.py CKPT OUT --safe_serialization, then sync (DeepSpeed's tools do not fsync
                 what they write; the toolkit's output is on disk when it returns, so both are timed to there)
  toolkit        toolkit convert CKPT OUT --to hf --fp32 --no-verify --quiet
  ds_to_universal  python -m deepspeed.checkpoint.ds_to_universal --input_folder TAG --output_folder OUT/TAG
                   (its default 4 extract / 2 merge worker processes), then sync
  toolkit universal  toolkit convert CKPT OUT --to universal --quiet
Each output is synced and then evicted from the page cache once timed (posix_fadvise DONTNEED; the checkpoint
itself stays cached), so every step starts with the same free memory: otherwise the step after ds_to_universal.py
would find its 12 GiB of output cached and the kernel might evict the checkpoint to make room. On a VM that
returns freed memory to its host (see bench/convert.py), every step here writes into fresh pages, cp included:
the toolkit's universal conversion took 15 s in this script and 8-9 s alone right after deleting its last output,
and cp of the 8.3 GiB 15-16 s against 7 s. Both pairs of outputs are compared tensor by tensor (they must be equal bit for bit; for the universal
checkpoints every zero/<param>/*.pt file), one tensor at a time; each pair is deleted once compared, so the disk
holds the checkpoint and at most one pair (about 4x the checkpoint at the peak, ds_to_universal.py's temp folder
included). The load average is printed with each step (the machine may be shared).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from convert import REPO, evict, folder_bytes, measure  # noqa: E402

SIZES = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=500),
    "0.1b": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                 num_key_value_heads=4, vocab_size=32000),
    "0.7b": dict(hidden_size=1536, intermediate_size=4096, num_hidden_layers=26, num_attention_heads=16,
                 num_key_value_heads=4, vocab_size=32000),  # 0.742B parameters (untied embeddings)
}


def train(work: Path, size: str) -> Path:
    # Smaller communication buckets than DeepSpeed's defaults (5e8 elements), and optimizer sub-groups of 1e8
    # elements instead of one per rank (Adam's temporaries and the fp32 gradients are per sub-group): about 4 GB less
    # to train the 0.7b size on a shared machine. The buckets leave no trace in the files; the sub-groups do (each
    # rank's fp32_flat_groups holds several), as in any run that sets sub_group_size.
    run = dict(name="ckpt", model="llama", stage=3, dtype="bf16", steps=1, no_16bit=True,
               sizes={**SIZES[size], "max_position_embeddings": 64},
               zero={"reduce_bucket_size": 50_000_000, "stage3_prefetch_bucket_size": 5_000_000,
                     "sub_group_size": 100_000_000})
    cmd = [str(Path(sys.executable).parent / "torchrun"), "--nproc_per_node", "2", "--master_port",
           str(29500 + os.getpid() % 1000), "tests/plain_deepspeed_train.py", "--out", str(work),
           "--runs", json.dumps([run])]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode:
        raise SystemExit(f"training the checkpoint failed:\n{proc.stderr[-3000:]}")
    return work / "ckpt"


def compare(ours: Path, theirs: Path) -> int:
    """Run in a child: every tensor of zero_to_fp32's output equals ours (a tied alias is in theirs only), read one
    pair at a time."""
    import torch
    from safetensors import safe_open

    def index(folder: Path) -> dict:
        return {k: f for f in sorted(folder.glob("*.safetensors")) for k in safe_open(f, "pt").keys()}

    mine, ref = index(ours), index(theirs)
    bad = []
    for k, f in ref.items():
        if k not in mine:
            bad.append(k)
            continue
        with safe_open(f, "pt") as a, safe_open(mine[k], "pt") as b:
            x, y = a.get_tensor(k), b.get_tensor(k)
        if x.dtype != y.dtype or not torch.equal(x, y):
            bad.append(k)
    if bad or set(mine) - set(ref):
        print(f"outputs differ: {bad[:5]} {sorted(set(mine) - set(ref))[:5]}")
        return 1
    print(f"outputs equal: {len(ref)} tensors")
    return 0


def _tree_anon_kib(pid: int) -> int:
    """RssAnon (KiB) of `pid` and all its descendants now."""
    kids: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(d.name))
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        todo += kids.get(p, [])
        try:
            total += int(re.search(r"RssAnon:\s+(\d+)", Path(f"/proc/{p}/status").read_text())[1])
        except (OSError, TypeError):
            pass
    return total


def measure_tree(cmd: list[str]) -> dict:
    """bench/convert.py's measure(), plus the peak anonymous memory of the whole process tree (sampled)."""
    peak, stop = [0], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            for proc in Path("/proc").iterdir():  # our own direct children: the command just started
                if proc.name.isdigit() and proc.name != str(os.getpid()):
                    try:
                        if int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1]) == os.getpid():
                            peak[0] = max(peak[0], _tree_anon_kib(int(proc.name)))
                    except (OSError, IndexError, ValueError):
                        pass
            time.sleep(0.05)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    try:
        r = measure(cmd)
    finally:
        stop.set()
        t.join()
    r["peak_anon_tree_mib"] = peak[0] / 1024
    return r


def compare_universal(ours: Path, theirs: Path) -> int:
    """Run in a child: every zero/<param>/*.pt tensor file of ds_to_universal.py's output equals ours."""
    import torch

    files = sorted(str(p.relative_to(theirs)) for p in (theirs / "zero").rglob("*.pt") if p.parent.name != "zero")
    bad = []
    for f in files:
        a, b = torch.load(ours / f, weights_only=True), torch.load(theirs / f, weights_only=True)
        a, b = (a["param"], b["param"]) if isinstance(a, dict) else (a, b)
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b):
            bad.append(f)
    if bad or not files:
        print(f"universal outputs differ: {bad[:5]} ({len(files)} files)")
        return 1
    print(f"universal outputs equal: {len(files)} files")
    return 0


def _param_shapes(tag: Path) -> list[list[int]]:
    """The element count of every parameter DeepSpeed recorded (param_shapes), read in a child (no torch here)."""
    code = ("import sys, math, json, torch; s = torch.load(sys.argv[1], weights_only=False, mmap=True); "
            "print(json.dumps([[math.prod(v) for v in g.values()] for g in s['param_shapes']]))")
    out = subprocess.run([sys.executable, "-c", code, str(tag / "zero_pp_rank_0_mp_rank_00_model_states.pt")],
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=list(SIZES), default="0.1b")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--json", default=None, help="also write the rows to this JSON file")
    ap.add_argument("--reps", type=int, default=1, help="runs of each step, the median reported (default 1: "
                    "ds_to_universal.py takes about a minute a run at 0.7b)")
    ap.add_argument("--checkpoint", default=None, help="time this checkpoint (a folder an earlier run of this "
                    "script trained, WORK/ckpt, with WORK/ckpt.config beside it) instead of training one")
    ap.add_argument("--compare", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--compare-universal", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.compare:
        return compare(Path(args.compare[0]), Path(args.compare[1]))
    if args.compare_universal:
        return compare_universal(Path(args.compare_universal[0]), Path(args.compare_universal[1]))
    with tempfile.TemporaryDirectory(dir=args.workdir, prefix="bench_plain_ds_") as work:
        work = Path(work)
        t0 = time.perf_counter()
        ckpt = Path(args.checkpoint) if args.checkpoint else train(work, args.size)
        config = ckpt.parent / f"{ckpt.name}.config"
        tag = ckpt / (ckpt / "latest").read_text().strip()
        params = sum(n for g in _param_shapes(tag) for n in g)
        made = f"given ({ckpt})" if args.checkpoint else f"trained and saved in {time.perf_counter() - t0:.0f} s"
        print(f"{params / 1e9:.3f}B parameters, ZeRO-3 bf16 checkpoint on 2 ranks, {folder_bytes(tag) / 2**30:.2f} "
              f"GiB, {made}", flush=True)
        steps = [
            ("cp", ["bash", "-c", f"cp -r {tag} {work / 'copy'} && sync {work / 'copy'}/*"], work / "copy"),
            ("zero_to_fp32.py", _then_sync([sys.executable, str(ckpt / "zero_to_fp32.py"), str(ckpt),
                                            str(work / "z2f"), "--safe_serialization"]), work / "z2f"),
            ("toolkit convert", [sys.executable, "-m", "toolkit", "convert", str(ckpt), str(work / "hf"), "--to",
                                 "hf", "--fp32", "--no-verify", "--quiet", "--config", str(config)],
             work / "hf"),
            ("ds_to_universal", _then_sync([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal",
                                            "--input_folder", str(tag), "--output_folder", str(work / "dsu" / tag.name),
                                            "--inject_missing_state"]), work / "dsu"),
            ("toolkit universal", [sys.executable, "-m", "toolkit", "convert", str(ckpt), str(work / "uc"), "--to",
                                   "universal", "--quiet"], work / "uc"),
        ]
        rows, same = [], {}
        pairs = {"toolkit convert": ("zero_to_fp32.py", "--compare", "", "zero_to_fp32.py"),
                 "toolkit universal": ("ds_to_universal", "--compare-universal", tag.name, "ds_to_universal.py")}
        outs = {label: out for label, _, out in steps}
        for label, cmd, out in steps:
            load, runs = os.getloadavg()[0], []
            for _ in range(args.reps):  # each run right after deleting the last one's output, as bench/convert.py
                shutil.rmtree(out, ignore_errors=True)
                os.sync()
                runs.append(measure_tree(cmd))
            r = sorted(runs, key=lambda x: x["wall_s"])[len(runs) // 2]  # the median run (by wall time)
            r.update(step=label, size=args.size, gib=folder_bytes(out) / 2**30, load_before=load,
                     walls=[x["wall_s"] for x in runs])
            rows.append(r)
            evict(out)  # its pages out of the cache: the next step gets the free memory this one had
            print(f"  {label:<17} {r['gib']:6.2f} GiB written  wall {r['wall_s']:6.1f} s"
                  + (f" (median of {', '.join(f'{w:.1f}' for w in r['walls'])})" if len(runs) > 1 else "")
                  + f"  peak RSS "
                  f"{r['peak_rss_mib']:6.0f} MiB  peak anonymous {r['peak_anon_tree_mib']:6.0f} MiB  (load "
                  f"{load:.1f} before)", flush=True)
            if label == "cp":
                shutil.rmtree(out)
            if label in pairs:
                theirs, flag, sub, name = pairs[label]
                ref = next(x for x in rows if x["step"] == theirs)
                print(f"  {label} is x{ref['wall_s'] / r['wall_s']:.2f} the speed of {name}, peak anonymous memory "
                      f"{r['peak_anon_tree_mib']:.0f} vs {ref['peak_anon_tree_mib']:.0f} MiB", flush=True)
                proc = subprocess.run([sys.executable, __file__, flag, str(out / sub), str(outs[theirs] / sub)],
                                      capture_output=True, text=True)
                same[label] = proc.returncode
                print("  " + (proc.stdout.strip() or proc.stderr[-500:]), flush=True)
                shutil.rmtree(out)
                shutil.rmtree(outs[theirs])
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=2))
        return max(same.values())


def _then_sync(cmd: list[str]) -> list[str]:
    """cmd, then sync (one shell): its output timed until it is on disk, as cp's and the toolkit's are."""
    return ["bash", "-c", f"{shlex.join(cmd)} && sync"]


if __name__ == "__main__":
    sys.exit(main())
