"""Registry reads."""

from __future__ import annotations

from django.db.models import QuerySet

from millm_site.errors import JobNotFound, ModelNotFound, SAENotFound
from registry.models import SAE, Job, Model


def model_list() -> QuerySet[Model]:
    return Model.objects.all()


def model_get(*, model_id: int | str) -> Model:
    """By primary key or by name (clients may send either)."""
    qs = Model.objects.all()
    try:
        if isinstance(model_id, int) or str(model_id).isdigit():
            return qs.get(pk=int(model_id))
        return qs.get(name=str(model_id))
    except Model.DoesNotExist:
        raise ModelNotFound(f"Model {model_id!r} not found",
                            details={"model_id": model_id}) from None


def model_loaded() -> Model | None:
    return Model.objects.filter(status=Model.Status.LOADED).first()


def sae_list() -> QuerySet[SAE]:
    return SAE.objects.all()


def sae_get(*, sae_id: str) -> SAE:
    try:
        return SAE.objects.get(pk=sae_id)
    except SAE.DoesNotExist:
        raise SAENotFound(f"SAE {sae_id!r} not found", details={"sae_id": sae_id}) from None


def job_get(*, job_id: int) -> Job:
    try:
        return Job.objects.get(pk=job_id)
    except Job.DoesNotExist:
        raise JobNotFound(f"Job {job_id} not found", details={"job_id": job_id}) from None
