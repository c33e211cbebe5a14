"""features.corpus: the shipped sample, corpus files (text lines or JSONL) as an attacker
might upload them, and the packing of tokens into contexts within a budget."""

from __future__ import annotations

import itertools
import json

import pytest

from features import corpus
from features.corpus import MAX_LINE_BYTES, SAMPLE_NAME, CorpusError, pack_contexts, parse_corpus, sample_texts


def docs(data: bytes, chunk: int = 7, **kw) -> list[str]:
    return list(parse_corpus((data[i : i + chunk] for i in range(0, len(data), chunk)), **kw))


def refused(data, **kw) -> CorpusError:
    chunks = [data] if isinstance(data, bytes) else data
    with pytest.raises(CorpusError) as info:
        list(parse_corpus(chunks, **kw))
    return info.value


def test_the_sample_ships_with_the_project_and_reads_as_a_corpus_file():
    assert SAMPLE_NAME == "sample"
    texts = sample_texts()
    raw = corpus.SAMPLE_PATH.read_bytes()
    assert texts == docs(raw, chunk=4096)
    assert 500 <= len(texts) <= 800 and all(t == t.strip() and t for t in texts)
    assert len(set(texts)) == len(texts)
    words = " ".join(texts).lower()
    for topic in ("rain", "recipe", "goal", "ocean", "piano", "def ", "triangle", "1914", "doctor", "once upon a time"):
        assert topic in words
    texts.append("changed")
    assert "changed" not in sample_texts()  # a copy, not the cached list


def test_text_lines_split_anywhere_in_a_multibyte_character():
    text = "\ufeffcafé au lait\r\n\n   \nnaïve résumé — ok\n日本語のテキスト\nlast line without newline"
    data = text.encode("utf-8")
    expected = ["café au lait", "naïve résumé — ok", "日本語のテキスト", "last line without newline"]
    for chunk in (1, 2, 3, 5, len(data)):
        assert docs(data, chunk=chunk) == expected


def test_jsonl_rows_with_the_text_field():
    rows = [{"text": "first doc", "id": 1}, {"text": "  "}, {"body": "x", "text": "second\ndoc"}]
    data = ("\n".join(json.dumps(r) for r in rows) + "\n\n").encode()
    assert docs(data) == ["first doc", "second\ndoc"]
    custom = b'{"body": "a"}\n{"body": "b", "text": "ignored"}\n'
    assert docs(custom, text_field="body") == ["a", "b"]


def test_a_first_line_that_is_not_a_json_object_means_text_lines():
    data = b'[1, 2, 3]\n{"text": "a json object, but the file is text"}\n{not json}\n'
    assert docs(data) == ["[1, 2, 3]", '{"text": "a json object, but the file is text"}', "{not json}"]
    assert docs(b"{not json\nplain\n") == ["{not json", "plain"]


def test_jsonl_row_without_the_field_names_text_field():
    err = refused(b'{"text": "ok"}\n{"content": "no text field"}\n')
    assert (err.code, err.param) == ("corpus_missing_field", "text_field")
    assert "line 2" in err.message and "'text'" in err.message
    err = refused(b'{"text": "ok"}\n{"text": 42}\n')
    assert err.code == "corpus_missing_field" and "non-string" in err.message
    err = refused(b'{"text": "ok"}\n', text_field="body")
    assert err.code == "corpus_missing_field" and "'body'" in err.message


def test_jsonl_with_a_row_that_is_not_an_object():
    for bad in (b"plain words", b"[1, 2]", b'{"text": "unterminated'):
        err = refused(b'{"text": "ok"}\n' + bad + b"\n")
        assert (err.code, err.param) == ("corpus_not_text", "file_id") and "line 2" in err.message


@pytest.mark.parametrize(
    "data",
    [
        b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x00\x00",  # an image
        b"PK\x03\x04\x14\x00\x00\x00\x08\x00",  # a zip
        b"good line\n\xff\xfe\xfa not utf-8\n",  # latin-1 or worse
        b"caf\xe9\n",  # latin-1 text
        "utf-16 text".encode("utf-16"),
    ],
)
def test_binary_or_non_utf8_is_not_text(data):
    err = refused(data)
    assert (err.code, err.param) == ("corpus_not_text", "file_id")


def test_an_overlong_line_is_refused_without_reading_the_rest():
    pulled = 0

    def endless():
        nonlocal pulled
        while True:
            pulled += 1
            yield b"a" * 65536

    err = refused(endless())
    assert err.code == "corpus_line_too_long" and str(MAX_LINE_BYTES) in err.message
    assert pulled <= MAX_LINE_BYTES // 65536 + 2
    # positive control: a line of exactly the limit is read
    assert docs(b"x" * MAX_LINE_BYTES + b"\nnext", chunk=1 << 16) == ["x" * MAX_LINE_BYTES, "next"]
    err = refused([b"short\n", b"y" * (MAX_LINE_BYTES + 1), b"\n"])
    assert err.code == "corpus_line_too_long" and "line 2" in err.message


@pytest.mark.parametrize(
    "data, kw",
    [
        (b"", {}),
        (b"\n\n  \r\n\t\n", {}),
        (b"\xef\xbb\xbf\n", {}),
        (b'{"text": ""}\n{"text": "   "}\n', {}),
    ],
)
def test_empty_corpus(data, kw):
    err = refused(data, **kw)
    assert (err.code, err.param) == ("corpus_empty", "file_id")


def test_errors_come_while_iterating_after_the_good_documents():
    it = parse_corpus([b"one\ntwo\n", b"\x00"])
    with pytest.raises(CorpusError):
        list(it)
    it = parse_corpus([b'{"text": "one"}\n{"x": 1}\n'])
    assert next(it) == "one"
    with pytest.raises(CorpusError):
        next(it)


def reference_pack(token_lists, context_tokens, budget):
    flat = list(itertools.chain.from_iterable(token_lists))[:budget]
    out = [flat[i : i + context_tokens] for i in range(0, len(flat), context_tokens)]
    return [c for c in out if len(c) == context_tokens or len(c) >= 2]


@pytest.mark.parametrize("context_tokens", [2, 3, 5, 64])
@pytest.mark.parametrize("budget", [1, 2, 7, 8, 30, 1000])
def test_pack_contexts_concatenates_and_cuts_within_the_budget(context_tokens, budget):
    docs_tokens = [list(range(100 * d, 100 * d + n)) for d, n in enumerate([5, 1, 0, 9, 4, 3])]
    got = pack_contexts(docs_tokens, context_tokens=context_tokens, budget=budget)
    assert got == reference_pack(docs_tokens, context_tokens, budget)
    assert sum(map(len, got)) <= budget
    assert all(len(c) == context_tokens for c in got[:-1]) and all(len(c) >= 2 for c in got)


def test_pack_contexts_stops_reading_at_the_budget():
    pulled = 0

    def endless():
        nonlocal pulled
        for d in itertools.count():
            pulled += 1
            yield [d] * 10

    got = pack_contexts(endless(), context_tokens=64, budget=1000)
    assert [len(c) for c in got] == [64] * 15 + [40] and pulled == 100


def test_pack_contexts_refuses_nonsense_sizes():
    with pytest.raises(ValueError):
        pack_contexts([[1, 2, 3]], context_tokens=1, budget=10)
    with pytest.raises(ValueError):
        pack_contexts([[1, 2, 3]], context_tokens=4, budget=0)


def test_chunks_may_be_memoryviews_or_text():
    assert list(parse_corpus([memoryview(b"one\ntw"), bytearray(b"o\n"), "thr", "ee"])) == ["one", "two", "three"]
    for chunk in (memoryview(b"text\x00more"), bytearray(b"\x00"), "nul\x00"):
        assert refused([chunk]).code == "corpus_not_text"
