"""Make the offline demo corpus and tokenizer used by the tiny-Llama recipes.

What it makes (all paths relative to this file's folder):

    demo_corpus/train.jsonl   ~1.2 MB of synthetic short stories, one JSON
                              object per line: {"text": "..."}
    demo_corpus/valid.jsonl   ~50 KB more stories, drawn with a different seed
    demo_tokenizer/           a byte-level BPE tokenizer (vocab 512) trained on
                              train.jsonl, saved as a Hugging Face tokenizer
                              folder (tokenizer.json, tokenizer_config.json,
                              special_tokens_map.json)

The stories come from a small hand-written grammar: a main character with a
name and consistent pronouns, a friend, a place, a favourite object, one of a
few simple events (losing and finding the object, sharing, bad weather, a
walk), a small arithmetic fact and a counting line.  The text is plain ASCII
English with a lot of learnable structure, so a tiny model's loss falls fast.

The text is generated with the Python standard library only (random.Random
with fixed seeds), and the tokenizer is trained single-threaded, so every run
writes byte-identical files.

Special tokens: <unk>=0, <s>=1 (bos), </s>=2 (eos), <pad>=3.  The tokenizer
does not add <s> or </s> by itself: append eos (and prepend bos) in the data
pipeline if you want them.

Run (from the repository root, in a venv with `tokenizers` and `transformers`):

    python recipes/data/make_demo_data.py
"""

import json
import os
import random

HERE = os.path.dirname(os.path.abspath(__file__))
CORPUS_DIR = os.path.join(HERE, "demo_corpus")
TOKENIZER_DIR = os.path.join(HERE, "demo_tokenizer")

TRAIN_SEED, TRAIN_STORIES = 1234, 1800
VALID_SEED, VALID_STORIES = 5678, 70
VOCAB_SIZE = 512
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>"]

# ----------------------------------------------------------------------------
# The grammar's word lists.
# ----------------------------------------------------------------------------

# (kind, pronouns): he/him/his, she/her/her, it/it/its
HE, SHE = ("he", "him", "his"), ("she", "her", "her")
CHARACTERS = {
    "girl": (SHE, ["Lily", "Mia", "Anna", "Sara", "Emma", "Lucy", "Zoe", "Ella"]),
    "boy": (HE, ["Tom", "Ben", "Max", "Sam", "Leo", "Jack", "Tim", "Finn"]),
    "cat": (SHE, ["Kitty", "Luna", "Misty"]),
    "dog": (HE, ["Rex", "Buddy", "Spot"]),
    "bunny": (SHE, ["Daisy", "Hoppy"]),
    "bear": (HE, ["Bruno", "Teddy"]),
}
PLACES = [
    ("park", "a big park"), ("forest", "a green forest"),
    ("beach", "a sunny beach"), ("garden", "a small garden"),
    ("farm", "a quiet farm"), ("lake", "a blue lake"),
    ("hill", "a tall hill"), ("town", "a little town"),
]
COLORS = ["red", "blue", "green", "yellow", "pink", "purple", "orange", "white"]
OBJECTS = ["ball", "kite", "hat", "book", "boat", "box", "cup", "drum", "toy car", "doll"]
FOODS = [("apple", "apples"), ("cookie", "cookies"), ("carrot", "carrots"),
         ("grape", "grapes"), ("cake", "cakes"), ("egg", "eggs"),
         ("berry", "berries"), ("nut", "nuts")]
FEELINGS_GOOD = ["happy", "glad", "proud", "excited"]
FEELINGS_BAD = ["sad", "scared", "worried", "upset"]
NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven",
                "eight", "nine", "ten", "eleven", "twelve"]


def cap(s):
    return s[0].upper() + s[1:]


def a_or_an(word):
    return ("an " if word[0] in "aeiou" else "a ") + word


class Who:
    """A character: name, kind (girl, dog...) and pronouns."""

    def __init__(self, rng, avoid=()):
        kind = rng.choice(sorted(CHARACTERS))
        pronouns, names = CHARACTERS[kind]
        self.name = rng.choice([n for n in names if n not in avoid] or names)
        self.kind = kind
        self.he, self.him, self.his = pronouns


# ----------------------------------------------------------------------------
# Story parts.  Each returns a list of sentences.
# ----------------------------------------------------------------------------

def opening(rng, hero, place, obj):
    little = rng.choice(["little ", "small ", "kind ", "funny ", ""])
    intro = rng.choice([
        f"Once upon a time, there was {a_or_an(little + hero.kind)} named {hero.name}.",
        f"One day, {a_or_an(little + hero.kind)} named {hero.name} woke up early.",
        f"{hero.name} was {a_or_an(little + hero.kind)}.",
    ])
    home = f"{cap(hero.he)} lived near {place[1]}."
    has = rng.choice([
        f"{hero.name} had {a_or_an(obj)}.",
        f"{cap(hero.he)} loved {hero.his} {obj} very much.",
        f"{cap(hero.his)} favorite toy was {a_or_an(obj)}.",
    ])
    return [intro, home, has]


def go_out(rng, hero, friend, place, obj):
    return [
        rng.choice([
            f"One morning, {hero.name} took {hero.his} {obj} to the {place[0]}.",
            f"{hero.name} went to the {place[0]} with {hero.his} {obj}.",
            f"The sun was up, so {hero.name} ran to the {place[0]}.",
        ]),
        rng.choice([
            f"There {hero.he} met {a_or_an(friend.kind)} named {friend.name}.",
            f"At the {place[0]}, {hero.he} saw {hero.his} friend {friend.name} the {friend.kind}.",
        ]),
        f"\"Hello, {friend.name}!\" said {hero.name}.",
        f"\"Hello, {hero.name}!\" said {friend.name}.",
    ]


def event_lost(rng, hero, friend, place, obj):
    spot = rng.choice(["under a tree", "behind a rock", "in the tall grass",
                       "near the water", "under a bush", "inside an old box"])
    return [
        f"They played with the {obj} all morning.",
        f"Then the {obj} was gone!",
        f"{hero.name} felt {rng.choice(FEELINGS_BAD)}. \"Where is my {obj}?\" {hero.he} asked.",
        f"\"I will help you look,\" said {friend.name}.",
        f"They looked and looked. At last {friend.name} found the {obj} {spot}.",
        f"\"Thank you, {friend.name}!\" said {hero.name}. {cap(hero.he)} gave {friend.name} a big hug.",
    ]


def event_share(rng, hero, friend, place, obj):
    return [
        f"{friend.name} looked at the {obj}. {cap(friend.he)} did not have a toy.",
        f"\"Can I play with your {obj}?\" asked {friend.name}.",
        rng.choice([
            f"{hero.name} thought for a moment. Then {hero.he} said, \"Yes, we can share it.\"",
            f"\"Yes, let us play together,\" said {hero.name}.",
        ]),
        f"They took turns with the {obj}. First {hero.name}, then {friend.name}.",
        f"Sharing made them both {rng.choice(FEELINGS_GOOD)}.",
    ]


def event_rain(rng, hero, friend, place, obj):
    return [
        "Suddenly, dark clouds came and it began to rain.",
        f"{friend.name} was {rng.choice(FEELINGS_BAD)}. {cap(friend.he)} did not like the rain.",
        f"\"Do not be afraid,\" said {hero.name}. \"We can hide under the big tree.\"",
        f"{hero.name} and {friend.name} sat under the tree and waited.",
        f"Soon the rain stopped and the sun came back. They saw a {rng.choice(COLORS)} bird in the sky.",
    ]


def event_walk(rng, hero, friend, place, obj):
    things = rng.sample(["a frog", "a duck", "a bee", "a big rock", "a red flower",
                         "a tall tree", "a little fish", "a snail"], 3)
    return [
        f"{hero.name} and {friend.name} went for a walk around the {place[0]}.",
        f"First they saw {things[0]}. Then they saw {things[1]}.",
        f"At the end of the walk, they found {things[2]}.",
        f"\"What a fun walk!\" said {friend.name}.",
    ]


EVENTS = [event_lost, event_share, event_rain, event_walk]


def count_of(n, food):
    """'one apple', 'three apples'."""
    return f"{NUMBER_WORDS[n]} {food[0] if n == 1 else food[1]}"


def arithmetic(rng, hero, friend):
    food = rng.choice(FOODS)
    a, b = rng.randint(1, 6), rng.randint(1, 6)
    if rng.random() < 0.6:
        return [
            f"{hero.name} had {count_of(a, food)}. {friend.name} gave {hero.him} {NUMBER_WORDS[b]} more.",
            f"Now {hero.name} had {count_of(a + b, food)}, because {a} plus {b} is {a + b}.",
        ]
    a = a + b  # make sure a > b for a subtraction
    return [
        f"{hero.name} had {count_of(a, food)}. {cap(hero.he)} gave {NUMBER_WORDS[b]} to {friend.name}.",
        f"Now {hero.name} had {count_of(a - b, food)} left, because {a} minus {b} is {a - b}.",
    ]


def counting(rng, hero):
    n = rng.randint(3, 7)
    what = rng.choice(["stars", "birds", "clouds", "trees", "ducks", "boats"])
    words = ", ".join(NUMBER_WORDS[1:n + 1])
    return [f"{hero.name} counted the {what}: {words}. There were {NUMBER_WORDS[n]} {what}."]


def ending(rng, hero, friend, place):
    feel = rng.choice(FEELINGS_GOOD)
    return [
        rng.choice([
            f"When it got dark, {hero.name} said goodbye to {friend.name} and went home.",
            f"In the evening, {hero.name} walked home from the {place[0]}.",
        ]),
        rng.choice([
            f"{cap(hero.he)} was very {feel}. It was a good day.",
            f"That night, {hero.name} went to bed {feel}. The end.",
            f"{hero.name} and {friend.name} were best friends. The end.",
        ]),
    ]


def story(rng):
    hero = Who(rng)
    friend = Who(rng, avoid=(hero.name,))
    place = rng.choice(PLACES)
    obj = f"{rng.choice(COLORS)} {rng.choice(OBJECTS)}"
    sentences = opening(rng, hero, place, obj)
    sentences += go_out(rng, hero, friend, place, obj)
    sentences += rng.choice(EVENTS)(rng, hero, friend, place, obj)
    extras = [arithmetic(rng, hero, friend), counting(rng, hero)]
    rng.shuffle(extras)
    for extra in extras[: rng.randint(1, 2)]:
        sentences += extra
    sentences += ending(rng, hero, friend, place)
    return " ".join(sentences)


def write_split(path, seed, n):
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for _ in range(n):
            f.write(json.dumps({"text": story(rng)}, ensure_ascii=True) + "\n")


# ----------------------------------------------------------------------------
# Tokenizer.
# ----------------------------------------------------------------------------

def train_tokenizer(train_path, out_dir):
    # One thread: BPE training then has no room for ordering differences.
    os.environ["RAYON_NUM_THREADS"] = "1"
    os.environ["RAYON_RS_NUM_CPUS"] = "1"
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    with open(train_path, encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f]
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))

    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>",
        clean_up_tokenization_spaces=False,
        model_max_length=2048,
    )
    hf_tok.save_pretrained(out_dir)

    # Make the folder loadable by transformers 4.x as well as 5.x: name the
    # class both understand, and write the special_tokens_map.json that 4.x
    # reads (5.x no longer writes it).
    config_path = os.path.join(out_dir, "tokenizer_config.json")
    with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config.pop("backend", None)
    write_json(config_path, config)
    write_json(os.path.join(out_dir, "special_tokens_map.json"), {
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>",
    })


def write_json(path, obj):
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")


def main():
    os.makedirs(CORPUS_DIR, exist_ok=True)
    train_path = os.path.join(CORPUS_DIR, "train.jsonl")
    write_split(train_path, TRAIN_SEED, TRAIN_STORIES)
    write_split(os.path.join(CORPUS_DIR, "valid.jsonl"), VALID_SEED, VALID_STORIES)
    train_tokenizer(train_path, TOKENIZER_DIR)
    for name in ("train.jsonl", "valid.jsonl"):
        p = os.path.join(CORPUS_DIR, name)
        print(f"{p}: {os.path.getsize(p)} bytes")
    print(f"{TOKENIZER_DIR}: vocab {VOCAB_SIZE}")


if __name__ == "__main__":
    main()
