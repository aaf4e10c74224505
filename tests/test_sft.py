"""Supervised fine-tuning on chat data (`data.kind: chat`, docs/sft.md).

In-process and fast: labels are the assistant turns exactly; packing keeps whole conversations with positions from
0; the Hugging Face loss path (the DeepSpeed backend's) is the masked mean of the assistant tokens' cross-entropy,
computed by hand, and a packed conversation is untouched by a change to another one's user turn; bad chat data
stops the run before anything is written. Two real runs (one process each): the tiny SFT recipe on DeepSpeed and
on Megatron-Core, each with its own micro-batch split of the global batch, gives the same losses step by step (the
same mean over the step's assistant tokens on the same packed sequences, through Megatron's loss_mask and
attention mask), and each exported HF folder loads with from_pretrained and answers."""
from __future__ import annotations

import importlib.util
import json
import sys

import pytest
import torch
from conftest import REPO, launch, read_metrics
from test_hostile_inputs import assert_refused, snapshot
from transformers import AutoModelForCausalLM, AutoTokenizer

from toolkit.data import build_dataset
from toolkit.data.chat import build_chat, pack, render
from toolkit.errors import ToolkitError
from toolkit.megatron.runtime import packed_attention_mask
from toolkit.recipe import load_recipe

CHAT_TOK = "recipes/data/chat_tokenizer"
BASE = "recipes/data/tiny_chat_base"
CONV = [{"role": "system", "content": "Answer in one short sentence."},
        {"role": "user", "content": "What is 2 plus 3?"}, {"role": "assistant", "content": "2 plus 3 is 5."},
        {"role": "user", "content": "And 4 more?"}, {"role": "assistant", "content": "5 plus 4 is 9."}]


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(CHAT_TOK)


def test_labels_are_the_assistant_turns_exactly(tok):
    ids, labels = render(CONV, tok)
    full = tok.apply_chat_template(CONV, tokenize=False)
    assert ids == tok(full, add_special_tokens=False)["input_ids"]  # this template: pieces tokenize like the whole
    trained = [i for i, x in zip(ids, labels) if x != -100]
    assert [x for x in labels if x != -100] == trained
    # the assistant contents with the template's end of turn, and nothing else; every other position is -100
    assert tok.decode(trained) == " 2 plus 3 is 5.</s>\n 5 plus 4 is 9.</s>\n"
    assert tok.decode([i for i, x in zip(ids, labels) if x == -100]) == (
        "<s>System: Answer in one short sentence.</s>\nUser: What is 2 plus 3?</s>\nAssistant:"
        "User: And 4 more?</s>\nAssistant:")


def test_an_opening_assistant_message_is_context(tok):
    """A greeting before the first user turn has no prompt before it to render: it is not trained, the replies
    after it are. It stopped the run with a traceback (an empty conversation to the template; a trial of
    2026-12-07)."""
    greeting = {"role": "assistant", "content": "Hello, how can I help?"}
    ids, labels = render([greeting] + CONV[1:], tok)
    assert ids == tok(tok.apply_chat_template([greeting] + CONV[1:], tokenize=False), add_special_tokens=False)[
        "input_ids"]
    assert tok.decode([i for i, x in zip(ids, labels) if x != -100]) == " 2 plus 3 is 5.</s>\n 5 plus 4 is 9.</s>\n"


def test_packing_keeps_whole_conversations_with_positions_from_zero():
    a, b, c = ([1] * 5, [-100] * 2 + [1] * 3), ([2] * 4, [-100] + [2] * 3), ([3] * 7, [-100] * 4 + [3] * 3)
    rows = pack([a, b, c], 10, pad_id=0, packing=True)
    assert rows["input_ids"] == [[1] * 5 + [2] * 4 + [0], [3] * 7 + [0] * 3]  # c does not fit: next row, whole
    assert rows["labels"][0] == a[1] + b[1] + [-100] and rows["labels"][1] == c[1] + [-100] * 3
    assert rows["position_ids"] == [[0, 1, 2, 3, 4, 0, 1, 2, 3, 0], [0, 1, 2, 3, 4, 5, 6, 0, 1, 2]]
    assert len(pack([a, b, c], 10, pad_id=0, packing=False)["input_ids"]) == 3  # one per row, padded
    mask = packed_attention_mask(torch.tensor([[0, 1, 2, 0, 1]]))[0, 0]  # Megatron's: True = masked
    allowed = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [0, 0, 0, 1, 0], [0, 0, 0, 1, 1]])
    assert torch.equal(~mask, allowed.bool())


def test_hf_loss_is_the_assistant_masked_mean_and_packed_conversations_stay_apart(tok):
    """The DeepSpeed backend's loss path: transformers' labels (-100 ignored) with position ids restarting per
    conversation. Exact checks on a real packed row of the shipped corpus."""
    r = load_recipe("tiny_sft")
    ds = build_dataset(r.data, tok)
    row = next(ds[i] for i in range(len(ds)) if (ds[i]["position_ids"] == 0).sum() >= 3)  # >= 2 convs + padding
    ids, labels, pos = row["input_ids"][None], row["labels"][None], row["position_ids"][None]
    model = AutoModelForCausalLM.from_pretrained(BASE, dtype=torch.float32)
    out = model(input_ids=ids, labels=labels, position_ids=pos, use_cache=False)  # as the backend calls it
    logits = out.logits[0, :-1]
    target = labels[0, 1:]
    keep = target != -100
    ce = torch.nn.functional.cross_entropy(logits[keep], target[keep], reduction="sum") / keep.sum()
    torch.testing.assert_close(out.loss, ce, rtol=0, atol=1e-6)

    starts = (pos[0] == 0).nonzero().flatten().tolist()
    first, second = slice(starts[0], starts[1]), slice(starts[1], starts[2])
    alone = model(input_ids=ids[:, second]).logits[0]
    torch.testing.assert_close(out.logits[0, second], alone, rtol=0, atol=1e-5)  # no attention across convs

    # change the first conversation's user tokens: the second's logits and loss terms and gradients are unchanged
    changed = ids.clone()
    user = [i for i in range(first.start + 1, first.stop) if labels[0, i] == -100][1:4]
    changed[0, user] = (changed[0, user] + 7) % 500 + 4
    logits_a = out.logits.detach().requires_grad_()
    logits_b = model(input_ids=changed, labels=labels, position_ids=pos, use_cache=False).logits.detach().requires_grad_()
    grads = []
    for lg in (logits_a, logits_b):
        loss = model.loss_function(lg, labels, vocab_size=lg.shape[-1])
        loss.backward()
        grads.append(lg.grad[0])
    torch.testing.assert_close(logits_b[0, second], logits_a[0, second], rtol=0, atol=1e-6)
    torch.testing.assert_close(grads[1][second], grads[0][second], rtol=0, atol=1e-9)
    no_target = torch.cat([labels[0, 1:] == -100, torch.tensor([True])])  # position t predicts t + 1
    assert (grads[0][no_target] == 0).all() and (grads[0][~no_target] != 0).any()


def test_parquet_rows_give_the_same_sequences_as_json_lines(tok, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [json.loads(line) for line in (REPO / "recipes/data/chat_corpus/train.jsonl").read_text().splitlines()[:40]]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "chat.parquet")
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    a, b = (build_dataset(load_recipe("tiny_sft", [f"data.paths=[{tmp_path / f}]"]).data, tok)
            for f in ("chat.parquet", "chat.jsonl"))
    assert len(a) == len(b) > 1
    for key in ("input_ids", "labels", "position_ids"):
        assert torch.equal(a[:][key], b[:][key])


def test_conversations_left_out_for_seq_len_are_counted(tok, tmp_path):
    """A conversation cut at seq_len before its first assistant token has nothing to train on and is left out; until
    2026-12-07 no line said how many were."""
    long_user = [{"role": "user", "content": "one two three " * 200}, {"role": "assistant", "content": "No."}]
    rows = [CONV, long_user, CONV, long_user, long_user]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps({"messages": m}) + "\n" for m in rows))
    notes = []
    ds = build_dataset(load_recipe("tiny_sft", [f"data.paths=[{tmp_path / 'chat.jsonl'}]"]).data, tok, notes=notes)
    assert notes == ["data: 3 of 5 conversations left out: no assistant token within data.seq_len=256 (raise "
                     "data.seq_len to train on them)"]
    (tmp_path / "kept.jsonl").write_text("".join(json.dumps({"messages": m}) + "\n" for m in rows if m is CONV))
    kept = build_dataset(load_recipe("tiny_sft", [f"data.paths=[{tmp_path / 'kept.jsonl'}]"]).data, tok, notes=notes)
    assert ds.column_names == kept.column_names == ["input_ids", "labels", "position_ids"] and len(notes) == 1
    assert all(torch.equal(ds[:][k], kept[:][k]) for k in ds.column_names)


# ------------------------------------------------------------------ bad chat data

def _train_main():
    spec = importlib.util.spec_from_file_location("train_entry", REPO / "recipes" / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


ASSISTANT = {"role": "assistant", "content": "ok"}
BAD = [
    ("no_assistant", [{"messages": [{"role": "user", "content": "hi"}]}], [],
     "line 1 is a conversation without an assistant turn"),
    ("no_messages", [{"text": "hello"}], [], "line 1 has no 'messages' (its keys: text)"),
    ("bad_role", [{"messages": [{"role": "robot", "content": "x"}, ASSISTANT]}], [], "message 0 has role 'robot'"),
    ("opening_assistant_only", [{"messages": [ASSISTANT, {"role": "user", "content": "hi"}]}], [],
     "line 1 has an assistant turn only as its opening message, which is context, not trained"),
    ("no_template", [{"messages": [{"role": "user", "content": "hi"}, ASSISTANT]}],
     ["data.tokenizer=recipes/data/demo_tokenizer"],
     "data.tokenizer: recipes/data/demo_tokenizer has no chat template"),
]


@pytest.mark.parametrize("name,rows,sets,needle", BAD, ids=[b[0] for b in BAD])
def test_bad_chat_data_stops_the_run_before_anything_starts(name, rows, sets, needle, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "unused"))
    monkeypatch.setenv("RANK", "0")  # if the check were skipped, init would wait for a world that never comes
    monkeypatch.setenv("WORLD_SIZE", "2")
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    before = snapshot(tmp_path)
    argv = ["train.py", "--recipe", "tiny_sft", "--set", f"data.paths=[{data}]", "--set",
            f"output_dir={tmp_path / 'run'}"]
    monkeypatch.setattr(sys, "argv", argv + [a for s in sets for a in ("--set", s)])
    code = _train_main()()
    assert_refused(code, capsys.readouterr().err, needle, block=True)
    assert snapshot(tmp_path) == before, "no run folder, log or TensorBoard file"


def test_a_bad_row_past_the_checked_head_is_named_when_rendering(tok):
    import datasets

    cfg = load_recipe("tiny_sft").data
    raw = datasets.Dataset.from_list([{"messages": CONV}] * 2 + [{"messages": [{"role": "user", "content": "x"}]}])
    with pytest.raises(ToolkitError, match="row 3 is a conversation without an assistant turn"):
        build_chat(raw, tok, cfg)
    tool = [{"role": "user", "content": "x"}, {"role": "tool", "content": "42"}, ASSISTANT]  # a role ROLES allows
    raw = datasets.Dataset.from_list([{"messages": CONV}] * 2 + [{"messages": tool}])
    with pytest.raises(ToolkitError, match=r"^data.paths: row 3: the chat template of recipes/data/chat_tokenizer "
                                           r"refuses it \(TemplateError: unknown role tool\); fix or remove"):
        build_chat(raw, tok, cfg)
    tok_without = AutoTokenizer.from_pretrained("recipes/data/demo_tokenizer")
    with pytest.raises(ToolkitError, match="has no chat template"):
        build_chat(raw, tok_without, cfg)


# ------------------------------------------------------------------ the tiny SFT recipe on both backends

STEPS = 30


# The same global batch of 8 as micro 4 x 2 accumulation steps (DeepSpeed) and micro 2 x 4 (Megatron): chat loss
# is the mean over the step's assistant tokens, so the split must not change it (a mean of per-micro-batch means
# would: the micro-batches hold different numbers of assistant tokens).
MICRO = {"deepspeed": 4, "megatron": 2}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for backend in ("deepspeed", "megatron"):
        out[backend] = tmp_path_factory.mktemp(f"sft_{backend}")
        launch("tiny_sft", [f"parallel.backend={backend}", f"training.steps={STEPS}", "logging.interval=1",
                            f"training.micro_batch_size={MICRO[backend]}", "logging.tensorboard=false",
                            "training.schedule.warmup_steps=2"],
               nproc=1, out_dir=out[backend], launcher="python")
    return out


@pytest.mark.slow
def test_tiny_sft_trains_with_the_same_masked_loss_on_both_backends(runs):
    ds, mg = (read_metrics(runs[b]) for b in ("deepspeed", "megatron"))
    assert [m["step"] for m in ds] == [m["step"] for m in mg] == list(range(1, STEPS + 1))
    # step 1 is a pure forward of the same weights on the same packed sequences: the same masked mean
    assert ds[0]["loss"] == pytest.approx(mg[0]["loss"], rel=1e-5)
    assert [m["loss"] for m in ds] == pytest.approx([m["loss"] for m in mg], rel=2e-3)
    assert ds[-1]["loss"] < 0.6 * ds[0]["loss"]


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["deepspeed", "megatron"])
def test_exported_hf_folder_loads_and_answers(runs, backend):
    folder = runs[backend] / "hf"
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 2 plus 3?"}], add_generation_prompt=True,
                                     return_tensors="pt", return_dict=True)
    out = model.generate(**prompt, max_new_tokens=30, do_sample=False, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id)[0, prompt["input_ids"].shape[1]:]
    assert out[-1] == tok.eos_token_id, tok.decode(out)  # an answer in the chat format, ended by the template's eos
    assert "plus" in tok.decode(out)
