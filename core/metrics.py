"""Process metrics (prometheus-client): requests by route and code, queue depth, tokens
generated, steering applications, refusals by reason, downloads and loads.

Counters that other parts of the server advance go through the ``record_*`` functions
here, so every name is declared once. Figures that already live elsewhere (the admission
queue, the engine's per-attachment ``steering_apply_count``, the hub breaker) are read at
scrape time by a collector instead of being copied into gauges.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import structlog
from prometheus_client import Counter, Histogram

from core.errors import retry_after_value
from core.middleware import LoopMiddleware

log = structlog.get_logger(__name__)

REQUESTS = Counter(
    "millm_http_requests",
    "HTTP requests answered, by surface, route pattern, method and status code",
    ["surface", "route", "method", "code"],
)
REQUEST_SECONDS = Histogram(
    "millm_http_request_duration_seconds",
    "Time to the response headers, by surface",
    ["surface"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
TOKENS = Counter("millm_tokens_generated", "Completion tokens generated", ["model"])
PROMPT_TOKENS = Counter("millm_prompt_tokens", "Prompt tokens processed", ["model"])
SPECULATIVE = Counter(
    "millm_speculative_tokens",
    "Speculative decoding's draft tokens, proposed (kind=drafted) and accepted by the main model (kind=accepted)",
    ["model", "kind"],
)
REFUSALS = Counter(
    "millm_refusals",
    "/api and /v1 requests refused for the server's state "
    "or the caller's credentials, by reason (queue_full, model_busy, "
    "model_loading, model_not_loaded, model_leased, unauthorized, …)",
    ["reason"],
)
DOWNLOADS = Counter("millm_downloads", "Finished downloads by kind and outcome", ["kind", "outcome"])
LOADS = Counter("millm_model_loads", "Finished model loads and unloads by outcome", ["operation", "outcome"])

# the shared admission controller's decisions (distributed mode), summed over the web
# processes in place of each one's own admitted_total / refused_total (system.metrics)
ADMISSIONS = Counter(
    "millm_admission_decisions", "/v1 requests given a slot or refused: queue full, by outcome", ["outcome"]
)

STARTED_AT = time.time()

# what the stack sums across its processes (``core.metrics_store``); the rest of the
# scrape is read where it lives, at scrape time (``system.metrics``)
SHARED = (REQUESTS, REQUEST_SECONDS, TOKENS, PROMPT_TOKENS, SPECULATIVE, REFUSALS, DOWNLOADS, LOADS)
# summed too, but exposed under the admission figures' own names
SUMMED = (*SHARED, ADMISSIONS)


_store: Any = None
_store_lock = threading.Lock()


def store() -> Any:
    """Where the figures of ``SHARED`` are read: this process's counters (embedded mode),
    or their sum over every process in Redis (``REDIS_URL`` set: several web workers,
    Celery). Built once per process, like the counters it reads."""
    global _store
    if _store is None:
        with _store_lock:
            if _store is None:
                _store = _build_store()
    return _store


def _build_store() -> Any:
    from django.conf import settings

    from core.metrics_store import LocalStore, RedisStore

    if not settings.REDIS_URL:
        return LocalStore(SUMMED, STARTED_AT)
    return RedisStore(
        SUMMED,
        url=settings.REDIS_URL,
        prefix=settings.ENGINE_STREAM_PREFIX,
        interval_s=settings.METRICS_FLUSH_INTERVAL_S,
    )


def record_tokens(*, model: str, completion_tokens: int, prompt_tokens: int = 0) -> None:
    if completion_tokens:
        TOKENS.labels(model=model).inc(completion_tokens)
    if prompt_tokens:
        PROMPT_TOKENS.labels(model=model).inc(prompt_tokens)


def record_speculative(*, model: str, drafted: int, accepted: int) -> None:
    """Speculative decoding (SPECULATIVE_MODEL): draft tokens proposed and accepted; the
    acceptance rate is accepted ÷ drafted."""
    SPECULATIVE.labels(model=model, kind="drafted").inc(drafted)
    SPECULATIVE.labels(model=model, kind="accepted").inc(accepted)


def record_admission(outcome: str) -> None:
    """``admitted`` or ``refused`` (queue full): the shared admission controller's decision."""
    ADMISSIONS.labels(outcome=outcome).inc()


def record_refusal(reason: str) -> None:
    REFUSALS.labels(reason=reason).inc()


# --------------------------------------------------------------------------- refusals
# A refusal is an answer that says "not now" or "not you" to a well-formed request: the
# queue is full, the model is loading, busy, leased, locked or not resident, the engine or
# hub is unavailable, the key is wrong. A request that is itself wrong (400, 404, 422) is
# not one; requests.by_code counts those. Each error response is built by one function
# per surface (core.api, core.openai_errors), which marks it with its code; the metrics
# middleware, which sees every answer once, counts the marked refusals.

ERROR_CODE_ATTR = "millm_error_code"

# 409s and the /api 400 of model_not_loaded are refusals by code; every 429 and 503 is one
# by status, except the readiness probe, whose 503 is its answer, not a refusal.
_REFUSAL_CODES = frozenset(
    {
        "model_locked",
        "model_leased",
        "model_not_resident",
        "lease_expired",
        "model_busy",
        "model_not_loaded",
        "insufficient_memory",
    }
)
_NOT_REFUSALS = frozenset({"not_ready"})


def mark_error(response: Any, code: str) -> Any:
    """Name the error code an error response answers (for ``refusal_reason``)."""
    setattr(response, ERROR_CODE_ATTR, code)
    return response


def refusal_reason(status: int, code: str | None) -> str | None:
    """The refusals label of an answer, or None when it is not a refusal. Both surfaces
    share the labels: /api's ``QUEUE_FULL`` and /v1's ``queue_full`` are ``queue_full``;
    /v1's ``invalid_api_key`` and /api's ``UNAUTHORIZED`` are ``unauthorized``."""
    if status == 401:
        return "unauthorized"
    if code is None:
        return None
    reason = code.lower()
    if reason in _NOT_REFUSALS:
        return None
    if status in (403, 429, 503) or reason in _REFUSAL_CODES:
        return reason
    return None


def record_download(*, kind: str, outcome: str) -> None:
    DOWNLOADS.labels(kind=kind, outcome=outcome).inc()


def record_load(*, operation: str, outcome: str) -> None:
    LOADS.labels(operation=operation, outcome=outcome).inc()


def _surface(path: str) -> str:
    if path.startswith("/api/") or path == "/api":
        return "api"
    if path.startswith("/v1/") or path == "/v1":
        return "v1"
    if path.startswith("/admin/"):
        return "admin"
    return "other"


class MetricsMiddleware(LoopMiddleware):
    """Counts every answer by route pattern (bounded label values) and status, and every
    refusal by reason (``refusal_reason``), and makes sure no 503 leaves without
    Retry-After (RETRY_AFTER_FALLBACK_S, logged).

    A LoopMiddleware: its hooks run on the event loop, so a /v1 stream pays no thread hop
    for them."""

    def process_request(self, request):
        request._millm_started = time.perf_counter()

    def process_response(self, request, response):
        surface = _surface(request.path)
        if response.status_code == 503 and not response.has_header("Retry-After"):
            response["Retry-After"] = str(retry_after_value(503, None, f"{surface}:503"))
        match = getattr(request, "resolver_match", None)
        route = match.route if match is not None and match.route else "unmatched"
        try:
            REQUESTS.labels(surface=surface, route=route, method=request.method, code=str(response.status_code)).inc()
            started = getattr(request, "_millm_started", None)
            if started is not None:
                REQUEST_SECONDS.labels(surface=surface).observe(time.perf_counter() - started)
            if response.status_code >= 400 and surface in ("api", "v1"):
                reason = refusal_reason(response.status_code, getattr(response, ERROR_CODE_ATTR, None))
                if reason is not None:
                    record_refusal(reason)
        except Exception:
            log.warning("metrics_record_failed", exc_info=True)
        return response
