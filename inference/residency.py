"""Which model the engine holds, from /v1's side: look-up by name, load on demand
(single-flight), and refusals while the model changes.

``orchestration.services.model_load`` is synchronous and slow, so it runs on its own thread;
every request for the model being loaded awaits the same load. While a load runs, a
request for another model is refused with ``model_busy`` (it must not start a second
load); ``X-miLLM-Load-Policy: refuse`` turns the on-demand load off: 409
``model_not_resident``, or 503 ``model_loading`` while a load of that model runs. An
inference key's request never loads (``ADMIN_ONLY``): only admin keys change what is
resident.

Across processes (several web workers, Celery, the engine process) the shared state
decides, not this process's memory:

- a load is claimed on the model row (``model_load``'s conditional update): a worker that
  loses the claim waits for the load another process runs instead of starting a second;
- a row that says ``unloading``, or an engine that is draining for an unload or a model
  swap (its status says so), gets 503 ``model_busy`` here, before any auto-load;
- the engine itself counts the requests running on it and makes an unload or a swap
  wait for them (GRACEFUL_UNLOAD_TIMEOUT), wherever the unload was asked from.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import threading
from concurrent.futures import Future
from dataclasses import dataclass

import structlog
from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import close_old_connections, connections

from core.engines import current_engine
from core.errors import MillmError, ModelBusy
from core.runtime import runtime
from gpu_engine.api.protocol import EngineStatus
from leases.services import lease_check_change
from orchestration.errors import LoadInProgress
from orchestration.services import model_load, model_load_wait
from registry.errors import ModelAlreadyLoaded
from registry.models import Model

log = structlog.get_logger(__name__)

LOAD_POLICIES = ("auto", "refuse")
# what an inference key's request gets whatever it asks: only admin keys load models (a
# request naming another model would otherwise swap the resident one for every user)
ADMIN_ONLY = "admin_only"


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
    # the model's d_model as the registry or the engine knows it (None: not known yet)
    hidden_size: int | None = None


class Residency:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loading: dict[str, Future] = {}
        self._engine_of: dict[str, str] = {}  # the engine each running load addresses

    def _other_load(self, name: str) -> str | None:
        """A load of another model on the same engine running from this process (a load
        on another engine changes nothing this request's engine holds). Under the lock."""
        engine = current_engine()
        return next((n for n in self._loading if n != name and self._engine_of.get(n) == engine), None)

    def loading(self, name: str) -> bool:
        with self._lock:
            return name in self._loading

    async def status(self) -> EngineStatus:
        """The engine's status: read on the loop when that needs no I/O (the engine in this
        process), else on a thread (a Redis read)."""
        engine = runtime().engine
        if not engine.status_blocks:
            return engine.status()
        return await asyncio.to_thread(engine.status)

    def check_policy(self, model: ModelRef, *, policy: str, resident: str | None, draining: str | None = None) -> None:
        """Refusals that must come before the request queues: the model is being unloaded
        (its row, or the engine draining for it), another model is loading, or (refuse
        policy) this one is not resident. ``draining``: the engine status's."""
        if model.status == "unloading" or (draining == "unloading" and resident == model.name):
            raise ModelBusy(
                f"Model {model.name!r} is being unloaded; retry shortly",
                details={"model": model.name, "state": "unloading"},
                retry_after=settings.RETRY_AFTER_UNLOAD_S,
            )
        with self._lock:
            other_load = self._other_load(model.name)
        if other_load is not None:
            raise ModelBusy(
                f"Model {other_load!r} is being loaded; retry shortly",
                details={"model": model.name, "loading": other_load},
                retry_after=settings.RETRY_AFTER_LOAD_S,
            )
        loading_here = self.loading(model.name)
        if draining is not None and not loading_here and model.status != "loading":
            # the engine is swapping the model under this request's: it would be refused
            raise ModelBusy(
                f"The engine is {draining} a model; retry shortly",
                details={"model": model.name, "state": draining},
                retry_after=settings.RETRY_AFTER_LOAD_S,
            )
        if resident == model.name and not loading_here:
            return
        # model.status was read before any wait: a "loading" seen then may be over now,
        # which the resident check above has already caught. A load running in another
        # process is awaited like one running here.
        if loading_here or model.status == "loading":
            if policy != "auto":
                raise ModelLoading(
                    f"Model {model.name!r} is loading; retry shortly",
                    details={"model": model.name},
                    retry_after=settings.RETRY_AFTER_LOAD_S,
                )
            return
        if policy == ADMIN_ONLY:
            raise ModelNotResident(
                f"Model {model.name!r} is not loaded, and loading a model needs an admin key "
                "(MILLM_ADMIN_API_KEYS); this key is an inference key",
                details={"model": model.name, "resident": resident},
            )
        if policy == "refuse":
            raise ModelNotResident(
                f"Model {model.name!r} is not loaded and X-miLLM-Load-Policy is refuse",
                details={"model": model.name, "resident": resident},
            )

    async def acquire(
        self, model: ModelRef, *, policy: str, status: EngineStatus | None = None, lease: str | None = None
    ) -> Use:
        """Make ``model`` resident (loading it if needed and allowed) and register a use
        of it; the returned ``Use`` must be released when the request ends. ``status``:
        an engine status the caller has just read (saves reading it again). ``lease``:
        the request's ``X-miLLM-Lease``, needed to load over a leased model."""
        for _ in range(3):
            if status is None:
                status = await self.status()
            resident = resident_model_id(status)
            self.check_policy(model, policy=policy, resident=resident, draining=status.draining)
            if resident != model.name and not self.loading(model.name):
                await sync_to_async(_check_lease, thread_sensitive=False)(model, lease)  # 409 model_leased
            with self._lock:
                other_load = self._other_load(model.name)
                if other_load is not None:
                    raise ModelBusy(
                        f"Model {other_load!r} is being loaded; retry shortly",
                        details={"model": model.name, "loading": other_load},
                        retry_after=settings.RETRY_AFTER_LOAD_S,
                    )
                if resident == model.name and model.name not in self._loading:
                    return Use(status)
                future = self._loading.get(model.name)
                if future is None:
                    future = Future()
                    self._loading[model.name] = future
                    self._engine_of[model.name] = current_engine()
                    starter = True
                else:
                    starter = False
            if starter:
                # in the request's context: the load's audit entry names the caller
                threading.Thread(
                    target=contextvars.copy_context().run,
                    args=(self._load, model, future),
                    name=f"millm-load-{model.name}",
                    daemon=True,
                ).start()
            await asyncio.wrap_future(future)
            status = None
            # what the wait changed is read again: a row that said "loading" then
            model = dataclasses.replace(model, status="unknown")
        raise ModelBusy(
            f"Model {model.name!r} was swapped out while this request waited",
            details={"model": model.name},
            retry_after=settings.RETRY_AFTER_LOAD_S,
        )

    def _load(self, model: ModelRef, future: Future) -> None:
        close_old_connections()
        try:
            # Requests running on the resident model finish first: the engine drains
            # them (bounded) before it swaps the weights, and refuses new ones meanwhile.
            log.info("v1_model_autoload", model=model.name)
            try:
                model_load(model=Model.objects.get(name=model.name))
            except LoadInProgress:
                # another process (a web worker, a Celery load) claimed it first
                model_load_wait(name=model.name, timeout_s=settings.ENGINE_COMMAND_TIMEOUT_S)
            except ModelAlreadyLoaded:
                pass  # another process's load finished first: the waiters find it resident
            error: BaseException | None = None
        except BaseException as exc:  # noqa: BLE001 - every waiter gets the same error
            error = exc
        # Off the table before the waiters wake, or a woken waiter finds the load still
        # "running" and waits on it again.
        with self._lock:
            self._loading.pop(model.name, None)
            self._engine_of.pop(model.name, None)
        # this thread ends here; its connection would pin a database session
        connections.close_all()
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)


def _check_lease(model: ModelRef, lease: str | None) -> None:
    """An auto-load would swap out a leased model: only its holder may."""
    close_old_connections()  # a pool thread's connection, checked like a request's
    lease_check_change(operation="load", target_model=None, lease_id=lease)


def resident_model_id(status: EngineStatus) -> str | None:
    return status.model_id if status.state == "ready" else None


class Use:
    """A request's grant to run on the resident model; ``status`` is the engine's status
    read when it was granted (its attachments are what the request resolves steering
    against). The engine counts the running work itself, so there is nothing to give
    back here; ``release`` stays for the callers' symmetry."""

    __slots__ = ("status",)

    def __init__(self, status: EngineStatus) -> None:
        self.status = status

    def release(self) -> None:
        """Nothing to do: the engine's own count ends with the request's last event."""
