"""What travels between the vLLM backend's driver (the engine process) and vLLM's workers.

A request's steering, monitoring and capture spec ride in its own
``SamplingParams.extra_args`` under ``"millm"`` — never in process-global state — so a
worker reads them from the request it is running, whichever process or rank it is.
Records and counts come back through the worker extension's ``collective_rpc`` calls as
plain builtins (msgspec's own ``to_builtins``/``from_builtins``: nothing is pickled by
us); a capture comes back as each worker's part, the safetensors bytes of what it took.
Torch-free.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import msgspec

from ...api.protocol import (
    ActivationRecord,
    AttachmentKey,
    CaptureSpec,
    GenerationJob,
    MonitorEntry,
    SteeringEntry,
    from_builtins,
    to_builtins,
)
from ...sae.hookpoints import HOOK_POINTS

EXTRA_KEY = "millm"

# every hook point the transformers backend hooks (gpu_engine.sae.hookpoints), each on the
# module whose output is that tensor on vLLM's model (the workers' ``hook_sites``, loader.py):
# resid_post / resid_pre of L >= 1 the decoder layer's ``(hidden, residual)`` pair,
# resid_pre of 0 the embedding module, attn_out / mlp_out the sub-block's module (its
# output after the row-parallel projection's all-reduce), a transcoder the MLP (reads its
# input, writes its output).  A point a model cannot give exactly is refused there.
VLLM_HOOK_POINTS = HOOK_POINTS


def hook_site(layer: int, hook_point: str, sites: dict[str, Any]) -> tuple[str, int, str]:
    """``(module path, decoder layer, kind)`` of an SAE of ``hook_point`` attached at
    ``layer``, from a worker's ``hook_sites``: the module the hook goes on, the decoder
    layer a rank must hold to run it (pipeline parallelism), and how it hooks (``pair``:
    the layer's ``(hidden, residual)`` pair; ``output``: the module's output; ``input``:
    reads the module's input, writes its output).  Refuses (``sae_incompatible``, naming
    the points this model supports) what the workers cannot hook exactly."""
    from ...api.errors import SAEIncompatible

    layers = sites["layers"]
    if hook_point == "resid_post":
        return f"{layers}.{layer}", layer, "pair"
    if hook_point == "resid_pre" and layer > 0:
        return f"{layers}.{layer - 1}", layer - 1, "pair"
    site = "embed" if hook_point == "resid_pre" else hook_point
    name = sites.get(site)
    if name is not None:
        if site == "embed":
            return name, 0, "output"
        return f"{layers}.{layer}.{name}", layer, "input" if hook_point == "mlp_transcoder" else "output"
    where = "resid_pre of layer 0 (the embeddings' output)" if site == "embed" else hook_point
    why = sites.get("why", {}).get(site) or "this model has no module that gives it exactly"
    supported = supported_points(sites)
    raise SAEIncompatible(
        f"the vLLM backend cannot hook {where} on this model: {why}; it supports {', '.join(supported)}"
        + (" (resid_pre of layers >= 1)" if sites.get("embed") is None else ""),
        details={"backend": "vllm", "hook_point": hook_point, "layer": layer, "supported": supported},
    )


def supported_points(sites: dict[str, Any] | None) -> list[str]:
    """The hook points a model with ``sites`` reaches at some layer (all of them with no
    sites known: resid_pre counts where only layers >= 1 are reached)."""
    if sites is None:
        return list(VLLM_HOOK_POINTS)
    return [p for p in VLLM_HOOK_POINTS if p in ("resid_post", "resid_pre") or sites.get(p) is not None]


def request_args(job: GenerationJob) -> dict[str, Any] | None:
    """The ``extra_args`` entry for ``job``: its steering entries in full (``SteeringEntry``
    as builtins: features and controls, only the entries that steer something), the
    monitor entries and the capture spec (what the workers take: layers, positions,
    attention; not where the driver stores it); None when it has none of them.  The
    workers build their plans from these with the engine's own builder
    (``gpu_engine.interp.plans.build_hooks``)."""
    steering = [to_builtins(e) for e in (job.steering.entries if job.steering else []) if not e.is_empty()]
    monitor = [to_builtins(m) for m in (job.monitor.entries if job.monitor else [])]
    capture = None
    if job.capture is not None:
        capture = to_builtins(msgspec.structs.replace(job.capture, directory=None, model=""))
    if not steering and not monitor and capture is None:
        return None
    return {"steering": steering, "monitor": monitor, "capture": capture}


def decode_args(args: dict[str, Any]) -> tuple[list[SteeringEntry], list[MonitorEntry]]:
    steering = [from_builtins(e, SteeringEntry) for e in args.get("steering", [])]
    monitor = [from_builtins(m, MonitorEntry) for m in args.get("monitor", [])]
    return steering, monitor


def decode_capture(args: dict[str, Any]) -> CaptureSpec | None:
    raw = args.get("capture")
    return None if raw is None else from_builtins(raw, CaptureSpec)


def keeps_gates(args: dict[str, Any] | None) -> bool:
    """Whether the request has a conditional control, whose gates are reported for every
    row (``steering_fired``): its prompt rows must be computed, never read from cache."""
    return bool(args) and any(c.get("condition") for e in args["steering"] for c in e.get("controls") or ())


def steering_salt(
    args: dict[str, Any] | None, generations: dict[AttachmentKey, str], *, n_prompt: int | None = None
) -> str | None:
    """The prefix-cache salt of a steered request: a hash of its canonical steering (entries
    sorted, features by index, strengths as floats, controls as given) and of which SAE
    files the attachments it names hold (``generations``: the key's attachment identity),
    so KV computed under one steering is only ever reused by a request under the same
    steering.  A control with a ``prompt`` or ``completion`` phase steers a position by
    where the prompt ends, which a cached block (prompt and generated tokens alike) does
    not record: such a request's salt also holds its prompt length ``n_prompt``.  None
    when unsteered."""
    if not args or not args["steering"]:
        return None
    canon: list[Any] = []
    if any(
        (c.get("phase") or "all") != "all"
        for e in args["steering"]
        for c in [*(e.get("controls") or ()), *(e.get("vectors") or ())]
    ):
        canon.append(["prompt_len", n_prompt])
    for e in args["steering"]:
        key = (e["sae_id"], int(e["layer"]))
        feats = sorted([int(i), float(s)] for i, s in (e.get("features") or {}).items())
        item = [key[0], key[1], feats, generations.get(key, "")]
        if e.get("controls"):
            item.append(e["controls"])
        if e.get("vectors"):
            # inline vectors as sent (their bytes are base64 text in builtins)
            item.append(e["vectors"])
        if e.get("splice"):
            # every row replaced: by the reconstruction and by zeros are apart
            item.append(["splice", e["splice"]])
        canon.append(item)
    canon.sort(key=lambda item: json.dumps(item, sort_keys=True))
    return "millm-steer-" + hashlib.sha256(json.dumps(canon).encode()).hexdigest()[:32]


def namespaced_salt(salt: str | None, namespace: str | None) -> str | None:
    """The prefix-cache salt of a request in a cache namespace (``GenerationJob.cache_namespace``,
    /v1's ``prompt_cache_key``): a hash of the namespace and of its steering salt, so its KV
    is reused only by requests under the same namespace and the same steering. ``salt``
    unchanged without a namespace."""
    if namespace is None:
        return salt
    return "millm-ns-" + hashlib.sha256(json.dumps([namespace, salt]).encode()).hexdigest()[:32]


def records_from(raw: list[Any]) -> list[ActivationRecord]:
    return [from_builtins(r, ActivationRecord) for r in raw]


__all__ = [
    "EXTRA_KEY",
    "VLLM_HOOK_POINTS",
    "decode_args",
    "hook_site",
    "decode_capture",
    "keeps_gates",
    "records_from",
    "request_args",
    "steering_salt",
    "supported_points",
]
