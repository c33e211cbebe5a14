"""What the engine reports about itself: its state, the loaded backend's geometry and
capabilities, the batch, the memory the backend keeps, the attachments.  Read on any
thread without the worker's cooperation: a racy snapshot is fine for status."""

from __future__ import annotations

from typing import Any

import msgspec

from ..backends import backends_report
from ..backends.base import CachesRows, ModelBackend
from ..interp.hooks import HookManager
from ..api.codec import to_builtins
from ..api.protocol import AttachmentStatus, EngineStatus
from .worker import EngineWorker


def _failure(backend: ModelBackend) -> str | None:
    check = getattr(backend, "failure", None)
    return check() if check is not None else None


class StatusReports(EngineWorker):
    def memory_status(self) -> dict[str, Any]:
        """What the backend keeps between requests now, and the idle releases so far."""
        runner = self._scheduler.backend if self._scheduler is not None else None
        with self._state_lock:
            data: dict[str, Any] = dict(self._memory)
        data["idle_release_s"] = self.idle_release_s
        data["cached_bytes"] = int(runner.cached_bytes()) if isinstance(runner, CachesRows) else None
        # the backend's prefix cache (decode/prefix_cache.py), where it keeps one
        cache = getattr(self._backend, "prefix_cache", None)
        data["prefix_cache"] = cache.status() if cache is not None else None
        return data

    def attachments(self) -> list[AttachmentStatus]:
        with self._state_lock:
            current = list(self._attachments.values())
        return [a.status() for a in current]

    def batching_status(self) -> dict[str, Any]:
        """The generation mode and what the loaded backend can do per request, as the
        backend reports it (empty while no model is loaded)."""
        sched = self._scheduler
        backend = self._backend
        caps: dict[str, Any] = {}
        if backend is not None:
            # the backend's report as JSON (the keys it has), with the runtime's own two
            caps = to_builtins(
                msgspec.structs.replace(
                    backend.capabilities(), shared_forward_passes=sched is not None, serial_fallback=False
                )
            )
        data: dict[str, Any] = {
            "enabled": sched is not None,
            "mode": "continuous_batching" if sched is not None else "serial",
            "capabilities": caps,
        }
        if sched is not None:
            data.update(sched.status())
            with self._state_lock:
                data.update(self._gathers, arriving=self._arriving, gather_ms=self.batching.gather_ms)
        elif backend is not None:
            # serial: one generation at a time, the rest queued on the worker
            running = min(self._in_flight, 1)
            data.update(
                occupancy=float(running),
                max_rows=1,
                running=running,
                queue_depth=max(self._queued, 0),
                kv=None,
                decode_steps=self._steps.decode_steps,
                **self._steps.status(),
            )
        return data

    def _in_flight_total(self) -> int:
        sched = self._scheduler
        # read without the worker's cooperation: a racy snapshot is fine for status
        extra = len(sched.running) + len(sched.waiting) if sched is not None else 0
        return self._in_flight + extra

    def status(self) -> EngineStatus:
        b = self._backend
        if b is None:
            return EngineStatus(
                state="empty",
                in_flight=self._in_flight_total(),
                queued=max(self._queued, 0),
                batching=self.batching_status(),
                draining=self._ledger.draining,
                backends=backends_report(),
            )
        return EngineStatus(
            state="ready",
            draining=self._ledger.draining,
            backend=b.name,
            model_id=self._model_id,
            model_path=str(self._load_job.path) if self._load_job else None,
            dtype=self._load_job.dtype if self._load_job else None,
            device=str(b.device),
            context_length=b.context_length,
            num_layers=b.num_layers,
            hidden_size=b.hidden_size,
            vocab_size=b.vocab_size,
            attachments=self.attachments(),
            in_flight=self._in_flight_total(),
            queued=max(self._queued, 0),
            batching=self.batching_status(),
            kernels=b.kernels,
            backends=backends_report(),
            memory=self.memory_status(),
            weights=dict(b.weights),
            failure=_failure(b),
        )

    @property
    def hook_manager(self) -> HookManager:
        return self._hooks

    @property
    def backend(self) -> ModelBackend | None:
        return self._backend

    @property
    def backend_name(self) -> str | None:
        backend = self._backend
        return backend.name if backend is not None else None


__all__ = ["StatusReports"]
