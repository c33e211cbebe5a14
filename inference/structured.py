"""``response_format`` on /v1: which JSON schemas are honoured, checked before anything runs.

The engine enforces a schema with xgrammar's grammar masks (constrained decoding), and
xgrammar accepts keywords it does not enforce (``not``, ``if``/``then``, ``uniqueItems``,
``multipleOf``, ``oneOf`` as ``anyOf``, unknown ``format`` values …) without a word.  An
output under such a schema could fail to validate, so this module keeps a list of the
keywords the grammar really enforces (checked by fuzzing xgrammar's masks against
``jsonschema``) and refuses every other one with ``400 response_format_unsupported``
naming where it is.  The web tier has no xgrammar (it needs torch); written by hand
because no library checks a schema against xgrammar's enforced subset.  A schema that
passes here and still fails to compile in the engine is refused there with the same code.

Limits are OpenAI's published ones for Structured Outputs: at most 5,000 object
properties in all, 10 levels of nesting, 1,000 enum values, and 120,000 characters of
property names, definition names, enum and const values; a ``name`` of a-z, A-Z, 0-9,
``_`` and ``-``, at most 64 characters (OpenAI's reference schema).

Cost caps (``400 schema_too_complex``, ``param`` the JSON path of the field): xgrammar's
time to build a grammar grows with a regex's repetition bounds (``"a{2000}"`` takes 0.6 s,
``"a{20000}"`` ~25 s, ``"a{60000}"`` minutes), so every ``pattern`` and
``patternProperties`` key is at most ``STRUCTURED_MAX_PATTERN_LENGTH`` characters and no
``{n}`` / ``{n,m}`` / ``{n,}`` bound in it, multiplied by the bounds of the groups around
it, exceeds ``STRUCTURED_MAX_REPEAT``; nor may a pattern's repetitions together add more
than ``STRUCTURED_MAX_REPEAT`` atoms to its length (``"a{999}"`` twenty times), nor the
whole schema's more than ``STRUCTURED_MAX_SCHEMA_REPEAT``.  What passes the caps and is
still slow meets the engine's deadline (``STRUCTURED_COMPILE_TIMEOUT_S``).
"""

from __future__ import annotations

import json
import re
from typing import Any

from django.conf import settings

from core.openai_errors import OpenAIError
from gpu_engine.api.protocol import StructuredOutput

SUPPORTED_TYPES = ("text", "json_object", "json_schema")
MAX_PROPERTIES = 5000
MAX_NESTING = 10
MAX_ENUM_VALUES = 1000
MAX_NAME_CHARS = 120_000
MAX_SCHEMA_BYTES = 1 << 20
NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")

# keywords that change nothing about which documents are valid
ANNOTATIONS = frozenset(
    {"title", "description", "$schema", "$id", "$comment", "default", "examples", "deprecated", "readOnly", "writeOnly"}
)
# keywords the grammar enforces, by what their value holds
_SCHEMA = frozenset({"additionalProperties", "items", "propertyNames"})  # one schema
_SCHEMA_MAP = frozenset({"properties", "patternProperties", "$defs", "definitions"})
_SCHEMA_LIST = frozenset({"anyOf", "prefixItems"})
_PLAIN = frozenset(
    {
        "type",
        "enum",
        "const",
        "required",
        "$ref",
        "minProperties",
        "maxProperties",
        "minItems",
        "maxItems",
        "minLength",
        "maxLength",
        "pattern",
        "format",
        "minimum",
        "maximum",
        "exclusiveMinimum",
        "exclusiveMaximum",
        "uniqueItems",
    }
)
JSON_TYPES = frozenset({"object", "array", "string", "integer", "number", "boolean", "null"})
FORMATS = frozenset({"date", "time", "date-time", "duration", "email", "hostname", "ipv4", "ipv6", "uri", "uuid"})


SCHEMA_ROOT = "response_format.json_schema.schema"


def _unsupported(where: str, why: str) -> OpenAIError:
    return OpenAIError(
        f"{SCHEMA_ROOT}{where}: {why}", status=400, code="response_format_unsupported", param="response_format"
    )


def _repeat_bound(pattern: str) -> tuple[int, str, int]:
    """The largest repetition a regex asks for: each ``{n}``, ``{n,}`` or ``{n,m}`` bound
    (its larger number) multiplied by the bounds of the groups around it, and the
    quantifier that reaches it (``*``, ``+`` and ``?`` are loops, cheap in a grammar); and
    the pattern's expansion: its atoms, each counted as often as its bounds (and the groups
    around it) repeat it, which is what the grammar is built from (``"a{999}"`` twenty
    times has no bound over 999 but expands to 19,980). Written by hand: no regex library
    reports its quantifiers' bounds."""
    stack = [0]  # per open group: the largest bound inside it so far
    sizes = [0]  # per open group: its expansion so far
    best, best_text = 0, ""
    i, n = 0, len(pattern)

    def quantifier(at: int) -> tuple[int, int, str]:
        """(bound, end index, text) of a {…} quantifier at ``at``, else (1, at, "")."""
        if at < n and pattern[at] == "{":
            close = pattern.find("}", at)
            body = pattern[at + 1 : close] if close > 0 else ""
            low, comma, high = body.partition(",")
            if (low.isdigit() or (comma and high.isdigit())) and (not high or high.isdigit()):
                # (a bound of more than 12 digits counts as 10**12: int() of thousands
                # of digits is refused by Python itself)
                low_n, high_n = (int(d) if len(d) <= 12 else 10**12 for d in (low or "0", high or "0"))
                return max(low_n, high_n), close + 1, pattern[at : close + 1]
        return 1, at, ""

    while i < n:
        c = pattern[i]
        if c == "(":
            stack.append(0)
            sizes.append(0)
            i += 1
            continue
        size = 1
        if c == ")" and len(stack) > 1:
            inner = max(stack.pop(), 1)
            size = max(sizes.pop(), 1)
            i += 1
        elif c == "[":  # a class is one atom; braces inside it are literal
            j = i + 1
            if j < n and pattern[j] == "^":
                j += 1
            if j < n and pattern[j] == "]":
                j += 1
            while j < n and pattern[j] != "]":
                j += 2 if pattern[j] == "\\" else 1
            inner, i = 1, j + 1
        elif c == "\\":
            inner, i = 1, i + 2
        else:
            inner, i = 1, i + 1
        bound, i, text = quantifier(i)
        value = inner * bound
        stack[-1] = max(stack[-1], value)
        sizes[-1] = min(sizes[-1] + size * bound, 10**15)
        if text and value > best:
            best, best_text = value, text
    while len(sizes) > 1:  # an unclosed group: the regex engine refuses it later
        sizes[-2] += sizes.pop()
    return max(stack[0], 1), best_text, sizes[0]


class _Walk:
    def __init__(self, root: str = SCHEMA_ROOT) -> None:
        self.root = root
        self.properties = 0
        self.enum_values = 0
        self.name_chars = 0
        self.max_pattern = int(settings.STRUCTURED_MAX_PATTERN_LENGTH)
        self.max_repeat = int(settings.STRUCTURED_MAX_REPEAT)
        self.max_schema_repeat = int(settings.STRUCTURED_MAX_SCHEMA_REPEAT)
        self.repeats = 0  # what every pattern's repetitions add, over the whole schema

    def _too_complex(self, at: str, why: str) -> OpenAIError:
        return OpenAIError(f"{self.root}{at}: {why}", status=400, code="schema_too_complex", param=f"{self.root}{at}")

    def pattern(self, pattern: str, at: str) -> None:
        """A regex within the cost caps (the module doc), else 400 schema_too_complex."""
        if len(pattern) > self.max_pattern:
            raise self._too_complex(
                at,
                f"the pattern is {len(pattern)} characters long; at "
                f"most {self.max_pattern} are allowed "
                "(STRUCTURED_MAX_PATTERN_LENGTH)",
            )
        bound, quantifier, expansion = _repeat_bound(pattern)
        if bound > self.max_repeat:
            raise self._too_complex(
                at,
                f"the pattern repeats up to {bound} times "
                f"({quantifier}, with the groups around it); at most "
                f"{self.max_repeat} are allowed (STRUCTURED_MAX_REPEAT)",
            )
        # what its repetitions add to the grammar, over the pattern's own length
        added = max(expansion - len(pattern), 0)
        if added > self.max_repeat:
            raise self._too_complex(
                at,
                f"the pattern's repetitions add up to {expansion} "
                f"atoms; they may add at most {self.max_repeat} to its "
                "length (STRUCTURED_MAX_REPEAT)",
            )
        self.repeats += added
        if self.repeats > self.max_schema_repeat:
            raise self._too_complex(
                at,
                f"the schema's patterns together add {self.repeats} "
                f"atoms by repetition; at most {self.max_schema_repeat} "
                "are allowed (STRUCTURED_MAX_SCHEMA_REPEAT)",
            )

    def schema(self, node: Any, where: str, depth: int) -> None:
        if isinstance(node, bool):
            return
        if not isinstance(node, dict):
            raise _unsupported(where, "a schema must be an object or a boolean")
        if depth > MAX_NESTING:
            raise _unsupported(where, f"more than {MAX_NESTING} levels of nesting")
        for key, value in node.items():
            at = f"{where}.{key}"
            if key in ANNOTATIONS:
                continue
            if key in _SCHEMA:
                self.schema(value, at, depth + 1)
            elif key in _SCHEMA_MAP:
                if not isinstance(value, dict):
                    raise _unsupported(at, "must map names to schemas")
                if key in ("properties", "patternProperties"):
                    self.properties += len(value)
                if key == "patternProperties":
                    for name in value:
                        self.pattern(name, f"{at}[{json.dumps(name)}]")
                self.name_chars += sum(len(k) for k in value)
                for name, sub in value.items():
                    self.schema(
                        sub, f"{at}[{json.dumps(name)}]", depth if key in ("$defs", "definitions") else depth + 1
                    )
            elif key in _SCHEMA_LIST:
                if not isinstance(value, list) or not value:
                    raise _unsupported(at, "must be a non-empty list of schemas")
                for i, sub in enumerate(value):
                    self.schema(sub, f"{at}[{i}]", depth + 1)
            elif key in _PLAIN:
                self.plain(key, value, at)
            else:
                raise _unsupported(
                    at, f"the keyword {key!r} is not supported (constrained decoding could not guarantee it)"
                )
        self._limits(where)

    def plain(self, key: str, value: Any, at: str) -> None:
        if key == "type":
            types = value if isinstance(value, list) else [value]
            bad = [t for t in types if t not in JSON_TYPES]
            if bad or not types:
                raise _unsupported(at, f"unknown type {bad[0] if bad else value!r}")
        elif key == "enum":
            if not isinstance(value, list) or not value:
                raise _unsupported(at, "must be a non-empty list")
            self.enum_values += len(value)
            self.name_chars += sum(len(v) if isinstance(v, str) else len(json.dumps(v)) for v in value)
        elif key == "const":
            self.name_chars += len(value) if isinstance(value, str) else len(json.dumps(value))
        elif key == "$ref":
            if not isinstance(value, str) or not (value == "#" or value.startswith("#/")):
                raise _unsupported(at, "only references inside the schema (#/...) are supported")
        elif key == "format":
            if value not in FORMATS:
                raise _unsupported(
                    at, f"the format {value!r} is not supported (supported: {', '.join(sorted(FORMATS))})"
                )
        elif key == "uniqueItems":
            if value is not False:
                raise _unsupported(at, "uniqueItems: true is not supported")
        elif key == "pattern":
            if not isinstance(value, str):
                raise _unsupported(at, "must be a string")
            if "(?<" in value.replace("(?<name>", "") or "(?=" in value or "(?!" in value:
                raise _unsupported(at, "lookaround assertions are not supported")
            self.pattern(value, at)

    def _limits(self, where: str) -> None:
        if self.properties > MAX_PROPERTIES:
            raise _unsupported(where, f"more than {MAX_PROPERTIES} object properties in all")
        if self.enum_values > MAX_ENUM_VALUES:
            raise _unsupported(where, f"more than {MAX_ENUM_VALUES} enum values in all")
        if self.name_chars > MAX_NAME_CHARS:
            raise _unsupported(
                where,
                f"more than {MAX_NAME_CHARS} characters of property names, definition names, enum and const values",
            )


def check_schema(schema: Any, *, root: str = SCHEMA_ROOT) -> str:
    """The schema as compact JSON text, or 400 ``response_format_unsupported`` naming the
    first part outside the supported subset or over a limit, or 400 ``schema_too_complex``
    naming (``param``, from ``root``) a pattern over the cost caps."""
    text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
    if len(text.encode()) > MAX_SCHEMA_BYTES:
        raise _unsupported("", f"the schema is larger than {MAX_SCHEMA_BYTES} bytes")
    _Walk(root).schema(schema, "", 1)
    return text


def structured_output(response_format: dict[str, Any] | None) -> StructuredOutput | None:
    """The engine's ``StructuredOutput`` for a request's ``response_format`` (already shaped
    by the wire model; its type already one of ``SUPPORTED_TYPES``); None for text."""
    if not response_format:
        return None
    kind = response_format.get("type")
    if kind == "json_object":
        return StructuredOutput("json_object")
    if kind == "json_schema":
        spec = response_format["json_schema"]
        # OpenAI: a json_schema without a schema accepts any JSON value
        schema = spec.get("schema")
        return StructuredOutput("json_schema", check_schema({} if schema is None else schema))
    return None


__all__ = ["SCHEMA_ROOT", "SUPPORTED_TYPES", "check_schema", "structured_output"]
