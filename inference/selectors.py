"""Registry reads /v1 needs: a model by the name clients send, and the listed models."""

from __future__ import annotations

from django.db.models import QuerySet

from core.engines import engine_for_model, several_engines
from inference.residency import ModelRef
from registry.errors import ModelNotFound
from registry.models import Model
from steering.selectors import profiles_for_model

LISTED_STATUSES = (Model.Status.READY, Model.Status.LOADING, Model.Status.LOADED)


def model_resolve(*, name: str) -> tuple[ModelRef, str | None]:
    """``name`` or ``"<model>@<profile>"`` → (model, profile or None).

    A registered name wins over the split, so a model whose name contains ``@`` is still
    reachable by its full name.
    """
    profile = None
    row = Model.objects.filter(name=name).first()
    if row is None and "@" in name:
        base, _, profile = name.rpartition("@")
        row = Model.objects.filter(name=base).first() if base and profile else None
    if row is None:
        raise ModelNotFound(f"The model {name!r} does not exist", details={"model": name, "param": "model"})
    return ModelRef(row.pk, row.name, row.status, row.hidden_size), profile


def models_listed() -> QuerySet[Model]:
    """What /v1/models shows: the servable models; only the locked one while a model is
    locked for steering, so such a server presents one stable id."""
    locked = Model.objects.filter(locked=True, status=Model.Status.LOADED)
    if locked.exists() and several_engines():
        # per engine: a locked model hides only the models its own engine could serve
        held = {row.engine for row in locked}
        rows = Model.objects.filter(status__in=LISTED_STATUSES).order_by("name")
        keep = [r.pk for r in rows if r.locked or engine_for_model(r.name) not in held]
        return rows.filter(pk__in=keep)
    if locked.exists():
        return locked
    return Model.objects.filter(status__in=LISTED_STATUSES).order_by("name")


def model_ids_listed() -> list[tuple[Model, str]]:
    """What /v1/models lists: each servable model under its name, then once per steering
    profile made for it (or for any model) as ``<model>@<profile>``, the form requests
    already accept, so a chat client can pick a profile from its model menu."""
    out: list[tuple[Model, str]] = []
    for row in models_listed():
        out.append((row, row.name))
        out.extend((row, f"{row.name}@{p.name}") for p in profiles_for_model(model_name=row.name))
    return out


def model_listed(*, name: str) -> Model:
    """A model by a listed id: its name, or ``<model>@<profile>`` with a profile made for it."""
    row = Model.objects.filter(name=name).first()
    if row is None and "@" in name:
        base, _, profile = name.rpartition("@")
        candidate = Model.objects.filter(name=base).first() if base and profile else None
        if candidate is not None and any(p.name == profile for p in profiles_for_model(model_name=candidate.name)):
            row = candidate
    if row is None:
        raise ModelNotFound(f"The model {name!r} does not exist", details={"model": name, "param": "model"})
    return row
