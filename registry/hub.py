"""Hugging Face hub access: huggingface_hub calls behind one circuit breaker.

Every call names its endpoint (HF_ENDPOINT, or huggingface_hub's default) and its token
explicitly: a per-request token wins over HF_TOKEN, and with neither no token is sent at
all (``token=False``), so a developer's cached login never leaks into a server call. A
token is an argument and nothing else here: it is never stored, logged or put in an
error message.

Failures are sorted in two:
- the hub answered about *this* request (repository missing, gated, bad token, bad
  revision, missing file): the domain error for it, and the breaker counts a success;
- the hub is unwell (connection refused or reset, timeout, 5xx): short metadata calls are
  retried (tenacity) for the named transient errors, then count as one breaker failure.
  After HF_CIRCUIT_FAIL_MAX consecutive failures the breaker opens and every hub call is
  refused at once with 503 HUB_UNAVAILABLE and a Retry-After of the time left until a
  trial call is let through (HF_CIRCUIT_RESET_TIMEOUT_S).

Metadata calls run inside the breaker. File transfers run outside it (the breaker holds a
lock for the length of a call, and a transfer can take an hour); they check the breaker
first and report their outcome to it.
"""

from __future__ import annotations

import contextlib
import tempfile
import threading
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import httpx2
import pybreaker
import structlog
from django.conf import settings
from huggingface_hub import HfApi, constants, get_hf_file_metadata, hf_hub_download, hf_hub_url
from huggingface_hub.errors import (
    EntryNotFoundError,
    GatedRepoError,
    HfHubHTTPError,
    HFValidationError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from tenacity import Retrying, retry_if_exception, stop_after_attempt, wait_exponential

from core.errors import MillmError, ValidationFailed
from core.runtime import runtime
from registry.errors import (
    CircuitNotFound,
    DownloadFailed,
    FileNotFoundOnHub,
    GatedModelNoToken,
    HubUnavailable,
    InvalidHFToken,
    RepoNotFound,
    RevisionNotFound,
)

log = structlog.get_logger(__name__)

T = TypeVar("T")

HUB = "huggingface"
TRANSIENT_STATUS = (500, 502, 503, 504)

# huggingface_hub reads the body in DOWNLOAD_CHUNK_SIZE pieces (10 MB) and the progress
# hook only sees whole pieces; 1 MiB gives smoother progress and a faster cancel.
constants.DOWNLOAD_CHUNK_SIZE = 1024 * 1024


def _status(exc: BaseException) -> int | None:
    response = getattr(exc, "response", None)
    return getattr(response, "status_code", None)


def is_transient(exc: BaseException) -> bool:
    """Errors worth another try: the network or the hub, not the request."""
    if isinstance(exc, httpx2.TransportError):
        return True
    if isinstance(exc, HfHubHTTPError) and _status(exc) in TRANSIENT_STATUS:
        return True
    # LocalEntryNotFoundError: hf_hub_download's wrapping of "could not reach the hub for
    # the file's metadata"
    return isinstance(exc, LocalEntryNotFoundError)


def _is_request_error(exc: BaseException) -> bool:
    """The hub answered about this request: not a sign of an outage (breaker exclude)."""
    return not is_transient(exc)


class HubBreakers:
    """The process's circuit breakers (a runtime part: ``runtime().hub``), one per name,
    created on first use from the HF_CIRCUIT_* settings."""

    def __init__(self) -> None:
        self._breakers: dict[str, pybreaker.CircuitBreaker] = {}
        self._lock = threading.Lock()

    def get(self, name: str = HUB) -> pybreaker.CircuitBreaker:
        with self._lock:
            found = self._breakers.get(name)
            if found is None:
                if name != HUB:
                    raise CircuitNotFound(f"No circuit breaker named {name!r}", details={"name": name, "known": [HUB]})
                found = pybreaker.CircuitBreaker(
                    fail_max=settings.HF_CIRCUIT_FAIL_MAX,
                    reset_timeout=settings.HF_CIRCUIT_RESET_TIMEOUT_S,
                    exclude=[_is_request_error],
                    name=name,
                    throw_new_error_on_trip=False,
                )
                self._breakers[name] = found
            return found


def breaker(name: str = HUB) -> pybreaker.CircuitBreaker:
    return runtime().hub.get(name)


def _seconds_left(cb: pybreaker.CircuitBreaker) -> int:
    opened = cb._state_storage.opened_at
    if opened is None:
        return int(cb.reset_timeout)
    left = cb.reset_timeout - (datetime.now(UTC) - opened).total_seconds()
    return max(1, int(left + 0.999))


def circuit_state(cb: pybreaker.CircuitBreaker) -> dict[str, Any]:
    state = cb.current_state
    opened = cb._state_storage.opened_at
    is_open = state == pybreaker.STATE_OPEN
    return {
        "name": cb.name,
        "state": state.replace("-", "_"),
        "is_open": is_open,
        "failure_count": cb.fail_counter,
        "fail_max": cb.fail_max,
        "reset_timeout_seconds": cb.reset_timeout,
        "opened_at": opened.isoformat() if (opened is not None and is_open) else None,
        "retry_after_seconds": _seconds_left(cb) if is_open else None,
    }


def circuit_states() -> list[dict[str, Any]]:
    return [circuit_state(breaker(HUB))]


def circuit_reset(*, name: str) -> dict[str, Any]:
    cb = breaker(name)
    cb.close()
    log.info("circuit_breaker_reset", name=name)
    return circuit_state(cb)


def _unavailable(cb: pybreaker.CircuitBreaker, cause: BaseException | None = None) -> HubUnavailable:
    if cb.current_state == pybreaker.STATE_OPEN:
        retry_after = _seconds_left(cb)
        message = (
            f"The Hugging Face hub is unavailable (circuit open after {cb.fail_max} failures); retry in {retry_after} s"
        )
    else:
        retry_after = int(settings.HF_CIRCUIT_RESET_TIMEOUT_S)
        message = "The Hugging Face hub could not be reached"
    details: dict[str, Any] = {"circuit": cb.name, "state": cb.current_state.replace("-", "_")}
    if cause is not None:
        details["cause"] = type(cause).__name__
    return HubUnavailable(message, details=details, retry_after=retry_after)


def translate(
    exc: BaseException,
    *,
    repo_id: str,
    revision: str | None = None,
    filename: str | None = None,
    token_given: bool = False,
) -> MillmError:
    """The domain error for a huggingface_hub failure (never quoting a token)."""
    details: dict[str, Any] = {"repo_id": repo_id}
    if revision:
        details["revision"] = revision
    if filename:
        details["file_path"] = filename
    if isinstance(exc, GatedRepoError):
        if token_given:
            return InvalidHFToken(
                f"The token was refused for gated repository {repo_id!r}: "
                "accept its license on the hub with that account",
                details=details,
            )
        return GatedModelNoToken(
            f"Repository {repo_id!r} is gated: accept its license on the hub and send an hf_token", details=details
        )
    if isinstance(exc, RepositoryNotFoundError):
        if token_given and _status(exc) == 401:
            return InvalidHFToken("The hub refused the token", details=details)
        return RepoNotFound(f"Repository {repo_id!r} was not found on the hub (or is private)", details=details)
    if isinstance(exc, RevisionNotFoundError):
        return RevisionNotFound(f"Revision {revision!r} of {repo_id!r} was not found", details=details)
    if isinstance(exc, EntryNotFoundError) and not isinstance(exc, LocalEntryNotFoundError):
        return FileNotFoundOnHub(f"{filename or 'The file'} is not in {repo_id!r}", details=details)
    if isinstance(exc, HfHubHTTPError) and _status(exc) in (401, 403):
        if token_given:
            return InvalidHFToken("The hub refused the token", details=details)
        return GatedModelNoToken(f"Repository {repo_id!r} needs a token", details=details)
    if isinstance(exc, HFValidationError):
        return ValidationFailed(f"The hub refuses this request: {str(exc).splitlines()[0]}", details=details)
    if is_transient(exc):
        return _unavailable(breaker(HUB), exc)
    return DownloadFailed(f"The hub call failed: {type(exc).__name__}", details={**details, "status": _status(exc)})


def _retrying() -> Retrying:
    return Retrying(
        stop=stop_after_attempt(settings.HF_RETRY_ATTEMPTS),
        wait=wait_exponential(multiplier=0.25, max=2),
        retry=retry_if_exception(is_transient),
        reraise=True,
    )


def call(
    fn: Callable[[], T],
    *,
    repo_id: str,
    revision: str | None = None,
    filename: str | None = None,
    token_given: bool = False,
) -> T:
    """Run a short hub call: retried on transient errors, inside the breaker."""
    cb = breaker(HUB)
    try:
        return cb.call(lambda: _retrying()(fn))
    except pybreaker.CircuitBreakerError as exc:
        raise _unavailable(cb, exc) from None
    except MillmError:
        raise
    except Exception as exc:  # noqa: BLE001 - translated to the contract's codes
        raise translate(exc, repo_id=repo_id, revision=revision, filename=filename, token_given=token_given) from None


def check_available() -> None:
    """Refuse at once while the breaker is open (before a long transfer)."""
    cb = breaker(HUB)
    opened = cb._state_storage.opened_at
    if (
        cb.current_state == pybreaker.STATE_OPEN
        and opened is not None
        and (datetime.now(UTC) - opened).total_seconds() < cb.reset_timeout
    ):
        raise _unavailable(cb)


def record_outcome(exc: BaseException | None) -> None:
    """Tell the breaker how a transfer (run outside it) ended."""

    def outcome() -> None:
        if exc is not None:
            raise exc

    with contextlib.suppress(BaseException):  # the caller already has the error
        breaker(HUB).call(outcome)


def resolve_token(request_token: str | None) -> str | bool:
    """A per-request token wins over HF_TOKEN; ``False`` sends none at all."""
    if request_token:
        return request_token
    return settings.HF_TOKEN or False


def endpoint() -> str | None:
    return settings.HF_ENDPOINT or None


def _api(token: str | bool) -> HfApi:
    return HfApi(endpoint=endpoint(), token=token, library_name="millm")


# --- calls -----------------------------------------------------------------------------


def model_info(*, repo_id: str, revision: str | None, token: str | bool) -> Any:
    """Repository metadata with file sizes (``siblings``) at a revision."""
    return call(
        lambda: _api(token).model_info(
            repo_id, revision=revision or None, files_metadata=True, timeout=settings.HF_REQUEST_TIMEOUT_S
        ),
        repo_id=repo_id,
        revision=revision,
        token_given=bool(token),
    )


def file_metadata(*, repo_id: str, filename: str, revision: str, token: str | bool) -> Any:
    """HEAD of one file: checks that this token may read it (gated repositories)."""
    url = hf_hub_url(repo_id, filename, revision=revision, endpoint=endpoint())
    return call(
        lambda: get_hf_file_metadata(url, token=token, timeout=settings.HF_REQUEST_TIMEOUT_S),
        repo_id=repo_id,
        revision=revision,
        filename=filename,
        token_given=bool(token),
    )


def read_small_file(*, repo_id: str, filename: str, revision: str, token: str | bool) -> bytes:
    """A small file's bytes (config.json for a preview), through a throw-away folder."""
    with tempfile.TemporaryDirectory(prefix="millm-hub-") as tmp:
        path = call(
            lambda: hf_hub_download(
                repo_id,
                filename,
                revision=revision,
                local_dir=tmp,
                token=token,
                endpoint=endpoint(),
                etag_timeout=settings.HF_REQUEST_TIMEOUT_S,
            ),
            repo_id=repo_id,
            revision=revision,
            filename=filename,
            token_given=bool(token),
        )
        return Path(path).read_bytes()


def download_file(
    *, repo_id: str, filename: str, revision: str, local_dir: Path, token: str | bool, tqdm_class: Any = None
) -> Path:
    """Download one file into ``local_dir`` with huggingface_hub (resuming inside the
    transfer after a dropped connection); the outcome is reported to the breaker."""
    check_available()
    try:
        path = hf_hub_download(
            repo_id,
            filename,
            revision=revision,
            local_dir=str(local_dir),
            token=token,
            endpoint=endpoint(),
            tqdm_class=tqdm_class,
            etag_timeout=settings.HF_REQUEST_TIMEOUT_S,
        )
    except MillmError:
        raise
    except Exception as exc:
        if is_transient(exc) or isinstance(exc, (HfHubHTTPError, EntryNotFoundError)):
            record_outcome(exc)
            raise translate(
                exc, repo_id=repo_id, revision=revision, filename=filename, token_given=bool(token)
            ) from None
        raise
    record_outcome(None)
    return Path(path)
