"""Registry reads."""

from __future__ import annotations

from django.db.models import QuerySet

from core.engines import current_engine, engine_names, several_engines, using_engine
from core.ids import get_by_pk_or_name
from core.runtime import runtime
from registry.errors import JobNotFound, ModelNotFound, SAENotFound
from registry.models import SAE, Attachment, Job, Model


def model_list() -> QuerySet[Model]:
    return Model.objects.all()


def model_get(*, model_id: int | str) -> Model:
    """By primary key or by name (clients may send either)."""
    try:
        return get_by_pk_or_name(Model.objects.all(), model_id)
    except Model.DoesNotExist:
        raise ModelNotFound(f"Model {model_id!r} not found", details={"model_id": model_id}) from None


def model_loaded(*, other_than: Model | None = None) -> Model | None:
    """The resident model (the row that says ``loaded``); with ``other_than``, the one a
    load of that model would replace."""
    qs = Model.objects.filter(status=Model.Status.LOADED)
    if several_engines():  # one resident model per engine: the addressed engine's
        qs = qs.filter(engine=current_engine())
    if other_than is not None:
        qs = qs.exclude(pk=other_than.pk)
    return qs.first()


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


def active_job(*, kinds: tuple[str, ...], model: Model | None = None, sae: SAE | None = None) -> Job | None:
    """The newest queued or running job of these kinds on the model or SAE."""
    target = {"model": model} if model is not None else {"sae": sae}
    return Job.objects.filter(kind__in=kinds, status__in=Job.ACTIVE, **target).order_by("-created_at").first()


def download_progress_by_model() -> dict[int, int]:
    """Percent of each model's running download (list pages ask for all at once)."""
    rows = (
        Job.objects.filter(kind=Job.Kind.MODEL_DOWNLOAD, model__isnull=False, status__in=Job.ACTIVE)
        .order_by("created_at")
        .values_list("model_id", "progress")
    )
    return dict(rows)


def download_progress_by_sae() -> dict[str, int]:
    rows = (
        Job.objects.filter(kind=Job.Kind.SAE_DOWNLOAD, sae__isnull=False, status__in=Job.ACTIVE)
        .order_by("created_at")
        .values_list("sae_id", "progress")
    )
    return dict(rows)


def attachment_list() -> QuerySet[Attachment]:
    return Attachment.objects.select_related("sae", "model").order_by("layer", "sae_id")


def job_list(*, kind: str | None = None, status: str | None = None, limit: int = 50) -> list[Job]:
    qs = Job.objects.all()
    if kind:
        qs = qs.filter(kind=kind)
    if status:
        qs = qs.filter(status=status)
    return list(qs.order_by("-created_at")[:limit])


def engine_attachment_counts() -> dict[tuple[str, int], int]:
    """steering_apply_count per (sae_id, layer), from the engine; empty when it is away."""
    counts: dict[tuple[str, int], int] = {}
    # with several engines, each one's attachments (core.engines); else the one engine's
    for name in engine_names() if several_engines() else [None]:
        try:
            if name is None:
                attached = runtime().engine.attachments()
            else:
                with using_engine(name):
                    attached = runtime().engine.attachments()
        except Exception:  # noqa: BLE001 - a read must not fail because an engine is away
            continue
        counts.update({(a.sae_id, a.layer): a.steering_apply_count for a in attached})
    return counts


def model_transition(*, name: str) -> str | None:
    """``"unloading"`` or ``"loading"`` while the named model is being moved, else None.

    /v1 refuses a request for a model that is unloading with 503 model_busy
    (Retry-After RETRY_AFTER_UNLOAD_S): the unload is draining the requests already
    running and must not see new ones arrive.
    """
    status = Model.objects.filter(name=name).values_list("status", flat=True).first()
    if status in (Model.Status.UNLOADING, Model.Status.LOADING):
        return status
    return None
