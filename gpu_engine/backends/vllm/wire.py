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

EXTRA_KEY = "millm"

# the hook points the workers reach exactly: vLLM's decoder layers return the
# ``(hidden, residual)`` pair, so the residual stream is a layer's output pair — after
# layer L (resid_post) or after layer L-1 (resid_pre of L >= 1).  Sub-block outputs and
# transcoders are refused: nothing here has tested where vLLM's fused modules put them.
VLLM_HOOK_POINTS = ("resid_post", "resid_pre")


def hook_layer(layer: int, hook_point: str) -> int:
    """The decoder layer whose output pair an SAE of ``hook_point`` attached at ``layer``
    hooks; refuses (``sae_incompatible``) what the workers cannot hook exactly."""
    from ...api.errors import SAEIncompatible

    if hook_point == "resid_post":
        return layer
    if hook_point == "resid_pre" and layer > 0:
        return layer - 1
    where = "resid_pre of layer 0 (the embeddings' output)" if hook_point == "resid_pre" else repr(hook_point)
    raise SAEIncompatible(
        f"the vLLM backend cannot hook {where}; it supports resid_post and resid_pre of layers >= 1 "
        "(the transformers backend hooks every point)",
        details={"backend": "vllm", "hook_point": hook_point, "layer": layer, "supported": list(VLLM_HOOK_POINTS)},
    )


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
    if any((c.get("phase") or "all") != "all" for e in args["steering"] for c in e.get("controls") or ()):
        canon.append(["prompt_len", n_prompt])
    for e in args["steering"]:
        key = (e["sae_id"], int(e["layer"]))
        feats = sorted([int(i), float(s)] for i, s in (e.get("features") or {}).items())
        item = [key[0], key[1], feats, generations.get(key, "")]
        if e.get("controls"):
            item.append(e["controls"])
        canon.append(item)
    canon.sort(key=lambda item: json.dumps(item, sort_keys=True))
    return "millm-steer-" + hashlib.sha256(json.dumps(canon).encode()).hexdigest()[:32]


def records_from(raw: list[Any]) -> list[ActivationRecord]:
    return [from_builtins(r, ActivationRecord) for r in raw]


__all__ = [
    "EXTRA_KEY",
    "decode_args",
    "decode_capture",
    "keeps_gates",
    "records_from",
    "request_args",
    "steering_salt",
]
