"""What the run commands share (``manage.py sweep``, ``calibrate``, ``fidelity``,
``attribution``, ``dashboards``): a refusal is one line, ``CODE: message``, and exit status
2; a run started with ``--wait`` runs here, in the foreground, its progress printed until
it ends (Ctrl-C cancels it). Each command keeps its own options and output."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from django.core.management.base import BaseCommand, CommandError
from django.db import connections
from rest_framework.exceptions import ValidationError
from rest_framework.utils.encoders import JSONEncoder

from core.auth import ANONYMOUS
from core.errors import MillmError

EXIT_REFUSED = 2
POLL_S = 0.5


def refused(code: str, message: str) -> CommandError:
    return CommandError(f"{code}: {message}", returncode=EXIT_REFUSED)


def refused_line(code: str, message: str) -> CommandError:
    """``refused``, the message's lines joined into one (a domain error's may hold several)."""
    return refused(code, " ".join(str(message).splitlines()))


def validation_line(exc: ValidationError, whole: str = "body") -> CommandError:
    """A serializer's refusal as one line naming its first field (``whole`` when the
    refusal names none)."""
    fields = exc.detail if isinstance(exc.detail, dict) else {whole: exc.detail}
    name, errors = next(iter(fields.items()))
    first = errors[0] if isinstance(errors, list) and errors else errors
    return refused("VALIDATION_ERROR", f"{name}: {first}")


@contextmanager
def refusals(whole: str = "body", refuse: Callable[[str, str], Exception] = refused) -> Iterator[None]:
    """A domain error or a serializer's refusal inside the block leaves as one line."""
    try:
        yield
    except MillmError as exc:
        raise refuse(exc.code, exc.message) from exc
    except ValidationError as exc:
        raise validation_line(exc, whole) from exc


def engine_unavailable(route: str) -> CommandError:
    """What a command in embedded mode answers where it needs the engine: the engine lives
    in the ``manage.py serve`` process."""
    return refused(
        "ENGINE_UNAVAILABLE",
        "embedded mode: the engine lives inside the `manage.py serve` process, which a separate "
        f"command cannot reach; use POST {route}, or run the distributed topology "
        "(REDIS_URL set), where commands reach run_engine",
    )


def dumps(data: Any) -> str:
    """As the API renders it (DRF's encoder), indented."""
    return json.dumps(data, cls=JSONEncoder, indent=2, ensure_ascii=False)


def error_suffix(run: Any) -> str:
    """``  CODE: message`` of a failed run's error, else nothing (a listing line's end)."""
    return f"  {run.error.get('code')}: {run.error.get('message')}" if run.error else ""


def refuse_unless_completed(run: Any, prefix: str, refuse: Callable[[str, str], Exception] = refused) -> None:
    """A run that ended other than completed: its error, else ``<PREFIX>_<STATUS>``."""
    if run.status != type(run).Status.COMPLETED:
        error = run.error or {}
        raise refuse(error.get("code") or f"{prefix}_{run.status.upper()}", error.get("message") or f"run {run.status}")


def run_in_foreground(
    command: BaseCommand,
    run_id: str,
    *,
    model: Any,
    work: Callable[..., Any],
    cancel: Callable[..., Any],
    progress: Callable[[Any], str],
    name: str,
    report_cancelled: bool = False,
) -> Any:
    """The run (``work(run_id=…)``) on a side thread of this process, its ``progress``
    line printed from the row whenever it changes, until the run ends. The run is queued
    as well: a run has one runner at a time, so should a worker take it first, this waits
    for that one. Ctrl-C cancels it (``cancel``); with ``report_cancelled`` the row's line
    is printed once more after that, if it changed."""
    failure: list[BaseException] = []

    def target() -> None:
        try:
            work(run_id=run_id)
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            failure.append(exc)
        finally:
            connections.close_all()

    def row(last: str | None) -> tuple[Any, str]:
        run = model.objects.get(pk=run_id)
        line = progress(run)
        if line != last:
            command.stderr.write(line)
        return run, line

    thread = threading.Thread(target=target, name=f"{name}-{run_id}", daemon=True)
    thread.start()
    last = None
    try:
        while True:
            thread.join(POLL_S)
            run, last = row(last)
            if run.status in model.TERMINAL:
                return run
            if failure:
                if isinstance(failure[0], MillmError):
                    raise failure[0]
                raise refused("INTERNAL_ERROR", f"the run stopped: {type(failure[0]).__name__}: {failure[0]}")
    except KeyboardInterrupt:
        command.stderr.write(f"Cancelling {run_id}…")
        cancel(run_id=run_id, principal=ANONYMOUS)
        thread.join()
        if report_cancelled:
            return row(last)[0]
        return model.objects.get(pk=run_id)
