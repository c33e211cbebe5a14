"""A dashboard run's corpus: the built-in sample, an uploaded file's documents, contexts.

Pure Python: no Django model access, no torch. A corpus file is UTF-8 text, one document
per line, or JSONL (one JSON object per line, the document in ``text_field``); which of
the two is decided by the first non-empty line (a JSON object: JSONL). Blank lines are
skipped. A file that is empty, binary, not UTF-8, has a line over ``MAX_LINE_BYTES`` or a
JSONL row without a string ``text_field`` is refused with a :class:`CorpusError`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from functools import cache
from pathlib import Path

SAMPLE_NAME = "sample"
SAMPLE_PATH = Path(__file__).resolve().parent / "data" / "sample_corpus.txt"

# One document per line: a line longer than this is refused (it is not a corpus line, and
# reading it whole would let one upload hold the worker's memory).
MAX_LINE_BYTES = 1 << 20


class CorpusError(ValueError):
    """A corpus that cannot be read: ``code`` (corpus_empty, corpus_not_text,
    corpus_missing_field, corpus_line_too_long), a message for the user and the request
    field it concerns (``param``)."""

    def __init__(self, code: str, message: str, param: str):
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param

    def as_dict(self) -> dict:
        return {"code": self.code, "message": self.message, "param": self.param}


@cache
def _sample() -> tuple[str, ...]:
    lines = SAMPLE_PATH.read_text(encoding="utf-8").splitlines()
    return tuple(line.strip() for line in lines if line.strip())


def sample_texts() -> list[str]:
    """The built-in sample corpus's documents (shipped with the project, no download)."""
    return list(_sample())


def _lines(chunks: Iterable[bytes | bytearray | memoryview | str], param: str) -> Iterator[tuple[int, bytes]]:
    """Split a byte stream into (line number, line) without holding more than one line."""
    pending = bytearray()
    number = 0
    for chunk in chunks:
        if not chunk:
            continue
        if isinstance(chunk, str):
            chunk = chunk.encode("utf-8", "surrogateescape")
        elif not isinstance(chunk, bytes):
            chunk = bytes(chunk)  # a memoryview's ``in`` compares single bytes as ints
        if b"\x00" in chunk:
            raise CorpusError("corpus_not_text", "the corpus is binary (it holds NUL bytes), not text", param)
        pending += chunk
        while True:
            cut = pending.find(b"\n")
            if cut < 0:
                break
            number += 1
            if cut > MAX_LINE_BYTES:
                raise _too_long(number, param)
            yield number, bytes(pending[:cut])
            del pending[: cut + 1]
        if len(pending) > MAX_LINE_BYTES:
            raise _too_long(number + 1, param)
    if pending:
        yield number + 1, bytes(pending)


def _too_long(number: int, param: str) -> CorpusError:
    return CorpusError(
        "corpus_line_too_long",
        f"line {number} of the corpus is longer than {MAX_LINE_BYTES} bytes (a corpus holds one document per line)",
        param,
    )


def parse_corpus(chunks: Iterable[bytes], *, text_field: str = "text", param: str = "file_id") -> Iterator[str]:
    """The documents of a corpus file given as byte chunks, lazily, in file order.

    Raises :class:`CorpusError` (while iterating) for a binary or non-UTF-8 file, an
    over-long line, a JSONL row that is not an object or lacks a string ``text_field``
    (param ``text_field``), or a file with no document at all (``corpus_empty``).
    """
    jsonl: bool | None = None
    found = False
    for number, raw in _lines(chunks, param):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise CorpusError("corpus_not_text", f"line {number} of the corpus is not UTF-8 text", param) from None
        if number == 1:
            line = line.removeprefix("\ufeff")
        line = line.strip()
        if not line:
            continue
        if jsonl is None:
            jsonl = _is_json_object(line)
        if not jsonl:
            found = True
            yield line
            continue
        try:
            row = json.loads(line)
        except ValueError:
            row = None
        if not isinstance(row, dict):
            raise CorpusError(
                "corpus_not_text",
                f"line {number} of the JSONL corpus is not a JSON object (the first line was one)",
                param,
            )
        text = row.get(text_field)
        if not isinstance(text, str):
            what = "has no" if text is None else "has a non-string"
            raise CorpusError(
                "corpus_missing_field",
                f"line {number} of the JSONL corpus {what} field {text_field!r}",
                "text_field",
            )
        text = text.strip()
        if text:
            found = True
            yield text
    if not found:
        raise CorpusError("corpus_empty", "the corpus holds no text (no non-empty line)", param)


def _is_json_object(line: str) -> bool:
    if not line.startswith("{"):
        return False
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:
        return False


def pack_contexts(token_lists: Iterable[list[int]], *, context_tokens: int, budget: int) -> list[list[int]]:
    """Concatenate the documents' tokens in order and cut them into contexts of exactly
    ``context_tokens`` tokens, stopping once ``budget`` tokens are taken (the iterable is
    read no further). The last context may be shorter (the corpus or the budget ran out);
    it is kept when it has at least 2 tokens."""
    if context_tokens < 2:
        raise ValueError("context_tokens must be at least 2")
    if budget < 1:
        raise ValueError("budget must be at least 1")
    contexts: list[list[int]] = []
    current: list[int] = []
    left = budget
    for tokens in token_lists:
        tokens = [int(t) for t in tokens[:left]]
        left -= len(tokens)
        at = 0
        while at < len(tokens):
            room = context_tokens - len(current)
            current.extend(tokens[at : at + room])
            at += room
            if len(current) == context_tokens:
                contexts.append(current)
                current = []
        if not left:
            break
    if len(current) >= 2:
        contexts.append(current)
    return contexts
