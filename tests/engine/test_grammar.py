"""The grammar every backend enforces (``gpu_engine.decode.grammar.grammar_for``), read with
Python's own ``json`` and ``jsonschema`` as the oracle: whatever the grammar accepts must
parse and validate."""

from __future__ import annotations

import json

import jsonschema
import pytest

from gpu_engine.api.protocol import StructuredOutput

BOUNDED = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "code": {"type": "string", "minLength": 2},
    },
    "required": ["city", "code"],
    "additionalProperties": False,
}


@pytest.mark.parametrize(
    "char",
    [chr(c) for c in range(0x20)] + ["\\", '"', "é", "\x7f"],
    ids=lambda c: f"U+{ord(c):04X}",
)
def test_a_string_with_a_length_bound_holds_only_what_json_allows(char):
    """A raw control character is not JSON: the grammar refuses it inside a bounded string
    (xgrammar's own conversion of ``maxLength`` let it through)."""
    import xgrammar as xg

    from gpu_engine.decode.grammar import grammar_for

    grammar = grammar_for(StructuredOutput("json_schema", json.dumps(BOUNDED)))
    text = '{"city": "a' + char + 'b", "code": "xy"}'
    accepted = xg.testing._is_grammar_accept_string(grammar, text)
    try:
        jsonschema.validate(json.loads(text), BOUNDED)
        valid = True
    except (ValueError, jsonschema.ValidationError):
        valid = False
    assert not accepted or valid, repr(text)
    if char in "é\x7f":  # positive control: ordinary characters stay allowed
        assert accepted
