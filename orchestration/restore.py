"""Putting back what the registry records as resident after the engine's process started
again: the loaded model, its SAE attachments and (once the engine holds any) live
steering.

One implementation for both topologies: ``run_engine`` calls it before it serves
(distributed mode), and the ASGI application calls it when it starts in embedded mode,
where the engine lives in the web process (``orchestration.startup.application_start``).
What cannot be restored is recorded as such on the rows (and logged), never retried for
ever: each start-up that begins a restore is counted somewhere that survives a crash, and
a state that keeps killing the process is given up after ENGINE_MAX_DELIVERIES attempts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog
from django.conf import settings
from django.db.models import Q

from core.engine_client import _resolve_here
from core.engines import DEFAULT_ENGINE, several_engines, using_engine
from gpu_engine.api.errors import EngineError
from gpu_engine.api.protocol import AttachSpec
from orchestration import services
from registry.models import Attachment, Model
from registry.services import model_set_status

log = structlog.get_logger("millm.engine")


@dataclass
class RecordedState:
    """What the database says the engine should hold."""

    model: Any = None  # registry.models.Model with status loaded, or None
    attachments: list[Any] = field(default_factory=list)  # its Attachment rows


def recorded_state(engine_name: str = DEFAULT_ENGINE) -> RecordedState:
    """What the database records on engine ``engine_name``: with one engine (ENGINE_MODELS
    unset and the default name) the loaded model, whichever it is; else the loaded model
    whose row names this engine (a row from before engines had names counts as the
    default engine's)."""
    loaded = Model.objects.filter(status=Model.Status.LOADED)
    if engine_name != DEFAULT_ENGINE or several_engines():
        on_engine = Q(engine=engine_name) | Q(engine="") if engine_name == DEFAULT_ENGINE else Q(engine=engine_name)
        loaded = loaded.filter(on_engine)
    model = loaded.order_by("-loaded_at").first()
    if model is None:
        return RecordedState()
    rows = list(Attachment.objects.filter(model=model).select_related("sae").order_by("pk"))
    return RecordedState(model=model, attachments=rows)


def _forget(state: RecordedState, message: str) -> None:
    for row in state.attachments:
        services.attachment_forget(sae_id=row.sae_id, layer=row.layer)
    model_set_status(model=state.model, status=Model.Status.ERROR, error=message)


def restore_recorded_state(
    *,
    engine: Any,
    begin_restore: Callable[[], int],
    end_restore: Callable[[], None],
    engine_name: str = DEFAULT_ENGINE,
) -> None:
    """Load the recorded model into ``engine`` (an ``Engine`` or an engine client) and
    attach its SAEs. ``begin_restore`` counts this attempt and returns the count (it must
    survive a crash of this process); ``end_restore`` clears it. ``engine_name``: which
    engine's record (``run_engine --name``)."""
    with using_engine(engine_name):  # the rows it writes name this engine
        _restore(engine=engine, begin_restore=begin_restore, end_restore=end_restore, engine_name=engine_name)


def _restore(
    *, engine: Any, begin_restore: Callable[[], int], end_restore: Callable[[], None], engine_name: str
) -> None:
    state = recorded_state(engine_name)
    if state.model is None:
        log.info("engine_restore_nothing_recorded")
        return
    model = state.model
    held = engine.status()
    if held.state == "ready" and held.model_id == model.name:
        # this process loaded it already (a script that serves the application after
        # loading through the services): nothing was lost
        log.info("engine_restore_not_needed", model=model.name)
        return
    attempts = begin_restore()
    if attempts > settings.ENGINE_MAX_DELIVERIES:
        message = (
            f"not restored: the engine stopped {attempts - 1} times while restoring this model; load it again to retry"
        )
        log.critical("engine_restore_given_up", model=model.name, attempts=attempts - 1)
        _forget(state, message)
        end_restore()
        return
    device, dtype = _resolve_here(
        model.device or settings.MILLM_ENGINE_DEVICE, model.dtype or settings.MILLM_ENGINE_DTYPE
    )
    log.info(
        "engine_restoring",
        model=model.name,
        device=device,
        dtype=dtype,
        attachments=[f"{a.sae_id}@{a.layer}" for a in state.attachments],
    )
    try:
        engine.load_model(
            services.load_job(model, device=device, dtype=dtype), timeout_s=settings.ENGINE_COMMAND_TIMEOUT_S
        )
    except EngineError as exc:
        log.error("engine_restore_failed", model=model.name, code=exc.code, message=exc.message)
        _forget(state, f"not restored after an engine restart: {exc.code}: {exc.message}")
        end_restore()
        return
    specs = [
        AttachSpec(sae_id=a.sae_id, path=a.sae.local_path, layer=a.layer, layout=a.sae.format or None)
        for a in state.attachments
    ]
    if specs:
        try:
            engine.attach_set(specs)
        except EngineError:
            # all-or-nothing failed: keep what attaches on its own, forget the rest
            for spec in specs:
                try:
                    engine.attach_set([spec])
                except EngineError as exc:
                    log.error(
                        "engine_restore_attach_failed",
                        sae_id=spec.sae_id,
                        layer=spec.layer,
                        code=exc.code,
                        message=exc.message,
                    )
                    services.attachment_forget(sae_id=spec.sae_id, layer=spec.layer)
    # live steering needs nothing: it is read from the database per request
    end_restore()
    log.info("engine_restored", model=model.name, attachments=[f"{a.sae_id}@{a.layer}" for a in engine.attachments()])
