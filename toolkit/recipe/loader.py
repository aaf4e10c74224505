"""Load a recipe: find the file, follow `base:`, apply `--set`, layer presets, type-check.

Precedence, highest first: `--set a.b=c` > the recipe file > its `base:` chain > a model preset
(or `model.hf_path`'s config.json) > the field defaults in schema.py.
"""
from __future__ import annotations

import copy
import difflib
import json
from pathlib import Path

import yaml
from pydantic import BaseModel, ValidationError

from toolkit.errors import Problem, RecipeError
from toolkit.recipe.presets import PRESETS, model_keys_from_hf_config
from toolkit.recipe.schema import Recipe

REPO_ROOT = Path(__file__).resolve().parents[2]
RECIPE_DIR = REPO_ROOT / "recipes"


def find_recipe(name_or_path: str) -> Path:
    """A recipe by path, or by name among the shipped recipes (`llama7b_zero3` -> recipes/llama7b_zero3.yaml)."""
    p = Path(name_or_path)
    for cand in (p, p.with_suffix(".yaml"), RECIPE_DIR / p.name, RECIPE_DIR / f"{p.name}.yaml"):
        if cand.is_file():
            return cand
    shipped = ", ".join(list_recipes())
    raise RecipeError(name_or_path, [Problem("--recipe", f"no recipe file or shipped recipe named {name_or_path!r}",
                                             f"pass a path to a .yaml file or one of: {shipped}")])


def list_recipes() -> list[str]:
    return sorted(p.stem for p in RECIPE_DIR.glob("*.yaml"))


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (plain YAML keeps the last one, silently)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"the key {key!r} is given twice in one mapping",
                                                        key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def _read_yaml(path: Path, source: str) -> dict:
    try:
        data = yaml.load(path.read_text(), Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        why = getattr(e, "problem", None) or str(e)
        raise RecipeError(source, [Problem("<yaml>", f"{path} is not valid YAML{where}: {why}",
                                           "keep one of the two entries" if "given twice" in str(why) else
                                           "fix the YAML syntax (indentation, a missing ':' or quote)")]) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise RecipeError(source, [Problem("<yaml>", f"{path} holds a {type(data).__name__}, not a mapping of keys",
                                           "a recipe is a YAML mapping such as `model: {preset: tiny}`")])
    return data


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
    data = _read_yaml(path, source)
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
            problems.append(Problem(f"--set {item}", "expected KEY.PATH=VALUE", "e.g. --set training.steps=20"))
            continue
        try:
            value = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError:
            value = raw
        node = out
        *parents, leaf = key.strip().split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                problems.append(Problem(f"--set {item}", f"{part} was already set to a value, not a section"))
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
        below = model_keys_from_hf_config(json.loads(cfg.read_text()))
    return {**raw, "model": {**below, **model}}


def _problems_from_validation(err: ValidationError) -> list[Problem]:
    problems = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"])
        if e["type"] == "extra_forbidden":
            problems.append(_unknown_key(e["loc"]))
        else:
            problems.append(Problem(key, f"{e['msg']} (got {e.get('input')!r})",
                                    f"see `toolkit show --explain` for what {key} takes"))
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
    return Problem(".".join(map(str, loc)), f"unknown key under {section}",
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
