"""The decoder architectures miLLM knows: per checkpoint architecture class
(``config.architectures[0]``), the attribute paths of its decoder-block list.

Torch-free and free of any backend, so that ``model_dir`` (reading a model directory for the
web) can say whether a checkpoint is supported without importing a backend; the
transformers backend resolves blocks with the same table
(``gpu_engine.backends.transformers.blocks``).  More than one candidate path covers layout
changes between transformers versions.
"""

from __future__ import annotations

_DECODER_LAYERS = ("model.layers",)

BLOCK_LIST_PATHS: dict[str, tuple[str, ...]] = {
    "LlamaForCausalLM": _DECODER_LAYERS,
    "MistralForCausalLM": _DECODER_LAYERS,
    "Qwen2ForCausalLM": _DECODER_LAYERS,
    "Qwen3ForCausalLM": _DECODER_LAYERS,
    "GemmaForCausalLM": _DECODER_LAYERS,
    "Gemma2ForCausalLM": _DECODER_LAYERS,
    "Gemma3ForCausalLM": _DECODER_LAYERS,
    "Gemma3ForConditionalGeneration": ("model.language_model.layers", "language_model.model.layers"),
    "PhiForCausalLM": _DECODER_LAYERS,
    "Phi3ForCausalLM": _DECODER_LAYERS,
    "GPT2LMHeadModel": ("transformer.h",),
    "GPTNeoXForCausalLM": ("gpt_neox.layers",),
}


def is_supported_architecture(architecture_class: str) -> bool:
    return architecture_class in BLOCK_LIST_PATHS


__all__ = ["BLOCK_LIST_PATHS", "is_supported_architecture"]
