"""/v1/files with purpose ``user_data``: UTF-8 text the server's own readers take (a
feature-dashboard corpus of text lines, docs/features.md), through the official client.
It is stored as uploaded, listed and read back by its owner only, refused when it is not
text (nothing stored), and a batch refuses it as it refuses any file that is not batch
input."""

from __future__ import annotations

import io

import openai
import pytest

from batches.models import File
from tests.v1.test_batches import batch_server  # noqa: F401 - fixture

TEXT = "The sea was calm today.\n\nA fox ran over the hill; the dog slept.\nÜber café naïve — unicode is text.\n"


def test_a_text_corpus_is_stored_as_sent_and_read_back(openai_client):
    file = openai_client.files.create(file=("corpus.txt", io.BytesIO(TEXT.encode())), purpose="user_data")
    assert (file.purpose, file.bytes, file.filename) == ("user_data", len(TEXT.encode()), "corpus.txt")
    assert openai_client.files.content(file.id).read() == TEXT.encode()
    assert file.id in [f.id for f in openai_client.files.list(purpose="user_data")]
    assert file.id not in [f.id for f in openai_client.files.list(purpose="batch")]


@pytest.mark.parametrize(
    "content",
    [b"text\x00with a NUL\n", b"\xff\xfe\x00binary", b"", b"\n\n"],
    ids=["nul", "not-utf8", "empty", "blank"],
)
def test_what_is_not_text_is_refused_and_nothing_is_stored(openai_client, content):
    before = File.objects.count()
    with pytest.raises(openai.BadRequestError) as info:
        openai_client.files.create(file=("x.txt", io.BytesIO(content)), purpose="user_data")
    assert (info.value.code, info.value.body["param"]) == ("invalid_file", "file")
    assert File.objects.count() == before


def test_a_batch_refuses_a_user_data_file(batch_server, openai_client):  # noqa: F811
    file = openai_client.files.create(file=("corpus.txt", io.BytesIO(TEXT.encode())), purpose="user_data")
    with pytest.raises(openai.BadRequestError) as info:
        openai_client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert info.value.body["param"] == "input_file_id"
    # a purpose that is neither is still refused by name
    with pytest.raises(openai.BadRequestError) as info:
        openai_client.files.create(file=("x.txt", io.BytesIO(TEXT.encode())), purpose="fine-tune")
    assert (info.value.code, info.value.body["param"]) == ("invalid_file", "purpose")
