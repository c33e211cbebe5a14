"""What a loaded backend reports it can do: one typed struct, read as attributes.

Every backend's ``capabilities()`` returns a ``Capabilities`` (``gpu_engine.backends.base``).
The engine refuses (``invalid_parameter`` naming the field, before anything runs) a request
needing a capability the backend lacks (``check_capabilities``; embeddings, scoring and
hidden states in the runtime's ``Engine``), and the web refuses settings that would fail
every request (``core.capabilities``).

The keys every backend reports (``CAPABILITY_KEYS``) default to True: a backend names what
it lacks. The rest belong to some backends only; they are ``UNSET`` (falsy, and left out of
the JSON) where a backend does not report them, so the status a backend reports names
exactly the keys it has. In ``EngineStatus.batching["capabilities"]`` they travel as JSON
(``to_builtins``); ``EngineStatus.capabilities`` and ``capabilities_of`` read them back.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec
from msgspec import UNSET, UnsetType


class Capabilities(msgspec.Struct, kw_only=True):
    # ---- every backend reports these (``CAPABILITY_KEYS``), each True unless it lacks it
    per_request_sampling: bool = True
    per_request_seeds: bool = True
    stop_sequences: bool = True
    cancellation: bool = True
    per_request_steering: bool = True
    # feature controls beyond a plain add (clamp, scale, ablate, phases, windows,
    # conditions: ``FeatureControl``), per request
    steering_controls: bool = True
    per_request_monitoring: bool = True
    exact_monitoring_attribution: bool = True
    logprobs: bool = True
    prompt_logprobs: bool = True
    embeddings: bool = True
    scoring: bool = True
    # the generation modes it runs: one at a time (``generate``), the engine's batch
    # (``batch_runner``)
    serial_mode: bool = True
    batched_mode: bool = True
    # GenerationJob.capture: hidden states of chosen layers per request
    hidden_state_capture: bool = True
    # CaptureSpec.attention: rotated Q and K of chosen layers and heads per request
    attention_capture: bool = True
    # SamplingParams.structured (/v1 response_format): per-request grammar masks, in a
    # batch on that request's row only
    structured_output: bool = True
    # GenerationJob.tools: the chat template renders tools (with ``tool_call_format``:
    # ``gpu_engine.api.sampling.TOOL_CALL_FORMATS``)
    tool_calling: bool = True

    # ---- reported by some backends only (UNSET: this backend does not say)
    # the hook points an attachment may name (``gpu_engine.sae.hookpoints``)
    hook_points: list[str] | UnsetType = UNSET
    # how the chat template writes a tool call (None: it renders no tools)
    tool_call_format: str | None | UnsetType = UNSET
    # Engine.hidden_states (transformers)
    hidden_states: bool | UnsetType = UNSET
    # SPECULATIVE_MODEL: the serial path's draft, when one is set (transformers)
    speculative_decoding: bool | UnsetType = UNSET
    speculative_model: str | None | UnsetType = UNSET
    # TORCH_COMPILE as in force, with its figures (mode, compiles, cache_resets), and
    # KV_CACHE_MODE (transformers; vLLM reports torch_compile and cuda_graphs)
    torch_compile: bool | UnsetType = UNSET
    torch_compile_status: dict[str, Any] | None | UnsetType = UNSET
    kv_cache_mode: str | UnsetType = UNSET
    # the one-token decode step without model.forward, and why not (transformers)
    lean_decode: bool | UnsetType = UNSET
    lean_decode_reason: str | None | UnsetType = UNSET
    # MILLM_ENGINE_FUSED_KERNELS: the lean step's small ops in C, and why not
    fused_cpu_kernels: bool | UnsetType = UNSET
    fused_cpu_kernels_reason: str | None | UnsetType = UNSET
    # MILLM_ENGINE_PACK_WEIGHTS=auto: the one-row timings it chose by (default_ms,
    # packed_ms, bytes)
    kernel_probe: dict[str, Any] | None | UnsetType = UNSET
    # why ``steering_controls`` is off, where a backend says (llama.cpp's swap mode); the
    # refusal of a request with a control carries it
    steering_controls_reason: str | None | UnsetType = UNSET
    # llama.cpp: how requests with different steering share a batch, and why
    steering_mode: str | UnsetType = UNSET
    steering_mode_reason: str | None | UnsetType = UNSET
    control_vectors: bool | UnsetType = UNSET
    native_eval_filter: bool | UnsetType = UNSET
    # vLLM: CUDA graphs (compiled on CUDA, piecewise around the steering taps), prefix
    # caching keyed by steering
    cuda_graphs: bool | UnsetType = UNSET
    prefix_caching: bool | UnsetType = UNSET
    # transformers and llama.cpp: PREFIX_CACHE_MAX_MB's cache (gpu_engine/decode/prefix_cache.py)
    # in force, and why not where it is off
    prefix_caching_reason: str | None | UnsetType = UNSET
    steered_prefix_cache_keyed_by_steering: bool | UnsetType = UNSET
    # SteeringEntry.splice: an attachment's hook rows replaced by the SAE's reconstruction
    # (or zeros), and why not where a backend cannot
    splice: bool | UnsetType = UNSET
    splice_reason: str | None | UnsetType = UNSET
    # GenerationJob.distributions_from: the full next-token log-softmax at prompt rows
    # (transformers, llama.cpp), and why not where a backend lacks it
    prompt_distributions: bool | UnsetType = UNSET
    prompt_distributions_reason: str | None | UnsetType = UNSET
    # the runtime's own (``Engine.batching_status``): whether the batch shares forward passes
    shared_forward_passes: bool | UnsetType = UNSET
    serial_fallback: bool | UnsetType = UNSET
    # the ``attribution`` command: gradients of a logit through an attached SAE
    # (transformers); where False, the reason the refusal carries
    gradients: bool | UnsetType = UNSET
    gradients_reason: str | None | UnsetType = UNSET


# the keys every backend reports (the struct's first fields, each a plain bool)
CAPABILITY_KEYS = tuple(name for name in Capabilities.__struct_fields__ if Capabilities.__annotations__[name] == "bool")


def capabilities_of(report: Capabilities | Mapping[str, Any] | None) -> Capabilities | None:
    """``report`` (a backend's ``Capabilities``, or its JSON as the engine's status carries
    it) read as a ``Capabilities``; None where nothing is reported (no model loaded). Keys
    the struct does not declare (a plugged-in backend's own) are left out."""
    if report is None or isinstance(report, Capabilities):
        return report
    if not report:
        return None
    return msgspec.convert(report, Capabilities)


__all__ = ["CAPABILITY_KEYS", "Capabilities", "capabilities_of"]
