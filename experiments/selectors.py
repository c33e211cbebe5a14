"""Reads of the steering experiments: runs (the caller's own; an admin key, and the server
itself, see all) and their points."""

from __future__ import annotations

from typing import Any

from django.db.models import QuerySet

from core.auth import Principal
from experiments.errors import ExperimentNotFound
from experiments.models import ExperimentPoint, ExperimentRun


def experiment_get(run_id: str, principal: Principal | None) -> ExperimentRun:
    """The run, if the caller may see it (its owner, or an admin); else 404 as if it did
    not exist."""
    query = ExperimentRun.objects.filter(id=run_id)
    if principal is not None and not principal.admin:
        query = query.filter(owner=principal.owner)
    run = query.first()
    if run is None:
        raise ExperimentNotFound(f"No experiment with id {run_id!r}", details={"param": "run_id"})
    return run


def experiments_for(principal: Principal | None, *, kind: str | None = None, sae_id: str | None = None) -> QuerySet:
    """Runs newest first: the caller's own (an admin key, or None for the server itself:
    everyone's), of one ``kind`` and about one SAE when given."""
    query = ExperimentRun.objects.all()
    if principal is not None and not principal.admin:
        query = query.filter(owner=principal.owner)
    if kind:
        query = query.filter(kind=kind)
    if sae_id:
        query = query.filter(sae_id=sae_id)
    return query.order_by("-created_at", "-id")


def points_of(run: ExperimentRun) -> QuerySet:
    return ExperimentPoint.objects.filter(run=run).order_by("ordinal")


def point_rows(*, run_id: str) -> list[dict[str, Any]]:
    """Every stored point of the run as a dict of its fields, by ordinal (a resumed
    runner's view of what is done)."""
    return list(ExperimentPoint.objects.filter(run_id=run_id).order_by("ordinal").values())
