"""Which model the engine holds, from /v1's side: look-up by name, load on demand
(single-flight), and a gate that keeps a load from swapping the model under requests
that are generating on it.

``orchestration.services.model_load`` is synchronous and slow, so it runs on its own thread;
every request for the model being loaded awaits the same load. While a load runs, a
request for another model is refused with ``model_busy`` (it must not start a second
load); ``X-miLLM-Load-Policy: refuse`` turns the on-demand load off: 409
``model_not_resident``, or 503 ``model_loading`` while a load of that model runs.

Per process, like admission: loads started elsewhere (``/api``) are seen through the
model row's status and the engine's own status.
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

import structlog
from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import close_old_connections, connections

from core.errors import MillmError, ModelBusy
from core.runtime import runtime
from gpu_engine.protocol import EngineStatus

log = structlog.get_logger(__name__)

LOAD_POLICIES = ("auto", "refuse")


class ModelNotResident(MillmError):
    code, status = "MODEL_NOT_RESIDENT", 409


class ModelLoading(MillmError):
    code, status = "MODEL_LOADING", 503


@dataclass(frozen=True)
class ModelRef:
    """What /v1 needs of a registry row, read once per request."""

    pk: int | None  # None: answered from the engine (resident), never loaded by pk
    name: str
    status: str


class Residency:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loading: dict[str, Future] = {}
        self._active: dict[str, int] = {}

    def loading(self, name: str) -> bool:
        with self._lock:
            return name in self._loading

    def active(self) -> dict[str, int]:
        with self._lock:
            return dict(self._active)

    async def _resident_name(self) -> str | None:
        return resident_model_id(await asyncio.to_thread(runtime().engine.status))

    async def status(self) -> EngineStatus:
        return await asyncio.to_thread(runtime().engine.status)

    def check_policy(self, model: ModelRef, *, policy: str, resident: str | None) -> None:
        """Refusals that must come before the request queues: another model is loading,
        or (refuse policy) this one is not resident."""
        with self._lock:
            other_load = next((n for n in self._loading if n != model.name), None)
        if other_load is not None:
            raise ModelBusy(f"Model {other_load!r} is being loaded; retry shortly",
                            details={"model": model.name, "loading": other_load},
                            retry_after=settings.RETRY_AFTER_LOAD_S)
        if resident == model.name and not self.loading(model.name):
            return
        # model.status was read before any wait: a "loading" seen then may be over now,
        # which the resident check above has already caught
        if self.loading(model.name) or model.status == "loading":
            if policy == "refuse" or not self.loading(model.name):
                raise ModelLoading(f"Model {model.name!r} is loading; retry shortly",
                                   details={"model": model.name},
                                   retry_after=settings.RETRY_AFTER_LOAD_S)
            return
        if policy == "refuse":
            raise ModelNotResident(
                f"Model {model.name!r} is not loaded and X-miLLM-Load-Policy is refuse",
                details={"model": model.name, "resident": resident})

    async def acquire(self, model: ModelRef, *, policy: str,
                      status: EngineStatus | None = None, lease: str | None = None) -> Use:
        """Make ``model`` resident (loading it if needed and allowed) and register a use
        of it; the returned ``Use`` must be released when the request ends. ``status``:
        an engine status the caller has just read (saves reading it again). ``lease``:
        the request's ``X-miLLM-Lease``, needed to load over a leased model."""
        for _ in range(3):
            if status is None:
                status = await asyncio.to_thread(runtime().engine.status)
            resident = resident_model_id(status)
            self.check_policy(model, policy=policy, resident=resident)
            if resident != model.name and not self.loading(model.name):
                await sync_to_async(_check_lease, thread_sensitive=False)(
                    model, lease)  # 409 model_leased
            with self._lock:
                other_load = next((n for n in self._loading if n != model.name), None)
                if other_load is not None:
                    raise ModelBusy(f"Model {other_load!r} is being loaded; retry shortly",
                                    details={"model": model.name, "loading": other_load},
                                    retry_after=settings.RETRY_AFTER_LOAD_S)
                if resident == model.name and model.name not in self._loading:
                    self._active[model.name] = self._active.get(model.name, 0) + 1
                    return Use(self, model.name, status)
                future = self._loading.get(model.name)
                if future is None:
                    future = Future()
                    self._loading[model.name] = future
                    starter = True
                else:
                    starter = False
            if starter:
                threading.Thread(target=self._load, args=(model, future),
                                 name=f"millm-load-{model.name}", daemon=True).start()
            await asyncio.wrap_future(future)
            status = None
        raise ModelBusy(f"Model {model.name!r} was swapped out while this request waited",
                        details={"model": model.name}, retry_after=settings.RETRY_AFTER_LOAD_S)

    def _load(self, model: ModelRef, future: Future) -> None:
        from orchestration.services import model_load
        from registry.models import Model

        close_old_connections()
        try:
            # Requests generating on another model finish first (bounded): the engine
            # would otherwise run their queued work on the new model.
            deadline = time.monotonic() + settings.GRACEFUL_UNLOAD_TIMEOUT
            while any(n != model.name and c for n, c in self.active().items()):
                if time.monotonic() > deadline:
                    raise ModelBusy("Requests on the resident model did not finish in time "
                                    "for a load; retry shortly",
                                    details={"model": model.name},
                                    retry_after=settings.RETRY_AFTER_LOAD_S)
                time.sleep(0.05)
            log.info("v1_model_autoload", model=model.name)
            model_load(model=Model.objects.get(name=model.name))
            error: BaseException | None = None
        except BaseException as exc:  # noqa: BLE001 - every waiter gets the same error
            error = exc
        # Off the table before the waiters wake, or a woken waiter finds the load still
        # "running" and waits on it again.
        with self._lock:
            self._loading.pop(model.name, None)
        # this thread ends here; its connection would pin a database session
        connections.close_all()
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)

    def _release(self, name: str) -> None:
        with self._lock:
            count = self._active.get(name, 0) - 1
            if count > 0:
                self._active[name] = count
            else:
                self._active.pop(name, None)


def _check_lease(model: ModelRef, lease: str | None) -> None:
    """An auto-load would swap out a leased model: only its holder may."""
    from leases.services import lease_check_change

    close_old_connections()  # a pool thread's connection, checked like a request's
    lease_check_change(operation="load", target_model=None, lease_id=lease)


def resident_model_id(status: EngineStatus) -> str | None:
    return status.model_id if status.state == "ready" else None


class Use:
    """A request's use of the resident model; ``status`` is the engine's status read when
    it was granted (its attachments are what the request resolves steering against)."""

    __slots__ = ("_name", "_released", "_residency", "status")

    def __init__(self, residency: Residency, name: str, status: EngineStatus) -> None:
        self._residency = residency
        self._name = name
        self._released = False
        self.status = status

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._residency._release(self._name)
