"""What a load must pass before the engine is asked, and what it is asked: the refusals
a load shares with its enqueueing (files, remote code, format and backend, quantization,
the backend installed, the engine's own ``check_load``, a locked resident model) and the
engine job (``load_job``: files, backend, the backend's options from the settings)."""

from __future__ import annotations

from pathlib import Path

from django.conf import settings

from core.engine_client import resolve_device_and_dtype
from core.errors import BackendUnavailable, UnsupportedModel, ValidationFailed, from_engine_error
from core.runtime import runtime
from gpu_engine.api.devices import check_card
from gpu_engine.api.errors import EngineError, InvalidParameter
from gpu_engine.api.host import backend_option_settings
from gpu_engine.api.protocol import LoadModelJob
from registry.access import remote_code_enabled
from registry.errors import (
    ModelInvalid,
    ModelLocked,
    ModelNotFound,
    RemoteCodeNotAllowed,
    UnsupportedQuantization,
)
from registry.models import Model
from registry.services import backend_format_mismatch
from registry.selectors import model_loaded

# Registry quantizations a load takes at the engine's dtype (MILLM_ENGINE_DTYPE); below
# them (Q8, Q4, Q2) the transformers backend quantizes the decoder blocks at load where it
# has a kernel for it (gpu_engine/backends/transformers/quantization.py), and says so in
# its backend report; GGUF rows carry their file's own quantization.
FULL_PRECISION = (Model.Quantization.FP32, Model.Quantization.FP16)
# engine errors that mean "no engine answered", not "the engine refuses": left to the load
_NO_ANSWER = ("engine_shutdown", "engine_busy", "engine_error")


def _check_quantization(model: Model) -> None:
    """Refuse at once (400 UNSUPPORTED_QUANTIZATION, naming it and why) a Q8/Q4/Q2 row on a
    backend that applies no quantization at load, or on one whose report says it cannot
    apply that one here (Q2: no kernel). The engine refuses the same in ``check_load``."""
    if model.format != Model.Format.TRANSFORMERS or model.quantization in FULL_PRECISION:
        return
    backend = model.effective_backend()
    try:
        report = runtime().engine.status().backends
    except EngineError:
        report = []
    entry = next((b for b in report if b.get("name") == backend), None)
    if entry is None:
        return  # no engine to ask: the load's own check_load decides
    offered = entry.get("quantizations") or {}
    state = offered.get(model.quantization)
    if state is not None and state.get("available"):
        return
    if state is None:
        why = (
            f"the {backend} backend loads transformers checkpoints at FP32/FP16 only "
            "(the transformers backend quantizes at load)"
        )
    elif state.get("missing"):
        why = (
            f"{model.quantization} needs {', '.join(state['missing'])}, not installed on the "
            f"engine's host (install it with `{entry.get('install')}`)"
        )
    else:
        why = str(state.get("reason") or "no kernel for it here")
    raise UnsupportedQuantization(
        f"Model {model.name!r} is registered as {model.quantization}, which this engine cannot load: {why}",
        details={
            "model_id": model.id,
            "quantization": model.quantization,
            "backend": backend,
            "supported": list(FULL_PRECISION) + sorted(k for k, v in offered.items() if v.get("available")),
        },
    )


def _check_engine_accepts(model: Model) -> None:
    """Ask the engine whether it would take this load (``check_load``: its backend's
    options and what the backend cannot honour, such as a pre-quantized checkpoint whose
    method cannot load on its host), so that a refusal is a 400 now rather than a failed
    job. An engine that does not answer is left to the load itself."""
    try:
        device, dtype = resolve_device_and_dtype(settings.MILLM_ENGINE_DEVICE, settings.MILLM_ENGINE_DTYPE)
        runtime().engine.check_load(load_job(model, device=device, dtype=dtype))
    except EngineError as exc:
        if exc.code in _NO_ANSWER:
            return
        raise from_engine_error(exc) from exc


def load_job(model: Model, *, device: str, dtype: str) -> LoadModelJob:
    """What the engine is asked to load for ``model``: its files, its backend (the row's,
    else MILLM_BACKEND) and that backend's options from the settings."""
    backend = model.effective_backend()
    # a setting left unset (TORCH_COMPILE=auto) leaves its option out: the backend decides
    # the setting each option comes from is declared with the option in the engine's
    # backend registry (gpu_engine.backends)
    options = {
        option: getattr(settings, name)
        for option, name in backend_option_settings(backend).items()
        if getattr(settings, name) is not None
    }
    if model.format == Model.Format.GGUF and model.gguf_file:
        # a directory holding the file (hub downloads): which GGUF in it
        options["gguf_file"] = model.gguf_file
    if (
        backend == "transformers"
        and model.format == Model.Format.TRANSFORMERS
        and model.quantization not in FULL_PRECISION
    ):
        options["quantization"] = model.quantization  # applied at load (Q8, Q4)
    if options.get("speculative_model"):
        # SPECULATIVE_MODEL may name a registered model: the engine reads its files
        options["speculative_model"] = speculative_draft(options["speculative_model"])
    # a row registered with remote code before the operator turned ALLOW_REMOTE_CODE off
    # runs none (``_check_loadable`` refuses it first; this holds for any other caller)
    return LoadModelJob(
        model_id=model.name,
        path=model.local_path,
        dtype=dtype,
        device=device,
        trust_remote_code=remote_code_enabled(model.trust_remote_code),
        backend=backend,
        options=options,
    )


def speculative_draft(value: str) -> str:
    """What the engine reads for SPECULATIVE_MODEL: ``self:layers=N`` as it is; a registered
    model's name, or the hub repository id of a registered model, as that model's files; an
    absolute path (or a directory here) as it is, the engine checks it. Anything else names
    nothing: 404 MODEL_NOT_FOUND naming the setting (start-up refuses it, and so does every
    load before the resident model is unloaded)."""
    if value.startswith("self:"):
        return value
    named = Model.objects.filter(name=value).first()
    if named is None:
        # a repository registered twice (two revisions, two GGUF files): the one with files
        same_repo = Model.objects.filter(repo_id=value).order_by("pk")
        named = same_repo.exclude(local_path="").first() or same_repo.first()
    if named is not None:
        if not named.local_path:
            raise ModelInvalid(
                f"SPECULATIVE_MODEL={value!r} names model {named.name!r}, which has no files yet "
                f"(status {named.status})",
                details={"setting": "SPECULATIVE_MODEL", "value": value, "model_id": named.id},
            )
        return named.local_path
    if Path(value).is_absolute() or Path(value).is_dir():
        return value
    raise ModelNotFound(
        f"SPECULATIVE_MODEL={value!r} is neither self:layers=N, a registered model's name, the "
        "repository id of a registered model, nor a checkpoint directory; register the draft "
        "first (manage.py download_model, or POST /api/models on a server started without "
        "SPECULATIVE_MODEL) or name its directory",
        details={"setting": "SPECULATIVE_MODEL", "value": value},
    )


def check_speculative_model() -> None:
    """Start-up's check of SPECULATIVE_MODEL (``orchestration.startup``): it must name a
    draft, else the process refuses to start. A registered draft still downloading passes
    (its loads are refused until its files are there)."""
    if settings.SPECULATIVE_MODEL:
        try:
            speculative_draft(settings.SPECULATIVE_MODEL)
        except ModelInvalid:
            pass


def check_engine_device() -> None:
    """Start-up's check of MILLM_ENGINE_DEVICE on the engine's host (embedded ``serve``,
    ``run_engine``): ``cuda:N`` must name a card torch sees there, else the process refuses
    to start (VALIDATION_ERROR naming the setting and the cards). A host whose torch sees
    no card at all is left to each load (a llama.cpp build may offload where torch cannot):
    the backend refuses it then, by name."""
    device = str(settings.MILLM_ENGINE_DEVICE)
    if not device.startswith("cuda:"):
        return
    import torch

    if not torch.cuda.is_available():
        return
    try:
        check_card(device, torch.cuda.device_count(), seen_by="this host")
    except InvalidParameter as exc:
        found = {k: v for k, v in exc.details.items() if k != "param"}
        raise ValidationFailed(
            exc.message, details={"setting": "MILLM_ENGINE_DEVICE", "value": device, **found}
        ) from None


def _check_backend(model: Model) -> None:
    """Refuse at once (400 backend_unavailable, with the install command) a load on a
    backend the engine's host does not have; the engine refuses it too, this only saves
    a 202 and a failed job. An engine that does not answer is left to the load itself."""
    backend = model.effective_backend()
    try:
        report = runtime().engine.status().backends
    except EngineError:
        return
    entry = next((b for b in report if b.get("name") == backend), None)
    if entry is None or entry.get("available"):
        return
    raise BackendUnavailable(
        f"Model {model.name!r} runs on the {backend} backend, which is not installed on the "
        f"engine's host; install it with `{entry.get('install')}`",
        details={
            "model_id": model.id,
            "backend": backend,
            "missing": entry.get("missing"),
            "install": entry.get("install"),
        },
    )


def _check_loadable(model: Model) -> Model | None:
    """The refusals a load shares with its enqueueing (the API's route checks them before
    the job row, the load itself again when it runs): no files yet, GGUF, a quantization
    this build cannot apply, a locked resident model. The resident model it would replace."""
    if model.status == Model.Status.DOWNLOADING or not model.local_path:
        raise ModelInvalid(
            f"Model {model.name!r} has no files yet (status {model.status})",
            details={"model_id": model.id, "status": model.status},
        )
    if model.trust_remote_code and not remote_code_enabled(True):
        raise RemoteCodeNotAllowed(
            f"Model {model.name!r} was registered with trust_remote_code, and running a "
            "repository's own code is off on this server (ALLOW_REMOTE_CODE); the operator "
            "enables it, or register the model again without it",
            details={"model_id": model.id, "field": "trust_remote_code", "setting": "ALLOW_REMOTE_CODE"},
        )
    backend = model.effective_backend()
    reason = backend_format_mismatch(backend, model.format)
    if reason is not None:
        raise UnsupportedModel(
            f"Model {model.name!r} is a {model.format} model and its backend is {backend}: {reason}"
            " (set the model's backend: PATCH /api/models/{id})",
            details={"model_id": model.id, "format": model.format, "backend": backend},
        )
    _check_quantization(model)
    _check_backend(model)
    _check_engine_accepts(model)
    resident = model_loaded(other_than=model)
    if resident is not None and resident.locked:
        raise ModelLocked(
            f"Model {resident.name!r} is resident and locked; unlock it first", details={"model_id": resident.id}
        )
    return resident
