"""The corpus a run reads, as its route's body and its command's options take it: a
dashboard run's (``POST /api/saes/{id}/dashboards``, ``manage.py dashboards``) and a corpus
fidelity run's (``POST /api/experiments/fidelity``, ``manage.py fidelity``). The corpus is
the offline sample or the caller's /v1 file, whose JSONL rows hold the text in
``text_field``; ``token_budget`` (≤ DASHBOARD_MAX_TOKENS) corpus tokens are read in
contexts of ``context_tokens``."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from rest_framework import serializers

from core.commands import refused

TEXT_FIELD = r"^[A-Za-z0-9_-]{1,100}$"


def corpus_fields() -> tuple[serializers.Field, ...]:
    """A body's ``file_id, text_field, token_budget, context_tokens``, in that order
    (declared after its ``corpus``; ``CorpusChecks`` checks them)."""
    return (
        serializers.CharField(
            required=False, max_length=40, help_text="a /v1/files id of the caller's; required iff corpus is file"
        ),
        serializers.RegexField(
            TEXT_FIELD,
            required=False,
            default="text",
            max_length=100,
            error_messages={"invalid": "a JSON field name: letters, digits, _ and -, at most 100"},
            help_text="the field of the file's JSONL rows that holds the text (read only for a file)",
        ),
        serializers.IntegerField(min_value=1, help_text="corpus tokens to read, ≤ DASHBOARD_MAX_TOKENS"),
        serializers.IntegerField(required=False, default=64, min_value=8, max_value=1024),
    )


# No docstring: drf-spectacular would show a serializer's base class's as its description.
class CorpusChecks:
    # A serializer's checks of ``corpus_fields``: the budget's cap, and ``file_id`` given
    # iff the corpus is a file.

    def validate_token_budget(self, value: int) -> int:
        cap = settings.DASHBOARD_MAX_TOKENS
        if value > cap:
            raise serializers.ValidationError(f"at most {cap} (DASHBOARD_MAX_TOKENS)")
        return value

    def validate(self, data: dict[str, Any]) -> dict[str, Any]:
        if data["corpus"] == "file" and not data.get("file_id"):
            raise serializers.ValidationError({"file_id": ["required when corpus is file"]})
        if data["corpus"] != "file" and "file_id" in data:
            raise serializers.ValidationError({"file_id": ["only with corpus file"]})
        return data


def add_corpus_arguments(parser: Any, *, context_help: str | None = None) -> None:
    """A command's ``--sample | --file-id ID``, ``--text-field``, ``--budget`` and
    ``--context-tokens``."""
    corpus = parser.add_mutually_exclusive_group()
    corpus.add_argument("--sample", action="store_true", help="the built-in offline sample corpus (default)")
    corpus.add_argument("--file-id", default=None, help="a /v1/files upload: JSONL rows, the text in --text-field")
    parser.add_argument("--text-field", default="text", help="the JSONL rows' text field (default text)")
    parser.add_argument("--budget", type=int, default=None, help="corpus tokens to read (≤ DASHBOARD_MAX_TOKENS)")
    parser.add_argument("--context-tokens", type=int, default=64, help=context_help)


def corpus_body(options: dict[str, Any]) -> dict[str, Any]:
    """The body's corpus fields from ``add_corpus_arguments``' options; ``--budget`` is
    required."""
    if options["budget"] is None:
        raise refused("VALIDATION_ERROR", "token_budget: --budget N is required")
    body: dict[str, Any] = {
        "corpus": "file" if options["file_id"] else "sample",
        "token_budget": options["budget"],
        "context_tokens": options["context_tokens"],
        "text_field": options["text_field"],
    }
    if options["file_id"]:
        body["file_id"] = options["file_id"]
    return body
