"""The vLLM backend's driver: vLLM's V1 engine (``LLMEngine``) in the engine process, with
vLLM's own scheduling, continuous batching and paged KV cache.  The model runs in vLLM's
workers (this process, worker processes, or a Ray cluster); steering and monitoring reach
them through the worker extension (``worker.MillmWorkerExtension``) and ride with each
request (``wire``).

What vLLM cannot honour is refused before generation with a clear code, never ignored:
embeddings (a generation engine has no pooling runner here).  With vLLM's compiled graphs
on (``enforce_eager=False``) the model is loaded by our loader (``loader.py``,
``load_format="millm"``), which puts a graph-safe tap on every module a hook point may
use (decoder layers, their attention and MLP modules, the embeddings) and every
``Attention`` module before vLLM compiles: steering, its controls, monitoring and
hidden-state and Q/K capture run through them exactly as eager (``steering_apply_count``
counts the forwards they ran in).  On CUDA the tap is one of the compiler's splitting ops
and graphs are captured piecewise around it.  Structured output and tool calls go to
vLLM's own structured outputs (its xgrammar backend) with the grammar every backend
enforces (``batch.py``).  Serial mode does not exist: the engine drives this backend
through its batch scheduler (``capabilities().serial_mode is False``).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from ...interp.capture import AttentionGeometry
from ...decode.text import tool_template_format
from ...api.errors import InvalidParameter, ModelLoadFailed, UnsupportedArchitecture
from ...interp.hooks import HookManager
from ...interp.logits import unembedding_from_safetensors
from ...api.model_dir import inspect_model_dir
from ...api.protocol import (
    AttachmentKey,
    EmbedJob,
    EmbedResult,
    GenerationJob,
    LoadModelJob,
    LogprobEntry,
    ScoreJob,
    ScoreResult,
)
from ...api.capabilities import Capabilities
from .cards import card_env
from .liveness import CoreWatch
from .loader import LOAD_FORMAT
from .wire import hook_site, supported_points

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
WORKER_EXTENSION = "gpu_engine.backends.vllm.worker.MillmWorkerExtension"


def compiled_config() -> dict[str, Any]:
    """vLLM's compilation config for a compiled load: its own defaults, plus, on CUDA, the
    steering tap (``interp.taps``) among the splitting ops, so that graphs are captured
    piecewise around it and its Python body runs at every forward (full graphs would
    replay without it)."""
    from vllm.config import CompilationConfig
    from vllm.platforms import current_platform

    from ...interp.taps import OP_NAME

    if not current_platform.is_cuda_alike():
        return {}
    splitting = [
        *CompilationConfig._attention_ops,
        "vllm::unified_kv_cache_update",
        "vllm::unified_mla_kv_cache_update",
        OP_NAME,
    ]
    return {"splitting_ops": splitting, "cudagraph_mode": "PIECEWISE"}


def _prepare_env(options: dict[str, Any], card: dict[str, str] | None = None) -> None:
    """vLLM reads its environment at import: caches and sockets in a private temp dir, a
    modest CPU KV cache unless the operator set one, and whether the engine core runs in
    this process (executor ``uni``) or its own."""
    scratch = tempfile.mkdtemp(prefix="millm-vllm-")
    os.environ.setdefault("VLLM_CACHE_ROOT", scratch)
    os.environ.setdefault("VLLM_RPC_BASE_PATH", scratch)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("VLLM_DO_NOT_TRACK", "1")
    # "uni": the engine core and its one worker run in this process (no extra start-up);
    # a load on one card of several (cuda:N) runs it in its own process, which alone sees
    # that card: this process keeps its view of the cards for the loads after it
    in_process = options.get("distributed_executor_backend") == "uni" and card is None
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if in_process else "1"


@contextlib.contextmanager
def _environment(extra: dict[str, str] | None) -> Iterator[None]:
    """``extra`` in this process's environment while vLLM starts its engine core's process
    (which inherits it), restored after."""
    saved = {key: os.environ.get(key) for key in extra or {}}
    os.environ.update(extra or {})
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


class VllmBackend:
    """``gpu_engine.backends.base.ModelBackend`` on vLLM (see the module doc)."""

    name = "vllm"

    def __init__(self, job: LoadModelJob, hooks: HookManager | None = None) -> None:
        opts = dict(job.options)
        path = Path(job.path)
        self.job = job
        self.info = inspect_model_dir(path, job.dtype)
        if not self.info.supported and not job.trust_remote_code:
            raise UnsupportedArchitecture(self.info.architecture_class or "<none in config.json>")
        # MILLM_ENGINE_DEVICE: cuda:N -> CUDA_VISIBLE_DEVICES for the engine core's process
        card = card_env(job)
        _prepare_env(opts, card)
        from transformers import AutoTokenizer
        from vllm import EngineArgs, LLMEngine
        from vllm.config import StructuredOutputsConfig

        self.enforce_eager = bool(opts.get("enforce_eager", True))
        self.tp = int(opts.get("tensor_parallel_size", 1))
        self.pp = int(opts.get("pipeline_parallel_size", 1))
        executor = opts.get("distributed_executor_backend") or None
        if executor == "uni" and self.tp * self.pp > 1:
            raise InvalidParameter(
                "the uni executor runs one worker: tensor or pipeline parallelism needs mp or ray",
                param="options.distributed_executor_backend",
            )
        # VLLM_MAX_MODEL_LEN is a ceiling, as GGUF_CONTEXT_LENGTH is: above the model's own
        # window vLLM refuses the load outright (after the resident model is gone)
        own = job.max_context_length or self.info.context_length or None
        asked = opts.get("max_model_len") or None
        max_len = min(int(asked), int(own)) if asked and own else (asked or own)
        args: dict[str, Any] = dict(
            model=str(path),
            tokenizer=str(path),
            dtype=job.dtype,
            seed=0,
            trust_remote_code=job.trust_remote_code,
            max_model_len=max_len,
            max_num_seqs=int(opts.get("max_num_seqs") or 16),
            tensor_parallel_size=self.tp,
            pipeline_parallel_size=self.pp,
            distributed_executor_backend=executor,
            # compiled: the loader taps every layer before vLLM traces it (loader.py)
            enforce_eager=self.enforce_eager,
            enable_prefix_caching=True,
            # positions come from the runner's num_computed_tokens, exact only when the
            # scheduler does not run a step ahead of the outputs
            async_scheduling=False,
            worker_extension_cls=WORKER_EXTENSION,
            # structured requests bring their own grammar (gpu_engine.decode.grammar) for
            # xgrammar, the engine the other backends use; no fallback to another one
            structured_outputs_config=StructuredOutputsConfig(backend="xgrammar"),
        )
        if "gpu_memory_utilization" in opts:
            args["gpu_memory_utilization"] = float(opts["gpu_memory_utilization"])
        if self.enforce_eager:
            args["compilation_config"] = {"mode": 0}
        else:
            args["load_format"] = LOAD_FORMAT
            compilation = compiled_config()
            if compilation:
                args["compilation_config"] = compilation
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(
                str(path), local_files_only=True, trust_remote_code=job.trust_remote_code
            )
            with _environment(card):
                self.engine = LLMEngine.from_engine_args(EngineArgs(**args))
        except (OSError, ValueError, KeyError, RuntimeError) as exc:
            raise ModelLoadFailed(f"vLLM cannot load {path}: {exc}", details={"path": str(path)}) from exc
        # whether vLLM's engine core is still alive (liveness.py): status and every
        # command ask ``failure()``
        self._core_watch = CoreWatch(self.engine)
        described = self.engine.collective_rpc("millm_describe")
        first = described[0]
        self.layers_path = first["layers_path"]
        # where each hook point is on this model (the first rank's: it holds layer 0)
        self.hook_sites = first["hook_sites"]
        self.num_layers = int(first["num_layers"])
        self.worker_device = first["device"]
        # the engine keeps its SAE copy (validation, driver-side plans) on the host: the
        # model's device belongs to vLLM's workers, which load their own copy
        self.device = torch.device("cpu")
        self.sae_device = self.device
        self.dtype = TORCH_DTYPES[job.dtype]
        self.hidden_size = int(self.info.hidden_size or first["hidden_size"])
        self.context_length = int(self.engine.model_config.max_model_len)
        self.vocab_size = int(self.info.vocab_size or len(self.tokenizer))
        self.eos_token_ids = self._eos_ids(path)
        # GenerationJob.tools: whether (and how) the chat template renders tools
        self.tool_call_format = tool_template_format(
            getattr(self.tokenizer, "chat_template", None),
            functools.partial(self.tokenizer.apply_chat_template, tokenize=False),
        )
        self.kernels = f"vllm:{'eager' if self.enforce_eager else 'graphs'}"
        # the parameters vLLM's workers hold, every rank's summed (each holds its shard);
        # the KV cache and vLLM's buffers are its memory profile's (gpu_memory_utilization)
        by_dtype: dict[str, int] = {}
        for part in described:
            for name, n in (part.get("parameter_bytes") or {}).items():
                by_dtype[name] = by_dtype.get(name, 0) + int(n)
        self.weights: dict[str, Any] = {
            "quantization": None,
            "checkpoint_quantization": self._checkpoint_quantization(path),
            "bytes": sum(by_dtype.values()),
            "bytes_by_dtype": by_dtype,
            "counts": "parameters",
        }
        self._attachments: dict[AttachmentKey, Any] = {}
        self._generation: dict[AttachmentKey, str] = {}
        self._attach_counter = itertools.count(1)
        self._ids = itertools.count(1)
        # other requests' outputs a score's steps produced, for the batch's next step
        self._held: dict[str, Any] = {}
        # capture: the workers take the rows (each its own shard), the driver packs them
        att = first.get("attention")
        self.attention_geometry = (
            None
            if att is None
            else AttentionGeometry(int(att["num_heads"]), int(att["num_kv_heads"]), int(att["head_dim"]))
        )
        self._attention_layers = set(att["layers"]) if att is not None else set()
        self._scaling = list(att["scaling"]) if att is not None else []

    @staticmethod
    def _checkpoint_quantization(path: Path) -> str | None:
        """A pre-quantized checkpoint's own method (config.json's quantization_config)."""
        import json

        try:
            config = json.loads((path / "config.json").read_text())
        except (OSError, ValueError):
            return None
        method = (config.get("quantization_config") or {}).get("quant_method")
        return str(method) if method else None

    def failure(self) -> str | None:
        """Why this backend can no longer serve (its engine core died), or None."""
        watch = getattr(self, "_core_watch", None)
        return watch.check() if watch is not None else None

    def _eos_ids(self, path: Path) -> set[int]:
        import json

        ids: set[int] = set()
        sources: list[Any] = [self.tokenizer.eos_token_id]
        for name in ("generation_config.json", "config.json"):
            f = path / name
            if f.is_file():
                sources.append(json.loads(f.read_text()).get("eos_token_id"))
        for src in sources:
            if src is None:
                continue
            ids.update(src if isinstance(src, (list, tuple)) else [src])
        return {int(i) for i in ids}

    # the engine's capture plans on this backend only pack what the workers took
    captures_in_workers = True

    def attention_scaling(self, layer: int) -> float | None:
        """The factor layer ``layer``'s attention multiplies q·k by (vLLM's ``scale``)."""
        return self._scaling[layer] if layer < len(self._scaling) else None

    def capabilities(self) -> Capabilities:
        # Q/K capture taps vLLM's Attention module: every layer must have one
        qk = getattr(self, "attention_geometry", None) is not None and getattr(self, "_attention_layers", set()) == set(
            range(getattr(self, "num_layers", 0))
        )
        return Capabilities(
            # eager: hooks on the layers; compiled: the same hooks on the layers' taps
            per_request_steering=True,
            # the workers' hooks route every request's controls (interp.hooks.route)
            steering_controls=True,
            # SteeringEntry.splice: a control table of its own there (interp.controls)
            splice=True,
            hidden_state_capture=True,
            attention_capture=qk,
            # SamplingParams.structured rides to vLLM's own structured outputs (batch.py)
            structured_output=True,
            # where the chat template renders tools; calls constrained as structured output
            tool_calling=self.tool_call_format is not None,
            tool_call_format=self.tool_call_format,
            per_request_monitoring=True,
            exact_monitoring_attribution=True,
            embeddings=False,
            serial_mode=False,
            # compiled: vLLM's torch.compile, and on CUDA its graphs (piecewise, around the
            # taps); steering_apply_count proves the taps ran at every forward
            cuda_graphs=not self.enforce_eager and self.worker_device.startswith("cuda"),
            torch_compile=not self.enforce_eager,
            prefix_caching=True,
            steered_prefix_cache_keyed_by_steering=True,
            # GenerationJob.distributions_from: vLLM hands back a prompt position's top
            # ``max_logprobs`` entries as Python objects, never the whole row
            prompt_distributions=False,
            prompt_distributions_reason=(
                "vLLM returns prompt log-probabilities as top-k entries (max_logprobs), not the "
                "full vocabulary's log-softmax rows; use the transformers or llama.cpp backend"
            ),
            # the points this model gives exactly (wire.hook_site refuses the others)
            hook_points=supported_points(getattr(self, "hook_sites", None)),
            # the attribution command: vLLM's workers run inference only
            gradients=False,
            gradients_reason=(
                "vLLM computes no gradients (its workers run the model in inference mode); load the "
                "model on the transformers backend for attribution"
            ),
        )

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
        return self.encode_text(text, add_special_tokens=False)

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def unembedding(self) -> torch.Tensor:
        """``lm_head.weight`` (or the tied input embedding) read from the checkpoint's
        safetensors files, float32 on the host: the model itself lives in the workers."""
        return unembedding_from_safetensors(self.job.path)

    # ------------------------------------------------------------------ attachments

    def layer_module_path(self, layer: int, hook_point: str = "resid_post") -> str:
        if not 0 <= layer < self.num_layers:
            raise InvalidParameter(f"layer {layer} is outside 0..{self.num_layers - 1}", param="layer")
        return hook_site(layer, hook_point, self.hook_sites)[0]

    def attach(self, attachment: Any) -> None:
        cfg = attachment.sae.cfg
        done = self.engine.collective_rpc(
            "millm_attach", args=(attachment.sae_id, attachment.layer, str(cfg.path), cfg.layout)
        )
        if not any(done):
            raise ModelLoadFailed(
                f"no vLLM worker holds {hook_site(attachment.layer, cfg.hook_point, self.hook_sites)[0]}"
            )
        self._attachments[attachment.key] = attachment
        # a re-attached key is another SAE: cached KV of the old one must not be reused
        self._generation[attachment.key] = f"{cfg.path}#{next(self._attach_counter)}"

    def detach(self, key: AttachmentKey) -> None:
        self.engine.collective_rpc("millm_detach", args=(key[0], key[1]))
        self._attachments.pop(key, None)
        self._generation.pop(key, None)

    # ------------------------------------------------------------------ generation

    def generate(self, **kwargs: Any) -> Any:
        raise InvalidParameter(
            "the vLLM backend runs generations in its batch only (serial_mode is False)", param="batching"
        )

    def batch_runner(self, *, max_rows: int) -> Any:
        from .batch import VllmBatch

        return VllmBatch(self, max_rows=max_rows)

    def new_sequence(
        self,
        job: GenerationJob,
        *,
        prompt_ids: list[int],
        max_tokens: int,
        request_hooks: Any,
        emit: Any,
        should_stop: Any,
    ) -> Any:
        from .batch import VllmSequence

        return VllmSequence(
            self,
            job,
            prompt_ids=prompt_ids,
            max_tokens=max_tokens,
            request_hooks=request_hooks,
            emit=emit,
            should_stop=should_stop,
        )

    def next_request_id(self, request_id: str) -> str:
        # vLLM needs unique ids among its live requests; ours may repeat
        return f"{request_id}#{next(self._ids)}"

    # ------------------------------------------------------------------ one-shot work

    def embed(self, job: EmbedJob, inputs: Sequence[list[int]]) -> EmbedResult:
        raise InvalidParameter(
            "the vLLM backend serves generation models only: embeddings are not available "
            "(load the model on the transformers backend for /v1/embeddings)",
            param="model",
            details={"backend": self.name, "capability": "embeddings"},
        )

    def score(self, job: ScoreJob, prompt_ids: list[int]) -> ScoreResult:
        """Next-token log-probabilities and prompt log-probabilities from one-token vLLM
        requests (unsteered: scores read the plain model), as ``sampling.score_result``
        computes them on the other backends: the top ``top_k`` of the vocabulary, or the
        ``allowed_token_ids`` in the order given (``top``: the ``top_k`` among them).

        Allowed ids ride in ``SamplingParams.logprob_token_ids``, which vLLM's sampler
        gathers from the raw log-softmax of the full vocabulary (before temperature, bias
        or any logits processor), at most ``MAX_LOGPROB_TOKEN_IDS`` (128) ids a request: a
        longer set is split, its first request run alone so that the others (all added
        together) read the prompt's KV from the prefix cache."""
        from vllm import SamplingParams as VllmSampling
        from vllm.sampling_params import MAX_LOGPROB_TOKEN_IDS

        top_k = int(job.top_k or 0)
        allowed_ids = None if job.allowed_token_ids is None else [int(t) for t in job.allowed_token_ids]
        prompt = {"prompt_token_ids": list(prompt_ids)}

        def params(ids: list[int] | None, first: bool) -> Any:
            return VllmSampling(
                max_tokens=1,
                temperature=0.0,
                logprobs=(top_k or None) if allowed_ids is None else None,
                logprob_token_ids=ids,
                prompt_logprobs=0 if job.prompt_logprobs and first else None,
                ignore_eos=True,
            )

        distinct = list(dict.fromkeys(allowed_ids or []))
        # no allowed ids (or an empty set, which still answers the prompt's logprobs): one request
        chunks = [distinct[i : i + MAX_LOGPROB_TOKEN_IDS] for i in range(0, len(distinct), MAX_LOGPROB_TOKEN_IDS)]
        first, *rest = [params(c, n == 0) for n, c in enumerate(chunks or [None])]
        batches = [[first], rest] if rest else [[first]]
        finals = [out for batch in batches for out in self._one_token(job.request_id, prompt, batch)]
        first_out = finals[0]
        top: list[LogprobEntry] = []
        allowed: list[LogprobEntry] = []
        if allowed_ids is not None:
            # vLLM's entry for one position is keyed by token id (the sampled token's too)
            read: dict[int, float] = {}
            for out in finals:
                if out.outputs[0].logprobs:
                    read.update({int(t): float(lp.logprob) for t, lp in out.outputs[0].logprobs[0].items()})
            allowed = [LogprobEntry(t, self.token_text(t), read[t]) for t in allowed_ids]
            if top_k:
                top = sorted(allowed, key=lambda e: -e.logprob)[:top_k]
        elif top_k and first_out.outputs[0].logprobs:
            entries = sorted(first_out.outputs[0].logprobs[0].items(), key=lambda kv: kv[1].rank)
            top = [
                LogprobEntry(int(t), self.token_text(int(t)), float(lp.logprob))
                for t, lp in entries
                if lp.rank <= top_k
            ][:top_k]
        prompt_lp = None
        if job.prompt_logprobs:
            prompt_lp = [None] + [float(d[t].logprob) for d, t in zip(first_out.prompt_logprobs[1:], prompt_ids[1:])]
        return ScoreResult(job.request_id, len(prompt_ids), top, allowed, prompt_lp)

    def _one_token(self, request_id: str, prompt: dict[str, Any], batch: list[Any]) -> list[Any]:
        """Run one-token requests (vLLM ``SamplingParams``, all added before the first
        step) on one prompt to their end; their final outputs in ``batch``'s order.  A
        score runs between the batch's steps, so these steps advance its generations too:
        their outputs are held for the batch (``take_held``), never dropped."""
        rids = [self.next_request_id(request_id) for _ in batch]
        worker_rids = []
        finals: dict[str, Any] = {}
        try:
            for rid, p in zip(rids, batch):
                worker_rids.append(self.engine.add_request(rid, dict(prompt), p))
            while len(finals) < len(rids):
                for out in self.engine.step():
                    if out.request_id in rids:
                        if out.finished:
                            finals[out.request_id] = out
                    else:
                        # a running generation's: the batch reads it at its next step
                        self._held[out.request_id] = out
        except BaseException:
            self.engine.abort_request([r for r in rids if r not in finals])
            raise
        finally:
            # a score runs unsteered, but the workers saw it pass: forget it there
            self.collect(worker_rids, final=True)
        return [finals[rid] for rid in rids]

    def take_held(self) -> list[Any]:
        """The running generations' outputs that scores' steps produced since the batch's
        last step, the latest of each request (vLLM's cumulative outputs: it holds the
        earlier ones' tokens and logprobs)."""
        held, self._held = list(self._held.values()), {}
        return held

    def collect(self, request_ids: list[str], *, final: bool) -> dict[str, Any]:
        """Counts, monitor records, fired positions and capture parts from the workers,
        merged over ranks: records and fired positions come from the first TP rank of
        each pipeline stage only (TP ranks compute the same; a stage reports the
        attachments it holds), steering counts — in all and per mode — are the largest
        any rank saw (pipeline stages hold different layers), every rank's capture part
        is kept (each holds its own heads; ``CapturePlan`` packs them).  Per request:
        ``applied`` ``{key: (count, {mode: count})}``, ``fired`` ``{key: [[index, mode,
        positions], ...]}`` (the plan's order)."""
        merged: dict[str, Any] = {}
        stats: dict[AttachmentKey, int] = {}
        for part in self.engine.collective_rpc("millm_collect", args=(list(request_ids), final)):
            for sae_id, layer, n in part["stats"]:
                stats[(sae_id, int(layer))] = max(stats.get((sae_id, int(layer)), 0), int(n))
            for rid, got in part["requests"].items():
                cur = merged.setdefault(rid, {"forwards": 0, "applied": {}, "fired": {}, "records": [], "capture": []})
                cur["forwards"] = max(cur["forwards"], got["forwards"])
                for sae_id, layer, n, modes in got["applied"]:
                    key = (sae_id, int(layer))
                    count, seen = cur["applied"].get(key, (0, {}))
                    for mode, m in modes.items():
                        seen[mode] = max(seen.get(mode, 0), int(m))
                    cur["applied"][key] = (max(count, int(n)), seen)
                for sae_id, layer, index, mode, positions in got.get("fired", []):
                    cur["fired"].setdefault((sae_id, int(layer)), []).append([int(index), mode, list(positions)])
                cur["records"].extend(got["records"])
                cur["capture"].extend(got.get("capture", []))
        self._stats = stats
        return merged

    def refresh_stats(self) -> None:
        """Each attachment's cumulative steering_apply_count as the workers last reported it."""
        for key, n in getattr(self, "_stats", {}).items():
            att = self._attachments.get(key)
            if att is not None:
                att.stats.steering_apply_count = n

    def close(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is None:
            return
        self.engine = None  # type: ignore[assignment]
        watch = getattr(self, "_core_watch", None)
        if watch is not None:
            watch.close()  # shutting the core down is no failure
        try:
            engine.collective_rpc("millm_close")
        except Exception:  # noqa: BLE001 - the workers are going away anyway
            pass
        shutdown = getattr(engine, "shutdown", None) or getattr(getattr(engine, "engine_core", None), "shutdown", None)
        if shutdown is not None:
            shutdown()


__all__ = ["VllmBackend", "WORKER_EXTENSION"]
