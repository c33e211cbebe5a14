"""One request's decode state, shared by the serial loop and the batch scheduler.

A ``Sequence`` owns everything that is per request and not a forward pass: its sampler
(own ``torch.Generator``, penalties), incremental detokeniser, stop matcher, EOS set,
logprobs, streaming monitor records, the events it emits and its ``FinishEvent``.  The
serial loop and the batched runner both feed it one sampled token at a time through
``accept``, so a request behaves the same — text, stops, holdback, events — whichever
path ran it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from ..api.errors import InvalidParameter
from ..interp.hooks import RequestHooks
from ..api.protocol import (
    ActivationRecord,
    Distributions,
    FinishEvent,
    LogprobEntry,
    SamplingParams,
    TokenEvent,
    TokenLogprob,
    Usage,
)
from .text import IncrementalDetokenizer, StopMatcher
from .sampling import Sampler

if TYPE_CHECKING:
    from .grammar import Grammars

Emit = Callable[[object], None]


@runtime_checkable
class CompilesGrammars(Protocol):
    """A backend masking structured output in this process: the vocabulary's grammars,
    built once (a backend sampling elsewhere, vLLM, compiles its own there).  Declared
    here, beside its reader, since this layer imports no backend; the runtime asks it with
    ``isinstance`` too."""

    def structured_grammars(self) -> Grammars: ...


def structured_grammar(runner, sampling: SamplingParams):  # type: ignore[no-untyped-def]
    """The request's ``gpu_engine.decode.grammar.RequestGrammar`` (None without
    ``response_format``); a runner without grammars is refused before this by
    ``check_capabilities``."""
    if sampling.structured is None:
        return None
    if not isinstance(runner, CompilesGrammars):
        raise InvalidParameter(f"the {runner.name} backend cannot honour response_format", param="response_format")
    return runner.structured_grammars().matcher(sampling.structured)


def token_logprob(runner, lsm: torch.Tensor, token_id: int, n_top: int) -> TokenLogprob:  # type: ignore[no-untyped-def]
    top: list[LogprobEntry] = []
    if n_top:
        vals, idx = torch.topk(lsm, n_top)
        top = [LogprobEntry(int(i), runner.token_text(int(i)), float(v)) for v, i in zip(vals.tolist(), idx.tolist())]
    return TokenLogprob(token_id, runner.token_text(token_id), float(lsm[token_id]), top)


def prompt_top_entries(
    runner,
    vals: list[list[float]],
    idx: list[list[int]],  # type: ignore[no-untyped-def]
) -> list[list[LogprobEntry]]:
    """Per prompt position, its top entries (best first) from parallel value/id rows;
    each token's text decoded once (the same few tokens recur across positions)."""
    texts: dict[int, str] = {}

    def text(t: int) -> str:
        if t not in texts:
            texts[t] = runner.token_text(t)
        return texts[t]

    return [[LogprobEntry(int(i), text(int(i)), float(v)) for v, i in zip(vs, ids)] for vs, ids in zip(vals, idx)]


class Sequence:
    """Per-request decode state (see the module doc)."""

    # whether this process chooses the tokens (its ``Sampler`` masks them with the request's
    # grammar); a backend sampling elsewhere enforces the grammar there
    samples_here = True

    def __init__(
        self,
        runner,  # type: ignore[no-untyped-def]  # the backend's runner (tokeniser, EOS ids, vocab, device)
        *,
        request_id: str,
        prompt_ids: list[int],
        sampling: SamplingParams,
        max_tokens: int,
        request_hooks: RequestHooks | None,
        emit: Emit,
        should_stop: Callable[[], bool],
        exclusive: bool = False,
        distributions_from: int | None = None,
    ) -> None:
        self.runner = runner
        self.request_id = request_id
        self.prompt_ids = list(prompt_ids)
        self.n_prompt = len(prompt_ids)
        self.sampling = sampling
        self.max_tokens = max_tokens
        self.hooks = request_hooks
        self.emit = emit
        self.should_stop = should_stop
        self.exclusive = exclusive
        # GenerationJob.distributions_from: the prefill's log-softmax rows predicting prompt
        # tokens from there on travel in the finish (checked against the prompt by the runtime)
        self.distributions_from = distributions_from
        self.distributions: Distributions | None = None
        device = runner.device
        self.prompt = torch.tensor([prompt_ids], dtype=torch.long, device=device)
        # response_format: this request's grammar matcher (compiled, or refused, now)
        self.grammar = structured_grammar(runner, sampling) if self.samples_here else None
        self.sampler = Sampler(
            sampling, vocab_size=runner.vocab_size, device=device, prompt_ids=self.prompt, grammar=self.grammar
        )
        self.detok = IncrementalDetokenizer(runner.tokenizer, prompt_ids)
        self.stopper = StopMatcher(sampling.stop)
        self.end_ids = set(sampling.stop_token_ids)
        if not sampling.ignore_eos:
            self.end_ids |= runner.eos_token_ids
        self.want_lp = sampling.logprobs or sampling.top_logprobs > 0
        monitors = request_hooks.monitors() if request_hooks is not None else []
        self.monitoring = bool(monitors)
        self.streaming_monitors = any(m.stream for m in monitors)
        # conditional controls: the batch lists this request's rows so their gates are kept
        self.gated = request_hooks is not None and request_hooks.conditional
        self.capture = request_hooks.capture if request_hooks is not None else None  # CapturePlan
        self.text = ""
        self.emitted = 0
        self.generated: list[int] = []
        self.extra_records: list[ActivationRecord] = []
        self.ahead_records: list[ActivationRecord] = []
        self.speculative: Any = None  # protocol.SpeculativeStats, on a speculative model
        self.prompt_logprobs: list[float | None] | None = None
        self.prompt_top_logprobs: list[list[LogprobEntry] | None] | None = None
        self.finish_reason = "length"
        self.forwards = 0
        self.done = False
        # batched path: delta-table slot and the attachments this request steers
        self.slot = -1
        self.steered_keys: list = []
        self.control_keys: list = []
        self.capture_armed = False

    @property
    def steered(self) -> bool:
        return self.hooks is not None and any(p.steers for p in self.hooks.plans.values())

    @property
    def last_token(self) -> int:
        return self.generated[-1]

    @property
    def echo_from(self) -> int | None:
        """The first prompt row whose logits the prefill must return (``echo_logprobs``
        reads rows from there to the last): 0 for ``prompt_logprobs``, the row before
        ``distributions_from`` for distributions; None when only the last row is needed."""
        if self.sampling.prompt_logprobs:
            return 0
        if self.distributions_from is not None:
            return self.distributions_from - 1
        return None

    @property
    def echo_rows(self) -> int:
        """How many of the prompt's last rows' logits the prefill must return (0: the
        last row's only, as every step)."""
        start = self.echo_from
        return 0 if start is None else self.n_prompt - start

    def echo_logprobs(self, logits: torch.Tensor) -> None:
        """What a request reads from its prefill's logits (``logits``: the prompt's last
        rows, at least ``echo_rows`` of them; row j - 1 predicts prompt token j): the prompt
        log-probabilities (``prompt_logprobs``) with the top ``prompt_top_logprobs``
        alternatives at each position, and the full log-softmax rows from
        ``distributions_from`` on (``Distributions``)."""
        if self.sampling.prompt_logprobs:
            if logits.shape[0] < self.n_prompt:
                raise RuntimeError(f"prompt logprobs need {self.n_prompt} rows of logits, got {logits.shape[0]}")
            lsm_all = torch.log_softmax(logits[-self.n_prompt : -1].float(), dim=-1)
            picked = lsm_all.gather(1, self.prompt[0, 1:].unsqueeze(1)).squeeze(1)
            self.prompt_logprobs = [None, *[float(v) for v in picked.tolist()]]
            k = min(self.sampling.prompt_top_logprobs, lsm_all.shape[-1])
            if k:
                vals, idx = torch.topk(lsm_all, k, dim=-1)
                self.prompt_top_logprobs = [None, *prompt_top_entries(self.runner, vals.tolist(), idx.tolist())]
        start = self.distributions_from
        if start is not None:
            rows = self.n_prompt - start
            if logits.shape[0] < rows + 1:
                raise RuntimeError(f"distributions need {rows + 1} rows of logits, got {logits.shape[0]}")
            lsm = torch.log_softmax(logits[-rows - 1 : -1].float(), dim=-1)
            self.distributions = Distributions(
                start=start,
                rows=rows,
                vocab=int(lsm.shape[-1]),
                logprobs=lsm.cpu().numpy().astype("<f4", copy=False).tobytes(),
            )

    def accept(self, token_id: int, lsm: torch.Tensor | None) -> bool:
        """Take the token sampled for this request; emit its event.  True when finished."""
        lp = token_logprob(self.runner, lsm, token_id, self.sampling.top_logprobs) if lsm is not None else None
        return self.accept_token(token_id, lp)

    def step_records(self, i: int) -> list[ActivationRecord]:
        """The streaming monitor records that travel with token ``i``: earlier ones (prompt
        rows) wait for the end, later ones (a speculative verification's rows) for their
        own token."""
        records: list[ActivationRecord] = []
        if self.streaming_monitors:
            ahead: list[ActivationRecord] = []
            for rec in [*self.ahead_records, *self.hooks.collect()]:  # type: ignore[union-attr]
                if rec.token_index == i:
                    records.append(rec)
                elif rec.token_index is not None and rec.token_index > i:
                    ahead.append(rec)
                else:
                    self.extra_records.append(rec)
            self.ahead_records = ahead
        return records

    def accept_token(self, token_id: int, lp: TokenLogprob | None) -> bool:
        """``accept`` with the token's logprob entry already built (a backend whose
        sampler runs elsewhere reports it).  True when finished."""
        i = len(self.generated)
        self.generated.append(token_id)
        records = self.step_records(i)
        is_end = token_id in self.end_ids
        if self.grammar is not None:
            self.grammar.accept(token_id)
            # the grammar's end is an EOS token, allowed by the mask only there
            is_end = is_end or self.grammar.terminated
        delta = "" if is_end else self.detok.step(token_id)
        text = self.text
        if delta:
            new_from = len(text)
            text += delta
            cut = self.stopper.find(text, new_from)
            if cut != -1:
                text = text[:cut]
                is_end = True
        if is_end:
            self.finish_reason = "stop"
        last_step = is_end or i + 1 == self.max_tokens
        if last_step and not is_end:
            text += self.detok.flush()
        release = len(text) if last_step else len(text) - self.stopper.holdback(text)
        piece = text[self.emitted : release] if release > self.emitted else ""
        self.emitted = max(self.emitted, release)
        self.text = text
        prompt_text = self.prompt_text() if i == 0 and self.sampling.token_texts else None
        self.emit(TokenEvent(self.request_id, i, token_id, piece, lp, records, prompt_text))
        self.done = last_step
        return last_step

    def prompt_text(self) -> str:
        return self.runner.tokenizer.decode(
            self.prompt_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False
        )

    def cancel(self) -> None:
        self.finish_reason = "cancelled"
        self.done = True

    def finish(self) -> FinishEvent:
        """Encode buffered monitor rows and build the ``FinishEvent``; a capture's rows are
        drained to the host here (and packed here too unless the runtime packs them on
        its capture writer: ``CapturePlan.finish``)."""
        if self.monitoring:
            if self.speculative is not None and self.speculative.used:
                # rows past the last fed token (drafts verified after the end) never count
                self.hooks.rewind(self.n_prompt + max(len(self.generated) - 1, 0))  # type: ignore[union-attr]
            with torch.inference_mode():
                self.extra_records.extend(self.hooks.finalize())  # type: ignore[union-attr]
        counts = self.hooks.steering_counts() if self.hooks is not None else []
        fired = self.hooks.steering_fired() if self.hooks is not None and self.hooks.conditional else []
        n = len(self.generated)
        texts = self.sampling.token_texts
        return FinishEvent(
            request_id=self.request_id,
            finish_reason=self.finish_reason,
            text=self.text,
            token_ids=list(self.generated),
            usage=Usage(self.n_prompt, n, self.n_prompt + n),
            prompt_token_ids=list(self.prompt_ids),
            prompt_logprobs=self.prompt_logprobs,
            prompt_top_logprobs=self.prompt_top_logprobs,
            distributions=self.distributions,
            activations=self.extra_records,
            steering_apply_count=counts,
            steering_fired=fired,
            # None while the engine's capture writer packs it (``CapturePlan.deferred``)
            capture=self.capture.finish(prompt_ids=self.prompt_ids, generated=self.generated, steering_counts=counts)
            if self.capture is not None
            else None,
            forward_passes=self.forwards,
            speculative=self.speculative,
            prompt_text=self.prompt_text() if texts else None,
            prompt_tokens=[self.runner.token_text(t) for t in self.prompt_ids] if texts else [],
            tokens=[self.runner.token_text(t) for t in self.generated] if texts else [],
        )


__all__ = ["CompilesGrammars", "Sequence", "prompt_top_entries", "structured_grammar", "token_logprob"]
