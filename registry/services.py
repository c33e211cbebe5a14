"""Registry mutations. Views, admin actions, commands, tasks and the engine bridge all
call these functions; none of this logic lives in views, serializers or ``save()``."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import structlog
from django.conf import settings
from django.db import transaction
from django.utils import timezone

from audit.services import audited
from core.engines import current_engine
from core.errors import UnsupportedModel, ValidationFailed
from gpu_engine.api.host import backend_names
from registry import access, describe, labels
from registry.access import check_remote_code
from registry.errors import (
    InvalidLocalPath,
    ModelAlreadyExists,
    ModelInvalid,
    ModelLoaded,
    ModelLocked,
    SAEAlreadyAttached,
    SAEAlreadyExists,
    UnsupportedQuantization,
)
from registry.models import SAE, Job, Model

log = structlog.get_logger(__name__)

# the registry's quantized levels (a transformers row is quantized to them at load)
QUANTIZED = (Model.Quantization.Q8, Model.Quantization.Q4, Model.Quantization.Q2)


def model_check_local(
    *, local_path: str, name: str | None = None, quantization: str | None = None, backend: str = ""
) -> dict:
    """What registering ``local_path`` as a model would record, or the refusal it would
    meet: an unknown backend, a path that is not an existing transformers directory or
    .gguf file outside the system directories, a name already taken. Nothing is written,
    so the admin form can show a refusal before it saves."""
    check_backend_name(backend)
    path = describe.check_local_path(local_path)
    if path.is_file() and path.suffix == ".gguf":
        fmt, gguf_file, meta = Model.Format.GGUF, path.name, describe.describe_gguf_file(path)
    elif path.is_dir():
        fmt, gguf_file, meta = (Model.Format.TRANSFORMERS, "", describe.describe_transformers_dir(path, quantization))
    else:
        raise InvalidLocalPath(
            f"{path} is neither a model directory nor a .gguf file", details={"local_path": local_path}
        )
    if fmt == Model.Format.GGUF:
        # a GGUF file carries its own quantization; naming a quantized level it does not
        # have asks for a quantize-at-load llama.cpp does not do (FP32/FP16, the forms'
        # defaults, make no such claim and give way to the file's)
        own = meta.pop("quantization", None)
        if own and quantization in QUANTIZED and quantization != own:
            raise UnsupportedQuantization(
                f"{path.name} is a {own} GGUF file: a GGUF model loads at its file's own "
                f"quantization, not {quantization} (register it without a quantization)",
                details={"local_path": local_path, "quantization": quantization, "file_quantization": own},
            )
        meta["quantization"] = own or quantization or Model.Quantization.FP32
    check_backend_format(backend, fmt)
    own_quantization = meta.get("quantization") or quantization or Model.Quantization.FP32
    twin = Model.objects.filter(local_path=str(path), quantization=own_quantization, backend=backend).first()
    if twin is not None:
        # one checkpoint, one row per way of loading it (another quantization or backend
        # is another registration)
        raise ModelAlreadyExists(
            f"{path} is already registered as model {twin.name!r} (id {twin.id}) with "
            f"quantization {own_quantization}" + (f" and backend {backend}" if backend else ""),
            details={"model_id": twin.id, "name": twin.name, "local_path": str(path)},
        )
    name = (name or (path.stem if path.is_file() else path.name)).strip()
    if Model.objects.filter(name=name).exists():
        raise ModelAlreadyExists(f"A model named {name!r} is already registered", details={"name": name})
    return {"name": name, "local_path": str(path), "format": fmt, "gguf_file": gguf_file, **meta}


def _row(kind: str, key: str, name_from: str = "name"):
    """An audit target from the keyword ``key`` (a row), else from the result."""

    def target(kwargs: dict[str, Any], result: Any) -> tuple[str, Any, str]:
        row = kwargs.get(key) if key else result
        if row is None and not key:
            return (kind, "", str(kwargs.get(name_from) or kwargs.get("local_path") or ""))
        if kind == "sae" and getattr(row, "format", "") == SAE.Format.VECTOR:
            return ("vector", getattr(row, "pk", ""), getattr(row, "name", ""))
        return (kind, getattr(row, "pk", ""), getattr(row, "name", ""))

    return target


def _fields(*names: str):
    return lambda kwargs: {n: kwargs[n] for n in names if n in kwargs}


@audited(
    "model.register",
    _row("model", "", "name"),
    params=_fields("local_path", "name", "quantization", "trust_remote_code", "backend"),
)
@transaction.atomic
def model_register_local(
    *,
    local_path: str,
    name: str | None = None,
    quantization: str | None = None,
    trust_remote_code: bool = False,
    backend: str = "",
) -> Model:
    """Register a checkpoint already on disk: a transformers directory or a GGUF file.
    ``trust_remote_code`` only where the operator allows it (ALLOW_REMOTE_CODE); the API
    also asks for an admin key (``registry.access``)."""
    check_remote_code(trust_remote_code=trust_remote_code)
    fields = model_check_local(local_path=local_path, name=name, quantization=quantization, backend=backend)
    quantization = fields.pop("quantization", None) or quantization or Model.Quantization.FP32
    model = Model.objects.create(
        source=Model.Source.LOCAL,
        quantization=quantization,
        trust_remote_code=trust_remote_code,
        backend=backend,
        status=Model.Status.READY,
        **fields,
    )
    log.info("model_registered", model_id=model.id, name=model.name, path=model.local_path)
    return model


def check_backend_name(backend: str) -> None:
    if backend and backend not in backend_names():
        message = f"unknown backend {backend!r}; known: {', '.join(backend_names())}"
        raise ValidationFailed(message, details={"fields": {"backend": [message]}, "known": list(backend_names())})


# the backend that reads GGUF files, and the only one that does (llama.cpp reads nothing else)
GGUF_BACKEND = "llamacpp"


def backend_format_mismatch(backend: str, fmt: str) -> str | None:
    """Why ``backend`` cannot read a model of format ``fmt``, or None: GGUF loads on
    llama.cpp only, and llama.cpp loads GGUF only (registration and load both ask)."""
    if (fmt == Model.Format.GGUF) == (backend == GGUF_BACKEND):
        return None
    if fmt == Model.Format.GGUF:
        return f"GGUF models load on the {GGUF_BACKEND} backend only"
    return f"the {GGUF_BACKEND} backend loads GGUF models only"


def check_backend_format(backend: str, fmt: str) -> None:
    """Refuse (400 UNSUPPORTED_MODEL naming the ``backend`` field) a backend chosen for a
    model whose format it cannot read. A blank backend is not checked (a GGUF row then
    loads on llama.cpp, any other on MILLM_BACKEND, which the load itself checks)."""
    reason = backend_format_mismatch(backend, fmt) if backend else None
    if reason is None:
        return
    message = f"a {fmt} model cannot run on the {backend} backend: {reason}"
    raise UnsupportedModel(
        message, details={"field": "backend", "fields": {"backend": [message]}, "format": fmt, "backend": backend}
    )


@transaction.atomic
@audited("model.update", _row("model", "model"), params=_fields("backend"))
def model_set_backend(*, model: Model, backend: str) -> Model:
    """Choose the backend the model loads on (blank: MILLM_BACKEND). Refused while the
    model is resident or moving: the engine holds it on the backend it was loaded with."""
    check_backend_name(backend)
    model = Model.objects.select_for_update().get(pk=model.pk)
    if model.status in (Model.Status.LOADED, Model.Status.LOADING, Model.Status.UNLOADING):
        raise ModelLoaded(
            f"Model {model.name!r} is {model.status}; unload it before changing its backend",
            details={"model_id": model.id, "status": model.status},
        )
    check_backend_format(backend, model.format)
    model.backend = backend
    model.save(update_fields=["backend", "updated_at"])
    log.info("model_backend_set", model_id=model.id, backend=backend or None)
    return model


def model_refresh_metadata(*, model: Model) -> Model:
    """Re-read architecture and sizes from the files (after a manual copy, say)."""
    if not model.local_path:
        raise ModelInvalid(f"Model {model.name!r} has no files yet", details={"model_id": model.id})
    path = Path(model.local_path)
    meta = (
        describe.describe_gguf_file(path)
        if model.format == Model.Format.GGUF
        else describe.describe_transformers_dir(path, model.quantization)
    )
    for key, value in meta.items():
        setattr(model, key, value)
    model.save(update_fields=[*meta.keys(), "updated_at"])
    return model


def model_set_status(*, model: Model, status: str, error: str = "", device: str = "", dtype: str = "") -> Model:
    model.status = status
    model.error_message = error
    fields = ["status", "error_message", "updated_at"]
    if status == Model.Status.LOADED:
        model.loaded_at = timezone.now()
        model.device, model.dtype = device, dtype
        model.engine = current_engine()  # the engine this load addressed (core.engines)
        fields += ["loaded_at", "device", "dtype", "engine"]
    elif status not in (Model.Status.UNLOADING,):
        model.device = model.dtype = model.engine = ""
        fields += ["device", "dtype", "engine"]
    model.save(update_fields=fields)
    return model


@audited("model.lock", _row("model", "model"))
def model_lock(*, model: Model) -> Model:
    Model.objects.filter(pk=model.pk).update(locked=True, locked_by_operator=True, updated_at=timezone.now())
    model.refresh_from_db()
    return model


@audited("model.unlock", _row("model", "model"))
def model_unlock(*, model: Model) -> Model:
    Model.objects.filter(pk=model.pk).update(locked=False, locked_by_operator=False, updated_at=timezone.now())
    model.refresh_from_db()
    return model


def _is_under(path: Path, root: Path) -> bool:
    try:
        path.resolve().relative_to(root.resolve())
    except ValueError:
        return False
    return True


@audited("model.delete", _row("model", "model"))
@transaction.atomic
def model_delete(*, model: Model) -> None:
    """Delete the row, and the folder the registry downloaded for this row (``files_dir``).

    Nothing else is ever removed: not a ``local_path`` (a ``source: local`` row's files
    are the user's, even when they lie in the cache as another row's download), and not a
    downloaded folder another row still reads. A download in progress is cancelled first.
    """
    model = Model.objects.select_for_update().get(pk=model.pk)
    if model.locked:
        raise ModelLocked(f"Model {model.name!r} is locked; unlock it first", details={"model_id": model.id})
    if model.status in (Model.Status.LOADED, Model.Status.LOADING, Model.Status.UNLOADING):
        raise ModelLoaded(
            f"Model {model.name!r} is {model.status}; unload it first",
            details={"model_id": model.id, "status": model.status},
        )
    Job.objects.filter(model=model, status__in=Job.ACTIVE).update(cancel_requested=True, updated_at=timezone.now())
    model_id, owned = model.id, model.files_dir
    model.delete()
    kept = _release_files(owned, cache=Path(settings.MODEL_CACHE_DIR))
    log.info("model_deleted", model_id=model_id, kept_files=kept)


def _in_use(path: Path) -> bool:
    """Whether a row that remains reads files inside ``path`` (its weights, its download
    folder): such a folder is never removed with another row."""
    target = path.resolve()
    for value in [
        *Model.objects.exclude(local_path="").values_list("local_path", flat=True),
        *Model.objects.exclude(files_dir="").values_list("files_dir", flat=True),
        *SAE.objects.exclude(local_path="").values_list("local_path", flat=True),
        *SAE.objects.exclude(files_dir="").values_list("files_dir", flat=True),
    ]:
        used = Path(value).resolve()
        if used == target or target in used.parents:
            return True
    return False


def _release_files(owned: str, *, cache: Path) -> bool:
    """Remove ``owned`` (a deleted row's own folder) after commit when it lies in ``cache``
    and no remaining row uses it; whether files were kept."""
    if not owned:
        return True
    files = Path(owned)
    if not _is_under(files, cache) or not files.exists():
        return True
    if _in_use(files):
        log.info("files_kept_in_use", path=str(files))
        return True
    transaction.on_commit(lambda: remove_files(files))
    return False


def remove_files(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


# --- SAEs ------------------------------------------------------------------------------


def sae_check_local(*, local_path: str) -> tuple[Path, dict]:
    """What registering ``local_path`` as an SAE would record, or the refusal it would meet.

    The same checks as a local model (an absolute path that exists, outside the system
    directories), then one of the SAE layouts must recognise it (SAELens: cfg.json +
    sae_weights.safetensors; Gemma Scope: params.npz), and no SAE may already be registered
    from those files. Nothing is written, so the admin form can show a refusal before it
    saves.
    """
    path = describe.check_local_path(local_path, what="an SAE")
    meta = describe.describe_sae(path)
    if path.is_file() and (path.suffix in (".json", ".safetensors") or path.name == "params.npz"):
        # one path per SAE: a SAELens file, or a Gemma Scope params.npz, names the SAE
        # that its directory holds (any other .npz is an SAE of its own)
        path = path.parent
    existing = SAE.objects.filter(repository_id="", local_path=str(path)).first()
    if existing is not None:
        raise SAEAlreadyExists(
            f"{path} is already registered as SAE {existing.id}",
            details={"sae_id": existing.id, "local_path": str(path)},
        )
    return path, meta


@audited(
    "sae.register",
    _row("sae", "", "name"),
    params=_fields("local_path", "name", "trained_on_model", "trained_on_layer"),
)
@transaction.atomic
def sae_register_local(
    *,
    local_path: str,
    name: str | None = None,
    average_l0: float | None = None,
    trained_on_model: str | None = None,
    trained_on_layer: int | None = None,
) -> SAE:
    """Register an SAE directory (SAELens) or params.npz (Gemma Scope) already on disk: one
    a researcher trained, or the offline demo's. It is ready to attach at once; its files
    stay the user's (``sae_delete`` never removes them).

    What the files say about the model and layer the SAE was trained on wins; the hints
    fill in what they do not say (a Gemma Scope params.npz names neither).
    """
    path, meta = sae_check_local(local_path=local_path)
    if not meta["trained_on_model"] and trained_on_model:
        meta["trained_on_model"] = trained_on_model.strip()
    if meta["trained_on_layer"] is None and trained_on_layer is not None:
        meta["trained_on_layer"] = trained_on_layer
    default_name = path.name if path.is_dir() else path.parent.name
    sae = SAE.objects.create(
        name=(name or "").strip() or default_name,
        local_path=str(path),
        average_l0=average_l0,
        status=SAE.Status.READY,
        **meta,
    )
    labels.import_labels_file(sae.id)  # its feature_labels.json, if it ships one
    log.info("sae_registered", sae_id=sae.id, path=str(path))
    return sae


@audited("sae.delete", _row("sae", "sae"))
@transaction.atomic
def sae_delete(*, sae: SAE) -> None:
    """Delete the row and the files the registry wrote for it; refused while attached (409).

    Only the folder a hub download wrote for this row (``files_dir``), or the copy written
    for a steering vector (``files_owned``), is removed, and neither while another row
    still reads inside it: an SAE registered from a local directory keeps its files
    wherever they are, even inside the cache (another row's download, say)."""
    sae = SAE.objects.select_for_update().get(pk=sae.pk)
    if sae.status == SAE.Status.ATTACHED or sae.attachments.exists():
        raise SAEAlreadyAttached(f"SAE {sae.id} is attached; detach it first", details={"sae_id": sae.id})
    Job.objects.filter(sae=sae, status__in=Job.ACTIVE).update(cancel_requested=True, updated_at=timezone.now())
    # a steering vector's own copy (registry.vectors), never the file it came from
    owned = sae.files_dir or (sae.local_path if sae.files_owned else "")
    sae_id = sae.id
    sae.delete()
    kept = _release_files(owned, cache=Path(settings.SAE_CACHE_DIR))
    log.info("sae_deleted", sae_id=sae_id, kept_files=kept)


# --- Demo assets -----------------------------------------------------------------------


def demo_assets_install(*, root: Path, seed: int = 0, include_demo: bool = True) -> tuple[list[Model], list[SAE]]:
    """Build the offline demo/test assets (cached) and register every one of them.

    Idempotent: a model or SAE already registered at the same path is refreshed, not
    duplicated, so the run command can call this on every start.
    """
    from offline_assets import ensure_assets

    manifest = ensure_assets(Path(root), seed=seed, include_demo=include_demo)
    # the files were built under ``root`` by this call: registering them is allowed even
    # where ``root`` is not under LOCAL_MODEL_ROOTS (create_demo_assets --output DIR)
    with access.built_here(Path(root).resolve()):
        return _demo_assets_register(manifest)


def _demo_assets_register(manifest: Any) -> tuple[list[Model], list[SAE]]:
    models: list[Model] = []
    for asset in manifest.models.values():
        existing = Model.objects.filter(name=asset.name).first()
        if existing is not None and existing.local_path == str(Path(asset.path).resolve()):
            models.append(model_refresh_metadata(model=existing))
            continue
        if existing is not None:
            raise ModelAlreadyExists(
                f"A model named {asset.name!r} is registered at another path "
                f"({existing.local_path}); delete it or rename it first",
                details={"name": asset.name},
            )
        models.append(model_register_local(local_path=str(asset.path), name=asset.name))
    saes: list[SAE] = []
    for asset in manifest.saes.values():
        path = str(Path(asset.path).resolve())
        existing = SAE.objects.filter(local_path=path).first()
        saes.append(
            existing
            or sae_register_local(
                local_path=path, name=asset.name, trained_on_model=asset.model_name, trained_on_layer=asset.layer
            )
        )
    return models, saes
