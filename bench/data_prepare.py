"""Throughput of `toolkit data prepare` next to a plain `datasets.map` tokenization of the same corpus, in one run.

    python bench/data_prepare.py                          # a generated 1 GB JSON-lines corpus, 2 workers
    python bench/data_prepare.py --size 20MB --workers 2 --json out.json
    python bench/data_prepare.py --size 200KB             # seconds: a quick check that the script runs

The corpus is generated first (words drawn from the shipped demo corpus, documents of 50-400 words, seeded), then
each tokenizer runs in a fresh process with its own empty `datasets` cache, so both pay for reading the JSON into
Arrow:
  prepare       `python -m toolkit data prepare --workers W --quiet`: tokenize, append EOS, write PREFIX.bin/.idx
                with Megatron-Core's IndexedDatasetBuilder
  datasets.map  `load_dataset("json")` then `.map(tokenizer(...), batched=True, num_proc=W)` into the Arrow cache,
                tokens only (no .bin/.idx: the figure a plain Hugging Face pipeline reaches)
For each: wall time (including Python start-up and imports), tokens/s over that wall time, the peak RSS of the
main process (wait4's ru_maxrss, from the kernel) and the peak summed RSS of the process and its workers
(VmRSS from /proc, sampled every 20 ms); for prepare also its own time for tokenizing and writing (from
PREFIX.tokenizer.json). The machine may be shared: compare the two rows of one run.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOKENIZER = REPO / "recipes/data/demo_tokenizer"

DATASETS_MAP = r"""
import sys, datasets
from transformers import AutoTokenizer
corpus, tokenizer, workers = sys.argv[1], sys.argv[2], int(sys.argv[3])
datasets.disable_progress_bars()
tok = AutoTokenizer.from_pretrained(tokenizer)
raw = datasets.load_dataset("json", data_files=[corpus], split="train")
ids = raw.map(lambda b: {"ids": tok(b["text"], add_special_tokens=False)["input_ids"]}, batched=True,
              remove_columns=raw.column_names, num_proc=workers if workers > 1 else None)
print("TOKENS", sum(len(x) for x in ids.with_format("numpy")["ids"]))
"""


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*([0-9.]+)\s*([KMG]?B?)\s*", text.upper())
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r}: give a size such as 1GB, 20MB or 200KB")
    unit = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "M": 1 << 20, "MB": 1 << 20, "G": 1 << 30, "GB": 1 << 30}
    return int(float(m.group(1)) * unit[m.group(2)])


def make_corpus(path: Path, size: int, seed: int = 0) -> int:
    """A JSON-lines corpus of about `size` bytes; returns the number of documents."""
    words = sorted({w for line in (REPO / "recipes/data/demo_corpus/train.jsonl").read_text().splitlines()
                    for w in json.loads(line)["text"].split()})
    rng, written, docs = random.Random(seed), 0, 0
    with path.open("w") as f:
        while written < size:
            line = json.dumps({"text": " ".join(rng.choices(words, k=rng.randint(50, 400)))}) + "\n"
            f.write(line)
            written, docs = written + len(line), docs + 1
    return docs


def _tree_rss(pid: int) -> int:
    """Summed VmRSS (bytes) of `pid` and its descendants, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        todo += children.get(p, [])
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


def measure(cmd: list[str], env: dict) -> dict:
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak, done = [0], threading.Event()

    def sample():
        while not done.wait(0.02):
            peak[0] = max(peak[0], _tree_rss(proc.pid))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out = proc.stdout.read()
    err = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    done.set()
    sampler.join()
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{out[-2000:]}\n{err[-3000:]}")
    return {"wall_s": wall, "peak_rss_mib": usage.ru_maxrss / 1024, "peak_tree_rss_mib": peak[0] / 2**20,
            "cpu_s": usage.ru_utime + usage.ru_stime, "stdout": out}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=parse_size, default=parse_size("1GB"), help="corpus size, e.g. 1GB (default), 20MB")
    ap.add_argument("--workers", type=int, default=2, help="tokenizing processes for both (default 2)")
    ap.add_argument("--workdir", help="where the corpus and outputs go (default: a temporary folder, removed)")
    ap.add_argument("--json", help="also write the results as JSON here")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        work = Path(tmp)
        corpus = work / "corpus.jsonl"
        t0 = time.perf_counter()
        docs = make_corpus(corpus, args.size)
        size = corpus.stat().st_size
        print(f"corpus: {size / 2**20:,.1f} MiB, {docs:,} documents (generated in {time.perf_counter() - t0:.1f} s)")
        base = {**os.environ, "OMP_NUM_THREADS": "1", "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
                "PYTHONPATH": str(REPO)}
        rows = {}
        prep = measure([sys.executable, "-m", "toolkit", "data", "prepare", "--input", str(corpus), "--output",
                        str(work / "prepared"), "--tokenizer", str(TOKENIZER), "--workers", str(args.workers),
                        "--quiet"], {**base, "HF_DATASETS_CACHE": str(work / "cache_prepare")})
        record = json.loads((work / "prepared.tokenizer.json").read_text())
        prep["tokens"] = record["tokens"] - record["documents"]  # the EOS ids are not text tokens
        prep["inner_s"] = record["seconds"]  # tokenizing and writing only: no start-up, no JSON -> Arrow read
        rows["prepare"] = prep
        plain = measure([sys.executable, "-c", DATASETS_MAP, str(corpus), str(TOKENIZER), str(args.workers)],
                        {**base, "HF_DATASETS_CACHE": str(work / "cache_map"), "TOKENIZERS_PARALLELISM": "false"})
        plain["tokens"] = int(plain["stdout"].split("TOKENS")[1])
        rows["datasets.map"] = plain
        print(f"{'':14}{'wall s':>8}{'tokens':>14}{'tokens/s':>12}{'peak RSS MiB':>14}{'tree RSS MiB':>14}")
        for name, r in rows.items():
            r.pop("stdout")
            r["tokens_per_s"] = r["tokens"] / r["wall_s"]
            print(f"{name:14}{r['wall_s']:8.1f}{r['tokens']:14,}{r['tokens_per_s']:12,.0f}{r['peak_rss_mib']:14,.0f}"
                  f"{r['peak_tree_rss_mib']:14,.0f}")
        print(f"prepare without start-up and the JSON -> Arrow read: {prep['inner_s']:.1f} s, "
              f"{prep['tokens'] / prep['inner_s']:,.0f} tokens/s")
        if rows["prepare"]["tokens"] != rows["datasets.map"]["tokens"]:
            raise SystemExit(f"the two tokenizations disagree: {rows['prepare']['tokens']:,} vs "
                             f"{rows['datasets.map']['tokens']:,} tokens")
        result = {"corpus_bytes": size, "documents": docs, "workers": args.workers, "cpus": os.cpu_count(),
                  "load_average": os.getloadavg(), "runs": rows}
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
