"""Reading a whole number out of a path or query value, and a record by id or by name."""

from __future__ import annotations

from typing import Any

from django.db.models import Model, QuerySet


def ascii_int(value: object) -> int | None:
    """``value`` as a whole number: an int, or a string of ASCII decimal digits; None for
    anything else (which the callers read as a name, or ignore). ``str.isdigit`` is not the
    test: it accepts "²" and other Unicode digits that ``int`` refuses (a 500 on
    ``/api/clusters/%C2%B2``, found by the schemathesis suite)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    text = str(value)
    return int(text) if text.isascii() and text.isdecimal() else None


def get_by_pk_or_name(qs: QuerySet[Any], value: int | str) -> Model:
    """The record of ``qs`` whose primary key is ``value`` when it reads as one
    (``ascii_int``), else the one named ``value`` (clients may send either); raises the
    model's ``DoesNotExist``."""
    pk = ascii_int(value)
    return qs.get(pk=pk) if pk is not None else qs.get(name=str(value))
