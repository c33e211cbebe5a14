"""Which engine the work on an SAE or a model addresses (``core.engines``, several engines
behind one front): a dashboard run, an experiment, a probe or sensing read, ``capture`` and
``vector compute`` reach the engine holding the model they work on, not the default one."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from core.engines import DEFAULT_ENGINE, engine_names, several_engines, using_engine, using_model_engine
from registry.models import SAE, Attachment, Model


def sae_engine(sae_id: str | None) -> str | None:
    """With several engines, the engine an SAE's work addresses: the engine holding the
    model its attachment rows name, else that of the loaded model it was trained on
    (``trained_on_model`` naming the model or its repository), else the default engine.
    None with one engine (nothing to choose)."""
    if not several_engines():
        return None
    if sae_id:
        row = Attachment.objects.filter(sae_id=sae_id).exclude(model__engine="").select_related("model").first()
        if row is not None and row.model.engine in engine_names():
            return row.model.engine
        sae = SAE.objects.filter(pk=sae_id).first()
        target = sae.trained_on_model if sae is not None else ""
        if target:
            loaded = Model.objects.filter(status=Model.Status.LOADED).exclude(engine="")
            model = loaded.filter(name=target).first() or loaded.filter(repo_id=target).first()
            if model is not None and model.engine in engine_names():
                return model.engine
    return DEFAULT_ENGINE


def saes_engine(sae_ids: Iterable[str]) -> str | None:
    """``sae_engine`` of the first of ``sae_ids`` (a sweep's variants address one engine)."""
    for sae_id in sae_ids:
        if sae_id:
            return sae_engine(sae_id)
    return sae_engine(None)


@contextmanager
def addressing(engine: str | None) -> Iterator[None]:
    """``using_engine(engine)`` for what this wraps; None: nothing selected (one engine)."""
    if engine is None:
        yield
    else:
        with using_engine(engine):
            yield


@contextmanager
def addressing_sae(sae_id: str | None) -> Iterator[None]:
    """Address the engine of ``sae_id``'s work (``sae_engine``) for what this wraps."""
    with addressing(sae_engine(sae_id)):
        yield


@contextmanager
def addressing_model(model_name: str | None) -> Iterator[None]:
    """Address the engine that holds ``model_name`` (its row's ``engine``), else the one
    ENGINE_MODELS gives it (409 ``MODEL_NOT_ROUTABLE`` when none may); None: nothing."""
    if model_name is None or not several_engines():
        yield
        return
    row = Model.objects.filter(name=model_name).only("engine").first()
    with addressing_held(model_name, row.engine if row is not None else ""):
        yield


@contextmanager
def addressing_held(model_name: str, engine: str) -> Iterator[str]:
    """Address ``engine`` (the engine a model row says holds or loads it) when it is one
    of ENGINE_MODELS, else the engine ENGINE_MODELS gives ``model_name`` (409
    ``MODEL_NOT_ROUTABLE`` when none may); yields the engine's name."""
    if several_engines() and engine in engine_names():
        with using_engine(engine) as name:
            yield name
    else:
        with using_model_engine(model_name) as name:
            yield name


def engine_status_of(engine: str | None, cache: dict[str | None, object] | None = None):  # type: ignore[no-untyped-def]
    """The status of ``engine`` (None: the one engine), once per ``cache``."""
    from core.runtime import runtime

    if cache is not None and engine in cache:
        return cache[engine]
    with addressing(engine):
        status = runtime().engine.status()
    if cache is not None:
        cache[engine] = status
    return status
