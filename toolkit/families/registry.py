"""The model families the converters know, by name and by Hugging Face `model_type`. Adding one: write its file
next to llama.py and list its FAMILY here (and its name in the recipe schema's `model.family`)."""
from __future__ import annotations

from typing import Any

from toolkit.errors import ToolkitError
from toolkit.families import llama, mistral, qwen2, qwen3, qwen3_moe
from toolkit.families.mapping import Dims, Family, config_getter


def _index(families: list[Family]) -> dict[str, Family]:
    out: dict[str, Family] = {}
    for fam in families:
        for key in (fam.name, *fam.model_types):
            if key in out and out[key] is not fam:
                raise ToolkitError(f"two model families claim {key!r}: {out[key].name} and {fam.name}")
            out[key] = fam
    return out


FAMILIES = _index([llama.FAMILY, mistral.FAMILY, qwen2.FAMILY, qwen3.FAMILY, qwen3_moe.FAMILY])


def family_named(name: str) -> Family:
    """The family with this name or HF model_type."""
    if name not in FAMILIES:
        known = sorted({f.name for f in FAMILIES.values()})
        raise ToolkitError(f"model family {name!r} is not supported; supported: {', '.join(known)} "
                           "(a family is one file in toolkit/families/, listed in registry.py)")
    return FAMILIES[name]


def family_of_config(config: Any) -> Family:
    """The family of an HF config (object or config.json dict), by its model_type."""
    model_type = config_getter(config)("model_type")
    if not model_type:
        known = sorted({t for f in FAMILIES.values() for t in f.model_types})
        raise ToolkitError(f"the model config has no model_type; add \"model_type\" to config.json (one of: "
                           f"{', '.join(known)})")
    return family_named(model_type)


def dims_from_hf(config: Any, tp: int = 1, divisible_by: int = 128) -> Dims:
    """The conversion dims of an HF config (transformers config object or config.json dict), for its family."""
    return family_of_config(config).dims(config, tp, divisible_by)
