"""Names of the steering documents (profiles, clusters, circuits) that their own routes
can reach: ``/api/<collection>/{name}`` looks a document up by id or by name
(``core.ids.get_by_pk_or_name``), so a name that is one of the collection's fixed route
words (steering/urls.py), reads as an id, or holds '/' would be shadowed and could never
be read, activated or deleted by name."""

from __future__ import annotations

from core.errors import ValidationFailed
from core.ids import ascii_int

# the fixed words under each collection (steering/urls.py; profiles keep their own list,
# steering.profiles.ROUTE_WORDS, with the '@' rule of /v1's model names)
ROUTE_WORDS: dict[str, tuple[str, ...]] = {
    "clusters": ("active", "import"),
    "circuits": ("active", "claims", "import"),
}


def name_problem(name: str, *, collection: str) -> str | None:
    """Why ``name`` could not be reached as ``/api/<collection>/{name}``, or None."""
    words = ROUTE_WORDS[collection]
    if ascii_int(name) is not None:
        return f"a name of digits only reads as an id in /api/{collection}/{{id}}"
    if name in words:
        return f"{name!r} is a route of /api/{collection} ({', '.join(words)})"
    if "/" in name:
        return f"a name with '/' cannot be a path segment of /api/{collection}/{{name}}"
    return None


def check_name(name: str, *, collection: str, what: str) -> None:
    """Refuse (422 VALIDATION_ERROR naming the field, as every /api schema refusal) a name
    its route would shadow."""
    if problem := name_problem(name, collection=collection):
        raise ValidationFailed(
            f"{what} name {name!r} is not allowed: {problem}", details={"name": name, "fields": {"name": [problem]}}
        )
