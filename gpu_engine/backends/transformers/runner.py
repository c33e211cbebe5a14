"""Loads a local transformers checkpoint and runs forward passes — nothing else.

Queueing, validation, admission and hook policy live in the engine (STYLE §10); the
runner knows devices, dtypes, tokenisation and where the decoder blocks are.
"""

from __future__ import annotations

import functools
import gc
import inspect as _inspect
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ...interp.capture import AttentionGeometry
from ...api.errors import InvalidParameter, ModelLoadFailed, UnsupportedArchitecture
from ...interp.hooks import HookManager
from ...interp.logits import unembedding_from_safetensors
from ...api.model_dir import ModelInfo, inspect_model_dir
from ...api.memory import trim_host_heap
from ...api.protocol import (
    AttachmentKey,
    AttributionJob,
    AttributionResult,
    EmbedJob,
    EmbedResult,
    GenerationJob,
    HiddenStatesJob,
    HiddenStatesResult,
    LoadModelJob,
    ScoreJob,
    ScoreResult,
    Usage,
)
from ...decode.prefix_cache import PrefixCache
from ...sae.hookpoints import DEFAULT_HOOK_POINT, HOOK_POINTS
from ...decode.text import tool_template_format
from ...api.capabilities import Capabilities
from .blocks import resolve_attention, resolve_block, resolve_block_list, resolve_hook_module
from .compiled import CompiledDecode, compile_wanted, decode_options, static_length
from .cpu_kernels import one_row_probe, pack_linears, packing_available
from .lean import LeanDecode, why_not
from .qk_tap import QKTaps
from .quantization import (
    check_method,
    checkpoint_quantization,
    import_torchao_quietly,
    method_name,
    quantize_blocks,
    weight_bytes,
)
from ...decode.sampling import embed_vector, score_result
from .speculative import Drafter, spec_config
from .batched import BatchedRunner
from .generation import run_generation
from .hidden import run_hidden_states
from .attribution import run_attribution
from ...decode.sequence import Sequence as DecodeState

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ModelLoadFailed("device 'cuda' requested but CUDA is not available", details={"device": device})
    return torch.device(device)


class TransformersRunner:
    """The transformers backend (``gpu_engine.backends.base.ModelBackend``): the model runs
    in this process; steering and monitoring are forward hooks (``HookManager``) on the
    module each attachment's hook point names (``blocks.resolve_hook_module``)."""

    name = "transformers"
    # the model, the SAEs and the capture buffers all live in this process
    captures_in_workers = False

    def __init__(self, job: LoadModelJob, hooks: HookManager | None = None) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = Path(job.path)
        self.job = job
        self.hooks = hooks if hooks is not None else HookManager()
        self.info: ModelInfo = inspect_model_dir(path, job.dtype)
        if not self.info.supported and not job.trust_remote_code:
            # refuse before reading any weight; remote-code classes are checked after load
            raise UnsupportedArchitecture(self.info.architecture_class or "<none in config.json>")
        self.device = pick_device(job.device)
        self.sae_device = self.device
        self.dtype = TORCH_DTYPES[job.dtype]
        import_torchao_quietly()  # transformers imports it in from_pretrained
        # TORCH_COMPILE / TORCH_COMPILE_MODE / KV_CACHE_MODE (compiled.py); a compiled
        # step needs the fixed shapes of the static cache
        compile_opt, compile_mode, kv_cache_mode = decode_options(job.options)
        compile_on = compile_wanted(compile_opt, self.device, speculative=bool(job.options.get("speculative_model")))
        self.static_kv = compile_on or kv_cache_mode == "static"
        try:
            # local files only, safetensors only: nothing is fetched, nothing unpickled
            model = AutoModelForCausalLM.from_pretrained(
                str(path),
                dtype=self.dtype,
                local_files_only=True,
                use_safetensors=True,
                trust_remote_code=job.trust_remote_code,
            )
            self.tokenizer = AutoTokenizer.from_pretrained(
                str(path), local_files_only=True, trust_remote_code=job.trust_remote_code
            )
        except (OSError, ValueError, KeyError) as exc:
            raise ModelLoadFailed(f"Cannot load model from {path}: {exc}", details={"path": str(path)}) from exc
        self.model = model.to(self.device).eval()
        # fails now (naming the class) rather than at the first attach
        blocks, self.blocks_path = resolve_block_list(self.model)
        self.num_layers = len(blocks)
        # Q8/Q4: the decoder blocks' linears, quantized in place (``quantization``); a
        # pre-quantized checkpoint came in at its own precision and is left as it is
        prequantized = checkpoint_quantization(path)
        requested = job.options.get("quantization") or None
        quantized = None
        if prequantized is None and requested:
            with torch.no_grad():
                method = check_method(requested, job.device).name
                quantized = quantize_blocks(blocks, self.blocks_path, method)
        self.packed_linears = 0
        self._quantized = quantized
        # why the attribution command's backward cannot run (None: it can): it passes every
        # linear after the hook point, and the int8/int4 kernels and a pre-quantized
        # checkpoint's layers carry no gradient
        self.gradients_reason = (
            f"a {quantized.method} load multiplies in integer kernels that carry no gradient"
            if quantized
            else f"the checkpoint is pre-quantized ({method_name(prequantized)}): its layers carry no gradient"
            if prequantized is not None
            else None
        )
        # MILLM_ENGINE_PACK_WEIGHTS: True, False or absent (auto: cpu_kernels.one_row_probe
        # decides for one-row decoding; a batching engine packs in batch_runner). Compiled on
        # the CPU, inductor's freezing packs the weights itself (it cannot take ours).
        pack = job.options.get("pack_cpu_weights")
        self._pack_later = False
        self.kernel_probe: dict[str, float] | None = None
        if not compile_on and packing_available(self.device, self.dtype):
            if pack is None:
                self.kernel_probe = one_row_probe(self.model)
                pack = self.kernel_probe["packed_ms"] <= self.kernel_probe["default_ms"]
                self._pack_later = not pack
            if pack is not False:
                self.packed_linears = pack_linears(self.model)  # what stayed float32 (the head)
        self._set_kernels()
        # what the weights are and what they take in memory (EngineStatus.weights)
        by_dtype = weight_bytes(self.model)
        self.weights: dict[str, Any] = {
            "quantization": quantized.method if quantized else None,
            "checkpoint_quantization": method_name(prequantized) if prequantized else None,
            "quantized_layers": quantized.quantized if quantized else 0,
            "unquantized_block_layers": quantized.kept if quantized else [],
            "bytes": sum(by_dtype.values()),
            "bytes_by_dtype": by_dtype,
        }
        cfg = self.model.config
        text_cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        self.hidden_size = int(self.info.hidden_size or text_cfg.hidden_size)
        window = self.info.context_length or int(getattr(self.tokenizer, "model_max_length", 0) or 2048)
        if job.max_context_length:
            window = min(window, int(job.max_context_length))
        self.context_length = window
        emb = self.model.get_input_embeddings()
        self.vocab_size = int(emb.weight.shape[0])
        self.eos_token_ids = self._eos_ids()
        params = _inspect.signature(self.model.forward).parameters
        self._has_logits_to_keep = "logits_to_keep" in params
        heads = int(text_cfg.num_attention_heads)
        self.attention_geometry = AttentionGeometry(
            num_heads=heads,
            num_kv_heads=int(getattr(text_cfg, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(text_cfg, "head_dim", None) or self.hidden_size // heads),
        )
        self.qk_taps = QKTaps(self.hooks)
        self._grammars: Any = None  # structured.Grammars, built at the first structured request
        # GenerationJob.tools: whether (and how) the chat template renders tools
        self.tool_call_format = tool_template_format(
            getattr(self.tokenizer, "chat_template", None),
            functools.partial(self.tokenizer.apply_chat_template, tokenize=False),
        )
        # SPECULATIVE_MODEL: the serial path's draft (speculative.py), or None
        spec = spec_config(job.options)
        self.drafter = Drafter(self, spec) if spec is not None else None
        self.compiled = CompiledDecode(self.model, mode=compile_mode, device=self.device) if compile_on else None
        # the serial path's StaticCache (serial_cache) and its length
        self._static_cache: Any = None
        self._static_length = 0
        # the one-token decode step without model.forward (lean.py), serial and batched: Llama-family
        # models on the dynamic cache, unless the load turns it off
        lean_off = job.options.get("lean_decode") is False
        self.lean_reason = (
            "turned off (lean_decode)"
            if lean_off
            else "the static KV cache or a compiled step is in force"
            if self.static_kv
            else why_not(self.model)
        )
        # PREFIX_CACHE_MAX_MB (absent: off): finished requests' KV for the next turn
        # (prefix.py; the books: decode/prefix_cache.py); cleared on attach and detach
        self.prefix_cache = PrefixCache.from_mb(job.options.get("prefix_cache_max_mb", 0))
        self._fused_option = job.options.get("fused_cpu_kernels")
        self.lean = LeanDecode(self.model, fused=self._fused_option) if self.lean_reason is None else None
        if self._fused_option is True and self.lean is not None and self.lean.kernels is None:
            raise InvalidParameter(
                f"MILLM_ENGINE_FUSED_KERNELS is true but {self.lean.kernels_reason}", param="options.fused_cpu_kernels"
            )

    # ------------------------------------------------------------------ structure

    def block(self, layer: int) -> tuple[torch.nn.Module, str]:
        return resolve_block(self.model, layer)

    def attention(self, layer: int) -> torch.nn.Module:
        return resolve_attention(self.model, layer)[0]

    def attention_scaling(self, layer: int) -> float | None:
        """The factor the attention multiplies q·k by at ``layer`` (what the sidecar records
        so analyzers score with the model's own scale)."""
        value = getattr(self.attention(layer), "scaling", None)
        return float(value) if value is not None else None

    def arm_qk(self, layer: int) -> None:
        """Tap ``layer``'s attention for Q/K capture (``qk_tap``), reference-counted."""
        self.qk_taps.arm(layer, self.attention(layer), self.model)

    def disarm_qk(self, layer: int) -> None:
        self.qk_taps.disarm(layer)

    def layer_module_path(self, layer: int, hook_point: str = DEFAULT_HOOK_POINT) -> str:
        return resolve_hook_module(self.model, layer, hook_point)[1]

    def attach(self, attachment: Any) -> None:
        module, _, read_input = resolve_hook_module(self.model, attachment.layer, attachment.hook_point)
        self.hooks.install(
            attachment.key, module, attachment.stats, read_input=read_input, graph_break=self.compiled is not None
        )
        self.prefix_cache.clear()  # an SAE of the same id may come back with other weights
        if self.compiled is not None:
            self.compiled.reset()

    def detach(self, key: AttachmentKey) -> None:
        self.hooks.remove(key)
        self.prefix_cache.clear()
        if self.compiled is not None:
            self.compiled.reset()

    def capabilities(self) -> Capabilities:
        # ``hidden_states``: this backend's own key (Engine.hidden_states refuses without it)
        return Capabilities(
            hook_points=list(HOOK_POINTS),
            hidden_states=True,
            # the attribution command: a logit's gradient through the model (attribution.py)
            gradients=self.gradients_reason is None,
            gradients_reason=self.gradients_reason,
            # SteeringEntry.splice: the hooks replace the rows (interp.controls), serial and batched
            splice=True,
            # GenerationJob.distributions_from: the prefill's own logits rows (Sequence)
            prompt_distributions=True,
            tool_calling=self.tool_call_format is not None,
            tool_call_format=self.tool_call_format,
            # SPECULATIVE_MODEL: the serial path's draft, when one is set
            speculative_decoding=self.drafter is not None,
            speculative_model=self.drafter.source if self.drafter else None,
            # TORCH_COMPILE (with its figures) and KV_CACHE_MODE as in force
            torch_compile=self.compiled is not None,
            torch_compile_status=(self.compiled.status() if self.compiled else None),
            kv_cache_mode="static" if self.static_kv else "dynamic",
            # the one-token decode step without model.forward (lean.py)
            lean_decode=self.lean is not None,
            lean_decode_reason=self.lean_reason,
            # MILLM_ENGINE_FUSED_KERNELS: the lean step's small ops in C
            fused_cpu_kernels=self.lean is not None and self.lean.kernels is not None,
            fused_cpu_kernels_reason=(
                self.lean.kernels_reason if self.lean is not None else "the lean step is not in force"
            ),
            # MILLM_ENGINE_PACK_WEIGHTS=auto: the one-row timings it chose by
            kernel_probe=self.kernel_probe,
            # PREFIX_CACHE_MAX_MB (docs/engine.md, "Prefix cache")
            prefix_caching=self.prefix_cache.enabled,
            prefix_caching_reason=(
                "PREFIX_CACHE_MAX_MB is 0"
                if not self.prefix_cache.enabled
                else "the serial path's static KV cache does not use it (the batched path does)"
                if self.static_kv
                else None
            ),
        )

    def structured_grammars(self) -> Any:
        """This model's ``structured.Grammars`` (vocabulary info built once, grammars
        cached); xgrammar is imported only when a request asks for structured output."""
        if self._grammars is None:
            from ...decode.grammar import Grammars

            self._grammars = Grammars.from_huggingface(
                self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.eos_token_ids
            )
        return self._grammars

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        gen = getattr(self.model, "generation_config", None)
        for src in (getattr(gen, "eos_token_id", None), self.model.config.eos_token_id, self.tokenizer.eos_token_id):
            if src is None:
                continue
            ids.update(src if isinstance(src, (list, tuple)) else [src])
        return {int(i) for i in ids}

    # ------------------------------------------------------------------ tokens

    def encode_text(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def encode_messages(
        self, messages: list[dict[str, Any]], *, add_generation_prompt: bool, **kwargs: Any
    ) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise InvalidParameter("this model has no chat template; send a prompt instead", param="messages")
        try:
            text = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs
            )
        except Exception as exc:  # jinja errors for malformed messages
            raise InvalidParameter(f"cannot apply the chat template: {exc}", param="messages") from exc
        # the template already holds BOS and friends
        return self.encode_text(text, add_special_tokens=False)

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def unembedding(self) -> torch.Tensor:
        """The output head's weight, else the tied input embedding's; where neither is a
        plain floating-point tensor here (a head prepacked for oneDNN, a quantized one),
        the checkpoint's own tensor read from its files."""
        heads = [self.model.get_output_embeddings()]
        if getattr(self.model.config, "tie_word_embeddings", False):
            heads.append(self.model.get_input_embeddings())
        for head in heads:
            w = getattr(head, "weight", None)
            if (
                type(w) in (torch.Tensor, torch.nn.Parameter)
                and w.is_floating_point()  # type: ignore[union-attr]
                and w.layout == torch.strided  # type: ignore[union-attr]
                and not w.is_mkldnn  # type: ignore[union-attr]
                and w.ndim == 2  # type: ignore[union-attr]
            ):
                return w.detach().float()  # type: ignore[union-attr]
        return unembedding_from_safetensors(self.job.path)

    # ------------------------------------------------------------------ forward

    def serial_cache(self, needed: int) -> Any:
        """The cache a serial generation of ``needed`` positions starts with: None (the
        model's own DynamicCache) or, with the static cache, a StaticCache of
        ``compiled.static_length(needed)`` slots, kept and reset between requests."""
        if not self.static_kv:
            return None
        from transformers import StaticCache

        length = static_length(needed, self.context_length)
        cache = self._static_cache
        if cache is not None and self._static_length == length:
            with torch.inference_mode():  # its tensors were made in inference mode
                cache.reset()
            return cache
        self._static_cache = None  # the old one's memory goes before the new one is made
        self._static_cache = StaticCache(config=self.model.config, max_cache_len=length)
        self._static_length = length
        return self._static_cache

    def lean_step(self) -> LeanDecode | None:
        """The lean one-token step for the request about to decode, or None when it must
        take ``model.forward`` (no lean step for this model, or a hook in the model now
        that the step does not run: ``LeanDecode.usable``)."""
        lean = self.lean
        if lean is None or not lean.usable():
            return None
        return lean

    def _compiled_usable(self) -> bool:
        # captures and attention taps are armed per request: those steps run eagerly
        return self.compiled is not None and not self.hooks.armed_captures() and not self.qk_taps.armed()

    def forward(
        self, input_ids: torch.Tensor, past: Any, *, cache_position: torch.Tensor, all_logits: bool | int = False
    ) -> tuple[torch.Tensor, Any]:
        """One forward over ``input_ids`` (1, T); returns (logits (T' , V), cache): the
        last position's (``all_logits`` False or 0), the last ``all_logits`` positions'
        (an int), or every position's (True); a model that cannot keep fewer returns
        every position's.  A one-token step on the static cache runs compiled when the
        model is."""
        if input_ids.shape[1] == 1 and past is not None and past is self._static_cache and self._compiled_usable():
            logits = self.compiled.serial(input_ids, past, cache_position)  # type: ignore[union-attr]
            return logits[0], past
        kwargs: dict[str, Any] = {"use_cache": True, "past_key_values": past, "cache_position": cache_position}
        if self._has_logits_to_keep and all_logits is not True:
            kwargs["logits_to_keep"] = max(int(all_logits), 1)
        out = self.model(input_ids=input_ids, **kwargs)
        return out.logits[0], out.past_key_values

    def prefill_full_cache(
        self, input_ids: torch.Tensor, *, all_logits: bool | int = False
    ) -> tuple[torch.Tensor, Any]:
        """A batch-1 prefill into a cache that keeps every position in every layer.

        The model's own default cache trims sliding-window layers (Gemma 2) to the window;
        the batch cache copies whole layers, so the prefill keeps them whole.  The
        attention computed is the same either way (the window comes from the mask).
        """
        from transformers import DynamicCache

        past = DynamicCache()
        cache_position = torch.arange(input_ids.shape[1], device=input_ids.device)
        return self.forward(input_ids, past, cache_position=cache_position, all_logits=all_logits)

    def prefill_rows(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, keep: int = 0
    ) -> tuple[torch.Tensor, Any]:
        """A prefill of several left-padded prompts (rows, T) at once into a full cache;
        returns the last position's logits (rows, V) and the cache, or with ``keep`` the
        last ``keep`` positions' logits (rows, keep, V)."""
        from transformers import DynamicCache

        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        kwargs: dict[str, Any] = {
            "use_cache": True,
            "past_key_values": DynamicCache(),
            "position_ids": position_ids,
            "attention_mask": attention_mask,
        }
        if self._has_logits_to_keep:
            kwargs["logits_to_keep"] = max(int(keep), 1)
        out = self.model(input_ids=input_ids, **kwargs)
        if keep:
            return out.logits[:, -int(keep) :], out.past_key_values
        return out.logits[:, -1], out.past_key_values

    def forward_rows(
        self, input_ids: torch.Tensor, *, position_ids: torch.Tensor, attention_mask: torch.Tensor | None, past: Any
    ) -> torch.Tensor:
        """One decode step for every row of a batch cache: ``input_ids`` (rows, 1) at
        per-row ``position_ids``, padding given by the 2-D ``attention_mask``; returns the
        last-position logits (rows, V)."""
        kwargs: dict[str, Any] = {
            "use_cache": True,
            "past_key_values": past,
            "position_ids": position_ids,
            "attention_mask": attention_mask,
        }
        if self._has_logits_to_keep:
            kwargs["logits_to_keep"] = 1
        out = self.model(input_ids=input_ids, **kwargs)
        return out.logits[:, -1]

    def forward_rows_fixed(
        self,
        input_ids: torch.Tensor,
        *,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        past: Any,
        slot: torch.Tensor,
        rows: int,
    ) -> torch.Tensor:
        """``forward_rows`` as a fixed-shape step of the slab cache (kv_cache.py, fixed
        mode): ``rows`` rows, padding included, the new keys written at ``slot``; runs
        compiled when the model is."""
        past.fixed_write = (slot, rows)
        try:
            if self._compiled_usable():
                logits = self.compiled.rows(  # type: ignore[union-attr]
                    input_ids, past, position_ids, attention_mask, slot
                )
            else:
                kwargs: dict[str, Any] = {
                    "use_cache": True,
                    "past_key_values": past,
                    "position_ids": position_ids,
                    "attention_mask": attention_mask,
                    "cache_position": slot,
                }
                if self._has_logits_to_keep:
                    kwargs["logits_to_keep"] = 1
                logits = self.model(input_ids=input_ids, **kwargs).logits
        finally:
            past.fixed_write = None
        return logits[:, -1]

    def last_hidden(self, ids: Sequence[int]) -> torch.Tensor:
        """Final hidden states (T, d) after the final norm (what embeddings pool)."""
        input_ids = torch.tensor([list(ids)], dtype=torch.long, device=self.device)
        out = self.model.base_model(input_ids=input_ids, use_cache=False)
        return out.last_hidden_state[0]

    def full_logits(self, ids: Sequence[int]) -> torch.Tensor:
        input_ids = torch.tensor([list(ids)], dtype=torch.long, device=self.device)
        return self.model(input_ids=input_ids, use_cache=False).logits[0]

    # ------------------------------------------------------------------ what the engine calls

    def generate(self, **kwargs: Any) -> Any:
        return run_generation(self, hook_manager=self.hooks, **kwargs)

    def _set_kernels(self) -> None:
        base = "onednn_packed" if self.packed_linears else "default"
        q = self._quantized
        self.kernels = f"{q.method.lower()}_weight_only+{base}" if q else base

    def batch_runner(self, *, max_rows: int) -> Any:
        if self._pack_later:
            # auto, and the probe kept the default kernels for one row: a batch decodes
            # several rows a step, where the packed weights win (docs/performance.md)
            self._pack_later = False
            self.packed_linears = pack_linears(self.model)
            self._set_kernels()
            if self.lean is not None:
                # it lists the model's modules, and its fused q/k/v and gate/up weights go
                # (the packed modules hold copies)
                self.lean = LeanDecode(self.model, fused=self._fused_option)
            by_dtype = weight_bytes(self.model)  # a tied head's packed copy is new
            self.weights["bytes"], self.weights["bytes_by_dtype"] = sum(by_dtype.values()), by_dtype

        return BatchedRunner(self, self.hooks, max_rows=max_rows)

    def new_sequence(
        self,
        job: GenerationJob,
        *,
        prompt_ids: list[int],
        max_tokens: int,
        request_hooks: Any,
        emit: Any,
        should_stop: Any,
        prefix_plan: Any = None,
    ) -> Any:
        seq = DecodeState(
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
        seq.prefix_plan = prefix_plan  # decode/prefix_cache.CachePlan, None: the cache is not used
        return seq

    def embed(self, job: EmbedJob, inputs: Sequence[list[int]]) -> EmbedResult:
        vectors: list[list[float]] = []
        total = 0
        # embeddings and scores read the unsteered model
        with torch.inference_mode(), self.hooks.suppressed():
            for ids in inputs:
                vectors.append(embed_vector(job, self.last_hidden(ids)))
                total += len(ids)
        return EmbedResult(job.request_id, vectors, Usage(total, 0, total))

    def score(self, job: ScoreJob, prompt_ids: list[int]) -> ScoreResult:
        with torch.inference_mode(), self.hooks.suppressed():
            return score_result(job, self.full_logits(prompt_ids).float(), prompt_ids, self.token_text)

    def hidden_states(self, job: HiddenStatesJob, inputs: Sequence[list[int]]) -> HiddenStatesResult:
        return run_hidden_states(self, job, inputs)

    def attribution(
        self, job: AttributionJob, prompt_ids: list[int], attachment: Any, target_token_id: int | None
    ) -> AttributionResult:
        return run_attribution(self, job, prompt_ids, attachment, target_token_id)

    def release_cached_memory(self) -> None:
        """Hand memory freed by finished requests back (the engine's idle release): PyTorch's
        CUDA cache, or on the CPU what glibc's malloc keeps in its arenas."""
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        else:
            trim_host_heap()

    def close(self) -> None:
        self.prefix_cache.clear()
        self.model = None  # type: ignore[assignment]
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


__all__ = ["TORCH_DTYPES", "TransformersRunner", "pick_device"]
