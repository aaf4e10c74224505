"""Raw text on the fly: text/json/parquet files or a hub dataset -> tokenized, packed fixed-length sequences.

Every rank builds the same dataset (rank 0 fills the `datasets` cache first); toolkit.data.stream hands the ranks
their slices."""
from __future__ import annotations

import codecs
import json
from contextlib import nullcontext
from itertools import chain
from pathlib import Path

from toolkit.data import chat
from toolkit.errors import Problem, ToolkitError
from toolkit.recipe.checks import expand_glob
from toolkit.recipe.schema import DataConfig

_BUILDERS = {".txt": "text", ".text": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}


def _builder(files: list[str], fmt: str) -> str:
    if fmt != "auto":
        return fmt
    kinds = {_BUILDERS.get(Path(f).suffix) for f in files}
    if len(kinds) != 1 or None in kinds:
        raise ToolkitError(f"data.paths: cannot tell the format of {files} from their extensions; set data.format "
                           "to text, json or parquet (all files must share one format)")
    return kinds.pop()


# How much of each data file the pre-start check reads: enough to catch an empty, binary or wrongly shaped file in
# milliseconds, whatever the corpus size (the full read happens later, in `datasets`).
CHECK_BYTES = 1 << 20
CHECK_LINES = 200


def _kind(file: Path, fmt: str) -> str | None:
    return fmt if fmt != "auto" else _BUILDERS.get(file.suffix)


def check_files(cfg: DataConfig) -> list[Problem]:
    """Problems with the local data files, found by reading the head of each: empty, not UTF-8, not JSON lines,
    no text column, not parquet. Pure Python and fast, so a run checks its data before it starts processes,
    builds a model or creates its output folder."""
    out = chat.check_tokenizer(cfg) if cfg.kind == "chat" else []
    if cfg.hub_dataset:
        return out
    files = [p for pattern in cfg.paths for p in expand_glob(pattern)]
    for file in files:
        if not file.is_file():
            out.append(Problem("data.paths", f"{file} is not a file", "list data files (or globs of them)"))
            continue
        kind = _kind(file, cfg.format)
        problem = _check_parquet(file) if kind == "parquet" else _check_text(file, kind, cfg)
        if problem:
            out.append(Problem("data.paths", f"{file} {problem[0]}", problem[1]))
    return out


def _check_parquet(file: Path) -> tuple[str, str] | None:
    size = file.stat().st_size
    with file.open("rb") as f:
        head = f.read(4)
        f.seek(max(size - 4, 0))
        tail = f.read(4)
    if size < 12 or head != b"PAR1" or tail != b"PAR1":
        return "is not a Parquet file (no PAR1 marks)", "write it with pandas/pyarrow, or fix data.format"
    return None


def _check_text(file: Path, kind: str | None, cfg: DataConfig) -> tuple[str, str] | None:
    with file.open("rb") as f:
        head = f.read(CHECK_BYTES)
        whole = not f.read(1)
    if not head:
        return "is empty", "remove it from data.paths or fill it with text"
    try:
        text = codecs.getincrementaldecoder("utf-8")().decode(head, final=whole)
    except UnicodeDecodeError as e:
        return (f"is not UTF-8 text (byte 0x{head[e.start]:02x} at offset {e.start:,})",
                "convert it to UTF-8 text, or remove it from data.paths if it is not data")
    if "\x00" in text:
        return "holds NUL bytes: it is a binary file, not text", "remove it from data.paths"
    if not text.strip():
        return ("holds only whitespace" if whole else f"starts with {len(head):,} bytes of whitespace",
                "remove it from data.paths or fill it with text")
    if kind == "json":
        return _check_json_lines(text, whole, cfg)
    if cfg.kind == "chat":
        return "is plain text, but data.kind chat reads conversations", "give JSON lines or parquet rows of messages"
    return None


def _check_json_lines(text: str, whole: bool, cfg: DataConfig) -> tuple[str, str] | None:
    """JSON lines, one object per line with the text column; a .json file may instead hold one JSON array."""
    fields = [cfg.text_field]
    lines = text.splitlines()
    if not whole:
        lines = lines[:-1]  # the last line may be cut by the read budget
    stripped = text.lstrip()
    if stripped.startswith("[") and whole:
        try:
            rows = json.loads(text)
        except ValueError as e:
            return f"is not valid JSON: {str(e)[:80]}", "write one JSON object per line (JSON lines)"
        rows = rows if isinstance(rows, list) else [rows]
        numbered = enumerate(rows[:CHECK_LINES], 1)
    else:
        numbered = ((n, line) for n, line in enumerate(lines[:CHECK_LINES], 1) if line.strip())
        rows = None
    label = "item" if rows is not None else "line"
    for n, row in numbered:
        if rows is None:
            try:
                row = json.loads(row)
            except ValueError as e:
                return (f"line {n} is not JSON ({getattr(e, 'msg', str(e))[:60]})",
                        'write one JSON object per line, e.g. {"text": "..."}; for plain text use a .txt file')
        if not isinstance(row, dict):
            return (f"{label} {n} is a JSON {type(row).__name__}, not an object",
                    'write one JSON object per line, e.g. {"text": "..."}')
        if cfg.kind == "chat":
            why = chat.check_row(row, cfg)
            if why:
                return f"{label} {n} {why}", "fix or remove that row (docs/sft.md shows the row format)"
        elif not any(isinstance(row.get(f), str) for f in fields):
            keys = ", ".join(list(map(str, row))[:8]) or "none"
            under = " or ".join(map(repr, dict.fromkeys(fields)))
            return (f"{label} {n} has no text string under {under} (its keys: {keys})",
                    "set data.text_field to the key that holds the text")
    return None


def load_raw(cfg: DataConfig):
    import datasets  # lazy: heavy; corpus reads only

    if cfg.hub_dataset:
        return datasets.load_dataset(cfg.hub_dataset, split="train")
    files = [str(p) for pattern in cfg.paths for p in expand_glob(pattern)]
    builder = _builder(files, cfg.format)
    try:
        return datasets.load_dataset(builder, data_files=files, split="train")
    except (datasets.exceptions.DatasetGenerationError, StopIteration) as e:  # what check_files cannot see
        bad = _first_bad_json_line(files) if builder == "json" else None
        if bad:
            raise ToolkitError(f"data.paths: {bad}; fix or remove that line") from None
        cause = e.__cause__ or e
        raise ToolkitError(f"data.paths: `datasets` cannot read {files} as {builder}: {type(cause).__name__}: "
                           f"{str(cause)[:200]}; fix or remove the file (or set data.format)") from None


def _first_bad_json_line(files: list[str]) -> str | None:
    """Where the first JSON lines file that `datasets` refused stops parsing: "FILE line N (1-based): why". Its own
    message counts rows from 0 within a block of the file (a trial of 2026-12-07), so the line is found here, only
    once the load has failed. None for a file of one JSON document (an array), or when every line parses."""
    for name in files:
        with open(name, "rb") as f:
            if f.read(64).lstrip()[:1] == b"[":
                continue
            f.seek(0)
            for n, line in enumerate(f, 1):
                if line.strip():
                    try:
                        json.loads(line)
                    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
                        why = f"{e.msg} column {e.colno}" if isinstance(e, json.JSONDecodeError) else str(e)
                        return f"{name} line {n} is not JSON ({why})"
    return None


def text_column(raw, cfg: DataConfig) -> str:
    """The column that holds the text: `text` for plain text files (the only column `datasets` gives them), else
    data.text_field, also where the rows have a `text` column as well (a title beside the body)."""
    files = [str(p) for pattern in cfg.paths for p in expand_glob(pattern)]
    plain = not cfg.hub_dataset and _builder(files, cfg.format) == "text"
    text_field = "text" if plain else cfg.text_field
    if text_field not in raw.column_names:
        raise ToolkitError(f"data.text_field: column {text_field!r} not in the dataset (columns: "
                           f"{raw.column_names}); set data.text_field to the text column")
    return text_field


def missing_text(i: int, field: str, value) -> str:
    """The line for row i (0-based, over all files in order) whose text column holds no string."""
    what = "no text" if value is None else f"a {type(value).__name__}, not a string,"
    return (f"data.paths: row {i + 1} has {what} under {field!r}; fix or remove that row (or set data.text_field "
            "to the key that holds the text)")


def tokenize_and_pack(raw, tokenizer, cfg: DataConfig):
    """Token blocks of exactly seq_len ids (packing), or one truncated/padded document per row."""
    text_field = text_column(raw, cfg)
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ToolkitError(f"data.tokenizer: {cfg.tokenizer} has no eos token, needed to separate documents")
    n = cfg.seq_len

    def encode(batch, idx):
        texts = batch[text_field]
        for i, t in zip(idx, texts):
            if not isinstance(t, str):  # past the rows check_files reads
                raise ToolkitError(missing_text(i, text_field, t))
        ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
        return {"ids": [x + [eos] for x in ids], "n": [len(x) + 1 for x in ids]}

    def pad(batch):
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
        rows = [x[:n] for x in batch["ids"]]
        return {"input_ids": [x + [pad_id] * (n - len(x)) for x in rows],
                "labels": [x + [-100] * (n - len(x)) for x in rows]}

    tokenized = raw.map(encode, batched=True, with_indices=True, remove_columns=raw.column_names, desc="tokenizing")
    if cfg.packing:
        out = pack_blocks(tokenized, n)
    else:
        out = tokenized.map(pad, batched=True, batch_size=1000, remove_columns=["ids", "n"], desc="padding")
    return out.with_format("torch")


def pack_blocks(tokenized, n: int):
    """The documents' ids (each ending in EOS) concatenated in order and cut into blocks of n: block k is tokens
    [k n, (k + 1) n) of the whole corpus, so only the corpus's last partial block is left out. Each batch of
    documents makes the blocks that start in it, reading ahead into the next documents for the last one's end."""
    import numpy  # lazy: heavy; corpus reads only

    starts = numpy.concatenate([[0], numpy.cumsum(numpy.asarray(tokenized["n"], dtype=numpy.int64))])
    blocks_in_all = int(starts[-1]) // n

    def pack(batch, idx):
        first, end = idx[0], idx[-1] + 1
        at, stop = int(starts[first]), int(starts[end])  # the batch's tokens are [at, stop) of the corpus
        k0, k1 = -(-at // n), min(-(-stop // n), blocks_in_all)  # the blocks that start in them
        flat = list(chain.from_iterable(batch["ids"]))
        if k1 * n - at > len(flat):  # the last block ends in the documents after this batch
            upto = int(numpy.searchsorted(starts, k1 * n, side="left"))
            flat += chain.from_iterable(tokenized[end:upto]["ids"])
        blocks = [flat[k * n - at:(k + 1) * n - at] for k in range(k0, k1)]
        return {"input_ids": blocks, "labels": blocks}

    return tokenized.map(pack, batched=True, batch_size=1000, with_indices=True, remove_columns=["ids", "n"],
                         desc="packing")


def build_dataset(cfg: DataConfig, tokenizer, rank_zero_first=nullcontext, notes: list | None = None):
    """The tokenized dataset. `rank_zero_first` lets rank 0 fill the `datasets` cache before the others read it.
    A line for the run's log goes to `notes`: how many conversations chat data left out (none was said until
    2026-12-07)."""
    dropped = 0
    with rank_zero_first():
        raw = load_raw(cfg)
        if cfg.kind == "chat":
            ds, dropped = chat.build_chat(raw, tokenizer, cfg)
        else:
            ds = tokenize_and_pack(raw, tokenizer, cfg)
    if dropped and notes is not None:
        notes.append(f"data: {dropped:,} of {len(raw):,} conversations left out: no assistant token within "
                     f"data.seq_len={cfg.seq_len} (raise data.seq_len to train on them)")
    if len(ds) == 0 and cfg.kind == "chat":
        raise ToolkitError(f"data: no conversation with an assistant token within data.seq_len={cfg.seq_len} in "
                           f"{cfg.hub_dataset or cfg.paths}; add data or raise data.seq_len")
    if len(ds) == 0:
        raise ToolkitError(f"data: no complete sequence of {cfg.seq_len} tokens in {cfg.paths}; add data or "
                           "lower data.seq_len")
    return ds
