"""What a kind of experiment runs with: ``RunContext``, handed by the runner
(``experiments.runner``) to the kind's function (``experiments.sweep.run_sweep``,
``experiments.calibration.run_calibration``, ``experiments.fidelity.run_fidelity``) as
``await fn(ctx)``, which returns the run's result (a dict merged into
``ExperimentRun.result``) once every point is stored.

The function does not watch for a cancel, a crash or a take-over: the runner keeps the
heartbeat and, when the run is cancelled (or stopped, or lost to another runner), cancels
the function's task; every ``generate`` in flight then cancels its job at the engine,
and the points already stored stay (the run ends ``cancelled``, ``partial``). So a kind
stores each point as soon as it is complete (``store_points``), and on start reads what
an earlier runner of the same run stored (``stored_points``) and does only the rest.

Engine work goes through ``generate`` (one ``GenerationJob`` → its ``FinishEvent``, at
most EXPERIMENT_ENGINE_ROWS of them at the engine at once, however many a kind starts)
and ``tokenize``; blocking work (numpy over large arrays) through ``off``; database
work is the context's own (one thread, writes in order).
"""

from __future__ import annotations

import asyncio
import contextvars
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from core.errors import MillmError, from_engine_error
from core.jobs import RunDatabase, engine_command
from core.runtime import runtime
from gpu_engine.api.protocol import EngineStatus, ErrorEvent, FinishEvent, GenerationJob, TokenEvent


class EngineJobFailed(MillmError):
    """The engine ended a job without a finish (it should not happen: an engine error
    arrives as its own code)."""

    code, status = "ENGINE_ERROR", 500


@dataclass
class RunContext:
    """One run as its kind's function sees it (see the module)."""

    run_id: str
    runner: str
    kind: str
    owner: str
    # the request as validated and stored (``ExperimentRun.spec``)
    spec: dict[str, Any]
    sae_id: str
    layer: int | None
    # the engine's status when the runner started: backend, model, attachments, capabilities
    status: EngineStatus
    # EXPERIMENT_ENGINE_ROWS
    rows: int
    # the runner's database thread (core.jobs.RunDatabase)
    _db: RunDatabase = field(repr=False)
    _engine_slots: asyncio.Semaphore = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._engine_slots = asyncio.Semaphore(self.rows)

    # ------------------------------------------------------------------ the engine

    @property
    def backend(self) -> str:
        return self.status.backend or ""

    @property
    def capabilities(self) -> Any:
        """The loaded backend's ``Capabilities`` (None: nothing reported)."""
        return self.status.capabilities

    def capability(self, name: str) -> tuple[bool, str | None]:
        """Whether the loaded backend reports ``name`` (``gpu_engine.api.capabilities``),
        and its reason where it does not (``<name>_reason``)."""
        caps = self.capabilities
        if caps is None:
            return False, "the engine reports no capabilities (no model loaded?)"
        has = bool(getattr(caps, name, False))
        reason = None if has else (getattr(caps, f"{name}_reason", None) or f"the {self.backend} backend lacks {name}")
        return has, reason

    def request_id(self, tag: str) -> str:
        """A request id for one engine job of this run (its logs name the run)."""
        return f"{self.run_id}-{tag}-{uuid.uuid4().hex[:8]}"

    async def generate(self, job: GenerationJob) -> FinishEvent:
        """Run ``job`` at the engine (waiting for one of the run's EXPERIMENT_ENGINE_ROWS
        slots first) and return its finish, whose ``activations`` hold every record of
        the job (those that travelled with its tokens too). An engine error is raised as
        the domain error of its code; a cancel of the caller's task cancels the job."""
        async with self._engine_slots:
            finish: FinishEvent | None = None
            records: list[Any] = []
            async for event in runtime().engine.agenerate(job):
                if isinstance(event, ErrorEvent):
                    raise from_engine_error(event.to_exception())
                if isinstance(event, TokenEvent):
                    records.extend(event.activations)
                elif isinstance(event, FinishEvent):
                    finish = event
        if finish is None:
            raise EngineJobFailed(f"The engine ended job {job.request_id} without finishing it")
        if records:
            finish = msgspec.structs.replace(finish, activations=[*records, *finish.activations])
        return finish

    async def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        """``texts`` tokenized by the loaded model's tokenizer (no special tokens added
        unless the engine's tokenize does)."""
        from gpu_engine.api.protocol import TokenizeJob

        job = TokenizeJob(request_id=self.request_id("tok"), texts=list(texts))

        def call() -> list[list[int]]:
            return [list(ids) for ids in engine_command(runtime().engine.tokenize, job).token_ids]

        async with self._engine_slots:
            return await self.off(call)

    # ------------------------------------------------------------------ elsewhere

    async def off(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Blocking work (numpy, files, the engine's commands) off the event loop, in this
        task's context (the engine the run addresses, ``experiments.runner``)."""
        return await asyncio.get_running_loop().run_in_executor(None, contextvars.copy_context().run, fn, *args)

    async def db(self, fn: Callable[..., Any], **kwargs: Any) -> Any:
        """``fn(**kwargs)`` on the run's database thread (writes in the order made)."""
        return await self._db(fn, **kwargs)

    # ------------------------------------------------------------------ the run's rows

    async def stored_points(self) -> list[dict[str, Any]]:
        """The points stored so far (by this runner or one before it), by ordinal, as
        ``ExperimentPoint`` field dicts."""
        from experiments import selectors

        return await self.db(selectors.point_rows, run_id=self.run_id)

    async def store_points(self, points: Sequence[dict[str, Any]], *, count_done: bool = True) -> int:
        """Store complete points (``ExperimentPoint`` fields; ``ordinal`` unique in the
        run: a point already stored under it is kept as it is); with ``count_done`` the
        run's ``done`` becomes the number of points it holds (a kind that counts steps
        otherwise says so with ``progress``). How many points the run holds now."""
        from experiments import services

        return await self.db(
            services.experiment_points_store,
            run_id=self.run_id,
            runner=self.runner,
            points=list(points),
            count_done=count_done,
        )

    async def set_total(self, total: int) -> None:
        """The number of points (or steps) the run will have done when complete."""
        from experiments import services

        await self.db(services.experiment_advance, run_id=self.run_id, runner=self.runner, total=int(total))

    async def progress(self, done: int) -> None:
        """Record progress that is not a stored point (steps of a fidelity corpus)."""
        from experiments import services

        await self.db(services.experiment_advance, run_id=self.run_id, runner=self.runner, done=int(done))

    async def set_result(self, **fields: Any) -> None:
        """Merge ``fields`` into the run's ``result`` now (what a backend could not
        measure, a partial figure): the final result the function returns is merged last."""
        from experiments import services

        await self.db(services.experiment_result_merge, run_id=self.run_id, runner=self.runner, fields=fields)


__all__ = ["EngineJobFailed", "RunContext"]
