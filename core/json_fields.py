"""A JSON encoder for model fields that hold large documents (a dashboard row holds
about a thousand activations and token texts): Django's ``JSONField`` calls
``json.dumps(value, cls=encoder)`` once per field and row, and Python's encoder is the
larger part of storing a dashboard run. ``FastJSONEncoder.encode`` writes the same JSON
with msgspec's C encoder; what msgspec cannot encode goes to Django's encoder as before.
NaN and infinities become ``null`` (PostgreSQL's jsonb refuses Python's ``NaN``)."""

from __future__ import annotations

from typing import Any

import msgspec
from django.core.serializers.json import DjangoJSONEncoder

_encode = msgspec.json.Encoder().encode


class FastJSONEncoder(DjangoJSONEncoder):
    def encode(self, o: Any) -> str:
        if self.indent is None and not self.sort_keys:
            try:
                return _encode(o).decode("utf-8")
            except (msgspec.EncodeError, TypeError, OverflowError):
                pass
        return super().encode(o)


def has_nul(value: Any) -> bool:
    """Whether a string somewhere in ``value`` (a JSON document) holds U+0000; true too,
    rarely, for a string holding the six characters ``\\u0000`` (the check is one C
    encode and a byte search; a caller then cleans the value the slow way)."""
    try:
        return b"\\u0000" in _encode(value)
    except (msgspec.EncodeError, TypeError, OverflowError):
        return True
