"""The Files and Batch API against the real server (daphne on a loopback socket) with the
official ``openai`` client: a batch answers every line exactly once, as the synchronous
route would (body and X-miLLM-* headers), cancels, refuses what breaks the limits in
OpenAI's shape, waits for a model that is not resident (never loading it), and resumes
after its runner dies without repeating a line."""

from __future__ import annotations

import io
import json
import threading
import time
from typing import Any

import openai
import pytest

from batches.models import Batch, BatchLine
from tests.v1.conftest import model_resident
from tests.v1.helpers import request, wait_for_status
from tests.fixtures.served import GatedEngine

pytestmark = pytest.mark.django_db(transaction=True)


def jsonl(rows: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def chat_line(i: int, **body: Any) -> dict[str, Any]:
    return {
        "custom_id": f"req-{i}",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": "tiny-llama",
            "max_tokens": 6,
            "temperature": 0,
            "messages": [{"role": "user", "content": f"count to {i}"}],
            **body,
        },
    }


def upload(client, rows: list[dict[str, Any]]) -> Any:
    return client.files.create(file=("input.jsonl", io.BytesIO(jsonl(rows))), purpose="batch")


def wait_status(client, batch_id: str, statuses: tuple[str, ...], timeout_s: float = 120):
    return wait_for_status(lambda: client.batches.retrieve(batch_id), statuses, timeout_s, every_s=0.1)


def output(client, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(x) for x in client.files.content(file_id).content.splitlines()]


class Events:
    """The event bus, recording what is published."""

    def __init__(self) -> None:
        self.published: list[tuple[str, dict[str, Any]]] = []

    def bind_loop(self, loop) -> None:  # noqa: ANN001
        pass

    def publish(self, event: str, data: dict[str, Any]) -> None:
        self.published.append((event, data))


class CountingEngine:
    """The server's engine client, counting the generations each prompt started."""

    def __init__(self, inner) -> None:  # noqa: ANN001
        self.inner = inner
        self.started: dict[str, int] = {}
        self.lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def agenerate(self, job):  # noqa: ANN001
        key = json.dumps(job.messages or job.prompt)
        with self.lock:
            self.started[key] = self.started.get(key, 0) + 1
        return self.inner.agenerate(job)


TERMINAL = ("completed", "failed", "expired", "cancelled")


@pytest.fixture
def batch_server(llama):
    """tiny-llama resident; every batch ended (and its runner gone) after the test."""
    yield llama
    for batch in Batch.objects.exclude(status__in=Batch.TERMINAL):
        from batches.services import batch_cancel

        batch_cancel(batch_id=batch.id)
    deadline = time.monotonic() + 60
    while Batch.objects.exclude(status__in=Batch.TERMINAL).exists() or Batch.objects.exclude(runner=None).exists():
        assert time.monotonic() < deadline, "a batch runner did not end"
        time.sleep(0.05)


def test_official_client_runs_a_chat_batch_answering_every_line_once(batch_server, openai_client):
    from core.runtime import runtime

    events = Events()
    rows = [chat_line(i) for i in range(12)]
    with runtime().replaced(events=events):
        file = upload(openai_client, rows)
        assert (file.object, file.purpose, file.bytes) == ("file", "batch", len(jsonl(rows)))
        batch = openai_client.batches.create(
            input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h", metadata={"run": "unit"}
        )
        assert batch.status in ("validating", "in_progress") and batch.metadata == {"run": "unit"}
        done = wait_status(openai_client, batch.id, ("completed", "failed"))
    assert done.status == "completed", done
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (12, 12, 0)
    assert done.error_file_id is None and done.model == "tiny-llama"
    assert done.in_progress_at and done.finalizing_at and done.completed_at
    lines = output(openai_client, done.output_file_id)
    assert [x["custom_id"] for x in lines] == [f"req-{i}" for i in range(12)]  # once each
    # each answer is what the synchronous route answers: body and X-miLLM-* headers
    for i in (0, 7):
        sync = request(batch_server.url, "POST", "/v1/chat/completions", rows[i]["body"])
        got = lines[i]["response"]
        assert got["status_code"] == 200 and lines[i]["error"] is None
        assert got["request_id"] == lines[i]["id"] and lines[i]["id"].startswith("batch_req_")
        assert got["body"]["object"] == "chat.completion"
        assert got["body"]["choices"][0]["message"] == sync.json()["choices"][0]["message"]
        assert got["body"]["usage"] == sync.json()["usage"]
        assert got["headers"] == {
            "X-miLLM-Backend": sync.headers["x-millm-backend"],
            "X-miLLM-Steering": sync.headers["x-millm-steering"],
        }
    # the rows: every line answered once, the usage summed
    assert BatchLine.objects.filter(batch_id=done.id, status="done", attempts=1).count() == 12
    row = Batch.objects.get(id=done.id)
    assert (
        row.output_tokens == sum(x["response"]["body"]["usage"]["completion_tokens"] for x in lines)
        and row.runner is None
    )
    progress = [d for e, d in events.published if e == "batch:progress"]
    assert progress[-1]["batch_id"] == done.id and progress[-1]["status"] == "completed"
    assert progress[-1]["request_counts"] == {"total": 12, "completed": 12, "failed": 0}
    assert "messages" not in json.dumps(progress)  # never a prompt over the socket
    # listing and retrieval
    assert done.id in [b.id for b in openai_client.batches.list(limit=5)]
    assert openai_client.files.retrieve(done.output_file_id).purpose == "batch_output"
    assert file.id in [f.id for f in openai_client.files.list(purpose="batch")]
    assert openai_client.files.delete(file.id).deleted is True
    with pytest.raises(openai.NotFoundError):
        openai_client.files.retrieve(file.id)


def test_completion_and_embedding_batches_answer_like_the_routes(batch_server, openai_client):
    rows = [
        {
            "custom_id": f"c{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {
                "model": "tiny-llama",
                "prompt": f"the sea {i}",
                "max_tokens": 5,
                "temperature": 0,
                "steering": {"features": []},
            },
        }
        for i in range(3)
    ]
    rows.append(
        {
            "custom_id": "bad",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": "tiny-llama", "prompt": "x", "max_tokens": -3},
        }
    )
    # the synchronous route's field policy holds for a line too: a field it cannot honour
    # is the line's 400, a field nothing reads is named in the line's header
    rows.append(
        {
            "custom_id": "suffix",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": "tiny-llama", "prompt": "x", "max_tokens": 2, "suffix": "the end"},
        }
    )
    rows[0]["body"]["user"] = "someone"
    file = upload(openai_client, rows)
    batch = openai_client.batches.create(input_file_id=file.id, endpoint="/v1/completions", completion_window="24h")
    done = wait_status(openai_client, batch.id, ("completed", "failed"))
    assert (done.status, done.request_counts.completed, done.request_counts.failed) == ("completed", 3, 2)
    good = output(openai_client, done.output_file_id)
    assert good[0]["response"]["headers"]["X-miLLM-Ignored-Fields"] == '"user"'
    sync = request(batch_server.url, "POST", "/v1/completions", rows[1]["body"])
    assert good[1]["response"]["body"]["choices"][0]["text"] == sync.json()["choices"][0]["text"]
    assert good[1]["response"]["headers"]["X-miLLM-Steering"] == sync.headers["x-millm-steering"]
    bad, suffix = sorted(output(openai_client, done.error_file_id), key=lambda line: line["custom_id"])
    assert bad["custom_id"] == "bad" and bad["response"]["status_code"] == 400
    assert bad["response"]["body"]["error"]["param"] == "max_tokens"
    assert suffix["response"]["status_code"] == 400
    assert (suffix["response"]["body"]["error"]["code"], suffix["response"]["body"]["error"]["param"]) == (
        "field_not_honoured",
        "suffix",
    )

    emb = [
        {
            "custom_id": "e0",
            "method": "POST",
            "url": "/v1/embeddings",
            "body": {"model": "tiny-llama", "input": ["hello there", "the sea"]},
        }
    ]
    batch = openai_client.batches.create(
        input_file_id=upload(openai_client, emb).id, endpoint="/v1/embeddings", completion_window="24h"
    )
    done = wait_status(openai_client, batch.id, ("completed", "failed"))
    (line,) = output(openai_client, done.output_file_id)
    sync = request(batch_server.url, "POST", "/v1/embeddings", emb[0]["body"]).json()
    assert line["response"]["body"]["data"] == sync["data"]
    assert line["response"]["headers"]["X-miLLM-Steering"] == "none"


def test_limits_and_bad_requests_are_openai_shaped_400s(batch_server, openai_client, settings):
    settings.BATCH_MAX_FILE_LINES = 3
    settings.BATCH_MAX_LINE_BYTES = 400
    settings.BATCH_MAX_FILE_BYTES = 1500
    cases = {
        "too_many_lines": [chat_line(i) for i in range(4)],
        "line_too_large": [chat_line(0, stop=["x" * 400])],
    }
    for code, rows in cases.items():
        with pytest.raises(openai.BadRequestError) as info:
            upload(openai_client, rows)
        assert info.value.status_code == 400 and info.value.code == code
        assert info.value.body["type"] == "invalid_request_error"
        assert info.value.body["param"] == "file"
    with pytest.raises(openai.BadRequestError) as info:
        openai_client.files.create(file=("big.jsonl", io.BytesIO(b"{}\n" * 600)), purpose="batch")
    assert info.value.code == "file_too_large"
    with pytest.raises(openai.BadRequestError) as info:
        openai_client.files.create(file=("x.jsonl", io.BytesIO(b"not json\n")), purpose="batch")
    assert info.value.code == "invalid_file"
    with pytest.raises(openai.BadRequestError) as info:
        openai_client.files.create(file=("x.jsonl", io.BytesIO(jsonl([chat_line(0)]))), purpose="fine-tune")
    assert (info.value.code, info.value.body["param"]) == ("invalid_file", "purpose")
    file = upload(openai_client, [chat_line(0)])
    with pytest.raises(openai.BadRequestError) as info:
        openai_client.batches.create(input_file_id=file.id, endpoint="/v1/moderations", completion_window="24h")
    assert info.value.body["param"] == "endpoint"
    with pytest.raises(openai.NotFoundError):
        openai_client.batches.create(
            input_file_id="file-nope", endpoint="/v1/chat/completions", completion_window="24h"
        )
    # malformed lines: the batch is created failed, its errors name the lines (OpenAI)
    rows = [chat_line(0), chat_line(0), {**chat_line(2), "url": "/v1/completions"}]
    batch = openai_client.batches.create(
        input_file_id=upload(openai_client, rows).id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    assert batch.status == "failed" and batch.failed_at
    assert [(e.code, e.line) for e in batch.errors.data] == [("duplicate_custom_id", 2), ("invalid_url", 3)]
    assert not BatchLine.objects.filter(batch_id=batch.id).exists()


def test_cancel_keeps_what_was_answered_and_ends_the_rest(batch_server, openai_client, settings):
    """The third line is held at the engine until the cancel is recorded: it is answered
    (a line at the engine finishes), no later line starts, and the batch ends
    ``cancelled`` with the 27 others in the error file as ``batch_cancelled``."""
    from core.runtime import runtime

    settings.BATCH_ENGINE_ROWS = 1
    rows = [chat_line(i) for i in range(30)]
    engine = GatedEngine(runtime().engine, hold=3)
    try:
        with runtime().replaced(engine=engine):
            batch = openai_client.batches.create(
                input_file_id=upload(openai_client, rows).id, endpoint="/v1/chat/completions", completion_window="24h"
            )
            assert engine.reached.wait(60), "the third line never reached the engine"
            assert BatchLine.objects.filter(batch_id=batch.id, status="done").count() == 2
            cancelling = openai_client.batches.cancel(batch.id)
            assert cancelling.status == "cancelling" and cancelling.cancelling_at
            engine.release.set()
            done = wait_status(openai_client, batch.id, TERMINAL, timeout_s=60)
    finally:
        engine.release.set()
    assert done.status == "cancelled" and done.cancelled_at, done
    assert engine.calls == 3  # no line started after the cancel
    answered = output(openai_client, done.output_file_id)
    ended = output(openai_client, done.error_file_id)
    assert [x["custom_id"] for x in answered] == ["req-0", "req-1", "req-2"]
    assert [x["custom_id"] for x in ended] == [f"req-{i}" for i in range(3, 30)]
    assert {x["error"]["code"] for x in ended} == {"batch_cancelled"}
    assert (done.request_counts.completed, done.request_counts.failed) == (3, 27)
    with pytest.raises(openai.ConflictError):
        openai_client.batches.cancel(
            wait_status(
                openai_client,
                (
                    openai_client.batches.create(
                        input_file_id=upload(openai_client, rows[:1]).id,
                        endpoint="/v1/chat/completions",
                        completion_window="24h",
                    )
                ).id,
                ("completed",),
            ).id
        )


def test_a_batch_waits_for_its_model_and_never_loads_it(batch_server, openai_client, settings):
    """The model named by the lines is not resident: nothing runs, nothing is loaded; once
    an operator loads it, the batch runs to the end."""
    rows = [{**chat_line(i), "body": {**chat_line(i)["body"], "model": "tiny-gemma2"}} for i in range(3)]
    batch = openai_client.batches.create(
        input_file_id=upload(openai_client, rows).id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    time.sleep(1.5)
    waiting = openai_client.batches.retrieve(batch.id)
    assert waiting.status == "in_progress" and waiting.request_counts.completed == 0
    assert batch_server.engine.status().model_id == "tiny-llama"  # no load was started
    model_resident(batch_server, "tiny-gemma2")
    done = wait_status(openai_client, batch.id, ("completed",), timeout_s=60)
    assert done.request_counts.completed == 3
    model_resident(batch_server, "tiny-llama")


def test_a_dead_runner_is_taken_over_without_repeating_a_line(batch_server, settings, monkeypatch):
    """The runner dies mid-batch (as with its web or Celery worker): the next one re-runs
    only the lines that were at the engine unanswered; every line is answered once."""
    from django.db import connections

    from batches import services
    from batches.runner import batch_run
    from core.runtime import runtime

    settings.BATCH_RUNNER_STALE_S = 1.0
    settings.BATCH_ENGINE_ROWS = 2
    monkeypatch.setattr(services, "enqueue", lambda *a, **k: None)  # this test runs it
    rows = [chat_line(i, max_tokens=12, ignore_eos=True) for i in range(10)]
    file = services.file_create(filename="in.jsonl", purpose="batch", content=jsonl(rows))
    batch = services.batch_create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h")
    engine = CountingEngine(runtime().engine)
    stop = threading.Event()
    with runtime().replaced(engine=engine):

        def run_first() -> None:
            try:
                batch_run(batch_id=batch.id, stop=stop)
            finally:
                connections.close_all()

        first = threading.Thread(target=run_first)
        first.start()
        deadline = time.monotonic() + 60
        while BatchLine.objects.filter(batch_id=batch.id, status="done").count() < 4:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        stop.set()  # dies: its lines at the engine stay claimed and unanswered
        first.join(30)
        before = {x.custom_id: x.answered_at for x in BatchLine.objects.filter(batch_id=batch.id, status="done")}
        orphaned = set(
            BatchLine.objects.filter(batch_id=batch.id, status="running").values_list("custom_id", flat=True)
        )
        assert 4 <= len(before) < 10
        # a second runner waits for the first one's heartbeat to go stale, then resumes
        assert batch_run(batch_id=batch.id) == "completed"
    lines = {x.custom_id: x for x in BatchLine.objects.filter(batch_id=batch.id)}
    assert all(x.status == "done" and x.status_code == 200 for x in lines.values())
    for custom_id, answered_at in before.items():
        assert lines[custom_id].answered_at == answered_at  # not answered again
    for row in rows:
        runs = engine.started[json.dumps(row["body"]["messages"])]
        expected = 2 if row["custom_id"] in orphaned else 1
        assert runs == expected, (row["custom_id"], runs, orphaned)
    done = Batch.objects.get(id=batch.id)
    assert (done.status, done.completed, done.failed) == ("completed", 10, 0)
    from batches.selectors import file_content
    from core.auth import ANONYMOUS

    out = [json.loads(x) for x in b"".join(file_content(file_id=done.output_file_id, principal=ANONYMOUS)).splitlines()]
    assert sorted(x["custom_id"] for x in out) == sorted(r["custom_id"] for r in rows)


def test_a_thousand_line_batch_answers_every_line_once(batch_server, openai_client):
    """Issue 18's size: 1,000 lines through the official client, each answered exactly
    once (the interactive time to first token beside such a batch is a benchmark,
    benchmarks/batch_ttft.py, in docs/performance.md — not a timed test)."""
    rows = [chat_line(i, max_tokens=1) for i in range(1000)]
    file = upload(openai_client, rows)
    batch = openai_client.batches.create(
        input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    done = wait_status(openai_client, batch.id, ("completed", "failed"), timeout_s=600)
    assert done.status == "completed", done
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (1000, 1000, 0)
    lines = output(openai_client, done.output_file_id)
    assert sorted(x["custom_id"] for x in lines) == sorted(f"req-{i}" for i in range(1000))
    assert len({x["id"] for x in lines}) == 1000  # one answer per line, none repeated
    assert all(x["response"]["status_code"] == 200 and x["error"] is None for x in lines)
    assert BatchLine.objects.filter(batch_id=done.id, status="done", attempts=1).count() == 1000
