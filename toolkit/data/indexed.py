"""`toolkit data prepare`: text files or a hub dataset -> Megatron-Core's indexed dataset (`PREFIX.bin/.idx`).

Documents are tokenized once, in worker processes, and written in order by Megatron-Core's own
`IndexedDatasetBuilder`, one document per entry with the tokenizer's EOS appended (as Megatron-LM's
tools/preprocess_data.py does with --append-eod). Beside the two files, `PREFIX.tokenizer.json` records which
tokenizer built them, so a run whose `data.tokenizer` differs is refused (`check_prepared`).

Nothing appears under PREFIX until every file is complete: the three are written under `.partial` names and
renamed at the end, the index last.
"""
from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import sys
import time
import warnings
from pathlib import Path

import numpy
from tqdm import tqdm

from toolkit.data.text import check_files, load_raw, missing_text, text_column
from toolkit.errors import Problem, ToolkitError
from toolkit.recipe.checks import expand_glob
from toolkit.recipe.schema import DataConfig

SIDECAR = ".tokenizer.json"  # PREFIX + this: the tokenizer that built PREFIX.bin/.idx
DOCS_PER_TASK = 256  # documents per work item handed to a worker


def prefix_files(prefix: str) -> dict[str, Path]:
    return {"bin": Path(prefix + ".bin"), "idx": Path(prefix + ".idx"), "tokenizer": Path(prefix + SIDECAR)}


def tokenizer_fingerprint(tokenizer, name: str) -> dict:
    """What identifies a tokenizer's ids: its vocabulary (every token -> id, added tokens included) and EOS."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    digest = hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()
    return {"name": name, "class": type(tokenizer).__name__, "vocab_size": len(tokenizer),
            "eos_token_id": tokenizer.eos_token_id, "vocab_sha256": digest}


def check_prepared(cfg: DataConfig, tokenizer, sources: list | None = None, key: str = "data.blend") -> list[Problem]:
    """Each blend source (data.blend's, or `sources` named `key`, e.g. eval.blend's) must have been prepared with
    the recipe's tokenizer (same vocabulary, same EOS). A source without the record (prepared by Megatron-LM's own
    tools) cannot be checked and is accepted."""
    ours, out = tokenizer_fingerprint(tokenizer, cfg.tokenizer), []
    for i, source in enumerate(cfg.blend or [] if sources is None else sources):
        record = prefix_files(source.path)["tokenizer"]
        mismatch = index_mismatch(source.path)
        if mismatch:
            out.append(Problem(f"{key}[{i}].path", mismatch, f"prepare {source.path} again (toolkit data prepare "
                               "--overwrite), or copy the .bin, .idx and .tokenizer.json of one preparation together"))
            continue
        if not record.is_file():
            continue
        try:
            theirs = json.loads(record.read_text())
            same = all(theirs[k] == ours[k] for k in ("vocab_size", "eos_token_id", "vocab_sha256"))
        except (ValueError, KeyError, TypeError):
            out.append(Problem(f"{key}[{i}].path", f"{record} is not a tokenizer record written by toolkit "
                               "data prepare", f"delete it, or prepare {source.path} again"))
            continue
        if not same:
            out.append(Problem(f"{key}[{i}].path", f"{source.path} was prepared with tokenizer "
                               f"{theirs.get('name')!r} ({theirs.get('vocab_size')} ids), not data.tokenizer "
                               f"{cfg.tokenizer!r} ({ours['vocab_size']} ids, another vocabulary)",
                               f"prepare it again with --tokenizer {cfg.tokenizer}, or set data.tokenizer to the "
                               "tokenizer it was prepared with"))
    return out


_INDEX_MAGIC = b"MMIDIDX\x00\x00"  # Megatron-Core's .idx: magic, version <Q, dtype code <B, sequences <Q, documents <Q
_ITEM_BYTES = {1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 6: 8, 7: 4, 8: 2}  # its DType codes -> bytes per token


def index_mismatch(prefix: str) -> str | None:
    """Why PREFIX.idx does not describe PREFIX.bin (or disagrees with the tokenizer record beside them), else None.
    Reads the index's header and its last sequence's length and pointer, not the whole index: the .bin must end
    where that sequence does. An .idx copied beside another preparation's .bin made runs read a third of the data,
    or fail mid-step (a trial of 2026-12-07)."""
    files = prefix_files(prefix)
    idx, size = files["idx"], files["bin"].stat().st_size
    with idx.open("rb") as f:
        head = f.read(34)
        if len(head) < 34 or head[:9] != _INDEX_MAGIC or int.from_bytes(head[9:17], "little") != 1 or \
                head[17] not in _ITEM_BYTES:
            return f"{idx} is not a Megatron-Core index (its header is not MMIDIDX version 1 with a known dtype)"
        item = _ITEM_BYTES[head[17]]
        sequences, documents = int.from_bytes(head[18:26], "little"), int.from_bytes(head[26:34], "little")
        if idx.stat().st_size < 34 + 12 * sequences + 8 * documents:
            return f"{idx} is cut short: its header lists {sequences:,} sequences that the file does not hold"
        ends = 0
        if sequences:
            f.seek(34 + 4 * (sequences - 1))  # the last of the int32 lengths, then of the int64 byte pointers
            length = int.from_bytes(f.read(4), "little", signed=True)
            f.seek(34 + 4 * sequences + 8 * (sequences - 1))
            ends = int.from_bytes(f.read(8), "little", signed=True) + length * item
    if ends != size:
        return (f"{idx} indexes {ends:,} bytes of tokens but {files['bin']} holds {size:,}: the two files come from "
                "different preparations")
    try:
        record = json.loads(files["tokenizer"].read_text()) if files["tokenizer"].is_file() else {}
    except ValueError:
        return None  # check_prepared names an unreadable record
    said = (record.get("documents"), record.get("tokens")) if isinstance(record, dict) else (None, None)
    if said != (None, None) and said != (sequences, size // item):
        return (f"{files['tokenizer']} records {said[0]} documents and {said[1]} tokens, but {prefix}.bin/.idx hold "
                f"{sequences:,} and {size // item:,}: the files come from different preparations")
    return None


# ---- prepare ---------------------------------------------------------------------------------------------------

_worker: dict = {}


def _start_worker(cfg: DataConfig, column: str, dtype) -> None:
    from transformers import AutoTokenizer  # lazy: heavy; prepare only

    _worker.update(raw=load_raw(cfg), column=column, dtype=dtype,
                   tokenizer=AutoTokenizer.from_pretrained(cfg.tokenizer))


def _encode(span: tuple[int, int]):
    """Documents [start, end) -> (their ids concatenated, each with EOS appended, and their lengths); a document
    that tokenizes to nothing is left out."""
    tok, start, end = _worker["tokenizer"], span[0], span[1]
    texts = _worker["raw"][start:end][_worker["column"]]
    for i, t in enumerate(texts, start):
        if not isinstance(t, str):  # past the rows check_files reads
            raise ToolkitError(cli_words(missing_text(i, _worker["column"], t)))
    ids = tok(texts, add_special_tokens=False)["input_ids"]
    eos = tok.eos_token_id
    docs = [x + [eos] for x in ids if x]
    flat = numpy.concatenate([numpy.array(d, dtype=_worker["dtype"]) for d in docs]) if docs else numpy.array([])
    return flat, [len(d) for d in docs], end - start


def prepare(inputs: list[str], output: str, tokenizer: str, *, workers: int = 1, text_field: str = "text",
            fmt: str = "auto", hub_dataset: str | None = None, overwrite: bool = False,
            progress: bool = True) -> dict:
    """Tokenize `inputs` (files or globs) or `hub_dataset` into OUTPUT.bin/.idx (+ OUTPUT.tokenizer.json).
    Returns the summary that is also stored in the tokenizer record."""
    cfg = DataConfig(paths=list(inputs), hub_dataset=hub_dataset, format=fmt, text_field=text_field,
                     tokenizer=tokenizer)
    files = _check_inputs(cfg, output, overwrite)
    from transformers import AutoTokenizer  # lazy: heavy; prepare only

    try:
        tok = AutoTokenizer.from_pretrained(tokenizer)
    except (OSError, ValueError) as e:
        first = " ".join(str(e).split())
        first = first[:first.index(". ") + 1] if ". " in first else first[:300]  # its first sentence, whole
        where = "" if Path(tokenizer).is_dir() else f"no local folder {tokenizer!r}, and as a hub name: "
        raise ToolkitError(f"--tokenizer: cannot load {tokenizer!r} ({where}{first}); point it at a tokenizer "
                           "folder") from None
    if tok.eos_token_id is None:
        raise ToolkitError(f"--tokenizer: {tokenizer} has no EOS token, which separates documents; use a "
                           "tokenizer that defines eos_token")
    with warnings.catch_warnings():  # megatron.core's import warns that Transformer Engine and Apex are absent
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder  # lazy: heavy; prepare only

    if not progress:
        import datasets  # lazy: heavy; corpus reads only

        datasets.disable_progress_bars()
    raw = load_raw(cfg)
    column = text_column(raw, cfg)
    dtype = DType.optimal_dtype(len(tok))
    spans = [(i, min(i + DOCS_PER_TASK, len(raw))) for i in range(0, len(raw), DOCS_PER_TASK)]
    dest = prefix_files(output)
    partial = {k: p.with_name(p.name + ".partial") for k, p in dest.items()}
    parent = Path(output).absolute().parent
    made = [d for d in (parent, *parent.parents) if not d.exists()]  # folders to remove again if this fails
    parent.mkdir(parents=True, exist_ok=True)
    t0, tokens, docs, done = time.perf_counter(), 0, 0, False
    builder = IndexedDatasetBuilder(str(partial["bin"]), dtype=dtype)
    try:
        with _progress(len(raw), progress) as bar, _pool(cfg, column, dtype, workers) as imap:
            for flat, lengths, seen in imap(_encode, spans):
                _add_each(builder, flat, lengths)
                tokens, docs = tokens + len(flat), docs + len(lengths)
                bar.update(seen)
        if tokens == 0:
            raise ToolkitError(f"--input: {', '.join(files) or hub_dataset} holds no text (every document is "
                               "empty); give files with text")
        builder.finalize(str(partial["idx"]))
        seconds = time.perf_counter() - t0
        summary = {**tokenizer_fingerprint(tok, tokenizer), "documents": docs, "tokens": tokens,
                   "dtype": dtype.__name__, "sources": files or [hub_dataset], "seconds": round(seconds, 3),
                   "workers": workers}
        partial["tokenizer"].write_text(json.dumps(summary, indent=2) + "\n")
        for key in ("tokenizer", "bin", "idx"):  # the index last: .bin and .idx both present means complete
            os.replace(partial[key], dest[key])
        done = True
    finally:
        builder.data_file.close()
        for p in partial.values():
            p.unlink(missing_ok=True)
        for d in [] if done else made:  # deepest first
            if d.is_dir() and not any(d.iterdir()):
                d.rmdir()
    return summary


def _add_each(builder, flat, lengths) -> None:
    """One Megatron document per text document (what preprocess_data.py writes without sentence splitting)."""
    import torch  # lazy: heavy; the builder takes tensors

    at = 0
    for n in lengths:
        builder.add_item(torch.from_numpy(flat[at:at + n]))
        builder.end_document()
        at += n


def cli_words(line: str) -> str:
    """A data check's line in the words of `toolkit data prepare`: its options, not the recipe keys they fill."""
    for key, option in (("data.paths", "--input"), ("data.text_field", "--text-field"), ("data.format", "--format")):
        line = line.replace(key, option)
    return line


def _check_inputs(cfg: DataConfig, output: str, overwrite: bool) -> list[str]:
    """Bad input stops here, before anything is written: one line naming the problem and the fix."""
    files = []
    if not cfg.hub_dataset:
        if not cfg.paths:
            raise ToolkitError("toolkit data prepare: no input; give files or globs (--input a.jsonl b.txt) or "
                               "--hub-dataset NAME")
        for pattern in cfg.paths:
            found = expand_glob(pattern)
            if not found:
                raise ToolkitError(f"--input: {pattern} matches no file; give text/jsonl/parquet files or globs")
            files += [str(f) for f in found]
        for p in check_files(cfg):
            raise ToolkitError(cli_words(f"--input: {p.message}; {p.fix}"))
    taken = [str(p) for p in prefix_files(output).values() if p.exists()]
    if taken and not overwrite:
        raise ToolkitError(f"--output: {', '.join(taken)} already exists; choose another prefix or pass --overwrite")
    if Path(output).name in ("", ".", "..") or Path(output).is_dir():
        raise ToolkitError(f"--output: {output} is a folder; give a file prefix such as {output.rstrip('/')}/corpus")
    return files


class _progress:
    """A tqdm bar over documents on a terminal (or when asked), else nothing."""

    def __init__(self, total: int, show: bool):
        self.total, self.show, self.bar = total, show, None

    def __enter__(self):
        if self.show:
            self.bar = tqdm(total=self.total, unit="docs", desc="tokenizing", file=sys.stderr)
        return self

    def update(self, n: int) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.close()


class _pool:
    """`imap` in order over worker processes (or in this process with one worker)."""

    def __init__(self, cfg: DataConfig, column: str, dtype, workers: int):
        self.args, self.workers, self.pool = (cfg, column, dtype), workers, None

    def __enter__(self):
        if self.workers <= 1:
            _start_worker(*self.args)
            return map
        os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the workers are the parallelism; no Rust threads in each
        self.pool = multiprocessing.get_context("fork").Pool(self.workers, _start_worker, self.args)
        return lambda fn, items: self.pool.imap(fn, items, chunksize=1)

    def __exit__(self, *exc):
        _worker.clear()
        if self.pool is not None:
            self.pool.terminate() if exc[0] else self.pool.close()
            self.pool.join()
