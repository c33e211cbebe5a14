"""Wire shapes of /api/models, /api/saes and /api/jobs, the outputs: the fields of the
documented contract (``*Output`` serializers, which the schema reads) and the ``*_out``
functions that arrange a row into them. What a request may send is
``registry.serializers``. No logic here: views call services and selectors, and ``*_out``
functions only arrange what they return."""

from __future__ import annotations

from typing import Any

from rest_framework import serializers

from core import attachment_flags
from registry import sizing
from registry.models import SAE, Attachment, Job, Model
from registry.selectors import download_progress_by_model


def _mb(value: int | None) -> float | None:
    return None if value is None else round(value / 2**20, 3)


class JobOutput(serializers.Serializer):
    id = serializers.IntegerField()
    kind = serializers.CharField()
    target = serializers.CharField()
    model_id = serializers.IntegerField(allow_null=True)
    sae_id = serializers.CharField(allow_null=True)
    status = serializers.CharField()
    progress = serializers.IntegerField()
    stage = serializers.CharField()
    bytes_done = serializers.IntegerField()
    bytes_total = serializers.IntegerField(allow_null=True)
    error = serializers.CharField()
    cancel_requested = serializers.BooleanField()
    created_at = serializers.DateTimeField()
    started_at = serializers.DateTimeField(allow_null=True)
    finished_at = serializers.DateTimeField(allow_null=True)


def job_out(job: Job | None) -> dict[str, Any] | None:
    return None if job is None else JobOutput(job).data


class ModelOutput(serializers.Serializer):
    id = serializers.IntegerField()
    name = serializers.CharField()
    source = serializers.CharField()
    repo_id = serializers.CharField(allow_null=True)
    revision = serializers.CharField(allow_null=True)
    local_path = serializers.CharField(allow_null=True)
    format = serializers.CharField()
    quantization = serializers.CharField()
    trust_remote_code = serializers.BooleanField()
    backend = serializers.CharField(allow_null=True, help_text="the row's own choice; null: MILLM_BACKEND")
    effective_backend = serializers.CharField(help_text="the backend a load uses")
    params = serializers.CharField(allow_null=True, help_text='e.g. "2.6B"')
    parameter_count = serializers.IntegerField(allow_null=True)
    architecture = serializers.CharField(allow_null=True)
    num_layers = serializers.IntegerField(allow_null=True)
    hidden_size = serializers.IntegerField(allow_null=True)
    context_length = serializers.IntegerField(allow_null=True)
    disk_size_mb = serializers.FloatField(allow_null=True)
    estimated_memory_mb = serializers.FloatField(allow_null=True)
    status = serializers.CharField()
    error_message = serializers.CharField(allow_null=True)
    locked = serializers.BooleanField()
    download_progress = serializers.IntegerField(allow_null=True)
    device = serializers.CharField(allow_null=True)
    dtype = serializers.CharField(allow_null=True)
    engine = serializers.CharField(allow_null=True, help_text="The engine holding or loading it (ENGINE_MODELS).")
    loaded_at = serializers.DateTimeField(allow_null=True)
    created_at = serializers.DateTimeField()
    updated_at = serializers.DateTimeField()


def model_view(model: Model) -> dict[str, Any]:
    """``model_out`` with the download progress of the model's running download."""
    return model_out(model, download_progress=download_progress_by_model().get(model.id))


def model_out(model: Model, *, download_progress: int | None = None) -> dict[str, Any]:
    return ModelOutput(
        {
            "id": model.id,
            "name": model.name,
            "source": model.source,
            "repo_id": model.repo_id or None,
            "revision": model.revision or None,
            "local_path": model.local_path or None,
            "format": model.format,
            "quantization": model.quantization,
            "trust_remote_code": model.trust_remote_code,
            "backend": model.backend or None,
            "effective_backend": model.effective_backend(),
            "params": sizing.format_params(model.parameter_count),
            "parameter_count": model.parameter_count,
            "architecture": model.architecture or None,
            "num_layers": model.num_layers,
            "hidden_size": model.hidden_size,
            "context_length": model.context_length,
            "disk_size_mb": _mb(model.disk_size_bytes),
            "estimated_memory_mb": _mb(model.estimated_memory_bytes),
            "status": model.status,
            "error_message": model.error_message or None,
            "locked": model.locked,
            "download_progress": (download_progress if model.status == Model.Status.DOWNLOADING else None),
            "device": model.device or None,
            "dtype": model.dtype or None,
            "engine": model.engine or None,
            "loaded_at": model.loaded_at,
            "created_at": model.created_at,
            "updated_at": model.updated_at,
        }
    ).data


class ModelListOutput(serializers.Serializer):
    models = ModelOutput(many=True)
    total = serializers.IntegerField()
    loaded_model_id = serializers.IntegerField(allow_null=True)
    loaded_models = serializers.DictField(child=serializers.IntegerField())


class ModelJobOutput(serializers.Serializer):
    model = ModelOutput()
    job = JobOutput(allow_null=True)


class SAEOutput(serializers.Serializer):
    id = serializers.CharField()
    name = serializers.CharField()
    source = serializers.CharField(
        help_text="huggingface (downloaded by miLLM) or local (registered from the user's directory)"
    )
    repository_id = serializers.CharField(allow_null=True)
    revision = serializers.CharField(allow_null=True)
    file_path = serializers.CharField(allow_null=True)
    local_path = serializers.CharField(allow_null=True)
    format = serializers.CharField(allow_null=True)
    d_in = serializers.IntegerField(allow_null=True)
    d_sae = serializers.IntegerField(allow_null=True)
    activation = serializers.CharField()
    topk_k = serializers.IntegerField(allow_null=True)
    trained_on = serializers.CharField(allow_null=True)
    trained_layer = serializers.IntegerField(allow_null=True)
    hook_name = serializers.CharField(allow_null=True)
    width = serializers.IntegerField(allow_null=True)
    average_l0 = serializers.FloatField(allow_null=True)
    memory_usage_mb = serializers.FloatField(allow_null=True)
    status = serializers.CharField()
    error_message = serializers.CharField(allow_null=True)
    download_progress = serializers.IntegerField(allow_null=True)
    attached_layers = serializers.ListField(child=serializers.IntegerField())
    created_at = serializers.DateTimeField()
    updated_at = serializers.DateTimeField()


def sae_memory_bytes(sae: SAE) -> int | None:
    """Encoder + decoder + biases in float32 (how the engine holds an SAE)."""
    if not sae.d_in or not sae.d_sae:
        return None
    return 4 * (
        2 * sae.d_in * sae.d_sae
        + sae.d_sae
        + sae.d_in
        + (sae.d_sae if sae.activation == SAE.Activation.JUMPRELU else 0)
    )


def sae_out(sae: SAE, *, layers: list[int] | None = None, download_progress: int | None = None) -> dict[str, Any]:
    return SAEOutput(
        {
            "id": sae.id,
            "name": sae.name,
            "source": "huggingface" if sae.repository_id else "local",
            "repository_id": sae.repository_id or None,
            "revision": sae.revision or None,
            "file_path": sae.file_path or None,
            "local_path": sae.local_path or None,
            "format": sae.format or None,
            "d_in": sae.d_in,
            "d_sae": sae.d_sae,
            "activation": sae.activation,
            "topk_k": sae.topk_k,
            "trained_on": sae.trained_on_model or None,
            "trained_layer": sae.trained_on_layer,
            "hook_name": sae.hook_name or None,
            "width": sae.width,
            "average_l0": sae.average_l0,
            "memory_usage_mb": _mb(sae_memory_bytes(sae)),
            "status": sae.status,
            "error_message": sae.error_message or None,
            "download_progress": download_progress if sae.status == SAE.Status.DOWNLOADING else None,
            "attached_layers": layers or [],
            "created_at": sae.created_at,
            "updated_at": sae.updated_at,
        }
    ).data


class AttachmentOutput(serializers.Serializer):
    sae_id = serializers.CharField()
    layer = serializers.IntegerField()
    layer_module_path = serializers.CharField()
    hook_point = serializers.CharField()
    model_id = serializers.IntegerField()
    d_in = serializers.IntegerField(allow_null=True)
    d_sae = serializers.IntegerField(allow_null=True)
    memory_usage_mb = serializers.FloatField(allow_null=True)
    steering_apply_count = serializers.IntegerField()
    attached_at = serializers.DateTimeField()


def attachment_out(row: Attachment, counts: dict[tuple[str, int], int]) -> dict[str, Any]:
    return AttachmentOutput(
        {
            "sae_id": row.sae_id,
            "layer": row.layer,
            "layer_module_path": row.layer_module_path,
            "hook_point": row.hook_point,
            "model_id": row.model_id,
            "d_in": row.sae.d_in,
            "d_sae": row.sae.d_sae,
            "memory_usage_mb": _mb(sae_memory_bytes(row.sae)),
            "steering_apply_count": counts.get((row.sae_id, row.layer), 0),
            "attached_at": row.created_at,
        }
    ).data


class AttachmentStatusOutput(serializers.Serializer):
    """The single-attachment status of the original contract (the first attachment when
    several are attached; ``attachments_count`` says how many)."""

    is_attached = serializers.BooleanField()
    sae_id = serializers.CharField(allow_null=True)
    layer = serializers.IntegerField(allow_null=True)
    layer_module_path = serializers.CharField(allow_null=True)
    hook_point = serializers.CharField(allow_null=True)
    memory_usage_mb = serializers.FloatField(allow_null=True)
    steering_enabled = serializers.BooleanField()
    monitoring_enabled = serializers.BooleanField()
    steering_apply_count = serializers.IntegerField()
    attachments_count = serializers.IntegerField()


def attachment_status(rows: list[Attachment], counts: dict[tuple[str, int], int]) -> dict[str, Any]:
    first = rows[0] if rows else None
    return AttachmentStatusOutput(
        {
            "is_attached": first is not None,
            "sae_id": first.sae_id if first else None,
            "layer": first.layer if first else None,
            "layer_module_path": first.layer_module_path if first else None,
            "hook_point": first.hook_point if first else None,
            "memory_usage_mb": _mb(sae_memory_bytes(first.sae)) if first else None,
            # live steering and monitoring state belong to the steering and monitoring apps,
            # which provide these two flags (core.attachment_flags)
            **(attachment_flags.flags(first) if first else dict.fromkeys(attachment_flags.FLAGS, False)),
            "steering_apply_count": counts.get((first.sae_id, first.layer), 0) if first else 0,
            "attachments_count": len(rows),
        }
    ).data


class SAEListOutput(serializers.Serializer):
    saes = SAEOutput(many=True)
    total = serializers.IntegerField()
    attachment = AttachmentStatusOutput()


class AttachOutput(serializers.Serializer):
    status = serializers.CharField()
    sae_id = serializers.CharField()
    layer = serializers.IntegerField()
    layer_module_path = serializers.CharField()
    hook_point = serializers.CharField()
    memory_usage_mb = serializers.FloatField(allow_null=True)
    warnings = serializers.ListField(child=serializers.CharField())


class AttachSetOutput(serializers.Serializer):
    attachments = AttachOutput(many=True)
    total = serializers.IntegerField()


class DetachOutput(serializers.Serializer):
    status = serializers.CharField()
    sae_id = serializers.CharField()
    layers = serializers.ListField(child=serializers.IntegerField())
    memory_freed_mb = serializers.FloatField(allow_null=True)


class AttachmentsOutput(serializers.Serializer):
    """Every attachment, as the original's ``GET /api/saes/attachments`` answers."""

    is_attached = serializers.BooleanField()
    count = serializers.IntegerField()
    entries = AttachmentOutput(many=True)
    total = serializers.IntegerField(help_text="= count: every list route has its total")
    total_memory_usage_mb = serializers.FloatField()


def attachments_out(rows: list[Attachment], counts: dict[tuple[str, int], int]) -> dict[str, Any]:
    entries = [attachment_out(row, counts) for row in rows]
    return AttachmentsOutput(
        {
            "is_attached": bool(rows),
            "count": len(rows),
            "entries": entries,
            "total": len(rows),
            "total_memory_usage_mb": round(sum(e["memory_usage_mb"] or 0.0 for e in entries), 3),
        }
    ).data


class CompatibilityOutput(serializers.Serializer):
    compatible = serializers.BooleanField()
    errors = serializers.ListField(child=serializers.CharField())
    warnings = serializers.ListField(child=serializers.CharField())
    sae_id = serializers.CharField()
    layer = serializers.IntegerField()
    model_id = serializers.IntegerField(allow_null=True)


class SAEDownloadOutput(serializers.Serializer):
    sae_id = serializers.CharField()
    status = serializers.CharField(
        help_text=("downloading | cached | attached | already_downloading | registered (local)")
    )
    message = serializers.CharField()
    sae = SAEOutput()
    job = JobOutput(allow_null=True)


class DeleteOutput(serializers.Serializer):
    status = serializers.CharField()
    id = serializers.CharField()
    freed_disk_mb = serializers.FloatField(allow_null=True)


class ModelDeleteOutput(DeleteOutput):
    id = serializers.IntegerField()  # model ids are integers everywhere else too


class JobListOutput(serializers.Serializer):
    jobs = JobOutput(many=True)
    total = serializers.IntegerField()
