"""The Mistral family (Mistral-7B v0.1-v0.3): Llama's weights and maths under another model_type. Sliding-window
attention (v0.1's sliding_window: 4096) is refused for a Megatron target and for training, not dropped: those
layers attend to the whole sequence (mapping.refuse_for_megatron). A Hugging Face target keeps it; v0.2/v0.3 set
sliding_window: null."""
from __future__ import annotations

from typing import Any

from toolkit.families import llama
from toolkit.families.mapping import Dims, Family, read_dims, refuse_unhonoured


def dims(config: Any, tp: int = 1, divisible_by: int = 128) -> Dims:
    refuse_unhonoured("mistral", config)
    return read_dims("mistral", config, tp, divisible_by, tied_default=False)


FAMILY = Family(name="mistral", model_types=("mistral",), hf_architecture="MistralForCausalLM", dims=dims,
                layer=llama.layer, embedding=llama.embedding, final_norm=llama.final_norm, output=llama.output,
                hf_config_class="MistralConfig", hf_config_fields={"sliding_window": None},
                modules=llama.MODULES)
