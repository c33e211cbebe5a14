"""The engine's sizing, read from the site's settings: /v1's generation slots (which follow
the loaded backend unless MAX_CONCURRENT_REQUESTS caps them), run_engine's bounds, and the
batching options and idle release the engine is built with.  Admission, ``run_engine``,
``check_config`` and the embedded client read them here, so one rule sizes all of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.conf import settings

from core.runtime import runtime
from gpu_engine.api.host import backend_names, backend_rows_setting, batch_rows
from gpu_engine.api.protocol import BatchingOptions


@dataclass(frozen=True)
class Slots:
    """/v1's generation slots in force and where they come from."""

    value: int
    # "MAX_CONCURRENT_REQUESTS" (the operator's cap), "VLLM_MAX_NUM_SEQS" (the loaded
    # backend's own batch, or that batch capping the operator's value) or "default"
    source: str
    backend: str  # the loaded model's backend ("none" while nothing is loaded)
    follows_backend: bool  # MAX_CONCURRENT_REQUESTS unset (0)

    def to_dict(self) -> dict[str, Any]:
        return {
            "slots": self.value,
            "source": self.source,
            "backend": self.backend,
            "follows_backend": self.follows_backend,
            "max_concurrent_requests": int(settings.MAX_CONCURRENT_REQUESTS),
        }


def _native_rows(backend: str) -> tuple[str, int] | None:
    """The site setting sizing ``backend``'s own batch and its value (None: no batch of its own)."""
    found = backend_rows_setting(backend)
    if found is None:
        return None
    name, default = found
    value = getattr(settings, name, None)
    return name, int(value or default)


def interactive_slots(backend: str | None = None) -> Slots:
    """The slots /v1 admits for ``backend`` (default: the loaded model's, as the engine
    last reported it) by the rule the engine sizes its rows with at load
    (``gpu_engine.backends.batch_rows``): MAX_CONCURRENT_REQUESTS unset (0) follows the
    backend (vLLM: VLLM_MAX_NUM_SEQS; any other backend 1); set, it caps them, and a
    backend's own batch caps it in turn."""
    if backend is None:
        try:
            backend = runtime().engine.backend_name
        except Exception:  # noqa: BLE001 - no engine yet: nothing is loaded
            backend = "none"
    asked = int(settings.MAX_CONCURRENT_REQUESTS)
    native = _native_rows(backend)
    follow = asked == 0
    value = batch_rows(max(asked, 1), native[1] if native else None, follow_backend=follow)
    if native is not None and (follow or native[1] < asked):
        source = native[0]
    else:
        source = "default" if follow else "MAX_CONCURRENT_REQUESTS"
    return Slots(value=value, source=source, backend=backend, follows_backend=follow)


def most_slots() -> int:
    """The most slots any model can get here: MAX_CONCURRENT_REQUESTS when set, else the
    largest backend's own batch (at least 1). The engine's bounds are sized for it, so
    a load on another backend never leaves admitted work waiting in the stream."""
    asked = int(settings.MAX_CONCURRENT_REQUESTS)
    if asked:
        return asked
    return max([1, *(n[1] for n in map(_native_rows, backend_names()) if n is not None)])


def fewest_slots() -> int:
    """The fewest slots any model can get here (the engine's fewest interactive rows):
    the batch scheduler's queue holds at least what run_engine takes beyond them."""
    return min(interactive_slots(name).value for name in backend_names())


@dataclass(frozen=True)
class EngineBounds:
    max_in_flight: int  # jobs run_engine takes from the request stream at once
    max_queue_size: int  # with batching: sequences waiting beyond the batch's free rows


def engine_bounds() -> EngineBounds:
    """The engine's own limits, sized from admission's so that they are safety nets only.

    Admission lets at most ``interactive_slots()`` requests hold a slot, each with one job
    at the engine at a time (the choices of a request run one after another). A job can
    outlive its slot for a moment (a client that left: the engine stops it at its next
    cancellation check), so run_engine takes up to the most slots a model can get
    (``most_slots``: the slots follow the loaded backend) + MAX_PENDING_REQUESTS jobs:
    everything admission can have let in, so an admitted job never waits in the stream.
    The batch scheduler holds at least as many beyond its rows as that can bring (its
    rows can be as few as ``fewest_slots``), so it never refuses one with ``model_busy``;
    CBM_MAX_QUEUE_SIZE only raises that. A batch runner keeps BATCH_ENGINE_ROWS Batch API
    lines at the engine besides, outside admission: run_engine takes those too, so they
    never hold an admitted job in the stream.
    """
    slots = most_slots()
    in_flight = int(settings.ENGINE_MAX_IN_FLIGHT) or (
        slots + int(settings.MAX_PENDING_REQUESTS) + int(settings.BATCH_ENGINE_ROWS)
    )
    return EngineBounds(
        max_in_flight=in_flight, max_queue_size=max(int(settings.CBM_MAX_QUEUE_SIZE), in_flight - fewest_slots(), 1)
    )


def idle_release_s() -> float | None:
    """TRANSFORMERS_IDLE_CACHE_RELEASE_S for the engine: None (never) when negative."""
    value = float(settings.TRANSFORMERS_IDLE_CACHE_RELEASE_S)
    return value if value >= 0 else None


def batching_options() -> BatchingOptions:
    """The engine's generation mode from settings.  With batching on, the admission slots
    are the batch's rows: every admitted request shares the decode steps, each with its
    own steering, sampling and monitoring.  MAX_CONCURRENT_REQUESTS unset (0) leaves the
    rows to the loaded backend (``follow_backend``: vLLM's VLLM_MAX_NUM_SEQS, else 1), as
    ``interactive_slots`` does for admission.  The queue beyond the rows is sized by
    admission (``engine_bounds``) so it never refuses admitted work."""

    asked = int(settings.MAX_CONCURRENT_REQUESTS)
    return BatchingOptions(
        enabled=bool(settings.ENABLE_CONTINUOUS_BATCHING),
        max_batch_size=max(asked, 1),
        follow_backend=asked == 0,
        max_queue_size=engine_bounds().max_queue_size,
        force_serial_monitoring=bool(settings.CBM_FORCE_SERIAL_MONITORING),
        gather_ms=int(settings.CBM_GATHER_MS),
        # Batch API lines get rows of their own beyond the interactive ones
        batch_rows=int(settings.BATCH_ENGINE_ROWS),
    )


__all__ = [
    "EngineBounds",
    "Slots",
    "batching_options",
    "engine_bounds",
    "fewest_slots",
    "idle_release_s",
    "interactive_slots",
    "most_slots",
]
