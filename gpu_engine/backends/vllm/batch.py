"""The engine's batch scheduler on vLLM: ``start`` hands admitted requests to vLLM's engine
(``add_request``, the request's steering and monitors in its ``extra_args``), ``step`` runs
one ``LLMEngine.step()`` and feeds each request's new tokens to its own decode state,
``remove`` aborts a request vLLM still runs.  vLLM schedules, batches and pages the KV
cache; this module only routes.

Per request the decode state is the transformers backend's ``Sequence`` (text, stop
strings, holdback, events, ``FinishEvent``), fed tokens vLLM sampled: vLLM is told to stop
on the same token ids (EOS unless ``ignore_eos``, ``stop_token_ids``) and at the same
``max_tokens``; a stop *string* ends the request here and aborts it in vLLM.  A structured
request (``SamplingParams.structured``) carries its grammar to vLLM's own structured
outputs (``gpu_engine.decode.grammar.grammar_text``): vLLM masks that row, and the grammar's
end, an EOS token, ends the request with ``stop``.

Prefix caching: a steered request's blocks are salted with its canonical steering hash
(``wire.steering_salt``; with its prompt's length where a control's phase depends on it),
so it reuses KV only from requests steered identically; a monitored or capturing request,
or one with a conditional control, gets a salt of its own, since a cached prompt row is
never computed and so could not be read (nor its gate reported in ``steering_fired``).

Steering counts (per mode) and conditional controls' fired positions are the workers'
(``take``): the driver's plans of the request only name what it asked for.

Capture: the request's ``CapturePlan`` here allocates nothing (the backend's
``captures_in_workers``); the workers take the rows and the final collect hands their
parts to it, packed into the artifact by ``finish``.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from ...interp.capture import CapturePart
from ...decode.sequence import Sequence
from ...api.errors import InvalidParameter
from ...api.protocol import (
    ActivationRecord,
    FinishEvent,
    GenerationJob,
    LogprobEntry,
    SteeringFired,
    TokenLogprob,
)
from . import wire


class VllmSequence(Sequence):
    # vLLM samples: a structured request's grammar goes to vLLM's own structured outputs
    # (its xgrammar backend), which masks that request's row in vLLM's batch
    samples_here = False

    def __init__(
        self,
        backend: Any,
        job: GenerationJob,
        *,
        prompt_ids: list[int],
        max_tokens: int,
        request_hooks: Any,
        emit: Any,
        should_stop: Any,
    ) -> None:
        super().__init__(
            backend,
            request_id=job.request_id,
            prompt_ids=prompt_ids,
            sampling=job.sampling,
            max_tokens=max_tokens,
            request_hooks=request_hooks,
            emit=emit,
            should_stop=should_stop,
        )
        self.backend = backend
        self.vllm_id = backend.next_request_id(job.request_id)
        extra = wire.request_args(job) if request_hooks is not None else None
        if extra and (extra["monitor"] or extra["capture"] is not None or wire.keeps_gates(extra)):
            self.cache_salt: str | None = f"millm-watch-{self.vllm_id}"
        else:
            steer = wire.steering_salt(extra, backend._generation, n_prompt=len(prompt_ids))
            self.cache_salt = wire.namespaced_salt(steer, job.cache_namespace)
        if job.sampling.structured is not None:
            # the grammar's end is an EOS token (vLLM's grammar ends on its request's stop
            # tokens): it ends the request there, ignore_eos or not, as on transformers
            self.end_ids |= backend.eos_token_ids
        self.params = self._vllm_params(extra)
        self.pending: dict[int, list[ActivationRecord]] = {}
        self.fired: list[SteeringFired] = []
        self.worker_id = self.vllm_id
        self.seen = 0  # tokens of vLLM's output already fed to accept
        self.vllm_done = False
        self.collected = False

    def _vllm_params(self, extra: dict[str, Any] | None) -> Any:
        from vllm import SamplingParams as VllmSampling

        p = self.sampling
        structured = None
        if p.structured is not None:
            from vllm.sampling_params import StructuredOutputsParams

            from ...decode.grammar import grammar_text

            # the grammar every backend enforces (``gpu_engine.decode.grammar``), as EBNF text;
            # a schema xgrammar refuses is response_format_unsupported here, before vLLM
            structured = StructuredOutputsParams(grammar=grammar_text(p.structured))
        try:
            return VllmSampling(
                temperature=p.temperature,
                top_p=p.top_p,
                top_k=p.top_k if p.top_k > 0 else 0,
                seed=None if p.seed is None else p.seed % (2**63),
                repetition_penalty=p.repetition_penalty,
                presence_penalty=p.presence_penalty,
                frequency_penalty=p.frequency_penalty,
                max_tokens=self.max_tokens,
                # checked against the vocabulary by this request's Sampler already
                logit_bias=dict(p.logit_bias) or None,
                # the same end tokens as our own decode state; stop strings are matched here
                ignore_eos=True,
                stop_token_ids=sorted(self.end_ids),
                logprobs=p.top_logprobs if self.want_lp else None,
                # vLLM's prompt_logprobs=k: the prompt token's own entry and the top k
                prompt_logprobs=p.prompt_top_logprobs if p.prompt_logprobs else None,
                detokenize=False,
                structured_outputs=structured,
                extra_args={wire.EXTRA_KEY: extra} if extra else None,
            )
        except (ValueError, TypeError) as exc:
            raise InvalidParameter(
                f"vLLM refuses these sampling parameters: {exc}", param="sampling", details={"backend": "vllm"}
            ) from exc

    def vllm_prompt(self) -> dict[str, Any]:
        out: dict[str, Any] = {"prompt_token_ids": list(self.prompt_ids)}
        if self.cache_salt is not None:
            out["cache_salt"] = self.cache_salt
        return out

    def step_records(self, i: int) -> list[ActivationRecord]:
        return self.pending.pop(i, [])

    def take(self, result: dict[str, Any], *, final: bool) -> None:
        """Records and counts the workers reported for this request."""
        for rec in wire.records_from(result["records"]):
            if not final and rec.token_index is not None and rec.token_index >= len(self.generated):
                self.pending.setdefault(rec.token_index, []).append(rec)
            else:
                self.extra_records.append(rec)
        if final:
            for recs in self.pending.values():
                self.extra_records.extend(recs)
            self.pending.clear()
            self.forwards = int(result["forwards"])
            if self.capture is not None:
                self.capture.receive(
                    [
                        CapturePart(int(p["rank"]), bytes(p["data"]), tuple(p["heads"]), tuple(p["kv_heads"]))
                        for p in result.get("capture", [])
                    ]
                )
            if self.hooks is not None:
                for key, (n, modes) in result["applied"].items():
                    plan = self.hooks.plans.get(key)
                    if plan is not None:
                        plan.count = n
                        plan.mode_counts = {mode: m for mode, m in modes.items() if m}
                self.fired = self._fired(result.get("fired", {}))
            self.collected = True

    def _fired(self, reported: dict[Any, list[Any]]) -> list[SteeringFired]:
        """The workers' fired positions in this request's plan order (the transformers
        backend's order): per attachment with conditional controls, one record per
        conditional control, empty where its gate never opened."""
        out: list[SteeringFired] = []
        for key, plan in self.hooks.plans.items():  # type: ignore[union-attr]
            if not plan.conditional:
                continue
            got = {(int(i), m): p for i, m, p in reported.get(key, [])}
            table = plan.controls
            for j in range(table.size):  # type: ignore[union-attr]
                if table.conditional[j]:  # type: ignore[union-attr]
                    index, mode = table.indices[j], table.modes[j]  # type: ignore[union-attr]
                    out.append(SteeringFired(key[0], key[1], index, mode, sorted(got.get((index, mode), []))))
        return out

    def finish(self) -> FinishEvent:
        event = super().finish()
        # the driver's plans ran no forward: where gates opened is what the workers saw
        event.steering_fired = self.fired
        return event

    def top_entries(self, entries: dict[int, Any]) -> list[LogprobEntry]:
        """A prompt position's top ``prompt_top_logprobs`` entries, best first (vLLM's dict
        also holds the prompt token itself, at its own rank)."""
        n = self.sampling.prompt_top_logprobs
        top = sorted(
            ((int(t), lp) for t, lp in entries.items() if lp.rank is not None and lp.rank <= n),
            key=lambda kv: kv[1].rank,
        )[:n]
        text = self.backend.token_text
        return [LogprobEntry(t, text(t), float(lp.logprob)) for t, lp in top]

    def logprob(self, entries: dict[int, Any] | None, token_id: int) -> TokenLogprob | None:
        if not self.want_lp or not entries:
            return None
        n = self.sampling.top_logprobs
        top = (
            sorted(
                ((int(t), lp) for t, lp in entries.items() if lp.rank is not None and lp.rank <= n),
                key=lambda kv: kv[1].rank,
            )[:n]
            if n
            else []
        )
        text = self.backend.token_text
        return TokenLogprob(
            token_id,
            text(token_id),
            float(entries[token_id].logprob),
            [LogprobEntry(t, text(t), float(lp.logprob)) for t, lp in top],
        )


class VllmBatch:
    """``gpu_engine.runtime.scheduler.BatchBackend`` on vLLM's ``LLMEngine``."""

    def __init__(self, backend: Any, *, max_rows: int) -> None:
        self.backend = backend
        self.max_rows = max_rows
        self.rows: list[VllmSequence] = []
        self.by_id: dict[str, VllmSequence] = {}
        self.steps = 0
        # prompt tokens each recent request found in vLLM's prefix cache (status, tests)
        self.cached_tokens: OrderedDict[str, int] = OrderedDict()

    @property
    def engine(self) -> Any:
        return self.backend.engine

    def kv_usage(self, running: list[Any]) -> dict[str, Any] | None:
        """``ReportsKV``: the paged blocks the running rows fill (vLLM allocates whole
        blocks) × bytes per position (the model's KV heads, head size and dtype), and
        vLLM's blocks × the same where its front end knows their number."""
        geometry = self.backend.attention_geometry
        if geometry is None:
            return None
        cache = getattr(getattr(self.engine, "vllm_config", None), "cache_config", None)
        block = int(getattr(cache, "block_size", None) or 16)
        per_token = (
            self.backend.num_layers * 2 * geometry.num_kv_heads * geometry.head_dim * self.backend.dtype.itemsize
        )
        held = sum(-(-(s.n_prompt + len(s.generated)) // block) * block for s in running)
        blocks = getattr(cache, "num_gpu_blocks", None)
        return {
            "bytes_in_use": int(held * per_token),
            "capacity_bytes": int(blocks * block * per_token) if blocks else None,
            "source": "vllm paged blocks",
        }

    def start(self, seqs: list[VllmSequence]) -> list[VllmSequence]:
        for seq in seqs:
            # vLLM suffixes the id it runs the request under (the workers see that one)
            seq.worker_id = self.engine.add_request(seq.vllm_id, seq.vllm_prompt(), seq.params)
            self.rows.append(seq)
            self.by_id[seq.vllm_id] = seq
        return []  # their first tokens come from the next step

    def step(self) -> list[VllmSequence]:
        # what a score's steps (between ours) produced for our rows comes first; vLLM's
        # outputs are cumulative, so a request's latest one replaces any held
        latest = {out.request_id: out for out in [*self.backend.take_held(), *self.engine.step()]}
        outputs = list(latest.values())
        self.steps += 1
        fresh: list[tuple[VllmSequence, Any]] = []
        for out in outputs:
            seq = self.by_id.get(out.request_id)
            if seq is None or seq.done:
                continue
            if out.finished:
                seq.vllm_done = True
            if out.num_cached_tokens is not None and seq.request_id not in self.cached_tokens:
                self.cached_tokens[seq.request_id] = int(out.num_cached_tokens)
                while len(self.cached_tokens) > 256:
                    self.cached_tokens.popitem(last=False)
            if seq.sampling.prompt_logprobs and seq.prompt_logprobs is None and out.prompt_logprobs:
                ids = seq.prompt_ids
                seq.prompt_logprobs = [None] + [float(d[t].logprob) for d, t in zip(out.prompt_logprobs[1:], ids[1:])]
                if seq.sampling.prompt_top_logprobs:
                    seq.prompt_top_logprobs = [None, *[seq.top_entries(d) for d in out.prompt_logprobs[1:]]]
            fresh.append((seq, out.outputs[0]))
        streaming = [s for s, _ in fresh if s.streaming_monitors]
        if streaming:
            self._collect(streaming, final=False)
        finished: list[VllmSequence] = []
        for seq, comp in fresh:
            tokens = list(comp.token_ids)
            for j in range(seq.seen, len(tokens)):
                lp = seq.logprob(comp.logprobs[j] if comp.logprobs else None, tokens[j])
                if seq.accept_token(int(tokens[j]), lp):
                    finished.append(seq)
                    break
            seq.seen = len(tokens)
            if not seq.done and seq.vllm_done:
                # vLLM ended it (it cannot without us, but never leave a row hanging)
                seq.done = True
                finished.append(seq)
        if finished:
            to_abort = [s.vllm_id for s in finished if not s.vllm_done]
            if to_abort:
                self.engine.abort_request(to_abort)
                for s in finished:
                    s.vllm_done = True
            self._collect(finished, final=True)
        return finished

    def _collect(self, seqs: list[VllmSequence], *, final: bool) -> None:
        results = self.backend.collect([s.worker_id for s in seqs], final=final)
        empty = {"forwards": 0, "applied": {}, "fired": {}, "records": [], "capture": []}
        for s in seqs:
            s.take(results.get(s.worker_id, empty), final=final)
        if final:
            self.backend.refresh_stats()

    def remove(self, seq: VllmSequence) -> None:
        if seq in self.rows:
            self.rows.remove(seq)
        self.by_id.pop(seq.vllm_id, None)
        if not seq.vllm_done:
            self.engine.abort_request([seq.vllm_id])
            seq.vllm_done = True
        if not seq.collected:
            self._collect([seq], final=True)

    def reset(self) -> None:
        ids = [s.vllm_id for s in self.rows if not s.vllm_done]
        if ids and self.engine is not None:
            self.engine.abort_request(ids)
        self.rows = []
        self.by_id = {}


__all__ = ["VllmBatch", "VllmSequence"]
