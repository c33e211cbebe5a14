"""Read a model's residual stream after each decoder block, the way the engine hooks it.

Used to calibrate the tiny SAEs and to compute the demo SAE's steering directions. It
hooks block outputs instead of using ``output_hidden_states`` because the last entry
of that tuple is taken after the final norm, which is not what an SAE at the last
layer sees.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


def block_output(output: object) -> torch.Tensor:
    """The hidden-state tensor of a decoder block's output (HF blocks may return tuples)."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, tuple | list) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise TypeError(f"unexpected decoder block output type {type(output).__name__}")


@torch.no_grad()
def residuals_per_text(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    layers_path: str,
    layers: Iterable[int],
    texts: Sequence[str],
    *,
    skip_first: int = 1,
) -> dict[int, list[np.ndarray]]:
    """For each layer, one (tokens, hidden) float32 array per text.

    The first ``skip_first`` positions are dropped: the BOS/attention-sink position has
    an outsized, text-independent residual that would dominate any statistics.
    """
    wanted = sorted(set(layers))
    blocks = model.get_submodule(layers_path)
    captured: dict[int, torch.Tensor] = {}

    def make_hook(layer: int):
        def hook(_module: torch.nn.Module, _inputs: object, output: object) -> None:
            captured[layer] = block_output(output).detach()

        return hook

    handles = [blocks[layer].register_forward_hook(make_hook(layer)) for layer in wanted]
    result: dict[int, list[np.ndarray]] = {layer: [] for layer in wanted}
    try:
        for text in texts:
            enc = tokenizer(text, return_tensors="pt")
            model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"], use_cache=False)
            for layer in wanted:
                acts = captured[layer][0, skip_first:].to(torch.float32).cpu().numpy()
                result[layer].append(acts)
    finally:
        for handle in handles:
            handle.remove()
    return result


def stacked_residuals(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    layers_path: str,
    layers: Iterable[int],
    texts: Sequence[str],
) -> dict[int, np.ndarray]:
    """For each layer, all token positions of all texts stacked into (n, hidden)."""
    per_text = residuals_per_text(model, tokenizer, layers_path, layers, texts)
    return {layer: np.concatenate(arrays, axis=0) for layer, arrays in per_text.items()}
