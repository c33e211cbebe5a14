"""Reading the residual stream after decoder blocks, for ``HiddenStatesJob``.

One scoped object (``BlockOutputs``) installs a forward hook per asked block and removes
them all in ``finally``; the engine's own steering/monitoring hooks are suppressed by the
caller, so what is read is the unsteered model.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from ...api.protocol import HiddenStatesJob, HiddenStatesResult, Usage


@contextmanager
def block_outputs(modules: Mapping[int, torch.nn.Module]) -> Iterator[dict[int, torch.Tensor]]:
    """Yield a dict that each forward fills with ``layer -> block output (batch, T, d)``."""
    seen: dict[int, torch.Tensor] = {}
    handles = []
    try:
        for layer, module in modules.items():

            def hook(_module: Any, _args: Any, output: Any, layer: int = layer) -> None:
                # HF blocks return a tensor or a tuple whose first item is the residual
                seen[layer] = output[0] if isinstance(output, tuple) else output

            handles.append(module.register_forward_hook(hook))
        yield seen
    finally:
        for handle in handles:
            handle.remove()


def run_hidden_states(runner: Any, job: HiddenStatesJob, inputs: Sequence[list[int]]) -> HiddenStatesResult:
    """Each input through the model alone (no padding to reason about), pooled per layer."""
    from .blocks import resolve_hook_module

    modules = {layer: resolve_hook_module(runner.model, layer, "resid_post")[0] for layer in job.layers}
    states: list[list[list[float]]] = []
    total = 0
    with torch.inference_mode(), runner.hooks.suppressed(), block_outputs(modules) as seen:
        for ids in inputs:
            seen.clear()
            input_ids = torch.tensor([list(ids)], dtype=torch.long, device=runner.device)
            runner.model.base_model(input_ids=input_ids, use_cache=False)
            total += len(ids)
            row = []
            for layer in job.layers:
                hidden = seen[layer][0].float()  # (T, d)
                pooled = hidden[-1] if job.pooling == "last" else hidden.mean(dim=0)
                row.append(pooled.cpu().tolist())
            states.append(row)
    return HiddenStatesResult(job.request_id, list(job.layers), states, Usage(total, 0, total))


__all__ = ["block_outputs", "run_hidden_states"]
