"""The corpus of malformed recipes in tests/bad_recipes/cases.yaml: each gives its pinned problem lines, all at once,
and through the CLI an exit code of 2 with no traceback."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from toolkit.errors import RecipeError
from toolkit.recipe import load_recipe, resolve

CASES = yaml.safe_load((Path(__file__).parent / "bad_recipes" / "cases.yaml").read_text())


def _write_case(case: dict, folder: Path) -> Path:
    for name, text in (case.get("files") or {}).items():
        (folder / name).write_text(text.replace("{dir}", str(folder)))
    path = folder / "recipe.yaml"
    path.write_text(case["recipe"].replace("{dir}", str(folder)))
    return path


def test_corpus_is_large_enough():
    assert len(CASES) >= 40
    assert len({c["name"] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_bad_recipe_gives_pinned_message(case, tmp_path):
    path = _write_case(case, tmp_path)
    with pytest.raises(RecipeError) as err:
        resolve(load_recipe(str(path)), case.get("world_size"))
    lines = [f"{p.key}: {p.message}" for p in err.value.problems]
    for expected in case["expect"]:
        assert expected.replace("{dir}", str(tmp_path)) in lines, f"got {lines}"
    assert all(p.fix for p in err.value.problems), "every problem says how to fix it"


@pytest.mark.parametrize("case", CASES[::7], ids=[c["name"] for c in CASES[::7]])
def test_cli_reports_without_traceback(case, tmp_path):
    path = _write_case(case, tmp_path)
    args = ["validate", "--recipe", str(path)]
    if case.get("world_size"):
        args += ["--world-size", str(case["world_size"])]
    proc = subprocess.run([sys.executable, "-m", "toolkit", *args], capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: recipe ") and "Traceback" not in proc.stderr
    assert case["expect"][0].replace("{dir}", str(tmp_path)) in proc.stderr
    assert proc.stdout == ""
