"""The engine facade: one resident model, SAE attachments, per-request steering/monitoring.

All model work (forward passes, hook installation, loads) runs on one worker thread, fed
by a priority queue: control operations (load, unload, attach, detach) go ahead of queued
work but wait for the generation in flight, which is how attach/detach "drain" before
touching hooks.  Every wait a caller makes on the worker is bounded.  The web tier calls
this object directly (embedded mode) or through a transport that carries the protocol
dataclasses (``run_engine``); admission and backpressure are the caller's job.

With ``BatchingOptions(enabled=True)`` generations go to a ``BatchScheduler`` instead of
running one by one: the worker alternates between the queue's tasks and one batch step
at a time (blocking on the queue only when the batch is empty, so an idle batch costs
nothing), and a control operation first drains the running batch — no admissions,
bounded by the caller's wait — before it touches hooks or weights.

The facade is built in layers, one module each: the worker thread and its queue
(``worker``), what it reports (``status``), what is resident and how it changes
(``loading``), and here the work itself: generations (serial or batched, structured ones
after their grammar is built off the worker), embeddings, scores and hidden states.
Apart from it: the ledger of accepted work and draining it (``drain``), preparing a
request for the model (``prepare``), an attached SAE (``attachments``), and the thread
that packs and writes finished captures before their requests' final events
(``capture_writer``; ``capture_writer=`` takes one built by the caller, as tests do).
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from ..api.commands import check_implements
from ..backends.base import ComputesAttribution, ReadsHiddenStates
from ..decode.sequence import CompilesGrammars
from ..api.errors import (
    ContextLengthExceeded,
    EngineBusy,
    EngineError,
    EngineShutdown,
    GenerationFailed,
    InsufficientMemory,
    InvalidParameter,
    SAENotAttached,
)
from ..interp.hooks import HookManager
from ..interp.logits import feature_logit_effects
from ..api.protocol import (
    AttributionJob,
    AttributionResult,
    BatchingOptions,
    EmbedJob,
    EmbedResult,
    EngineEvent,
    ErrorEvent,
    FeatureLogitsJob,
    FeatureLogitsResult,
    FinishEvent,
    GenerationJob,
    GenerationResult,
    HiddenStatesJob,
    HiddenStatesResult,
    ScoreJob,
    ScoreResult,
    StructuredOutput,
    TokenizeJob,
    TokenizeResult,
    Usage,
)
from . import prepare
from .attachments import Attachment, is_out_of_memory
from .capture_writer import CaptureWriter, deliver
from .drain import WorkLedger
from ..decode.prefix_cache import prefix_kwargs
from .loading import ModelLoading
from ..api import tracing
from .scheduler import BatchScheduler, StepFigures
from .stream import GenerationStream
from .worker import _WORK, Arrival, _priority

if TYPE_CHECKING:
    from ..decode.grammar import GrammarBuilder

log = logging.getLogger("gpu_engine")

DEFAULT_DRAIN_TIMEOUT_S = 30.0
# STRUCTURED_COMPILE_TIMEOUT_S: the longest a request's grammar may take to build
DEFAULT_STRUCTURED_TIMEOUT_S = 10.0


class Engine(ModelLoading):
    """One resident model and the work on it (see the module doc); built once per process
    (``core.engine_client`` embedded, ``run_engine`` behind Redis)."""

    def __init__(
        self,
        *,
        on_event: Callable[[EngineEvent], None] | None = None,
        drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S,
        batching: BatchingOptions | None = None,
        idle_release_s: float | None = None,
        structured_timeout_s: float = DEFAULT_STRUCTURED_TIMEOUT_S,
        capture_writer: CaptureWriter | None = None,
    ) -> None:
        self.on_event = on_event
        self.drain_timeout_s = drain_timeout_s
        # TRANSFORMERS_IDLE_CACHE_RELEASE_S: after this many idle seconds the worker hands
        # the memory the backend keeps between requests back (None or negative: never)
        self.idle_release_s = idle_release_s if idle_release_s is not None and idle_release_s >= 0 else None
        self._used_since_release = False
        self._memory = {"idle_releases": 0, "released_bytes": 0}
        self.batching = batching or BatchingOptions()
        self._scheduler = None
        self._backend_scheduler = False
        # finished captures are packed and written here, off the worker (capture_writer)
        self._capture_writer = capture_writer if capture_writer is not None else CaptureWriter()
        # step time and tokens, batched or serial (engine metrics: status ``batching``)
        self._steps = StepFigures()
        if self.batching.enabled:
            self._scheduler = BatchScheduler(
                self.batching,
                make_sequence=self._make_sequence,
                classify=self._classify,
                writer=self._capture_writer,
                figures=self._steps,
            )
        self._queue = queue.PriorityQueue()
        self._seq = itertools.count()
        self._backend = None
        self._model_id = None
        self._load_job = None
        self._hooks = HookManager()
        self._attachments = {}
        self._in_flight = 0
        self._queued = 0
        # requests announced by the serving tier and not submitted yet (``arriving``), and
        # the worker's wait for them before an idle batch's first prefill (``_gather_wait``)
        self._arriving = 0
        self._gather_from = None
        self._gather_until = None
        self._gathers = {"gathers": 0, "gather_wait_ms": 0.0}
        self._closed = False
        # guards the attachment table and the counters, which status readers on other
        # threads look at while the worker changes them
        self._state_lock = threading.Lock()
        # Work accepted and not finished, whoever sent it: an unload or a model swap
        # drains it first (runtime/drain.py)
        self._ledger = WorkLedger()
        # structured requests build their grammar here before they reach the worker
        # (``_prepare_structured``): built lazily, xgrammar is imported only then
        self.structured_timeout_s = structured_timeout_s
        self._grammar_builder = None
        self._grammar_threads = None
        # one feature_logits product at a time (it runs on its caller's thread)
        self._logits_lock = threading.Lock()
        self._thread = threading.Thread(target=self._worker, name="millm-engine", daemon=True)
        self._thread.start()

    def _run_generation(self, job: GenerationJob, stream: GenerationStream) -> None:
        if self._scheduler is not None:  # queued before a batch-only backend was loaded
            self._enqueue(job, stream)
            return
        with self._state_lock:
            self._in_flight += 1
        try:
            if stream.cancelled:
                stream._put(FinishEvent(job.request_id, "cancelled", "", [], Usage()))
                return
            backend = self._require_backend()
            prepare.check_capabilities(backend, job)
            prompt_ids = prepare.prompt_ids(backend, job)
            max_tokens = prepare.token_budget(backend, job, len(prompt_ids))
            hooks = prepare.request_hooks(backend, self._attachments, job, len(prompt_ids))
            hooks = prepare.with_capture(backend, job, hooks, len(prompt_ids), max_tokens)
            capture = hooks.capture if hooks is not None else None
            if capture is not None:
                capture.deferred = True  # packed by the capture writer, after the rows are drained
            finish = backend.generate(
                request_id=job.request_id,
                prompt_ids=prompt_ids,
                sampling=job.sampling,
                max_tokens=max_tokens,
                request_hooks=hooks,
                should_stop=stream._cancel.is_set,
                emit=self._steps.timed(stream._put),
                distributions_from=job.distributions_from,
                **prefix_kwargs(backend, job, prompt_ids),
            )
            deliver(self._capture_writer, capture, finish, stream._put)
        except EngineError as exc:
            stream._put(ErrorEvent(job.request_id, exc.code, exc.message, exc.details))
        except Exception as exc:
            if is_out_of_memory(exc):
                self._handle_oom(exc)
                err: EngineError = InsufficientMemory(
                    "out of memory during generation; attached SAEs were detached, the base model keeps serving"
                )
            else:
                log.exception("generation %s failed", job.request_id)
                err = GenerationFailed(f"generation failed: {type(exc).__name__}: {exc}")
            stream._put(ErrorEvent(job.request_id, err.code, err.message, err.details))
        finally:
            with self._state_lock:
                self._in_flight -= 1

    def _make_sequence(self, job: GenerationJob, stream: GenerationStream) -> Any:
        """Validate a job against the loaded model and build its decode state (batched path;
        runs on the worker when the request gets a row, like the serial path's checks)."""
        backend = self._require_backend()
        prepare.check_capabilities(backend, job)
        prompt_ids = prepare.prompt_ids(backend, job)
        max_tokens = prepare.token_budget(backend, job, len(prompt_ids))
        hooks = prepare.request_hooks(backend, self._attachments, job, len(prompt_ids))
        hooks = prepare.with_capture(backend, job, hooks, len(prompt_ids), max_tokens)
        return backend.new_sequence(
            job,
            prompt_ids=prompt_ids,
            max_tokens=max_tokens,
            request_hooks=hooks,
            emit=stream._put,
            should_stop=stream._cancel.is_set,
            **prefix_kwargs(backend, job, prompt_ids),
        )

    def _enqueue(self, job: GenerationJob, stream: GenerationStream) -> None:
        try:
            self._scheduler.enqueue(job, stream)  # type: ignore[union-attr]
        except EngineError as exc:
            stream._put(ErrorEvent(job.request_id, exc.code, exc.message, exc.details))

    def generate(self, job: GenerationJob) -> GenerationStream:
        """Queue a generation; returns at once with a stream of its events."""
        stream = GenerationStream(job.request_id, on_end=self._traced(job) or self._ledger.ended)
        refused = self._ledger.admit(stream)
        if refused is not None:
            stream._put(ErrorEvent(job.request_id, refused.code, refused.message, refused.details))
            return stream

        def dropped() -> None:
            err = EngineShutdown("the engine shut down before the request ran")
            stream._put(ErrorEvent(job.request_id, err.code, err.message, {}))

        if job.sampling.structured is not None:
            self._prepare_structured(job, stream, dropped)
        else:
            self._submit_generation(job, stream, dropped)
        return stream

    def _traced(self, job: GenerationJob) -> Callable[[GenerationStream], None] | None:
        """OTEL_ENABLED: the job's span (from its arrival here to its last event), a child of
        the web request's; the stream's end ends it. None when tracing is off."""
        steering = job.steering
        span = tracing.start_job_span(
            "millm.engine.generate",
            job.traceparent,
            {
                "millm.request_id": job.request_id,
                "millm.steering_hash": steering.canonical_hash() if steering and not steering.is_empty() else None,
                "millm.model": self._model_id,
                "millm.priority": job.priority,
            },
        )
        if span is None:
            return None
        ended = self._ledger.ended

        def end(stream: GenerationStream) -> None:
            span.end()
            ended(stream)

        return end

    def _submit_generation(self, job: GenerationJob, stream: GenerationStream, dropped: Callable[[], None]) -> None:
        if self._scheduler is not None:
            self._submit(lambda: self._enqueue(job, stream), _WORK, on_drop=dropped)
        else:
            self._submit(lambda: self._run_generation(job, stream), _priority(job.priority), on_drop=dropped)

    def _builder(self) -> GrammarBuilder:
        # here, not at the top: it imports xgrammar, which only a structured request needs
        from ..decode.grammar import GRAMMAR_WORKERS, GrammarBuilder

        with self._state_lock:
            if self._grammar_builder is None:
                self._grammar_builder = GrammarBuilder(timeout_s=self.structured_timeout_s)
                # one more thread than children: a request waiting for a free child
                # still counts its own deadline
                self._grammar_threads = ThreadPoolExecutor(GRAMMAR_WORKERS + 1, thread_name_prefix="millm-grammar")
            return self._grammar_builder

    def build_grammar(self, spec: StructuredOutput) -> None:
        """Build ``spec``'s grammar now, on the caller's thread (the web tier asks before a
        structured request takes an admission slot, so a costly schema holds no slot while
        it builds); ``SchemaTooComplex`` past ``structured_timeout_s``,
        ``ResponseFormatUnsupported`` for a schema xgrammar refuses.  The request's own
        ``generate`` then finds it built."""
        if self._closed:
            raise EngineShutdown("the engine is shut down")
        self._builder().build(spec)

    def _prepare_structured(self, job: GenerationJob, stream: GenerationStream, dropped: Callable[[], None]) -> None:
        """Build the request's grammar off the worker thread, then queue the request: a
        costly schema (xgrammar spends seconds to minutes on long regex repetitions) never
        holds the generation of others, and one not built within ``structured_timeout_s``
        ends as ``schema_too_complex`` (``gpu_engine.decode.grammar.GrammarBuilder``)."""
        builder, threads = self._builder(), self._grammar_threads

        def build_then_queue() -> None:
            spec = job.sampling.structured
            try:
                if not stream.cancelled:
                    builder.build(spec)
                    backend = self._backend
                    if isinstance(backend, CompilesGrammars):
                        # the vocabulary's masks too (fast: xgrammar compiles from the
                        # grammar just built); vLLM compiles its own from the same grammar
                        backend.structured_grammars().compile(spec)
            except EngineError as exc:
                stream._put(ErrorEvent(job.request_id, exc.code, exc.message, exc.details))
                return
            except Exception as exc:  # noqa: BLE001 - this request's failure, reported on its stream
                log.exception("building the grammar of %s failed", job.request_id)
                err = GenerationFailed(f"building the grammar failed: {type(exc).__name__}: {exc}")
                stream._put(ErrorEvent(job.request_id, err.code, err.message, err.details))
                return
            try:
                self._submit_generation(job, stream, dropped)
            except EngineShutdown:
                dropped()

        try:
            threads.submit(build_then_queue)  # type: ignore[union-attr]
        except RuntimeError:  # the pool was shut down with the engine
            dropped()

    def generate_sync(self, job: GenerationJob, *, timeout_s: float | None = None) -> GenerationResult:
        return self.generate(job).result(timeout_s)

    def embed(self, job: EmbedJob, *, timeout_s: float | None = None) -> EmbedResult:
        def op() -> EmbedResult:
            backend = self._require_backend()
            if not backend.capabilities().embeddings:
                raise InvalidParameter(
                    f"the {backend.name} backend does not compute embeddings",
                    param="input",
                    details={"backend": backend.name, "capability": "embeddings"},
                )
            inputs = prepare.encode_inputs(backend, job.inputs, "input")
            return backend.embed(job, inputs)

        return self._work(op, timeout_s, job.priority)

    def score(self, job: ScoreJob, *, timeout_s: float | None = None) -> ScoreResult:
        def op() -> ScoreResult:
            backend = self._require_backend()
            if not backend.capabilities().scoring:
                raise InvalidParameter(
                    f"the {backend.name} backend does not score prompts",
                    param="prompt",
                    details={"backend": backend.name, "capability": "scoring"},
                )
            if job.prompt_token_ids is not None:
                ids = prepare.encode_inputs(backend, [list(job.prompt_token_ids)], "prompt")[0]
            elif job.messages is not None:
                ids = backend.encode_messages(job.messages, add_generation_prompt=True, **job.chat_template_kwargs)
                ids = prepare.encode_inputs(backend, [ids], "messages")[0]
            else:
                ids = prepare.encode_inputs(backend, [job.prompt], "prompt", job.add_special_tokens)[0]
            if job.allowed_token_ids is not None:
                prepare.validate_ids(backend, job.allowed_token_ids, "allowed_token_ids")
            return backend.score(job, ids)

        return self._work(op, timeout_s)

    def hidden_states(self, job: HiddenStatesJob, *, timeout_s: float | None = None) -> HiddenStatesResult:
        """Pooled residuals after the given blocks, unsteered (``HiddenStatesJob``); a
        backend that cannot read them (capability ``hidden_states`` off) refuses."""

        def op() -> HiddenStatesResult:
            backend = self._require_backend()
            if not backend.capabilities().hidden_states or not isinstance(backend, ReadsHiddenStates):
                raise InvalidParameter(
                    f"the {backend.name} backend cannot return hidden states "
                    "(computing a steering vector needs the transformers backend)",
                    param="layers",
                    details={"backend": backend.name, "capability": "hidden_states"},
                )
            for layer in job.layers:
                if layer >= backend.num_layers:
                    raise InvalidParameter(
                        f"layer {layer} is out of range: the model has {backend.num_layers} "
                        f"decoder blocks (0..{backend.num_layers - 1})",
                        param="layers",
                        details={"layer": layer, "num_layers": backend.num_layers},
                    )
            inputs = prepare.encode_inputs(backend, job.inputs, "inputs", job.add_special_tokens)
            return backend.hidden_states(job, inputs)

        return self._work(op, timeout_s, job.priority)

    def tokenize(self, job: TokenizeJob, *, timeout_s: float | None = None) -> TokenizeResult:
        """The loaded tokenizer's ids of each text (``TokenizeJob``)."""

        def op() -> TokenizeResult:
            backend = self._require_backend()
            add = job.add_special_tokens
            return TokenizeResult(job.request_id, [backend.encode_text(t, add_special_tokens=add) for t in job.texts])

        return self._work(op, timeout_s)

    def _attached(self, sae_id: str, layer: int) -> Attachment:
        """The attachment of ``sae_id`` at ``layer``, read under the state lock;
        ``SAENotAttached`` when there is none."""
        with self._state_lock:
            att = self._attachments.get((sae_id, layer))
        if att is None:
            raise SAENotAttached(
                f"SAE {sae_id!r} is not attached at layer {layer}",
                details={"sae_id": sae_id, "layer": layer},
            )
        return att

    def feature_logits(self, job: FeatureLogitsJob, *, timeout_s: float | None = None) -> FeatureLogitsResult:
        """Each feature's decoder row through the model's unembedding, its ``top_n``
        highest and lowest entries (``FeatureLogitsJob``).  The worker resolves the SAE
        and the unembedding and later decodes the tokens; the product itself runs on the
        caller's thread, one call at a time, so a long one never stalls the batch."""

        def resolve() -> tuple[Any, Any, Any]:
            backend = self._require_backend()
            att = self._attached(job.sae_id, job.layer)
            sae = att.sae
            if job.features is not None:
                sae.check_indices(job.sae_id, job.features, "features")
            w_u = backend.unembedding()
            if w_u.ndim != 2 or w_u.shape[1] != sae.d_in:
                raise InvalidParameter(
                    f"the model's unembedding is {tuple(w_u.shape)}; {job.sae_id!r}'s decoder rows are {sae.d_in} wide",
                    param="sae_id",
                    details={"sae_id": job.sae_id, "layer": job.layer},
                )
            return backend, sae, w_u

        backend, sae, w_u = self._work(resolve, timeout_s)
        features = list(range(sae.d_sae)) if job.features is None else list(job.features)
        with self._logits_lock:
            with torch.inference_mode():
                idx = torch.tensor(features, dtype=torch.long)
                top_v, top_i, bot_v, bot_i = (t.cpu() for t in feature_logit_effects(sae.W_dec, w_u, idx, job.top_n))
        del w_u
        top_ids, bottom_ids = top_i.tolist(), bot_i.tolist()
        wanted = sorted({i for row in (*top_ids, *bottom_ids) for i in row})

        def decode() -> dict[int, str]:
            if self._backend is not backend:
                raise EngineBusy(
                    "the model changed while its feature logits were computed", details={"sae_id": job.sae_id}
                )
            return {i: backend.token_text(i) for i in wanted}

        text = self._work(decode, timeout_s)
        return FeatureLogitsResult(
            request_id=job.request_id,
            features=features,
            top_ids=top_ids,
            top_values=top_v.tolist(),
            bottom_ids=bottom_ids,
            bottom_values=bot_v.tolist(),
            top_tokens=[[text[i] for i in row] for row in top_ids],
            bottom_tokens=[[text[i] for i in row] for row in bottom_ids],
        )

    def attribution(self, job: AttributionJob, *, timeout_s: float | None = None) -> AttributionResult:
        """Each feature of the SAE attached at ``job.layer`` attributed to one logit of the
        next token after the prompt (``AttributionJob``). Refused before anything runs on a
        backend without gradients (naming it), for an SAE not attached there or without an
        encoder, a prompt longer than the context and a target outside the vocabulary; the
        forwards and the backward then run on the worker at batch priority, between two
        steps of the running batch, the model unsteered (``ComputesAttribution``)."""

        def op() -> AttributionResult:
            backend = self._require_backend()
            caps = backend.capabilities()
            if not caps.gradients or not isinstance(backend, ComputesAttribution):
                reason = caps.gradients_reason or None
                raise InvalidParameter(
                    f"the {backend.name} backend cannot compute attributions (gradients is off"
                    + (f": {reason})" if reason else ")"),
                    param="backend",
                    details={
                        "backend": backend.name,
                        "capability": "gradients",
                        **({"reason": reason} if reason else {}),
                    },
                )
            att = self._attached(job.sae_id, job.layer)
            if not att.sae.has_encoder:
                raise InvalidParameter(
                    f"{job.sae_id!r} is a steering vector without an encoder: it has no features to attribute",
                    param="sae_id",
                    details={"sae_id": job.sae_id, "layer": job.layer},
                )
            if job.prompt_token_ids is not None:
                ids = prepare.validate_ids(backend, job.prompt_token_ids, "prompt")
            elif job.messages is not None:
                ids = backend.encode_messages(
                    job.messages, add_generation_prompt=job.add_generation_prompt, **job.chat_template_kwargs
                )
            else:
                ids = backend.encode_text(job.prompt or "", add_special_tokens=job.add_special_tokens)
            if not ids:
                raise InvalidParameter("the prompt is empty after tokenisation", param="prompt")
            if len(ids) > backend.context_length:
                raise ContextLengthExceeded(prompt_tokens=len(ids), max_tokens=0, context_length=backend.context_length)
            if job.target_token_id is not None:
                prepare.validate_ids(backend, [job.target_token_id], "target_token_id")
            try:
                return backend.attribution(job, ids, att, job.target_token_id)
            except EngineError:
                raise
            except Exception as exc:
                if is_out_of_memory(exc):
                    raise InsufficientMemory(
                        f"the attribution of {len(ids)} prompt tokens ran out of memory; send a shorter prompt",
                        details={"prompt_tokens": len(ids)},
                    ) from exc
                log.exception("attribution %s failed", job.request_id)
                raise GenerationFailed(f"attribution failed: {type(exc).__name__}: {exc}") from exc

        return self._work(op, timeout_s, "batch")


# every command of the protocol table is an Engine method with the declared arguments
check_implements(Engine)

__all__ = [
    "DEFAULT_DRAIN_TIMEOUT_S",
    "DEFAULT_STRUCTURED_TIMEOUT_S",
    "Arrival",
    "Attachment",
    "Engine",
    "GenerationStream",
    "is_out_of_memory",
]
