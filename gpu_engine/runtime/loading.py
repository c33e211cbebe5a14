"""What is resident and how it changes: loading a model through the backend registry
(checked against ``ModelBackend``), unloading it, attaching and detaching SAEs (all or
nothing), and the out-of-memory policy (detach every SAE, keep the base model serving).

Each change runs on the worker once the work already accepted has drained
(``drain.WorkLedger``); the runtime names no backend adapter, only the registry's entry.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import torch

from ..backends import batch_rows, get_backend
from ..backends.base import Closeable, missing_members
from ..api.errors import (
    EngineError,
    GenerationFailed,
    InsufficientMemory,
    InvalidParameter,
    ModelLoadFailed,
    SAEIncompatible,
    SAENotAttached,
)
from ..api.protocol import (
    AttachmentKey,
    AttachResult,
    AttachSpec,
    CompatibilityReport,
    EngineStatus,
    GenerationJob,
    LoadModelJob,
)
from ..sae import check_compatibility
from ..sae.layouts import config_at_layer, resolve_layout
from .attachments import Attachment, is_out_of_memory, prepare_attachment
from .drain import STOP_WAIT_S
from .scheduler import BatchScheduler
from .status import StatusReports
from .stream import GenerationStream
from .worker import backend_failure

log = logging.getLogger("gpu_engine")


class ModelLoading(StatusReports):
    """Loads, unloads, attachments and the out-of-memory policy (see the module doc)."""

    # a request's decode state for the batch scheduler (``runtime.engine.Engine``)
    _make_sequence: Callable[[GenerationJob, GenerationStream], Any]

    def _drained(
        self, reason: str, model_id: str | None, timeout_s: float | None, *, stop_after: bool, op: Callable[[], Any]
    ) -> Any:
        """Run control ``op`` once the work already accepted has finished (``WorkLedger.drained``)."""
        timeout = self.drain_timeout_s if timeout_s is None else float(timeout_s)
        return self._ledger.drained(
            reason,
            model_id,
            timeout,
            stop_after=stop_after,
            run=lambda: self._call(op, timeout_s=max(timeout, STOP_WAIT_S)),
        )

    def cancel_all(self, reason: str = "cancel_all") -> int:
        """Stop every running generation; their clients get ``engine_busy``."""
        return self._ledger.cancel_all(reason)

    def check_load(self, job: LoadModelJob) -> None:
        """Refuse ``job`` as ``load_model`` would before anything drains (its backend not
        installed, its options, what the backend cannot honour: a quantization without a
        kernel, a pre-quantized checkpoint this host cannot load); nothing else happens.
        The web tier asks before it queues a load, so that such a load is a 400 at once."""
        entry = get_backend(job.backend)
        entry.require()
        entry.check_job(job)

    def load_model(self, job: LoadModelJob, *, timeout_s: float | None = None) -> EngineStatus:
        """Load ``job``'s model, replacing the resident one once the work running on it
        has finished (bounded by ``timeout_s``: engine_busy after, nothing replaced)."""

        entry = get_backend(job.backend)
        self.check_load(job)  # refused before anything drains

        def op() -> EngineStatus:
            self._unload()
            try:
                backend = entry.load(job, hooks=self._hooks)
            except Exception as exc:
                if is_out_of_memory(exc):
                    gc.collect()
                    raise InsufficientMemory(f"not enough memory to load {job.model_id}: {exc}") from exc
                raise
            missing = missing_members(backend)
            if missing:
                if isinstance(backend, Closeable):
                    backend.close()
                raise ModelLoadFailed(f"the {entry.name} backend broke its contract (missing: {', '.join(missing)})")
            self._backend, self._model_id, self._load_job = backend, job.model_id, job
            # the interactive rows: a backend with a batch of its own (vLLM's max_num_seqs)
            # sizes them unless the operator set them, and caps them when the operator did
            rows = batch_rows(
                self.batching.max_batch_size, entry.rows(job.options), follow_backend=self.batching.follow_backend
            )
            if self._scheduler is None and not backend.capabilities().serial_mode:
                # a backend that only batches (vLLM) runs every generation through a batch
                # scheduler even on a serial engine; it goes with the backend (_unload)
                self._scheduler = BatchScheduler(
                    msgspec.structs.replace(self.batching, enabled=True),
                    make_sequence=self._make_sequence,
                    classify=self._classify,
                    writer=self._capture_writer,
                    figures=self._steps,
                )
                self._backend_scheduler = True
            if self._scheduler is not None:
                self._scheduler.options = msgspec.structs.replace(self._scheduler.options, max_batch_size=rows)
                self._scheduler.set_backend(backend.batch_runner(max_rows=rows + self.batching.batch_rows))
            self._emit("model:load:complete", model_id=job.model_id)
            return self.status()

        return self._drained("loading", job.model_id, timeout_s, stop_after=False, op=op)

    def _unload(self) -> None:
        if self._backend is None:
            return
        self._detach_keys(list(self._attachments), reason="unload")
        backend, model_id = self._backend, self._model_id
        self._backend = self._model_id = self._load_job = None
        if self._scheduler is not None:
            self._scheduler.set_backend(None)
            # the engine's own rows again until the next model's backend sizes them
            self._scheduler.options = msgspec.structs.replace(
                self._scheduler.options, max_batch_size=self.batching.max_batch_size
            )
        if self._backend_scheduler:
            self._scheduler, self._backend_scheduler = None, False
        try:
            backend.close()
        except Exception:  # noqa: BLE001 - a dead backend still leaves: nothing is resident
            log.exception("closing the %s backend failed; unloaded anyway", backend.name)
        gc.collect()
        self._emit("model:unload:complete", model_id=model_id)

    def unload_model(self, *, timeout_s: float | None = None) -> None:
        """Unload the resident model. New work is refused at once (engine_busy); work
        already accepted gets ``timeout_s`` (GRACEFUL_UNLOAD_TIMEOUT) to finish, then it
        is stopped and the unload goes ahead."""
        if self._backend is None:
            return
        self._drained("unloading", self._model_id, timeout_s, stop_after=True, op=self._unload)

    # ------------------------------------------------------------------ SAEs

    def check_sae(self, path: str, layer: int, *, layout: str | None = None) -> CompatibilityReport:
        """Compatibility of an SAE with the loaded model, from its metadata only."""
        backend = self._require_backend()
        found_layout, found = resolve_layout(path, layout)
        try:
            cfg = config_at_layer(found_layout, found_layout.read_metadata(found), layer)
        except SAEIncompatible as exc:  # a vector file without that layer's vector
            return CompatibilityReport(False, errors=[exc.message])
        return check_compatibility(
            cfg, hidden_size=backend.hidden_size, num_layers=backend.num_layers, layer=layer, model_name=self._model_id
        )

    def attach_set(self, specs: Sequence[AttachSpec], *, timeout_s: float | None = None) -> list[AttachResult]:
        """Attach several SAEs all-or-nothing (an existing (sae_id, layer) is replaced)."""
        specs = list(specs)
        keys = [(s.sae_id, s.layer) for s in specs]
        if len(set(keys)) != len(keys):
            raise InvalidParameter("the set names one (sae_id, layer) twice", param="attachments")

        def op() -> list[AttachResult]:
            backend = self._require_backend()
            prepared = [prepare_attachment(backend, s, self._model_id) for s in specs]  # loads everything first
            installed: list[AttachmentKey] = []
            replaced: dict[AttachmentKey, Attachment] = {}
            try:
                for att, _ in prepared:
                    with self._state_lock:
                        old = self._attachments.pop(att.key, None)
                    if old is not None:
                        backend.detach(att.key)
                        replaced[att.key] = old
                    backend.attach(att)
                    with self._state_lock:
                        self._attachments[att.key] = att
                    installed.append(att.key)
            except BaseException:
                for key in installed:
                    backend.detach(key)
                    with self._state_lock:
                        self._attachments.pop(key, None)
                for key, old in replaced.items():
                    backend.attach(old)
                    with self._state_lock:
                        self._attachments[key] = old
                raise
            results = []
            for att, warnings in prepared:
                cfg = att.sae.cfg
                results.append(
                    AttachResult(
                        att.sae_id,
                        att.layer,
                        att.layer_module_path,
                        cfg.d_in,
                        cfg.d_sae,
                        cfg.activation,
                        cfg.layout,
                        warnings,
                        hook_point=att.hook_point,
                    )
                )
                self._emit(
                    "sae:attached",
                    sae_id=att.sae_id,
                    layer=att.layer,
                    layer_module_path=att.layer_module_path,
                    hook_point=att.hook_point,
                )
            return results

        return self._call(op, timeout_s=timeout_s)

    def attach(self, spec: AttachSpec, *, timeout_s: float | None = None) -> AttachResult:
        return self.attach_set([spec], timeout_s=timeout_s)[0]

    def _detach_keys(self, keys: list[AttachmentKey], *, reason: str) -> list[AttachmentKey]:
        for key in keys:
            if self._backend is not None:
                try:
                    self._backend.detach(key)
                except Exception:  # noqa: BLE001 - a backend that died (vLLM's engine core)
                    # cannot run the hook any more either: the attachment is gone all the same
                    log.exception("detaching %s from the backend failed; forgotten anyway", key)
            with self._state_lock:
                self._attachments.pop(key, None)
        if keys and self._backend is not None and self._backend.device.type == "cuda":
            torch.cuda.empty_cache()
        for sae_id, layer in keys:
            self._emit("sae:detached", sae_id=sae_id, layer=layer, reason=reason)
        return keys

    def detach(
        self, sae_id: str | None = None, layer: int | None = None, *, timeout_s: float | None = None
    ) -> list[AttachmentKey]:
        """Detach matching attachments (``sae_id=None``: all).  Unknown → SAENotAttached."""

        def op() -> list[AttachmentKey]:
            keys = [
                k for k in self._attachments if (sae_id is None or k[0] == sae_id) and (layer is None or k[1] == layer)
            ]
            if not keys and sae_id is not None:
                raise SAENotAttached(
                    f"SAE {sae_id!r}{'' if layer is None else f' at layer {layer}'} is not attached",
                    details={"sae_id": sae_id, "layer": layer},
                )
            return self._detach_keys(keys, reason="detach")

        return self._call(op, timeout_s=timeout_s)

    def _handle_oom(self, exc: BaseException) -> None:
        keys = list(self._attachments)
        log.error("out of memory during a forward pass (%s); detaching %d SAE(s)", exc, len(keys))
        gc.collect()
        if keys:
            self._detach_keys(keys, reason="out_of_memory")
        elif self._backend is not None and self._backend.device.type == "cuda":
            torch.cuda.empty_cache()
        self._emit("engine:out_of_memory", detached=[{"sae_id": s, "layer": layer} for s, layer in keys])

    def _classify(self, exc: BaseException) -> EngineError:
        dead = backend_failure(self._backend) if self._backend is not None else None
        if dead is not None:  # the backend's engine died under the step (vLLM's core)
            return dead
        if is_out_of_memory(exc):
            self._handle_oom(exc)
            return InsufficientMemory(
                "out of memory during generation; attached SAEs were detached, the base model keeps serving"
            )
        return GenerationFailed(f"generation failed: {type(exc).__name__}: {exc}")


__all__ = ["ModelLoading"]
