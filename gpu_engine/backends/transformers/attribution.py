"""``AttributionJob`` on the transformers backend: the forwards and the one backward.

Three passes over the prompt, each through ``model.forward`` without a KV cache, the
engine's own steering and monitoring hooks suppressed (the model is read unsteered):

1. clean, in inference mode: the last position's logits (the target, when none is
   given, is their argmax: the greedy next token) and the rows the SAE reads;
2. the gradient: a zero tensor added to the rows the SAE writes (so the forward is the
   model's own, exactly) is the leaf; ``torch.autograd.grad`` of the target logit gives
   ``g_p`` at every position. Grad mode is on for this pass only, the model's parameters
   are taken out of the graph for it (nothing upstream of the hook is recorded) and
   handed back as they were; the hook is removed in ``finally``;
3. the ablation check, in inference mode: the prompt as several rows of one forward,
   row 0 clean and row b with feature ``top[b - 1]`` zeroed at every position
   (``interp.attribution.ablation_rows``), in chunks of at most
   ``ABLATION_TOKENS`` tokens.

The engine runs it on its worker, between two steps of the batch (``Engine.attribution``):
nothing of a running request's state (KV slab, hook context) is touched.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from ...api.protocol import AttributionJob, AttributionResult
from ...interp.attribution import ablation_rows, attribute
from .blocks import resolve_hook_module

# the ablation check's forwards take at most this many tokens at once (rows × prompt)
ABLATION_TOKENS = 8192


def _hidden(output: Any) -> torch.Tensor:
    return output[0] if isinstance(output, tuple) else output


def _replace(output: Any, new: torch.Tensor) -> Any:
    return (new, *output[1:]) if isinstance(output, tuple) else new


@contextmanager
def _hooked(runner: Any, module: torch.nn.Module, hook: Any) -> Iterator[None]:
    handle = runner.hooks.register(module, hook)
    try:
        yield
    finally:
        handle.remove()


@contextmanager
def _frozen(model: torch.nn.Module) -> Iterator[None]:
    """The model's parameters out of autograd's graph while inside; as they were after."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    for p in trainable:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p in trainable:
            p.requires_grad_(True)


def _last_logits(runner: Any, input_ids: torch.Tensor) -> torch.Tensor:
    """The last position's logits (rows, vocab) of a forward without a cache."""
    kwargs: dict[str, Any] = {"use_cache": False}
    if runner._has_logits_to_keep:
        kwargs["logits_to_keep"] = 1
    return runner.model(input_ids=input_ids, **kwargs).logits[:, -1]


def run_attribution(
    runner: Any, job: AttributionJob, prompt_ids: list[int], attachment: Any, target_token_id: int | None
) -> AttributionResult:
    sae = attachment.sae
    module, _, read_input = resolve_hook_module(runner.model, attachment.layer, attachment.hook_point)
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=runner.device)
    seen: dict[str, torch.Tensor] = {}

    def read_rows(_module: Any, args: Any, output: Any) -> None:
        seen["read"] = (args[0] if read_input else _hidden(output))[0].detach()

    # 1. clean
    with torch.inference_mode(), runner.hooks.suppressed(), _hooked(runner, module, read_rows):
        clean = _last_logits(runner, ids)[0].float()
    target = int(clean.argmax()) if target_token_id is None else int(target_token_id)
    target_logit = float(clean[target])
    read = seen.pop("read")

    # 2. the gradient at the rows the SAE writes
    leaf: dict[str, torch.Tensor] = {}

    def add_leaf(_module: Any, _args: Any, output: Any) -> Any:
        hidden = _hidden(output)
        zero = torch.zeros_like(hidden, requires_grad=True)
        leaf["zero"] = zero
        return _replace(output, hidden + zero)

    with runner.hooks.suppressed(), _frozen(runner.model), _hooked(runner, module, add_leaf):
        with torch.enable_grad():
            logit = _last_logits(runner, ids)[0, target]
            (grad,) = torch.autograd.grad(logit, leaf["zero"])
    del logit
    grad = grad[0].detach()

    with torch.inference_mode():
        result = attribute(sae, read, grad)
        top = result.top(job.top_n)
    del grad

    # 3. the ablation check of the first ``ablate_top``
    checked = [f.index for f in top[: job.ablate_top]]
    if checked:
        per_chunk = max(1, ABLATION_TOKENS // len(prompt_ids) - 1)
        for lo in range(0, len(checked), per_chunk):
            features = checked[lo : lo + per_chunk]
            rows = len(features) + 1

            def ablate(_module: Any, args: Any, output: Any, features: list[int] = features) -> Any:
                hidden = _hidden(output)
                x = args[0] if read_input else hidden
                delta = ablation_rows(sae, x, features).to(device=hidden.device, dtype=hidden.dtype)
                return _replace(output, hidden - delta)

            with torch.inference_mode(), runner.hooks.suppressed(), _hooked(runner, module, ablate):
                logits = _last_logits(runner, ids.expand(rows, -1))[:, target].float().cpu()
            for j in range(len(features)):
                top[lo + j].ablation_delta = float(logits[j + 1] - logits[0])

    return AttributionResult(
        request_id=job.request_id,
        prompt_token_ids=list(prompt_ids),
        target_token_id=target,
        target_logit=target_logit,
        attributions=result.packed,
        top=top,
        prompt_tokens=[runner.token_text(i) for i in prompt_ids],
        target_token=runner.token_text(target),
    )


__all__ = ["ABLATION_TOKENS", "run_attribution"]
