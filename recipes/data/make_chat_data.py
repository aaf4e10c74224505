"""Make the offline chat corpus, chat tokenizer and tiny pretrained model of the tiny SFT recipe (recipes/tiny_sft.yaml).

What it makes (paths relative to this file's folder):

    chat_corpus/train.jsonl   ~600 short conversations, one JSON object per line:
                              {"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}
                              arithmetic questions (some with a follow-up turn), counting, and short stories
                              about a named character, in the words of the demo corpus
    chat_tokenizer/           the demo tokenizer (same files, same ids) plus a chat template in
                              tokenizer_config.json: "<s>" once, then "User: ...</s>\\n", "Assistant: ...</s>\\n",
                              "System: ...</s>\\n"; the generation prompt is "Assistant:"
    tiny_chat_base/           a tiny Llama (the `tiny` preset: 2 layers, hidden 64, vocab 512; ~160k parameters,
                              bf16 safetensors, ~320 KB) pretrained for 200 steps on the demo corpus: the "pretrained
                              model" the SFT recipe starts from (model.hf_path + model.pretrained: true)

The text comes from random.Random with fixed seeds (byte-identical on rerun); the base model from a fixed torch
seed on CPU (identical on the same torch build). Run from the repository root:

    python recipes/data/make_chat_data.py
"""

import json
import os
import random
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from make_demo_data import (  # noqa: E402  (the demo corpus's word lists and story parts)
    CORPUS_DIR, NUMBER_WORDS, PLACES, TOKENIZER_DIR, Who, ending, go_out, opening, write_json,
)

CHAT_DIR = os.path.join(HERE, "chat_corpus")
CHAT_TOKENIZER_DIR = os.path.join(HERE, "chat_tokenizer")
BASE_DIR = os.path.join(HERE, "tiny_chat_base")
SEED, CONVERSATIONS = 4321, 600

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}System: {% elif m['role'] == 'user' %}User: "
    "{% elif m['role'] == 'assistant' %}Assistant: {% else %}{{ raise_exception('unknown role ' + m['role']) }}"
    "{% endif %}{{ m['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)
SYSTEMS = ["You are a helpful assistant.", "You are a friendly storyteller.", "Answer in one short sentence."]


def arithmetic(rng):
    a, b = rng.randint(1, 9), rng.randint(1, 9)
    msgs = [{"role": "user", "content": f"What is {a} plus {b}?"},
            {"role": "assistant", "content": f"{a} plus {b} is {a + b}."}]
    if rng.random() < 0.4:
        c = rng.randint(1, 9)
        msgs += [{"role": "user", "content": f"And {c} more?"},
                 {"role": "assistant", "content": f"{a + b} plus {c} is {a + b + c}."}]
    return msgs


def counting(rng):
    n = rng.randint(2, 9)
    return [{"role": "user", "content": f"Count to {NUMBER_WORDS[n]}."},
            {"role": "assistant", "content": ", ".join(cap(w) if i == 0 else w for i, w in
                                                       enumerate(NUMBER_WORDS[1:n + 1])) + "."}]


def cap(s):
    return s[0].upper() + s[1:]


def story(rng):
    hero, place = Who(rng), rng.choice(PLACES)
    friend = Who(rng, avoid=(hero.name,))
    obj = f"{rng.choice(['red', 'blue', 'green'])} {rng.choice(['ball', 'kite', 'hat', 'book'])}"
    text = " ".join(opening(rng, hero, place, obj) + go_out(rng, hero, friend, place, obj)[:2]
                    + ending(rng, hero, friend, place))
    return [{"role": "user", "content": f"Tell me a short story about {hero.name}."},
            {"role": "assistant", "content": text}]


def conversation(rng):
    msgs = rng.choice([arithmetic, arithmetic, counting, story])(rng)
    if rng.random() < 0.3:
        msgs = [{"role": "system", "content": rng.choice(SYSTEMS)}] + msgs
    return {"messages": msgs}


def write_corpus(path):
    rng = random.Random(SEED)
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for _ in range(CONVERSATIONS):
            f.write(json.dumps(conversation(rng), ensure_ascii=True) + "\n")


def write_tokenizer():
    os.makedirs(CHAT_TOKENIZER_DIR, exist_ok=True)
    for name in ("tokenizer.json", "special_tokens_map.json"):
        shutil.copyfile(os.path.join(TOKENIZER_DIR, name), os.path.join(CHAT_TOKENIZER_DIR, name))
    with open(os.path.join(TOKENIZER_DIR, "tokenizer_config.json"), encoding="utf-8") as f:
        config = json.load(f)
    config["chat_template"] = CHAT_TEMPLATE
    write_json(os.path.join(CHAT_TOKENIZER_DIR, "tokenizer_config.json"), config)


def write_base_model(steps=200, batch=16, seq=128):
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    with open(os.path.join(CORPUS_DIR, "train.jsonl"), encoding="utf-8") as f:
        ids = [t for line in f for t in tok(json.loads(line)["text"])["input_ids"] + [tok.eos_token_id]]
    data = torch.tensor(ids[:len(ids) // seq * seq]).view(-1, seq)
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id)
    model = LlamaForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    gen = torch.Generator().manual_seed(0)
    for step in range(steps):
        rows = data[torch.randint(len(data), (batch,), generator=gen)]
        loss = model(input_ids=rows, labels=rows).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step % 50 == 0 or step == steps - 1:
            print(f"base model step {step}: loss {loss.item():.3f}")
    model.to(torch.bfloat16).save_pretrained(BASE_DIR)


def main():
    os.makedirs(CHAT_DIR, exist_ok=True)
    path = os.path.join(CHAT_DIR, "train.jsonl")
    write_corpus(path)
    write_tokenizer()
    print(f"{path}: {os.path.getsize(path)} bytes; {CHAT_TOKENIZER_DIR}")
    if "--no-model" not in sys.argv:
        write_base_model()
        print(f"{BASE_DIR}: " + ", ".join(f"{n} {os.path.getsize(os.path.join(BASE_DIR, n))} bytes"
                                          for n in sorted(os.listdir(BASE_DIR))))


if __name__ == "__main__":
    main()
