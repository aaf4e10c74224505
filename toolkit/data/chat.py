"""Chat data for supervised fine-tuning (`data.kind: chat`): conversations rendered through the tokenizer's own chat
template, labels on assistant tokens only, several whole conversations packed per sequence.

Assistant spans come from rendering the conversation prefix by prefix: for each assistant turn i, the text between
render(messages[:i], add_generation_prompt=True) and render(messages[:i + 1]) is that turn (its content and the
template's end-of-turn marks). Each piece is tokenized on its own, so a label's span is exact whatever the
tokenizer merges. This works with any template whose rendering of a conversation's prefix is a prefix of its full
rendering (ChatML/Qwen2.5, Llama 3, Mistral, Gemma, ...); a template that rewrites earlier turns (e.g. Qwen3's,
which drops the <think> part of earlier assistant turns) is refused with a clear error.

Packing puts whole conversations one after another, each with position ids from 0, and pads the rest of the row;
the backends keep the conversations from attending to each other (docs/sft.md). A conversation longer than
data.seq_len is cut at seq_len.
"""
from __future__ import annotations

import json
from pathlib import Path

from toolkit.errors import Problem, ToolkitError
from toolkit.recipe.schema import DataConfig

ROLES = ("system", "developer", "user", "assistant", "tool", "ipython")
TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")


def check_row(row, cfg: DataConfig) -> str | None:
    """What is wrong with one row of chat data (None when it is usable)."""
    if not isinstance(row, dict):
        return f"is a JSON {type(row).__name__}, not an object"
    msgs = row.get(cfg.messages_field)
    if msgs is None:
        keys = ", ".join(list(map(str, row))[:8]) or "none"
        return f"has no {cfg.messages_field!r} (its keys: {keys}); set data.messages_field to the conversation column"
    if not isinstance(msgs, list) or not msgs:
        return f"has {cfg.messages_field!r} that is not a non-empty list of {{role, content}} messages"
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            return f"message {i} is not an object with string 'role' and 'content'"
        if m["role"] not in ROLES:
            return f"message {i} has role {m['role']!r}; roles are {', '.join(ROLES)}"
    if not any(m["role"] == "assistant" for m in msgs[1:]):
        if msgs[0]["role"] == "assistant":
            return ("has an assistant turn only as its opening message, which is context, not trained (nothing "
                    "precedes it to answer): there is nothing to train on; remove it")
        return "is a conversation without an assistant turn: there is nothing to train on; remove it"
    return None


def check_tokenizer(cfg: DataConfig) -> list[Problem]:
    """A local tokenizer folder must carry a chat template (in tokenizer_config.json or chat_template.jinja)."""
    folder = Path(cfg.tokenizer)
    if not folder.is_dir():
        return []  # a hub name: checked once loaded
    if any((folder / f).is_file() for f in TEMPLATE_FILES) or (folder / "additional_chat_templates").is_dir():
        return []
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        config = {}
    if isinstance(config, dict) and config.get("chat_template"):
        return []
    return [_no_template(cfg)]


def _no_template(cfg: DataConfig) -> Problem:
    return Problem("data.tokenizer", f"{cfg.tokenizer} has no chat template, which data.kind chat renders with",
                   "use the tokenizer of an instruct/chat model, or add a chat_template.jinja to the folder")


class TemplateRefused(Exception):
    """The tokenizer's chat template raised on a conversation (e.g. a role it does not know)."""


def render(messages: list[dict], tokenizer) -> tuple[list[int], list[int]]:
    """(input ids, labels) of one conversation: labels are the ids on assistant turns and -100 elsewhere. An
    assistant message that opens the conversation is context: no prompt precedes it, so it is not trained."""
    def text(msgs, gen):
        try:
            return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
        except Exception as e:  # noqa: BLE001 - a template raises what its author chose (jinja2's TemplateError)
            raise TemplateRefused(f"{type(e).__name__}: {str(e)[:120]}") from None

    full, pieces, at = text(messages, False), [], 0  # pieces: (text, is assistant)
    for i, m in enumerate(messages):
        if m["role"] != "assistant" or i == 0:
            continue
        before, after = text(messages[:i], True), text(messages[:i + 1], False)
        if not (full.startswith(after) and after.startswith(before) and len(before) >= at):
            raise ToolkitError(f"data.tokenizer: its chat template does not render a conversation's beginning as the "
                               f"beginning of the whole (turn {i}); data.kind chat finds assistant turns that way "
                               "(docs/sft.md): use a template without that rewriting")
        pieces += [(full[at:len(before)], False), (full[len(before):len(after)], True)]
        at = len(after)
    pieces.append((full[at:], False))
    ids, labels = [], []
    for piece, train in pieces:
        if piece:
            p = tokenizer(piece, add_special_tokens=False)["input_ids"]
            ids += p
            labels += p if train else [-100] * len(p)
    return ids, labels


def pack(convs: list[tuple[list[int], list[int]]], n: int, pad_id: int, packing: bool) -> dict[str, list]:
    """Rows of exactly n tokens: whole conversations one after another (packing) or one per row, each with
    position ids from 0; the rest of a row is padding (labels -100, its own position ids from 0)."""
    rows: dict[str, list] = {"input_ids": [], "labels": [], "position_ids": []}
    cur: dict[str, list] = {k: [] for k in rows}
    rows["conversations"], held = [], [0]  # how many conversations each row holds (build_chat counts the dropped)

    def flush():
        if cur["input_ids"]:
            pad = n - len(cur["input_ids"])
            rows["input_ids"].append(cur["input_ids"] + [pad_id] * pad)
            rows["labels"].append(cur["labels"] + [-100] * pad)
            rows["position_ids"].append(cur["position_ids"] + list(range(pad)))
            for k in cur:
                cur[k] = []
            rows["conversations"].append(held[0])
            held[0] = 0

    for ids, labels in convs:
        ids, labels = ids[:n], labels[:n]
        if not packing or len(cur["input_ids"]) + len(ids) > n:
            flush()
        cur["input_ids"] += ids
        cur["labels"] += labels
        cur["position_ids"] += list(range(len(ids)))
        held[0] += 1
    flush()
    return rows


ROWS_FORMAT = 2
"""The format of the rows pack() makes: 2 added the `conversations` count. Change it with the format."""


def build_chat(raw, tokenizer, cfg: DataConfig):
    """(the tokenized, packed chat dataset: input_ids, labels, position_ids per row of seq_len; how many
    conversations were left out for having no assistant token within seq_len)."""
    if cfg.messages_field not in raw.column_names:
        raise ToolkitError(f"data.messages_field: column {cfg.messages_field!r} not in the dataset (columns: "
                           f"{raw.column_names}); set data.messages_field to the conversation column")
    if not getattr(tokenizer, "chat_template", None):
        p = _no_template(cfg)
        raise ToolkitError(f"{p.key}: {p.message}; fix: {p.fix}")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad_id is None:
        raise ToolkitError(f"data.tokenizer: {cfg.tokenizer} has neither a pad nor an eos token to pad with")

    def encode(batch, idx, rows_format):  # rows_format: in the `datasets` cache key (below)
        convs = []
        for i, msgs in zip(idx, batch[cfg.messages_field]):
            why = check_row({cfg.messages_field: msgs}, cfg)
            if why:
                raise ToolkitError(f"data.paths: row {i + 1} {why}")
            try:
                ids, labels = render(msgs, tokenizer)
            except TemplateRefused as e:
                raise ToolkitError(f"data.paths: row {i + 1}: the chat template of {cfg.tokenizer} refuses it ({e}); "
                                   "fix or remove that row, or use a tokenizer whose template takes it") from None
            if all(x == -100 for x in labels[:cfg.seq_len]):
                continue  # cut at seq_len before its first assistant token: nothing to train on
            convs.append((ids, labels))
        return pack(convs, cfg.seq_len, pad_id, cfg.packing)

    # `datasets` keys its cache on encode's own code and arguments, not on the functions it calls (pack): the rows'
    # format is an argument, so a cache of another format is not taken (the "conversations" column, 2026-12-07)
    out = raw.map(encode, batched=True, with_indices=True, remove_columns=raw.column_names,
                  fn_kwargs={"rows_format": ROWS_FORMAT},
                  desc="rendering chats" if not cfg.packing else "rendering and packing chats")
    dropped = len(raw) - sum(out["conversations"])
    return out.remove_columns("conversations").with_format("torch"), dropped
