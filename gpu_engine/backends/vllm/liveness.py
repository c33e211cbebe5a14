"""Whether vLLM's engine core is still alive (``CoreWatch``), for status and for refusing
work once it is not.

vLLM's V1 ``LLMEngine`` runs its ``EngineCore`` in a child process (multiprocessing on,
the default here) or in this process (the ``uni`` executor). A child can die on its own
(the kernel's OOM killer, a signal, a crash in a kernel): vLLM's own monitor then marks
the client dead and shuts it down, but a ``step()`` already waiting for outputs is never
woken (its output thread exits without a word) and a utility call already sent waits on
a future nobody resolves — the engine's worker would hang, and status would keep saying
``ready``. ``CoreWatch`` waits on the child's sentinel itself: when it ends, it records
why (pid and exit code), then wakes whatever waits on the client with vLLM's
``EngineDeadError``. In-process, the core cannot die apart from us, but its worker
processes (the ``mp`` executor) can: ``model_executor.is_failed`` says so.

A deliberate shutdown (``close``) is not a failure.
"""

from __future__ import annotations

import threading
from multiprocessing.connection import wait
from typing import Any


class CoreWatch:
    def __init__(self, engine: Any) -> None:
        self._client = getattr(engine, "engine_core", None)
        self._closing = threading.Event()
        self.failure: str | None = None
        manager = getattr(getattr(self._client, "resources", None), "engine_manager", None)
        self._processes = list(getattr(manager, "processes", None) or [])
        if self._processes:
            threading.Thread(target=self._watch, name="millm-vllm-core-watch", daemon=True).start()

    @property
    def pids(self) -> list[int]:
        """The engine core processes watched (none in-process)."""
        return [p.pid for p in self._processes if p.pid is not None]

    def _watch(self) -> None:
        wait([p.sentinel for p in self._processes])
        if not self._closing.is_set():
            gone = next((p for p in self._processes if not p.is_alive()), self._processes[0])
            gone.join(timeout=1)  # its exit code is read once it is reaped
            self.failure = f"vLLM's engine core process (pid {gone.pid}) exited with code {gone.exitcode}"
        self._wake()  # a shutdown's own last call must not wait on it either

    def _wake(self) -> None:
        """vLLM's ``EngineDeadError`` to a step waiting for outputs and to every utility
        call (``collective_rpc``) waiting for its answer."""
        try:
            from vllm.v1.engine.exceptions import EngineDeadError
        except ImportError:  # another vLLM layout
            EngineDeadError = RuntimeError  # noqa: N806
        client = self._client
        queue = getattr(client, "outputs_queue", None)
        if queue is not None:
            queue.put_nowait(EngineDeadError())
        for future in list((getattr(client, "utility_results", None) or {}).values()):
            if not future.done():
                try:
                    future.set_exception(EngineDeadError())
                except Exception:  # noqa: BLE001 - resolved meanwhile
                    pass

    def check(self) -> str | None:
        """Why the engine core cannot serve, or None while it can."""
        if self.failure is not None or self._closing.is_set():
            return self.failure
        client = self._client
        if getattr(getattr(client, "resources", None), "engine_dead", False):
            self.failure = "vLLM's engine core stopped (its client reports the engine dead)"
        executor = getattr(getattr(client, "engine_core", None), "model_executor", None)
        if getattr(executor, "is_failed", False):
            self.failure = "a vLLM worker process of the in-process engine core died"
        return self.failure

    def close(self) -> None:
        """The core is being shut down on purpose: what follows is no failure."""
        self._closing.set()


__all__ = ["CoreWatch"]
