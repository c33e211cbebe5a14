"""The llama.cpp backend (``ModelBackend``): GGUF models through llama-cpp-python.

The model runs in this process on llama.cpp's own kernels; sampling, text and monitor
encoding run on the host in torch, with the same code as the transformers backend.
Steering is a control vector when every row of a forward is steered alike and the eval
callback otherwise (``batched.py``); monitoring and capture (hidden states, rotated Q/K)
are the eval callback (``taps.py``). Structured output and tool calls are the shared
xgrammar masks (``gpu_engine.decode.grammar``) over the GGUF's vocabulary, applied by each
request's sampler to its own row.

How requests with different steering share the model is decided at load
(``steering_mode`` in the capabilities): ``eval_callback_per_row`` — one decode, each
row's delta written in the eval callback — only where the graph runs on the CPU backend
and a self-check shows a written row reaching the next layer
(``batched.check_per_row_writes``); ``control_vector_swap`` otherwise (GPU offload, a
GPU ggml backend, a failed self-check, or forced): each decode holds requests of one
steering only, under that steering's control vector, the groups taking turns.

Load options: ``options.py``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence as Seq
from typing import Any

import torch

from ...interp.capture import AttentionGeometry
from ...decode.sampling import embed_vector, score_result
from ...decode.sequence import Sequence
from ...decode.text import tool_template_format
from ...api.errors import InvalidParameter, ModelLoadFailed, SAEIncompatible
from ...interp.hooks import AttachmentStats, HookManager
from ...api.memory import available_memory
from ...api.protocol import (
    AttachmentKey,
    EmbedJob,
    EmbedResult,
    GenerationJob,
    LoadModelJob,
    ScoreJob,
    ScoreResult,
    Usage,
)
from ...decode.prefix_cache import CachePlan
from ...sae.hookpoints import DEFAULT_HOOK_POINT
from ...api.capabilities import Capabilities
from .batched import (
    CONTROL_VECTOR_SWAP,
    EVAL_CALLBACK_PER_ROW,
    LlamaBatchRunner,
    check_per_row_writes,
    run_serial,
)
from .native import (
    GGML_OP_ROPE,
    ContextSettings,
    NativeContext,
    NativeModel,
    card_free_memory,
    gpu_device_count,
    resolve_gguf,
)
from .taps import ATTN_OUT, EMBD, FFN_OUT, LAYER_OUT, EvalTaps, node_name
from .options import KV_BYTES, KV_CARD_SHARE, KV_MEMORY_SHARE, check_options
from .prefix import ResidentPrefixCache
from .tokens import ChatTemplate, LlamaTokenizer, grammar_vocabulary
from .weights import gguf_weights
from .unembedding import gguf_unembedding

DEFAULT_N_BATCH = 512
# the hook points this backend reaches exactly (``gpu_engine.sae.hookpoints``), per
# steering mode: the eval callback writes any node's rows; a control vector adds to layer
# outputs only, which are resid_post and resid_pre (block L-1's output)
LLAMACPP_HOOK_POINTS = ("resid_post", "resid_pre", "attn_out", "mlp_out", "mlp_transcoder")
SWAP_HOOK_POINTS = ("resid_post", "resid_pre")
# GGUF architectures whose graph was read for the nodes of ``hook_node`` other than the
# layer outputs (``embd`` is the stream entering block 0, ``attn_out``/``ffn_out`` the
# sub-block outputs the residual adds read): llama.cpp's Llama graph (also Mistral's GGUF
# files).  Other graphs differ there (Gemma scales the embeddings after ``embd`` and
# norms the sub-block outputs after those nodes), so they get the layer outputs only
NODE_ARCHITECTURES = ("llama",)


def hook_node(hook_point: str, layer: int) -> tuple[int, int]:
    """The graph node ``(kind, layer)`` (``taps.py``) an SAE of ``hook_point`` attached at
    ``layer`` reads and writes: resid_post ``l_out-L``; resid_pre ``l_out-{L-1}``, the
    embeddings (``embd``) for L = 0; attn_out ``attn_out-L`` (the output projection's
    result, before the residual add); mlp_out and a transcoder's write ``ffn_out-L`` (the
    MLP's down projection, before the add; a transcoder reads ``ffn_norm-L``)."""
    if hook_point == "resid_pre":
        return (LAYER_OUT, layer - 1) if layer > 0 else (EMBD, 0)
    if hook_point == "attn_out":
        return (ATTN_OUT, layer)
    if hook_point in ("mlp_out", "mlp_transcoder"):
        return (FFN_OUT, layer)
    return (LAYER_OUT, layer)


def _needs_per_row(what: str, steering_mode: str, steering_mode_reason: str) -> str | None:
    """Why a load in ``steering_mode`` cannot run ``what`` (which reads or writes each row
    in the eval callback); None where it can."""
    if steering_mode != CONTROL_VECTOR_SWAP:
        return None
    return (
        f"{what}, which needs per-row writes in the eval callback; this llama.cpp load steers "
        f"with control vectors swapped between requests (steering_mode {CONTROL_VECTOR_SWAP}: "
        f"{steering_mode_reason})"
    )


def splice_refused(steering_mode: str, steering_mode_reason: str) -> str | None:
    """Why a load in ``steering_mode`` cannot splice (None: it can)."""
    return _needs_per_row(
        "a splice replaces each row by the SAE's reconstruction of it", steering_mode, steering_mode_reason
    )


def controls_refused(steering_mode: str, steering_mode_reason: str) -> str | None:
    """Why a load in ``steering_mode`` cannot run feature controls (None: it can)."""
    return _needs_per_row(
        "clamp, scale, ablate, phases, windows and conditions read each row's own activations",
        steering_mode,
        steering_mode_reason,
    )


class LlamaCppBackend:
    """``gpu_engine.backends.base.ModelBackend`` on llama.cpp (see the module doc)."""

    name = "llamacpp"
    # capture buffers fill from the eval callback in this process
    captures_in_workers = False

    def __init__(self, job: LoadModelJob, hooks: HookManager | None = None) -> None:
        opts = check_options(job)
        self.job = job
        self.opts = opts
        self.gguf = resolve_gguf(job.path, opts["gguf_file"])
        self.native = NativeModel(
            self.gguf,
            gpu_layers=-1 if opts["offload"] else 0,
            tensor_split=opts["tensor_split"] or None,
            main_gpu=opts["main_gpu"],
            split_mode=opts["split_mode"],
        )
        try:
            if not self.native.has_decoder or self.native.n_layer < 1:
                raise ModelLoadFailed(f"{self.gguf.name} is not a decoder language model")
            self.num_layers = self.native.n_layer
            self.hidden_size = self.native.n_embd
            self.vocab_size = self.native.n_vocab
            # torch tensors (SAEs, deltas, sampling) live on the host whatever llama.cpp offloads
            self.device = torch.device("cpu")
            self.sae_device = self.device
            self.dtype = torch.float32
            self.tokenizer = LlamaTokenizer(self.native)
            self.chat = ChatTemplate.from_model(self.native, self.tokenizer)
            # GenerationJob.tools: whether (and how) the GGUF's chat template renders tools
            self.tool_call_format = tool_template_format(self.chat.source, self.chat.render)
            self._grammars: Any = None  # gpu_engine.decode.grammar.Grammars, at the first use
            self.eos_token_ids = self.native.eog_ids()
            self.file_type = self.native.meta("general.file_type")
            # the tensors llama.cpp holds (weights.py): per GGML type from the file's table,
            # in all as llama.cpp counts them
            self.weights: dict[str, Any] = gguf_weights(self.gguf, self.file_type, self.native.model_size())
            self.kernels = f"llama.cpp ({'gpu offload' if opts['offload'] else 'cpu'})"
            self.context_length = self._window()
            self.attachment_stats: dict[AttachmentKey, AttachmentStats] = {}
            # each attachment's hook point (resid_post where none is recorded)
            self.attachment_points: dict[AttachmentKey, str] = {}
            self.architecture = self.native.meta("general.architecture") or ""
            self.attention_geometry = AttentionGeometry(
                num_heads=self.native.n_head, num_kv_heads=self.native.n_head_kv, head_dim=self.native.head_dim
            )
            self.taps = EvalTaps(
                self.num_layers,
                interleaved_rope=self.native.interleaved_rope,
                hidden_size=self.hidden_size,
                heads=(self.native.n_head, self.native.n_head_kv, self.native.head_dim),
            )
            # steered forwards by path: a control vector over a batch steered alike, per
            # row in the eval callback, a control vector over one steering group of the
            # batch (``control_vector_swap`` mode)
            self.steering_forwards = {"control_vector": 0, "eval_callback": 0, "control_vector_swap": 0}
            self.context: NativeContext | None = None
            self._rows = 0
            # PREFIX_CACHE_MAX_MB: stored prompt KV, resident in the context (prefix.py)
            self.prefix = ResidentPrefixCache(self, opts["prefix_cache_max_mb"])
            # the bookkeeping the runtime plans requests against and reads status from
            self.prefix_cache = self.prefix.cache
            self._open_context(1)
            self.steering_mode, self.steering_mode_reason = self._choose_steering_mode()
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ context

    def _kv_bytes_per_token(self) -> float:
        from llama_cpp import llama_cpp as lc

        n_head = max(lc.llama_model_n_head(self.native.ptr), 1)
        n_head_kv = max(lc.llama_model_n_head_kv(self.native.ptr), 1)
        kv_dim = self.hidden_size * n_head_kv / n_head
        return self.num_layers * 2 * kv_dim * KV_BYTES[self.opts["kv"]]

    def _kv_memory(self) -> tuple[float, str]:
        """(bytes the KV cache may take, where): with the layers offloaded, KV_CARD_SHARE
        of what the cards holding them have free once the weights are on them (llama.cpp
        puts each offloaded layer's KV beside it); on the CPU, KV_MEMORY_SHARE of the
        host's available memory."""
        cards = self.opts["cards"]
        if cards:
            free = card_free_memory(cards)
            if free is not None:
                return free * KV_CARD_SHARE, ", ".join(f"cuda:{c}" for c in cards)
        return available_memory() * KV_MEMORY_SHARE, "the host"

    def _window(self) -> int:
        """The per-request window: the file's, under GGUF_CONTEXT_LENGTH (0: the file's)
        and the job's ceiling, and what fits in memory."""
        declared = self.native.n_ctx_train or 4096
        window = declared
        if self.opts["context_length"]:
            window = min(window, self.opts["context_length"])
        if self.job.max_context_length:
            window = min(window, int(self.job.max_context_length))
        memory, where = self._kv_memory()
        fits = int(memory / self._kv_bytes_per_token())
        if fits < 16:
            raise ModelLoadFailed(
                f"not enough memory for a KV cache on {where}",
                details={"fits_tokens": fits, "memory_mb": round(memory / 2**20), "where": where},
            )
        return max(min(window, fits), 16)

    def _open_context(self, rows: int) -> None:
        """A context for ``rows`` batch rows plus one scratch sequence (serial generation,
        embeddings, scores), then the prefix cache's slots; the KV cache holds a full
        window per live sequence while memory allows, else what fits (the prefix cache
        lives in the cells they leave free)."""
        n_seq = rows + 1
        # the old context's KV cache goes first: the budget is what its memory leaves free
        old = self.context
        self.context = None
        if old is not None:
            old.close()
        budget = int(self._kv_memory()[0] / self._kv_bytes_per_token())
        n_ctx = max(min(self.context_length * n_seq, budget), self.context_length)
        settings = ContextSettings(
            n_ctx=n_ctx,
            n_seq=n_seq + self.prefix.n_slots(n_seq),
            n_batch=DEFAULT_N_BATCH,
            kv_type=self.opts["kv"],
            flash_attention=self.opts["flash_attention"],
            n_threads=len(os.sched_getaffinity(0)),
        )
        self.context = NativeContext(self.native, settings, self.taps.callback, self.taps.user_data)
        self._rows = rows
        self.prefix.reset(n_seq)

    @property
    def scratch_seq(self) -> int:
        return self._rows

    def _choose_steering_mode(self) -> tuple[str, str]:
        """(mode, why): per-row writes in the eval callback only where the graph is
        computed on the CPU backend node by node and a written row is seen to reach the
        next layer; control vectors swapped between steering groups otherwise."""
        if self.opts["steering_mode"] == CONTROL_VECTOR_SWAP:
            return CONTROL_VECTOR_SWAP, "forced (GGUF_STEERING_MODE=control_vector_swap)"
        if self.opts["offload"]:
            return CONTROL_VECTOR_SWAP, "layers offloaded to a GPU"
        if gpu_device_count() > 0:
            return CONTROL_VECTOR_SWAP, (
                "this llama.cpp build has a GPU ggml backend, which may compute layer outputs off the CPU"
            )
        failure = check_per_row_writes(self)
        if failure is not None:
            return CONTROL_VECTOR_SWAP, f"per-row write self-check failed: {failure}"
        return EVAL_CALLBACK_PER_ROW, (
            "CPU backend; a row written in the eval callback reached the next layer (self-check at load)"
        )

    def _check_steering(self, request_hooks: Any) -> None:
        """What the fallback cannot run, refused by name before the request runs: a
        control vector has no tensor at layer 0 (llama.cpp's buffer starts at layer 1),
        and adds one vector to every row (feature controls depend on the row; the engine
        refuses them from the capabilities first, this holds for a direct caller)."""
        if self.steering_mode != CONTROL_VECTOR_SWAP or request_hooks is None:
            return
        for (sae_id, layer), plan in request_hooks.plans.items():
            if plan.controls is not None:
                if plan.controls.splice_modes:
                    param, capability = "steering.splice", "splice"
                    why = splice_refused(self.steering_mode, self.steering_mode_reason)
                else:
                    param, capability = "steering.features.mode", "steering_controls"
                    why = controls_refused(self.steering_mode, self.steering_mode_reason)
                raise InvalidParameter(
                    f"the {self.name} backend cannot run {param} here: {why}",
                    param=param,
                    details={
                        "backend": self.name,
                        "capability": capability,
                        "sae_id": sae_id,
                        "layer": layer,
                        "steering_mode": self.steering_mode,
                        "reason": why,
                    },
                )
            kind, il = self.hook_node((sae_id, layer))
            if (kind != LAYER_OUT or il == 0) and plan.delta is not None:
                raise InvalidParameter(
                    f"steering at {node_name(kind, il)} (layer {layer}, hook point "
                    f"{self.attachment_points.get((sae_id, layer), DEFAULT_HOOK_POINT)}) needs per-row "
                    "writes in the eval callback; this llama.cpp load steers with control vectors "
                    f"swapped between requests (steering_mode {CONTROL_VECTOR_SWAP}: "
                    f"{self.steering_mode_reason}), which start at layer 1's output",
                    param="steering",
                    details={
                        "backend": self.name,
                        "sae_id": sae_id,
                        "layer": layer,
                        "steering_mode": self.steering_mode,
                    },
                )

    # ------------------------------------------------------------------ contract

    def capabilities(self) -> Capabilities:
        return Capabilities(
            embeddings=self.opts["embeddings"],
            # feature controls run per row in the eval callback (``taps.py``: ``route``);
            # a control vector cannot carry them (refused, with the reason, in the swap mode)
            steering_controls=self.steering_mode == EVAL_CALLBACK_PER_ROW,
            steering_controls_reason=controls_refused(self.steering_mode, self.steering_mode_reason),
            # SteeringEntry.splice: a control table of no operation, per row as the controls
            splice=self.steering_mode == EVAL_CALLBACK_PER_ROW,
            splice_reason=splice_refused(self.steering_mode, self.steering_mode_reason),
            # capture reads the eval callback's nodes (``taps.py``); Q/K needs rope's output
            # (a model without rotary embedding has no node that is its Q/K as attended)
            attention_capture=self.native.rotary and GGML_OP_ROPE is not None,
            # grammar masks in the shared Sampler, on the request's own row (structured_grammars)
            structured_output=True,
            tool_calling=self.tool_call_format is not None,
            tool_call_format=self.tool_call_format,
            # how requests with different steering share a batch (decided at load): each
            # row's delta added in the eval callback, or one steering per decode under its
            # control vector (``control_vector_swap``); rows steered alike use a control
            # vector either way
            steering_mode=self.steering_mode,
            steering_mode_reason=self.steering_mode_reason,
            control_vectors=True,
            native_eval_filter=self.taps.native_filter,
            hook_points=list(self.hook_points),
            # the attribution command: llama.cpp's graph runs forward only
            gradients=False,
            gradients_reason=(
                "llama.cpp computes no gradients (its graph runs forward only); load the model on the "
                "transformers backend for attribution"
            ),
            # PREFIX_CACHE_MAX_MB: stored prompt KV reused by later prompts (prefix.py)
            prefix_caching=self.prefix.enabled,
            prefix_caching_reason=None if self.prefix.enabled else "PREFIX_CACHE_MAX_MB is 0",
            # entries are keyed by the steering that touches the prompt (decode/prefix_cache.py)
            steered_prefix_cache_keyed_by_steering=self.prefix.enabled,
            # GenerationJob.distributions_from: the prefill's logits rows (batched.py)
            prompt_distributions=True,
        )

    @property
    def hook_points(self) -> tuple[str, ...]:
        """What this load can hook: every point where the eval callback writes rows; the
        layer outputs alone (resid_post, resid_pre) under swapped control vectors."""
        if self.steering_mode == CONTROL_VECTOR_SWAP or self.architecture not in NODE_ARCHITECTURES:
            return SWAP_HOOK_POINTS
        return LLAMACPP_HOOK_POINTS

    def hook_node(self, key: AttachmentKey) -> tuple[int, int]:
        """The graph node an attachment reads and writes (``hook_node``)."""
        return hook_node(self.attachment_points.get(key, DEFAULT_HOOK_POINT), key[1])

    def reads_mlp_input(self, key: AttachmentKey) -> bool:
        """The attachment is a transcoder (reads ``ffn_norm-L``, writes ``ffn_out-L``)."""
        return self.attachment_points.get(key) == "mlp_transcoder"

    def structured_grammars(self) -> Any:
        """This model's ``gpu_engine.decode.grammar.Grammars`` over the GGUF's vocabulary (built
        at the first structured request; xgrammar is imported only then)."""
        if self._grammars is None:
            from ...decode.grammar import Grammars

            self._grammars = Grammars.from_vocabulary(
                grammar_vocabulary(self.native), stop_token_ids=self.eos_token_ids
            )
        return self._grammars

    def encode_text(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return self.native.tokenize(text, add_special=add_special_tokens)

    def encode_messages(
        self, messages: list[dict[str, Any]], *, add_generation_prompt: bool, **kwargs: Any
    ) -> list[int]:
        chat = self.chat
        source = kwargs.pop("chat_template", None)
        if source is not None:  # a request's own template (the web tier allows it or not)
            if not isinstance(source, str) or not source:
                raise InvalidParameter(
                    "chat_template must be a non-empty Jinja template string",
                    param="chat_template_kwargs.chat_template",
                )
            try:
                chat = ChatTemplate(source, bos=chat.bos, eos=chat.eos)
            except Exception as exc:  # a Jinja syntax error
                raise InvalidParameter(
                    f"cannot read the chat template: {exc}", param="chat_template_kwargs.chat_template"
                ) from exc
        text = chat.render(messages, add_generation_prompt=add_generation_prompt, **kwargs)
        return self.encode_text(text, add_special_tokens=False)

    def token_text(self, token_id: int) -> str:
        return self.native.detokenize([token_id], skip_special=False)

    def unembedding(self) -> torch.Tensor:
        """The GGUF's ``output.weight`` (else the tied ``token_embd.weight``),
        dequantized to float32 with the ``gguf`` package's reader."""
        return gguf_unembedding(self.gguf)

    def attention_scaling(self, layer: int) -> float:
        """The factor llama.cpp's attention multiplies q·k by (``kq_scale``: the file's
        ``attention.scale``, else 1/sqrt(head_dim); the same at every layer)."""
        return self.native.attention_scale

    def layer_module_path(self, layer: int, hook_point: str = DEFAULT_HOOK_POINT) -> str:
        # the eval callback reaches the nodes of ``hook_node``; under swapped control
        # vectors only the layer outputs can be steered, and on a graph not read for the
        # other nodes (``NODE_ARCHITECTURES``) only they are known: any other point is
        # refused rather than tapped one node away from where it is
        supported = self.hook_points
        architecture = self.architecture
        # resid_pre of layer 0 is the ``embd`` node, known only on the graphs read
        embd_unknown = hook_point == "resid_pre" and layer == 0 and architecture not in NODE_ARCHITECTURES
        if hook_point not in supported or embd_unknown:
            if self.steering_mode == CONTROL_VECTOR_SWAP and hook_point in LLAMACPP_HOOK_POINTS:
                why = (
                    f" in steering_mode {self.steering_mode} (control vectors add to layer outputs only: "
                    f"{self.steering_mode_reason})"
                )
            elif architecture not in NODE_ARCHITECTURES:
                where = "resid_pre of layer 0" if hook_point == "resid_pre" else hook_point
                why = (
                    f" ({where}) on a {architecture!r} GGUF: only the layer outputs of its graph are known "
                    f"to be the transformers backend's points (every point on {', '.join(NODE_ARCHITECTURES)})"
                )
            else:
                why = ""
            raise SAEIncompatible(
                f"the llama.cpp backend cannot hook {hook_point!r}{why}; this load supports {', '.join(supported)}",
                details={
                    "backend": self.name,
                    "hook_point": hook_point,
                    "supported": list(supported),
                    "steering_mode": self.steering_mode,
                },
            )
        return node_name(*hook_node(hook_point, layer))

    def attach(self, attachment: Any) -> None:
        self.attachment_stats[attachment.key] = attachment.stats
        self.attachment_points[attachment.key] = attachment.hook_point
        self.prefix.clear()  # stored KV names SAEs by id: another one may take the id

    def detach(self, key: AttachmentKey) -> None:
        self.attachment_stats.pop(key, None)
        self.attachment_points.pop(key, None)
        self.prefix.clear()

    # ------------------------------------------------------------------ generation

    def new_sequence(
        self,
        job: GenerationJob,
        *,
        prompt_ids: list[int],
        max_tokens: int,
        request_hooks: Any,
        emit: Any,
        should_stop: Any,
        prefix_plan: CachePlan | None = None,
    ) -> Sequence:
        self._check_steering(request_hooks)
        seq = Sequence(
            self,
            request_id=job.request_id,
            prompt_ids=prompt_ids,
            sampling=job.sampling,
            max_tokens=max_tokens,
            request_hooks=request_hooks,
            emit=emit,
            should_stop=should_stop,
            distributions_from=job.distributions_from,
        )
        self.prefix.admit(seq, prefix_plan)
        return seq

    def batch_runner(self, *, max_rows: int) -> LlamaBatchRunner:
        if max_rows != self._rows:
            self._open_context(max_rows)
        return LlamaBatchRunner(self, max_rows=max_rows)

    def generate(
        self,
        *,
        request_id: str,
        prompt_ids: list[int],
        sampling: Any,
        max_tokens: int,
        request_hooks: Any,
        should_stop: Any,
        emit: Any,
        prefix_plan: CachePlan | None = None,
        distributions_from: int | None = None,
    ) -> Any:
        self._check_steering(request_hooks)
        seq = Sequence(
            self,
            request_id=request_id,
            prompt_ids=prompt_ids,
            sampling=sampling,
            max_tokens=max_tokens,
            request_hooks=request_hooks,
            emit=emit,
            should_stop=should_stop,
            distributions_from=distributions_from,
        )
        self.prefix.admit(seq, prefix_plan)  # None (a direct caller): no prefix cache
        runner = LlamaBatchRunner(self, max_rows=1, seq_ids=[self.scratch_seq])
        with torch.inference_mode():
            run_serial(runner, seq, should_stop)
        return seq.finish()

    # ------------------------------------------------------------------ one-shot work

    def _scratch_forward(self, ids: list[int], *, embeddings: bool) -> Any:
        """Every position of ``ids`` through the unsteered model on the scratch sequence:
        (T, V) logits, or (T, d) final hidden states (after the output norm)."""
        ctx = self.context
        sid = self.scratch_seq
        n_batch = ctx.settings.n_batch
        ctx.set_cvec(None, None)
        ctx.seq_clear(sid)
        if embeddings:
            ctx.set_embeddings(True)
        chunks = []
        try:
            for off in range(0, len(ids), n_batch):
                part = ids[off : off + n_batch]
                toks = [(t, off + i, sid, True) for i, t in enumerate(part)]
                self.taps.run(None, lambda toks=toks: self.prefix.decode(toks))
                rows = list(range(len(part)))
                chunks.append(ctx.embeddings_rows(rows) if embeddings else ctx.logits_rows(rows))
        finally:
            if embeddings:
                ctx.set_embeddings(False)
            ctx.seq_clear(sid)
        import numpy as np

        return torch.from_numpy(np.concatenate(chunks, axis=0))

    def embed(self, job: EmbedJob, inputs: Seq[list[int]]) -> EmbedResult:
        if not self.opts["embeddings"]:
            raise InvalidParameter(
                "embeddings are off for GGUF models here (GGUF_ENABLE_EMBEDDINGS=false)",
                param="input",
            )
        vectors: list[list[float]] = []
        total = 0
        for ids in inputs:
            vectors.append(embed_vector(job, self._scratch_forward(list(ids), embeddings=True)))
            total += len(ids)
        return EmbedResult(job.request_id, vectors, Usage(total, 0, total))

    def score(self, job: ScoreJob, prompt_ids: list[int]) -> ScoreResult:
        logits = self._scratch_forward(list(prompt_ids), embeddings=False)
        return score_result(job, logits, list(prompt_ids), self.token_text)

    def close(self) -> None:
        ctx = getattr(self, "context", None)
        if ctx is not None:
            ctx.close()
            self.context = None
        native = getattr(self, "native", None)
        if native is not None:
            native.close()


__all__ = ["LlamaCppBackend", "check_options"]
