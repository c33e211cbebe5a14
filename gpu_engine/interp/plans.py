"""The one plan builder: a request's steering, monitors and capture as the hooks' plans.

Two halves, so that every check runs once and every backend builds the same tensors:

- ``check_request`` runs on the engine's process before anything is queued: every named
  attachment exists, every feature index is in range, nothing reads an encoder a raw
  vector lacks, every control's phase and window select a position;
- ``build_hooks`` only builds: per attachment the plain adds' delta, the feature controls'
  ``ControlTable`` (a splice is one of no operation) and the ``MonitorPlan``s, from the
  SAEs the caller holds.  The engine calls it (through ``request_hooks``) with its
  attachments; a vLLM worker calls it with the SAEs loaded on its rank, from the entries
  its request carried (``vllm/wire.py``), and skips the attachments a pipeline stage does
  not hold.

``with_capture`` adds the capture plan, after its own checks (layers, heads, size).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Protocol

import torch

from ..api.errors import CaptureStoreFull, CaptureTooLarge, InvalidParameter, SAENotAttached
from ..api.protocol import AttachmentKey, GenerationJob, LoadModelJob, MonitorEntry, SteeringEntry
from ..api.steering import ENCODER_MODES, SteeringVector, refuse_encoder_controls
from ..api.vectors import as_float32
from ..sae.module import SAE
from .capture import AttentionGeometry, CapturePlan, estimate_bytes
from .controls import ControlTable, control_range
from .hooks import AttachmentPlan, RequestHooks
from .monitors import MonitorPlan


class HoldsSAE(Protocol):
    """An attachment as the plan builder reads it (the runtime's ``Attachment``)."""

    sae: SAE


class PlansFor(Protocol):
    """The loaded backend as the plan builder reads it: members every backend has
    (``gpu_engine.backends.base.ModelBackend``, whose load fails naming one a backend
    lacks), declared here since this layer imports no backend."""

    name: str
    job: LoadModelJob
    device: torch.device
    # where an attached SAE's tensors, and so a request's deltas, live
    sae_device: torch.device
    dtype: torch.dtype
    context_length: int
    num_layers: int
    hidden_size: int
    attention_geometry: AttentionGeometry | None
    # True where worker processes take a capture's rows (vLLM): the plan allocates nothing
    captures_in_workers: bool

    def attention_scaling(self, layer: int) -> float | None: ...


def steering_entries(job: GenerationJob) -> list[SteeringEntry]:
    """The job's steering entries that steer something."""
    return [e for e in (job.steering.entries if job.steering else []) if not e.is_empty()]


def monitor_entries(job: GenerationJob) -> list[MonitorEntry]:
    return list(job.monitor.entries) if job.monitor else []


def _attached(saes: Mapping[AttachmentKey, SAE], key: AttachmentKey) -> SAE:
    sae = saes.get(key)
    if sae is None:
        raise SAENotAttached(
            f"SAE {key[0]!r} is not attached at layer {key[1]}", details={"sae_id": key[0], "layer": key[1]}
        )
    return sae


def check_request(
    saes: Mapping[AttachmentKey, SAE],
    steering: Iterable[SteeringEntry],
    monitors: Iterable[MonitorEntry],
    *,
    n_prompt: int,
    context_length: int,
) -> None:
    """Refuse, before anything is built or queued, a plan the model or its attachments
    cannot carry out; ``build_hooks`` then trusts what it is given."""
    for entry in steering:
        sae = _attached(saes, entry.key)
        # the one range check of a request's steering indices (the web checks none of
        # what it sends here); ``param`` names the field as /v1 writes it
        sae.check_indices(entry.sae_id, [*entry.features, *(c.index for c in entry.controls)], "steering.features")
        triggers = [c.condition.feature for c in entry.controls if c.condition is not None]
        sae.check_indices(entry.sae_id, triggers, "steering.features.condition.feature")
        if not sae.has_encoder:
            refuse_encoder_controls(entry)
            if entry.splice == "reconstruction":
                raise InvalidParameter(
                    f"{entry.sae_id!r} is a raw steering vector: it has no encoder, so it reconstructs "
                    "nothing (splice zero needs none)",
                    param="steering.splice",
                    details={"sae_id": entry.sae_id, "layer": entry.layer, "splice": entry.splice},
                )
        for v in entry.vectors:
            if v.width != sae.d_in:
                raise InvalidParameter(
                    f"an inline steering vector at {entry.sae_id!r} (layer {entry.layer}) is {v.width} wide; "
                    f"the stream it is added to there is {sae.d_in} wide",
                    param="steering.vectors.data",
                    details={"sae_id": entry.sae_id, "layer": entry.layer, "width": v.width, "expected": sae.d_in},
                )
        for c in entry.controls:
            if c.no_op:
                continue
            start, end = control_range(c, n_prompt)
            if c.window is not None and c.window.start >= context_length:
                raise InvalidParameter(
                    f"steering window starts at {c.window.start}, past the context window ({context_length} positions)",
                    param="steering.features.window",
                    details={"index": c.index, "context_length": context_length},
                )
            if start >= min(end, context_length):
                raise InvalidParameter(
                    f"feature {c.index}'s phase {c.phase!r} and window select no position of this "
                    f"request (prompt of {n_prompt} tokens)",
                    param="steering.features.window",
                    details={"index": c.index, "prompt_tokens": n_prompt},
                )
    for mon in monitors:
        sae = _attached(saes, mon.key)
        if not sae.has_encoder:
            raise InvalidParameter(
                f"{mon.sae_id!r} is a raw steering vector: it has no encoder, so nothing can be monitored with it",
                param="monitor.sae_id",
                details={"sae_id": mon.sae_id, "layer": mon.layer},
            )
        sae.check_indices(mon.sae_id, mon.features, "monitor.features")
        if mon.fidelity and sae.cfg.hook_point == "mlp_transcoder":
            raise InvalidParameter(
                f"{mon.sae_id!r} is a transcoder: it reads its MLP's input and predicts its output, so "
                "the rows it reads are not what it reconstructs; a fidelity monitor reads an SAE",
                param="monitor.fidelity",
                details={"sae_id": mon.sae_id, "layer": mon.layer, "hook_point": sae.cfg.hook_point},
            )


def build_hooks(
    saes: Mapping[AttachmentKey, SAE],
    request_id: str,
    steering: Iterable[SteeringEntry],
    monitors: Iterable[MonitorEntry],
    *,
    n_prompt: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> RequestHooks:
    """The request's plans from checked entries (``check_request``): an attachment missing
    from ``saes`` is one this caller does not hold (a pipeline stage) and is skipped."""
    plans: dict[AttachmentKey, AttachmentPlan] = {}
    for entry in steering:
        sae = saes.get(entry.key)
        if sae is None or entry.is_empty():
            continue
        plan = plans.setdefault(entry.key, AttachmentPlan(entry.key))
        vectors = [(v, _vector(v, sae)) for v in entry.vectors if not v.no_op]
        everywhere = [t for v, t in vectors if v.phase == "all" and not v.projects]
        phased = [(v, t) for v, t in vectors if v.phase != "all" or v.projects]
        if entry.features or everywhere:
            # summed in the SAE dtype and cast once, as the features' delta is
            delta = (
                sae.steering_delta(entry.features, dtype=sae.dtype, device=sae.W_dec.device) if entry.features else None
            )
            for t in everywhere:
                delta = t if delta is None else delta + t
            if any(v.projects for v, _ in phased):
                # a clamp reads the row as steered: the plain adds run first, in its table
                phased.insert(0, (_PLAIN_ADDS, delta))  # type: ignore[arg-type]
            else:
                plan.delta = delta.to(device=device, dtype=dtype)  # type: ignore[union-attr]
        controls = [c for c in entry.controls if not c.no_op]
        if controls or phased or entry.splice is not None:
            plan.controls = ControlTable.build(controls, sae, prompt_len=n_prompt, vectors=phased, splice=entry.splice)
            plan.cols = (0, plan.controls.size)
    for mon in monitors:
        sae = saes.get(mon.key)
        if sae is None:
            continue
        plan = plans.setdefault(mon.key, AttachmentPlan(mon.key))
        mp = MonitorPlan(mon, sae, prompt_len=n_prompt)
        (plan.pre if mon.read_point == "pre_steering" else plan.post).append(mp)
    return RequestHooks(request_id, plans)


# the op of an attachment's plain adds (features, unphased vector adds) in a table that
# clamps: an add of its row, 1 at every position (its bytes are never read)
_PLAIN_ADDS = SteeringVector(b"\0\0\0\0")


def _vector(vector: SteeringVector, sae: SAE) -> torch.Tensor:
    """An add's ``strength · v``, a clamp's ``v`` (its table normalises it and applies the
    strength per row), in the SAE dtype, on its device (checked: ``check_request``)."""
    values = torch.from_numpy(as_float32(vector.dtype, vector.data, "steering.vectors.data").copy())
    values = values.to(device=sae.W_dec.device, dtype=sae.dtype)
    return values if vector.projects else values * vector.strength


def request_hooks(
    backend: PlansFor, attachments: Mapping[AttachmentKey, HoldsSAE], job: GenerationJob, n_prompt: int
) -> RequestHooks | None:
    """The engine's half: check the job against the backend and its attachments, then
    build its plans (None when it steers and monitors nothing)."""
    steering, monitors = steering_entries(job), monitor_entries(job)
    if not steering and not monitors:
        return None
    saes = {k: attachments[k].sae for k in {*(e.key for e in steering), *(m.key for m in monitors)} if k in attachments}
    check_request(saes, steering, monitors, n_prompt=n_prompt, context_length=backend.context_length)
    hooks = build_hooks(
        saes, job.request_id, steering, monitors, n_prompt=n_prompt, dtype=backend.dtype, device=backend.sae_device
    )
    return hooks if hooks.plans else None


def with_capture(
    backend: PlansFor, job: GenerationJob, hooks: RequestHooks | None, n_prompt: int, max_tokens: int
) -> RequestHooks | None:
    """Add the request's capture plan (its buffer allocated now) to its hooks, after
    checking its layers and its worst-case size (``capture_too_large``): before any
    forward runs."""
    spec = job.capture
    if spec is None:
        return hooks
    n_layers = backend.num_layers
    bad = [layer for layer in spec.layers if layer >= n_layers]
    if bad:
        raise InvalidParameter(
            f"capture.layers {bad} out of range: the model has layers 0..{n_layers - 1}",
            param="capture.layers",
            details={"layers": bad, "num_layers": n_layers},
        )
    geometry = scaling = None
    att = spec.attention
    if att is not None:
        geometry = backend.attention_geometry
        bad = [layer for layer in att.layers if layer >= n_layers]
        if bad:
            raise InvalidParameter(
                f"capture.attention.layers {bad} out of range: the model has layers 0..{n_layers - 1}",
                param="capture.attention.layers",
                details={"layers": bad, "num_layers": n_layers},
            )
        bad = [h for h in att.heads or () if h >= geometry.num_heads]
        if bad:
            raise InvalidParameter(
                f"capture.attention.heads {bad} out of range: the model has heads 0..{geometry.num_heads - 1}",
                param="capture.attention.heads",
                details={"heads": bad, "num_heads": geometry.num_heads},
            )
        scaling = {layer: backend.attention_scaling(layer) for layer in att.layers}
    dtype = backend.dtype
    estimate, rows = estimate_bytes(
        spec,
        prompt_len=n_prompt,
        max_tokens=max_tokens,
        hidden_size=backend.hidden_size,
        itemsize=dtype.itemsize,
        geometry=geometry,
    )
    if spec.max_bytes and estimate > spec.max_bytes:
        raise CaptureTooLarge(
            estimate_bytes=estimate,
            max_bytes=spec.max_bytes,
            rows=rows,
            layers=len(set(spec.layers) | set(att.layers if att is not None else ())),
        )
    if (
        spec.store_max_bytes is not None
        and spec.directory is not None
        and estimate > spec.inline_max_bytes
        and estimate > spec.store_max_bytes
    ):
        raise CaptureStoreFull(estimate_bytes=estimate, room_bytes=max(0, spec.store_max_bytes))
    steered = job.steering is not None and not job.steering.is_empty()
    model = spec.model or backend.job.model_id or ""
    # a backend whose workers take the rows (vLLM) gets a plan that only packs their parts
    device = None if backend.captures_in_workers else backend.device
    plan = CapturePlan(
        spec,
        request_id=job.request_id,
        prompt_len=n_prompt,
        max_tokens=max_tokens,
        hidden_size=backend.hidden_size,
        dtype=dtype,
        device=device,
        model=model,
        backend=backend.name,
        steering_hash=job.steering.canonical_hash() if steered else None,
        geometry=geometry,
        scaling=scaling,
    )
    hooks = hooks if hooks is not None else RequestHooks(job.request_id)
    hooks.capture = plan
    return hooks


__all__ = [
    "ENCODER_MODES",
    "HoldsSAE",
    "PlansFor",
    "build_hooks",
    "check_request",
    "monitor_entries",
    "refuse_encoder_controls",
    "request_hooks",
    "steering_entries",
    "with_capture",
]
