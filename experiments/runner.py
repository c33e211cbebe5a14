"""Running an experiment: one runner per run, whatever its kind.

The runner is a Celery task of the ``experiments`` queue in distributed mode and a job of
the in-process ``experiments`` pool embedded (``core.jobs``); either way it is this one
function, ``experiment_run``. It takes the run over (``services.RUNS.run``: a run
has one runner; one whose heartbeat is older than BATCH_RUNNER_STALE_S is presumed dead),
builds the run's ``RunContext`` (``experiments.context``) and awaits its kind's function
(``KINDS``) on a task of its own while it keeps the heartbeat every HEARTBEAT_S:

- ``cancelling``: the kind's task is cancelled (its jobs at the engine with it) and the
  run ends ``cancelled``, the points stored kept (``partial``);
- taken over by another runner (this one's heartbeat was stale): the task is cancelled
  and this runner lets go without writing;
- ``stop`` set (tests: a crash): the task is cancelled and the run stays ``running`` for
  the next runner, which resumes it from the points stored.

The function's result is merged into the run's ``result`` as it ends ``completed``; an
error ends it ``failed`` with the error's code (the points stored stay, ``partial``).
"""

from __future__ import annotations

import asyncio
import contextvars
import importlib
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import structlog
from django.conf import settings

from core.jobs import RunDatabase, run_error
from core.runtime import runtime
from experiments import services
from experiments.context import RunContext
from experiments.models import ExperimentRun
from registry.engines import addressing, saes_engine

log = structlog.get_logger(__name__)

HEARTBEAT_S = 1.0
# each kind's function, ``async fn(ctx: RunContext) -> dict`` (its result)
KINDS = {
    ExperimentRun.Kind.SWEEP: "experiments.sweep.run_sweep",
    ExperimentRun.Kind.CALIBRATION: "experiments.calibration.run_calibration",
    ExperimentRun.Kind.FIDELITY: "experiments.fidelity.run_fidelity",
}


def experiment_run(*, run_id: str, force: bool = False, stop: threading.Event | None = None) -> str:
    """Run the experiment to its end; ``force`` takes it over even from a runner that
    looks alive (embedded start-up: this process is the only runner there is). ``stop``
    ends the run abruptly, as a crash would (tests). Returns how it ended."""
    return services.RUNS.run(
        run_id,
        force=force,
        main=lambda run, runner: _Runner(run, runner, stop).run,
        describe=lambda run: {"kind": run.kind},
    )


def kind_function(kind: str) -> Callable[[RunContext], Awaitable[dict[str, Any]]]:
    module, _, name = KINDS[kind].rpartition(".")
    return getattr(importlib.import_module(module), name)


class _Runner:
    def __init__(self, run: ExperimentRun, runner: str, stop: threading.Event | None) -> None:
        self.run_id = run.id
        self.kind = run.kind
        self.owner = run.owner
        self.spec = dict(run.spec or {})
        self.sae_id = run.sae_id
        self.layer = run.layer
        self.runner = runner
        self.stop = stop
        # the run's database thread, which its kind's function shares (RunContext.db)
        self.db = RunDatabase(thread_name_prefix="millm-experiment-db")

    async def run(self) -> str:
        # the engine of the run's SAE's model (registry.engines), derived again on every
        # resume: a run taken over after a restart addresses the same engine
        async with self.db:
            engine = await self.db(saes_engine, self._sae_ids())
            with addressing(engine):
                return await self._run()

    def _sae_ids(self) -> list[str]:
        """The run's SAE, else its variants' (a sweep's)."""
        variants = [*(self.spec.get("variants") or []), self.spec.get("variant")]
        return [self.sae_id] + [str(v.get("sae_id") or "") for v in variants if isinstance(v, dict)]

    async def _run(self) -> str:
        try:
            status = await asyncio.get_running_loop().run_in_executor(
                None, contextvars.copy_context().run, runtime().engine.status
            )
            ctx = RunContext(
                run_id=self.run_id,
                runner=self.runner,
                kind=self.kind,
                owner=self.owner,
                spec=self.spec,
                sae_id=self.sae_id,
                layer=self.layer,
                status=status,
                rows=int(settings.EXPERIMENT_ENGINE_ROWS),
                _db=self.db,
            )
            fn = kind_function(self.kind)
        except Exception as exc:  # noqa: BLE001 - every failure ends the run with its code
            return await self._failed(exc)
        work = asyncio.ensure_future(fn(ctx))
        try:
            while True:
                done, _ = await asyncio.wait({work}, timeout=HEARTBEAT_S)
                if done:
                    break
                if self.stop is not None and self.stop.is_set():
                    log.warning("experiment_run_stopped", run_id=self.run_id)
                    await _cancel(work)
                    return "stopped"
                state = await self.db(services.experiment_heartbeat, run_id=self.run_id, runner=self.runner)
                if state is None:
                    await _cancel(work)
                    return "lost"
                if state == ExperimentRun.Status.CANCELLING:
                    await _cancel(work)
                    outcome = await self.db(services.experiment_cancelled, run_id=self.run_id, runner=self.runner)
                    log.info("experiment_cancelled", run_id=self.run_id)
                    return outcome
            result = work.result()
        except asyncio.CancelledError:
            await _cancel(work)
            raise
        except Exception as exc:  # noqa: BLE001 - every failure ends the run with its code
            return await self._failed(exc)
        if self.stop is not None and self.stop.is_set():
            return "stopped"
        return await self.db(
            services.experiment_complete, run_id=self.run_id, runner=self.runner, result=dict(result or {})
        )

    async def _failed(self, exc: Exception) -> str:
        code, message = _error_of(exc)
        if code == "INTERNAL_ERROR":
            log.error("experiment_run_error", run_id=self.run_id, exc_info=exc)
        return await self.db(
            services.experiment_fail, run_id=self.run_id, runner=self.runner, code=code, message=message
        )


async def _cancel(task: asyncio.Future) -> None:
    """Cancel the kind's task (its jobs at the engine with it) and wait until it let go."""
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def _error_of(exc: Exception) -> tuple[str, str]:
    """The run's error {code, message} for what ended it."""
    return run_error(exc, internal="The experiment failed on the server; its log says why")


def experiments_resume(*, force: bool) -> int:
    return services.experiments_resume(force=force)
