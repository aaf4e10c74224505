"""The package layers go one way: every import of a toolkit module (at the top of a file or inside a function)
points to a lower layer; function-local imports are kept for heavy libraries, each with its reason on the line;
the on-disk format and the model families import in isolation; no module grows past 500 lines."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "toolkit"

# Bottom first. A unit (a package, or a module at the top of toolkit/) may import only units on earlier lines.
LAYERS = [
    ["errors", "proc", "repo"],
    ["layout"],
    ["recipe"],
    ["format", "families"],
    ["model", "data", "metrics", "adapters"],
    ["checkpoint"],
    ["train"],
    ["megatron"],
    ["run", "plan", "slurm", "doctor", "preflight"],
    ["cli"],
    ["__main__"],
]
LEVEL = {unit: level for level, units in enumerate(LAYERS) for unit in units}
HEAVY = {"torch", "deepspeed", "megatron", "transformers", "datasets", "transformer_engine", "numpy"}
# (numpy: 0.1 s, which `validate` and `plan` never need; the families' rules use it only for the byte planner)
# toolkit modules that cli.py may import inside a command: each pulls in torch (copy_only: numpy), which `validate`
# never needs
LAZY_FOR_STARTUP = {"toolkit.checkpoint.inspect", "toolkit.checkpoint.convert", "toolkit.megatron.runtime",
                    "toolkit.data.indexed", "toolkit.checkpoint.copy_only", "toolkit.checkpoint.output",
                    # and what only some commands use (0.3 s of imports `toolkit convert` never needs)
                    "toolkit.doctor", "toolkit.adapters.deepspeed", "toolkit.adapters.megatron", "toolkit.plan",
                    "toolkit.recipe", "toolkit.recipe.schema", "toolkit.slurm", "yaml", "pydantic"}


def unit_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "toolkit"


def modules() -> list[Path]:
    return sorted(PKG.rglob("*.py"))


def imports(path: Path) -> list[tuple[ast.AST, str, bool]]:
    """(node, imported module, inside a function) for every import in the file."""
    tree = ast.parse(path.read_text())
    local = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
             for n in ast.walk(f) if isinstance(n, (ast.Import, ast.ImportFrom))}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node, alias.name, id(node) in local) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: use absolute imports"
            names = [f"{node.module}.{a.name}" for a in node.names] if node.module == "toolkit" else [node.module]
            out += [(node, name, id(node) in local) for name in names]
    return out


def test_every_unit_is_on_a_layer():
    units = {p.stem if p.parent == PKG else p.relative_to(PKG).parts[0] for p in modules()} - {"__init__"}
    assert units <= set(LEVEL), f"put {sorted(units - set(LEVEL))} on a layer in LAYERS"


def test_imports_go_down_only():
    wrong = []
    for path in modules():
        rel = path.relative_to(PKG)
        me = rel.parts[0] if len(rel.parts) > 1 else rel.stem
        for node, name, _ in imports(path):
            if not name.startswith("toolkit.") or unit_of(name) == me:
                continue
            if LEVEL[unit_of(name)] >= LEVEL.get(me, 0):
                wrong.append(f"toolkit/{rel}:{node.lineno} ({me}, layer {LEVEL.get(me)}) imports {name} "
                             f"(layer {LEVEL[unit_of(name)]})")
    assert not wrong, "imports that go up or sideways:\n" + "\n".join(wrong)


def test_function_local_imports_are_heavy_libraries_with_a_reason():
    wrong = []
    for path in modules():
        lines = path.read_text().splitlines()
        for node, name, local in imports(path):
            if not local:
                continue
            where = f"toolkit/{path.relative_to(PKG)}:{node.lineno}"
            allowed = name.split(".")[0] in HEAVY or (path.name == "cli.py" and name in LAZY_FOR_STARTUP)
            reason = "#" in lines[node.lineno - 1] or lines[node.lineno - 2].strip().startswith("#")
            if not allowed:
                wrong.append(f"{where}: {name} imported inside a function; import it at the top of the file")
            elif not reason:
                wrong.append(f"{where}: {name} imported inside a function with no one-line reason")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("package, allowed", [
    ("toolkit.format", {"toolkit", "toolkit.errors"}),
    ("toolkit.families", {"toolkit", "toolkit.errors", "toolkit.layout"}),
    ("toolkit.recipe", {"toolkit", "toolkit.errors", "toolkit.layout", "toolkit.repo"}),
])
def test_the_floor_imports_in_isolation(package, allowed):
    """Imported alone, in a fresh interpreter, a floor package loads no toolkit module above it."""
    code = (f"import sys, {package}; print('\\n'.join(sorted(m for m in sys.modules "
            f"if m.startswith('toolkit') and not m.startswith('{package}'))))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert set(proc.stdout.split()) <= allowed, f"{package} pulls in {set(proc.stdout.split()) - allowed}"


def test_no_module_over_500_lines():
    long = {str(p.relative_to(ROOT)): n for p in modules() if (n := len(p.read_text().splitlines())) > 500}
    assert not long, f"split these modules: {long}"


def test_the_checker_sees_an_upward_import(tmp_path, monkeypatch):
    """The check itself can fail: a planted upward import in a copy of the format package is reported."""
    fake = tmp_path / "toolkit"
    (fake / "format").mkdir(parents=True)
    (fake / "format" / "bad.py").write_text("from toolkit.train import checkpoint\n")
    monkeypatch.setattr(sys.modules[__name__], "PKG", fake)
    with pytest.raises(AssertionError, match=r"format/bad.py:1 .*imports toolkit.train \(layer"):
        test_imports_go_down_only()
