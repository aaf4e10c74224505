"""User-facing errors: problems collected from a recipe, checkpoint or command line, raised once."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    """One thing wrong with user input: where it is, what is wrong (with the arithmetic), how to fix it."""

    key: str
    message: str
    fix: str = ""

    def render(self) -> str:
        text = f"{self.key}: {self.message}"
        return f"{text}\n     fix: {self.fix}" if self.fix else text


class ToolkitError(Exception):
    """An error caused by user input. The CLI prints it without a traceback and exits with code 2."""

    exit_code = 2


class RecipeError(ToolkitError):
    """Every problem found in one recipe, reported together."""

    def __init__(self, source: str, problems: list[Problem], what: str = "recipe"):
        self.source, self.what = source, what  # what: "recipe", or whose options ("toolkit plan's")
        self.problems = list(problems)
        super().__init__(self.render())

    def render(self) -> str:
        n = len(self.problems)
        head = f"{self.what} {self.source}: {n} problem{'s' if n != 1 else ''}"
        body = "\n".join(f"  {i}. {p.render()}" for i, p in enumerate(self.problems, 1))
        return f"{head}\n{body}"
