"""Reading a record's id out of a path or query value that may also be a name."""

from __future__ import annotations


def as_pk(value: object) -> int | None:
    """``value`` as a primary key: an int, or a string of ASCII decimal digits; None for
    anything else, which callers then read as a name. ``str.isdigit`` is not the test: it
    accepts "²" and other Unicode digits that ``int`` refuses (a 500 on
    ``/api/clusters/%C2%B2``, found by the schemathesis suite)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    text = str(value)
    return int(text) if text.isascii() and text.isdecimal() else None
