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


def quantized(cfg: dict, where: str, key: str = "model.hf_path") -> Problem | None:
    """The problem with a Hugging Face config.json of a quantized model (its quantization_config: GPTQ, AWQ,
    bitsandbytes, FP8, ...), whose weights are integers or 8-bit floats stored with scales that no family's map
    holds. Such a folder was refused as
    tensors the map does not know (with a fix that pointed at the family's map), as missing tensors, or as a file
    to re-copy, until 2026-12-07. Here, below both, because recipes (model.hf_path) and the converter refuse it
    alike, and the converter's torch-free copy path must not load the recipe schema."""
    q = cfg.get("quantization_config")
    if not q:
        return None
    method = q.get("quant_method", "not named") if isinstance(q, dict) else "not named"
    return Problem(key, f"{where} describes a quantized model (quantization_config, quant_method: {method}): its "
                   "weights are stored with scales, and the toolkit reads full-precision weights only",
                   "use the model's unquantized (bf16 or fp32) release, or load it in transformers, call "
                   "model.dequantize() where its method has one, and save_pretrained a full-precision copy")
