"""Load a recipe: find the file, follow `base:`, apply `--set`, layer presets, type-check.

Precedence, highest first: `--set a.b=c` > the recipe file > its `base:` chain > a model preset
(or `model.hf_path`'s config.json) > the field defaults in schema.py.
"""
from __future__ import annotations

import copy
import difflib
import re
from pathlib import Path

import yaml
from pydantic import BaseModel, ValidationError

from toolkit.errors import Problem, RecipeError
from toolkit.recipe.presets import PRESETS, model_keys_from_hf_config, read_hf_config
from toolkit.recipe.schema import Recipe
from toolkit.repo import REPO_ROOT

RECIPE_DIR = REPO_ROOT / "recipes"


def find_recipe(name_or_path: str) -> Path:
    """A recipe by path, or by name among the shipped recipes (`llama7b_zero3` -> recipes/llama7b_zero3.yaml)."""
    p = Path(name_or_path)
    shipped = ", ".join(list_recipes())
    if p.name:  # '', '.', '/' have none: Path.with_suffix raised ValueError (a traceback until 2026-12-07)
        for cand in (p, p.with_suffix(".yaml"), RECIPE_DIR / p.name, RECIPE_DIR / f"{p.name}.yaml"):
            if cand.is_file():
                return cand
    if not p.name or p.is_dir():
        what = "an empty name" if not str(name_or_path).strip() else f"{name_or_path!r}, a folder,"
        fix = "pass a path to a .yaml file or a shipped recipe's name (toolkit show --list)"
        raise RecipeError(name_or_path or "''", [Problem("--recipe", f"{what} is not a recipe", fix)])
    raise RecipeError(name_or_path, [Problem("--recipe", f"no recipe file or shipped recipe named {name_or_path!r}",
                                             f"pass a path to a .yaml file or one of: {shipped}")])


def list_recipes() -> list[str]:
    return sorted(p.stem for p in RECIPE_DIR.glob("*.yaml"))


class _TooBig(ValueError):
    """A YAML text beyond the budgets: args are (what is wrong, the fix)."""


MAX_RECIPE_DEPTH = 64  # a recipe nests 3-4 levels; deeper nesting only exhausts the composer's recursion


class _BoundedLoader(yaml.SafeLoader):
    """SafeLoader that refuses, while composing, nesting deeper than MAX_RECIPE_DEPTH (before Python's recursion
    limit turns it into a slow RecursionError) and more than MAX_RECIPE_NODES written values (pure-Python YAML
    takes tens of microseconds per value). Aliases are counted after composing, by _expanded_size."""

    _depth = 0
    _composed = 0
    lines = False  # whether a refusal names the line: a recipe file's does; a --set value is one line

    def compose_node(self, parent, index):
        self._depth += 1
        self._composed += 1
        try:
            if self._depth > MAX_RECIPE_DEPTH:
                raise _TooBig(f"nests its values more than {MAX_RECIPE_DEPTH} levels deep",
                              "a recipe nests a few levels (section: {key: value}); flatten it")
            if self._composed > MAX_RECIPE_NODES:
                raise _TooBig(f"holds more than {MAX_RECIPE_NODES:,} values",
                              "a recipe holds a few hundred values; pass the recipe YAML, not a data file")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def _no_octal(loader: _BoundedLoader, node: yaml.ScalarNode) -> int:
    """An integer, except one written with a leading zero: YAML 1.1, which PyYAML reads, takes `010` as octal 8
    (`steps: 010` trained 8 steps without a word until 2026-12-07)."""
    text = str(node.value).replace("_", "")
    if re.fullmatch(r"[-+]?0[0-7]+", text):
        sign, digits = ("-" if text[0] == "-" else ""), text.lstrip("+-").lstrip("0")
        line = f" (line {node.start_mark.line + 1})" if loader.lines else ""
        raise _TooBig(f"has {node.value}{line} with a leading zero, which YAML reads as an octal number: "
                      f"{int(text, 8)}", f"write {sign}{digits} for the number, or quote it ('{node.value}') for text")
    return loader.construct_yaml_int(node)


_BoundedLoader.add_constructor("tag:yaml.org,2002:int", _no_octal)


class _UniqueKeyLoader(_BoundedLoader):
    """SafeLoader that refuses a key given twice in one mapping (plain YAML keeps the last one, silently)."""

    lines = True

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"the key {key!r} is given twice in one mapping",
                                                        key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


# Budgets for hostile recipe files. A recipe is a few KB with a few hundred values; these are far above that and far
# below what would hang validation (nested aliases, "billion laughs", expand 1 KB into 9^9 values).
MAX_RECIPE_BYTES = 256 << 10
MAX_RECIPE_NODES = 5_000
MAX_PROBLEMS = 20
MAX_REPR = 80


def _expanded_size(root: yaml.Node) -> int | None:
    """How many nodes the document holds once every alias is expanded (an alias re-uses its anchor's node object,
    so this counts each shared node as often as it is reached; memoised, so it costs the unique nodes only).
    None when a node contains itself (`a: &a [*a]`)."""
    sizes: dict[int, int] = {}
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    open_: set[int] = set()
    while stack:
        node, done = stack.pop()
        key = id(node)
        if done:
            open_.discard(key)
            children = _children(node)
            sizes[key] = min(1 + sum(sizes[id(c)] for c in children), MAX_RECIPE_NODES + 1)
            continue
        if key in sizes:
            continue
        if key in open_:
            return None
        open_.add(key)
        stack.append((node, True))
        stack.extend((c, False) for c in _children(node) if id(c) not in sizes)
    return sizes[id(root)]


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return []


def _yaml_problem(path: Path, source: str, message: str, fix: str) -> RecipeError:
    return RecipeError(source, [Problem("<yaml>", f"{path} {message}", fix)])


def _bounded_load(text: str, loader_cls: type = _BoundedLoader):
    """yaml.safe_load with budgets: aliases may not expand past MAX_RECIPE_NODES values or contain themselves,
    nesting may not exhaust the stack, integers may not exceed Python's int-str limit. Raises _TooBig or
    yaml.YAMLError."""
    loader = loader_cls(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        nodes = _expanded_size(node)
        if nodes is None:
            raise _TooBig("has an alias inside its own anchor (the value contains itself)",
                          "write the value out instead of the recursive *alias")
        if nodes > MAX_RECIPE_NODES:
            raise _TooBig(f"expands to more than {MAX_RECIPE_NODES:,} values through its &anchors and *aliases",
                          "write the recipe without nested aliases; a recipe holds a few hundred values")
        return loader.construct_document(node)
    except RecursionError:
        raise _TooBig("nests its values too deeply to read",
                      "a recipe nests a few levels (section: {key: value}); flatten it") from None
    except _TooBig:
        raise
    except ValueError as e:  # an integer of thousands of digits: Python's int-str conversion limit
        what = ("holds an integer of more than 4,300 digits" if "integer string conversion" in str(e)
                else f"holds a value Python cannot read: {_short(str(e))}")
        raise _TooBig(what, "use numbers of ordinary size (steps, sizes and rates fit in a few digits)") from None
    finally:
        loader.dispose()


def _read_yaml(path: Path, source: str, top: bool = False) -> dict:
    size = path.stat().st_size
    if size > MAX_RECIPE_BYTES:
        raise _yaml_problem(path, source, f"is {size:,} bytes; a recipe is a few KB (the limit is "
                            f"{MAX_RECIPE_BYTES:,})", "pass the recipe YAML, not a data or checkpoint file")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise _yaml_problem(path, source, f"is not UTF-8 text (byte 0x{raw[e.start]:02x} at line {line})",
                            "save the recipe as UTF-8 (a recipe is a text file; check it is not a binary file)"
                            ) from None
    try:
        data = _bounded_load(text, _UniqueKeyLoader)
    except _TooBig as e:
        raise _yaml_problem(path, source, *e.args) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        why = getattr(e, "problem", None) or str(e)
        raise _yaml_problem(path, source, f"is not valid YAML{where}: {_short(str(why), 200)}",
                            "keep one of the two entries" if "given twice" in str(why) else
                            "fix the YAML syntax (indentation, a missing ':' or quote)") from None
    if top and not data:
        raise _yaml_problem(path, source, "is empty (no keys)" if data is None or data == {} else
                            f"holds {data!r}, not a mapping of keys",
                            "start from a shipped recipe, e.g. `base: tiny_zero0` (see `toolkit show --list`)")
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise _yaml_problem(path, source, f"holds a {type(data).__name__}, not a mapping of keys",
                            "a recipe is a YAML mapping such as `model: {preset: tiny}`")
    return data


def _short(text: str, limit: int = MAX_REPR) -> str:
    return text if len(text) <= limit else f"{text[:limit - 3]}..."


def _deep_merge(low: dict, high: dict) -> dict:
    out = copy.deepcopy(low)
    for k, v in high.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


def _load_chain(path: Path, source: str, seen: tuple[Path, ...] = ()) -> dict:
    """The file merged over its `base:` chain; a loop in the chain is an error naming it."""
    path = path.resolve()
    if path in seen:
        chain = " -> ".join(p.name for p in (*seen, path))
        raise RecipeError(source, [Problem("base", f"the base chain loops: {chain}",
                                           "remove the `base:` that points back to a recipe already in the chain")])
    data = _read_yaml(path, source, top=not seen)
    base = data.pop("base", None)
    if base is None:
        return data
    if not isinstance(base, str):
        raise RecipeError(source, [Problem("base", f"expected a recipe name or path, got {base!r}",
                                           "write `base: tiny_base` or `base: ../other.yaml`")])
    local = path.parent / base
    base_path = local if local.is_file() else (local.with_suffix(".yaml") if local.with_suffix(".yaml").is_file()
                                                else _find_base(base, path, source))
    return _deep_merge(_load_chain(base_path, source, (*seen, path)), data)


def _find_base(base: str, path: Path, source: str) -> Path:
    try:
        return find_recipe(base)
    except RecipeError:
        raise RecipeError(source, [Problem("base", f"{path.name} names base {base!r}, which is neither a file next "
                                           "to it nor a shipped recipe",
                                           f"fix the name, or pass a path; shipped: {', '.join(list_recipes())}")]
                          ) from None


def parse_overrides(items: list[str], source: str) -> dict:
    """`--set a.b=c` strings as a nested dict; values are parsed as YAML (numbers, booleans, lists, null)."""
    out: dict = {}
    problems = []
    for item in items or []:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip() or any(not part for part in key.split(".")):
            problems.append(Problem(_short(f"--set {item}"), "expected KEY.PATH=VALUE", "e.g. --set training.steps=20"))
            continue
        try:
            value = _bounded_load(raw) if raw.strip() else None
        except _TooBig as e:
            problems.append(Problem(_short(f"--set {item}"), f"the value {e.args[0]}", e.args[1]))
            continue
        except yaml.YAMLError:
            value = raw
        node = out
        *parents, leaf = key.strip().split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                problems.append(Problem(_short(f"--set {item}"), f"{part} was already set to a value, not a section"))
                break
        else:
            node[leaf] = value
    if problems:
        raise RecipeError(source, problems)
    return out


def _layer_model_source(raw: dict, source: str) -> dict:
    """Put preset or hf_path values under the recipe's own model keys."""
    model = raw.get("model")
    if not isinstance(model, dict):
        return raw
    # With both set, the preset names the architecture (so a cluster recipe validates on a laptop without the
    # weights); the run then checks hf_path's config.json against it (checks.check_paths).
    preset, hf_path = model.get("preset"), model.get("hf_path")
    below: dict = {}
    if preset is not None:
        if preset not in PRESETS:
            raise RecipeError(source, [Problem("model.preset", f"unknown preset {preset!r}",
                                               f"use one of: {', '.join(PRESETS)}")])
        below = PRESETS[preset]
    elif hf_path is not None:
        cfg = Path(hf_path) / "config.json"
        if not cfg.is_file():
            raise RecipeError(source, [Problem("model.hf_path", f"{cfg} does not exist",
                                               "point hf_path at a local Hugging Face model folder with config.json")])
        hf, problems = read_hf_config(cfg)
        if problems:
            raise RecipeError(source, problems)
        below = model_keys_from_hf_config(hf)
    return {**raw, "model": {**below, **model}}


def _problems_from_validation(err: ValidationError) -> list[Problem]:
    problems = []
    errors = err.errors()
    for e in errors[:MAX_PROBLEMS]:
        key = _short(".".join(str(p) for p in e["loc"]))
        if e["type"] == "extra_forbidden":
            problems.append(_unknown_key(e["loc"]))
        else:
            problems.append(Problem(key, f"{e['msg']} (got {_short(repr(e.get('input')))})",
                                    f"see `toolkit show --explain` for what {key} takes"))
    if len(errors) > MAX_PROBLEMS:
        problems.append(Problem("...", f"and {len(errors) - MAX_PROBLEMS} more problems like these",
                                "fix the ones above, then validate again"))
    return problems


def _unknown_key(loc: tuple) -> Problem:
    node: type[BaseModel] = Recipe
    for part in loc[:-1]:
        field = node.model_fields.get(str(part))
        ann = field.annotation if field else None
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            break
        node = ann
    valid = list(node.model_fields)
    close = difflib.get_close_matches(str(loc[-1]), valid, n=1)
    hint = f"did you mean `{close[0]}`? " if close else ""
    section = ".".join(map(str, loc[:-1])) or "the top level"
    return Problem(_short(".".join(map(str, loc))), f"unknown key under {_short(section)}",
                   f"{hint}valid keys: {', '.join(valid)}")


def load_recipe(name_or_path: str, overrides: list[str] | None = None) -> Recipe:
    """The typed recipe. Raises RecipeError listing every schema problem at once."""
    path = find_recipe(name_or_path)
    source = path.stem
    raw = _deep_merge(_load_chain(path, source), parse_overrides(overrides or [], source))
    raw = _layer_model_source(raw, source)
    try:
        return Recipe.model_validate(raw)
    except ValidationError as e:
        raise RecipeError(source, _problems_from_validation(e)) from None
