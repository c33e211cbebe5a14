"""The SAEs the engine holds: attach (one or several, all or nothing), detach, a dry run
of an attach, what a lost attachment means for the rows and the live steering, and a
circuit's activation (its SAEs attached, then its steering)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from audit.services import audited
from core import events
from core.engine_client import resolve_device_and_dtype
from core.engines import DEFAULT_ENGINE, several_engines, using_engine
from core.errors import ModelNotLoaded, SAEInvalid, SAENotAttached, ValidationFailed, from_engine_error
from core.runtime import runtime
from gpu_engine.api.errors import EngineError
from gpu_engine.api.protocol import AttachResult, AttachSpec
from orchestration.memory_fit import check_saes_fit
from registry.errors import SAEAlreadyAttached, SAENotFound
from registry.models import SAE, Attachment, Model
from registry.selectors import model_loaded
from steering.circuits import (
    circuit_activation_plan,
    circuit_mark_active,
    circuit_set_incomplete,
)
from steering.forget import live_forget


def _sae(kwargs: dict[str, Any], _result: Any) -> tuple[str, Any, str]:
    sae = kwargs.get("sae")
    return ("sae", getattr(sae, "id", ""), getattr(sae, "name", ""))


def _pairs(kwargs: dict[str, Any]) -> dict[str, Any]:
    return {"attachments": [{"sae_id": sae.id, "layer": layer} for sae, layer in kwargs.get("items", [])]}


def _sae_engine(sae: SAE) -> str | None:
    """With several engines, the engine an attach of ``sae`` addresses: that of the loaded
    model the SAE was trained on (``trained_on_model`` naming the model or its repository),
    else the default engine. None with one engine (nothing to choose)."""
    if not several_engines():
        return None
    target = sae.trained_on_model
    loaded = Model.objects.filter(status=Model.Status.LOADED).exclude(engine="")
    row = loaded.filter(name=target).first() or (loaded.filter(repo_id=target).first() if target else None)
    return row.engine if row is not None else DEFAULT_ENGINE


@contextmanager
def _addressing(engine: str | None):
    if engine is None:
        yield
    else:
        with using_engine(engine):
            yield


def _check_sae_ready(sae: SAE) -> None:
    if sae.status not in (SAE.Status.READY, SAE.Status.ATTACHED) or not sae.local_path:
        raise SAEInvalid(
            f"SAE {sae.id} is not ready to attach (status {sae.status})",
            details={"sae_id": sae.id, "status": sae.status},
        )


@audited("sae.attach_set", lambda kw, r: ("saes", "", ""), params=_pairs)
def sae_attach_set(*, items: list[tuple[SAE, int]]) -> list[Any]:
    """Attach several (SAE, layer) pairs, all or nothing.

    Idempotent per (sae_id, layer): a pair that is already attached is left as it is and
    reported again; only the new pairs reach the engine, in one all-or-nothing call. With
    several engines, on the engine of the model the SAEs were trained on (``_sae_engine``;
    one engine per call).
    """
    engines = {_sae_engine(sae) for sae, _ in items}
    if len(engines) > 1:
        raise ValidationFailed(
            "These SAEs address different engines (each attaches to the engine holding the model "
            "it was trained on); attach them in one call per engine",
            details={"engines": sorted(e for e in engines if e)},
        )
    with _addressing(next(iter(engines), None)):
        return _attach_set(items)


def _attach_set(items: list[tuple[SAE, int]]) -> list[Any]:

    model = model_loaded()
    if model is None:
        raise ModelNotLoaded("No model is loaded; load one before attaching an SAE")
    ordered: list[tuple[SAE, int]] = []
    seen: set[tuple[str, int]] = set()
    for sae, layer in items:
        if (sae.id, int(layer)) not in seen:
            seen.add((sae.id, int(layer)))
            ordered.append((sae, int(layer)))
    for sae, _ in ordered:
        _check_sae_ready(sae)
    existing = {(a.sae_id, a.layer): a for a in Attachment.objects.filter(model=model)}
    new = [(sae, layer) for sae, layer in ordered if (sae.id, layer) not in existing]
    specs = [
        AttachSpec(sae_id=sae.id, path=sae.local_path, layer=layer, layout=sae.format or None) for sae, layer in new
    ]
    if new:
        device, dtype = resolve_device_and_dtype(settings.MILLM_ENGINE_DEVICE, settings.MILLM_ENGINE_DTYPE)
        check_saes_fit([sae for sae, _ in new], model=model, device=device, dtype=dtype)
    try:
        fresh = runtime().engine.attach_set(specs) if specs else []
    except EngineError as exc:
        raise from_engine_error(exc) from exc
    by_key = {(r.sae_id, r.layer): r for r in fresh}
    with transaction.atomic():
        for (sae, _), result in zip(new, fresh, strict=True):
            Attachment.objects.update_or_create(
                sae=sae,
                layer=result.layer,
                defaults={
                    "model": model,
                    "layer_module_path": result.layer_module_path,
                    "hook_point": result.hook_point,
                },
            )
            SAE.objects.filter(pk=sae.pk).update(status=SAE.Status.ATTACHED, updated_at=timezone.now())
        # Attaching locks the model, so a steered session cannot be swapped out under it.
        if fresh:
            Model.objects.filter(pk=model.pk).update(locked=True, updated_at=timezone.now())
    for result in fresh:
        events.publish(
            "sae:attached",
            {
                "sae_id": result.sae_id,
                "layer": result.layer,
                "layer_module_path": result.layer_module_path,
                "hook_point": result.hook_point,
                "model_id": model.id,
                "warnings": list(result.warnings),
            },
        )
    results = []
    for sae, layer in ordered:
        result = by_key.get((sae.id, layer))
        if result is None:
            row = existing[(sae.id, layer)]
            result = AttachResult(
                sae_id=sae.id,
                layer=layer,
                layer_module_path=row.layer_module_path,
                d_in=sae.d_in or 0,
                d_sae=sae.d_sae or 0,
                activation=sae.activation,
                layout=sae.format,
                warnings=[],
                hook_point=row.hook_point,
            )
        results.append(result)
    return results


@audited("sae.attach", _sae, params=lambda kw: {"layer": kw.get("layer")})
def sae_attach(*, sae: SAE, layer: int) -> Any:
    """Attach one SAE at one layer; attaching the same pair again is refused (409)."""
    if Attachment.objects.filter(sae=sae, layer=layer).exists():
        raise SAEAlreadyAttached(
            f"SAE {sae.id} is already attached at layer {layer}", details={"sae_id": sae.id, "layer": layer}
        )
    return sae_attach_set(items=[(sae, layer)])[0]


@audited("sae.detach", _sae, params=lambda kw: {"layer": kw.get("layer")})
def sae_detach(*, sae: SAE, layer: int | None = None) -> list[tuple[str, int]]:

    if not Attachment.objects.filter(sae=sae, **({} if layer is None else {"layer": layer})).exists():
        raise SAENotAttached(
            f"SAE {sae.id} is not attached" + ("" if layer is None else f" at layer {layer}"),
            details={"sae_id": sae.id, "layer": layer},
        )
    rows = Attachment.objects.filter(sae=sae, **({} if layer is None else {"layer": layer})).select_related("model")
    engine = None
    if several_engines():  # the engine that holds the model the rows attach it to
        engine = next((r.model.engine for r in rows if r.model.engine), DEFAULT_ENGINE)
    try:
        with _addressing(engine):
            keys = runtime().engine.detach(sae.id, layer)
    except EngineError as exc:
        if getattr(exc, "code", "") != "sae_not_attached":
            raise from_engine_error(exc) from exc
        keys = []  # the engine already lost it (restart); the rows catch up below
    for _, key_layer in keys or [(sae.id, layer)]:
        attachment_forget(sae_id=sae.id, layer=key_layer)
    for sae_id, key_layer in keys:
        events.publish("sae:detached", {"sae_id": sae_id, "layer": key_layer, "reason": "detach"})
    return keys


@transaction.atomic
def attachment_forget(*, sae_id: str, layer: int | None) -> None:
    """Record that an attachment is gone (detach, or the engine dropped it after an OOM)."""

    qs = Attachment.objects.filter(sae_id=sae_id)
    if layer is not None:
        qs = qs.filter(layer=layer)
    model_ids = set(qs.values_list("model_id", flat=True))
    live_forget(attachments=qs)  # detaching clears the attachment's live steering
    qs.delete()
    if not Attachment.objects.filter(sae_id=sae_id).exists():
        SAE.objects.filter(pk=sae_id).update(status=SAE.Status.READY, updated_at=timezone.now())
    for model_id in model_ids:
        if not Attachment.objects.filter(model_id=model_id).exists():
            # the lock attaching took goes with the last SAE; an operator's own lock stays
            Model.objects.filter(pk=model_id, locked_by_operator=False).update(locked=False, updated_at=timezone.now())


def sae_check_compatibility(*, sae: SAE, layer: int) -> dict[str, Any]:
    """Dry run of an attach: errors (refusals) and warnings, nothing changed."""

    _check_sae_ready(sae)
    with _addressing(_sae_engine(sae)):
        if model_loaded() is None:
            raise ModelNotLoaded("No model is loaded; compatibility is judged against the loaded model")
        try:
            report = runtime().engine.check_sae(sae.local_path, layer, layout=sae.format or None)
        except EngineError as exc:
            raise from_engine_error(exc) from exc
    return {"compatible": bool(report.compatible), "errors": list(report.errors), "warnings": list(report.warnings)}


@audited(
    "circuit.activate",
    lambda kw, r: ("circuit", getattr(kw.get("circuit"), "id", ""), getattr(kw.get("circuit"), "name", "")),
    params=lambda kw: {
        k: kw.get(k) for k in ("acknowledge_unvalidated", "allow_layer_overlap", "intensity") if k in kw
    },
)
def circuit_activate(
    *, circuit: Any, acknowledge_unvalidated: bool = False, allow_layer_overlap: bool = False, intensity: Any = None
) -> Any:
    """Activate a circuit: its checks (steering), every member SAE attached all or nothing,
    then its live steering (steering again). Nothing changes unless every check passed."""
    items, lam = circuit_activation_plan(
        circuit=circuit,
        acknowledge_unvalidated=acknowledge_unvalidated,
        allow_layer_overlap=allow_layer_overlap,
        intensity=intensity,
    )
    try:
        sae_attach_set(items=items)
    except (SAEInvalid, SAENotFound) as exc:
        raise circuit_set_incomplete(items, exc) from exc
    return circuit_mark_active(circuit=circuit, items=items, intensity=lam, allow_layer_overlap=allow_layer_overlap)
