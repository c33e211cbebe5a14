"""The serial decode loop: prefill, then one token per forward pass with a KV cache.

Sampling is ours (``Sampler``) rather than ``model.generate`` so that a step costs one
forward, one sample and one host sync (the token id, needed for EOS/stop detection and
streaming), and so that cancel and stop sequences take effect before the next forward.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ...hooks import BatchContext, HookManager, RequestHooks, Segment
from ...protocol import (
    ActivationRecord,
    FinishEvent,
    LogprobEntry,
    SamplingParams,
    SteeringCount,
    TokenEvent,
    TokenLogprob,
    Usage,
)
from ...text import IncrementalDetokenizer, StopMatcher
from .runner import TransformersRunner
from .sampling import Sampler

Emit = Callable[[object], None]


def _logprob(runner: TransformersRunner, lsm: torch.Tensor, token_id: int, n_top: int) -> TokenLogprob:
    top: list[LogprobEntry] = []
    if n_top:
        vals, idx = torch.topk(lsm, n_top)
        top = [LogprobEntry(int(i), runner.token_text(int(i)), float(v)) for v, i in zip(vals.tolist(), idx.tolist())]
    return TokenLogprob(token_id, runner.token_text(token_id), float(lsm[token_id]), top)


def run_generation(
    runner: TransformersRunner,
    *,
    request_id: str,
    prompt_ids: list[int],
    sampling: SamplingParams,
    max_tokens: int,
    hook_manager: HookManager,
    request_hooks: RequestHooks | None,
    should_stop: Callable[[], bool],
    emit: Emit,
) -> FinishEvent:
    device = runner.device
    n_prompt = len(prompt_ids)
    prompt = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    sampler = Sampler(sampling, vocab_size=runner.vocab_size, device=device, prompt_ids=prompt)
    detok = IncrementalDetokenizer(runner.tokenizer, prompt_ids)
    stopper = StopMatcher(sampling.stop)
    end_ids = set(sampling.stop_token_ids)
    if not sampling.ignore_eos:
        end_ids |= runner.eos_token_ids
    want_lp = sampling.logprobs or sampling.top_logprobs > 0
    monitoring = request_hooks is not None and bool(request_hooks.monitors())
    streaming_monitors = monitoring and any(m.stream for m in request_hooks.monitors())  # type: ignore[union-attr]

    segment = Segment(request_hooks, 0, n_prompt, 0) if request_hooks is not None else None
    ctx = BatchContext([segment]) if segment is not None else None

    text = ""
    emitted = 0
    generated: list[int] = []
    extra_records: list[ActivationRecord] = []
    prompt_logprobs: list[float | None] | None = None
    finish_reason = "length"
    forwards = 0
    input_ids = prompt
    cache_position = torch.arange(n_prompt, device=device)
    past = None

    with torch.inference_mode(), hook_manager.active(ctx):
        for i in range(max_tokens):
            if should_stop():
                finish_reason = "cancelled"
                break
            if segment is not None:
                segment.row_end = input_ids.shape[1]
                segment.start_position = n_prompt + i - 1 if i else 0
            echo = i == 0 and sampling.prompt_logprobs
            logits, past = runner.forward(input_ids, past, cache_position=cache_position, all_logits=echo)
            forwards += 1
            if echo:
                lsm_all = torch.log_softmax(logits[:-1].float(), dim=-1)
                picked = lsm_all.gather(1, prompt[0, 1:].unsqueeze(1)).squeeze(1)
                prompt_logprobs = [None, *[float(v) for v in picked.tolist()]]
            last = logits[-1]
            token = sampler.sample(last)
            sampler.observe(token)
            input_ids = token.view(1, 1)
            cache_position = cache_position[-1:] + 1
            lsm = torch.log_softmax(last.float(), dim=-1) if want_lp else None

            token_id = int(token)  # the one host sync per step
            generated.append(token_id)
            lp = _logprob(runner, lsm, token_id, sampling.top_logprobs) if lsm is not None else None
            records: list[ActivationRecord] = []
            if streaming_monitors:
                for rec in request_hooks.collect():  # type: ignore[union-attr]
                    (records if rec.token_index == i else extra_records).append(rec)

            is_end = token_id in end_ids
            delta = "" if is_end else detok.step(token_id)
            if delta:
                new_from = len(text)
                text += delta
                cut = stopper.find(text, new_from)
                if cut != -1:
                    text = text[:cut]
                    is_end = True
            if is_end:
                finish_reason = "stop"
            last_step = is_end or i + 1 == max_tokens
            if last_step and not is_end:
                text += detok.flush()
            release = len(text) if last_step else len(text) - stopper.holdback(text)
            piece = text[emitted:release] if release > emitted else ""
            emitted = max(emitted, release)
            emit(TokenEvent(request_id, i, token_id, piece, lp, records))
            if last_step:
                break

    if monitoring:
        with torch.inference_mode():
            extra_records.extend(request_hooks.finalize())  # type: ignore[union-attr]
    counts = request_hooks.steering_counts() if request_hooks is not None else {}
    return FinishEvent(
        request_id=request_id,
        finish_reason=finish_reason,
        text=text,
        token_ids=generated,
        usage=Usage(n_prompt, len(generated), n_prompt + len(generated)),
        prompt_token_ids=list(prompt_ids),
        prompt_logprobs=prompt_logprobs,
        activations=extra_records,
        steering_apply_count=[SteeringCount(k[0], k[1], c) for k, c in counts.items()],
        forward_passes=forwards,
    )


__all__ = ["run_generation"]
