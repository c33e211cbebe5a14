"""Stored responses end to end (issue 36), POST /v1/responses through the official
``openai`` client against the live daphne of tests/v1:

- a second ``responses.create(previous_response_id=…)`` answers as the equivalent chat
  request holding the whole conversation (the same greedy text); ``retrieve`` is what
  ``create`` answered; a deleted response cannot be continued; ``store=false`` keeps nothing;
- with keys on, another key can neither retrieve nor continue a response (404);
- ``background: true`` answers ``queued`` at once and ends as the synchronous request does
  (``completed``, or ``incomplete`` at max_output_tokens) with its text; ``cancel`` while the engine holds it ends it ``cancelled``
  with no output, and the engine is free again;
- a background response whose runner died (a server restart) is run again from the start
  and ends as the synchronous request does; one still queued when the server starts is run.
"""

from __future__ import annotations

import asyncio
import threading
import time
from datetime import timedelta
from typing import Any

import openai
import pytest
from django.utils import timezone

from inference.models import StoredResponse
from tests.v1.helpers import assert_openai_error, request, wait_for_status
from tests.fixtures.served import GatedEngine

pytestmark = pytest.mark.django_db(transaction=True)

MODEL = "tiny-llama"
GREEDY = {"temperature": 0, "max_output_tokens": 8}
TERMINAL = ("completed", "failed", "incomplete", "cancelled")


def wait_status(client: Any, response_id: str, statuses: tuple[str, ...] = TERMINAL, timeout_s: float = 120) -> Any:
    return wait_for_status(lambda: client.responses.retrieve(response_id), statuses, timeout_s, every_s=0.05)


def wait_released(response_id: str, timeout_s: float = 60) -> None:
    """Until no runner holds the response (its run has ended)."""
    deadline = time.monotonic() + timeout_s
    while StoredResponse.objects.filter(id=response_id, runner__isnull=False).exists():
        assert time.monotonic() < deadline, (
            f"the runner of {response_id} did not end",
            list(StoredResponse.objects.filter(id=response_id).values("status", "runner", "runner_seen_at", "body")),
        )
        time.sleep(0.05)


@pytest.fixture
def responses_server(llama):
    """tiny-llama resident; every background response ended after the test."""
    yield llama
    from inference.responses_store import response_cancel
    from monitoring.ownership import EVERYONE

    for row in StoredResponse.objects.filter(background=True, status__in=("queued", "in_progress")):
        response_cancel(row.id, EVERYONE)
    for row in StoredResponse.objects.filter(background=True):
        wait_released(row.id)


def test_a_chain_answers_as_the_whole_conversation(responses_server, openai_client):
    first = openai_client.responses.create(model=MODEL, input="The sky is", **GREEDY)
    # 8 tokens of a tiny model: it stops at max_output_tokens, which OpenAI calls incomplete
    assert first.status in ("completed", "incomplete") and first.output_text
    second = openai_client.responses.create(
        model=MODEL, input="And the sea is", previous_response_id=first.id, **GREEDY
    )
    chat = openai_client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "user", "content": "The sky is"},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "And the sea is"},
        ],
        temperature=0,
        max_tokens=8,
    )
    assert second.output_text == chat.choices[0].message.content
    assert second.previous_response_id == first.id
    # retrieve answers what create answered
    for made in (first, second):
        assert openai_client.responses.retrieve(made.id).model_dump() == made.model_dump()
    items = openai_client.responses.input_items.list(second.id, order="asc")
    assert [x.content[0].text for x in items.data] == ["And the sea is"]  # its own input only

    deleted = request(responses_server.base_url, "DELETE", f"/responses/{first.id}")
    assert deleted.json() == {"id": first.id, "object": "response", "deleted": True}
    with pytest.raises(openai.NotFoundError):
        openai_client.responses.retrieve(first.id)
    for previous in (first.id, second.id):  # itself, or a chain that runs through it
        answer = request(
            responses_server.base_url,
            "POST",
            "/responses",
            {"model": MODEL, "input": "more", "previous_response_id": previous, **GREEDY},
        )
        assert_openai_error(answer, 404, "response_not_found", "previous_response_id")

    unstored = openai_client.responses.create(model=MODEL, input="The sky is", store=False, **GREEDY)
    assert unstored.output_text == first.output_text
    with pytest.raises(openai.NotFoundError):
        openai_client.responses.retrieve(unstored.id)
    assert not StoredResponse.objects.filter(id=unstored.id).exists()


def test_another_key_can_neither_read_nor_continue_a_response(responses_server, keyed):
    alice, bob = keyed["alice"], keyed["bob"]
    mine = alice.responses.create(model=MODEL, input="Alice's secret is", **GREEDY)
    assert StoredResponse.objects.get(id=mine.id).owner == "key:alice"
    with pytest.raises(openai.NotFoundError) as info:
        bob.responses.create(model=MODEL, input="tell me", previous_response_id=mine.id, **GREEDY)
    assert info.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        bob.responses.retrieve(mine.id)
    assert StoredResponse.objects.filter(owner="key:bob").count() == 0  # bob's refusal stored nothing
    follow = alice.responses.create(model=MODEL, input="and", previous_response_id=mine.id, **GREEDY)
    assert follow.status in ("completed", "incomplete")


def test_background_is_queued_then_completed_as_the_synchronous_answer(responses_server, openai_client):
    queued = openai_client.responses.create(model=MODEL, input="Once upon a time", background=True, **GREEDY)
    assert queued.status == "queued" and queued.background and queued.output == []
    done = wait_status(openai_client, queued.id)
    assert done.status in ("completed", "incomplete"), done
    assert done.id == queued.id and done.created_at == queued.created_at and done.background
    sync = openai_client.responses.create(model=MODEL, input="Once upon a time", **GREEDY)
    assert done.output_text == sync.output_text and done.usage.output_tokens == sync.usage.output_tokens
    assert done.status == sync.status
    # it can be continued like any other, and cancelling it now is refused (it ended)
    assert openai_client.responses.create(model=MODEL, input="then", previous_response_id=done.id, **GREEDY).status
    assert_openai_error(
        request(responses_server.base_url, "POST", f"/responses/{done.id}/cancel"), 400, "invalid_parameter"
    )
    # background needs store (OpenAI), and is not streamed here
    for extra, param in (({"store": False}, "background"), ({"stream": True}, "stream")):
        answer = request(
            responses_server.base_url,
            "POST",
            "/responses",
            {"model": MODEL, "input": "x", "background": True, **extra, **GREEDY},
        )
        assert_openai_error(answer, 400, "invalid_parameter", param)
    assert StoredResponse.objects.count() == 3


def test_cancel_while_the_engine_holds_it_ends_cancelled_with_no_output(responses_server, openai_client):
    from core.runtime import runtime

    engine = GatedEngine(runtime().engine, hold=1)
    try:
        with runtime().replaced(engine=engine):
            queued = openai_client.responses.create(model=MODEL, input="Hold me", background=True, **GREEDY)
            assert engine.reached.wait(60), "the background response never reached the engine"
            assert openai_client.responses.retrieve(queued.id).status == "in_progress"
            cancelled = openai_client.responses.cancel(queued.id)
            assert cancelled.status == "cancelled"
            wait_released(queued.id)  # the runner saw the cancel and stopped its engine job
            engine.release.set()
            got = openai_client.responses.retrieve(queued.id)
            assert got.status == "cancelled" and got.output == [] and got.usage is None
            assert engine.calls == 1
            # the engine and the slots are free: the next request is answered
            after = openai_client.responses.create(model=MODEL, input="Hold me", **GREEDY)
            assert after.status in ("completed", "incomplete") and after.output_text
    finally:
        engine.release.set()
    assert openai_client.responses.cancel(queued.id).status == "cancelled"  # again: as it is
    assert openai_client.responses.retrieve(queued.id).output == []


def test_a_response_whose_runner_died_is_run_again(responses_server, openai_client, settings):
    from batches.sweeper import sweep_once
    from inference.responses_store import responses_resume

    sync = openai_client.responses.create(model=MODEL, input="A dead runner", **GREEDY)
    data = {"model": MODEL, "input": "A dead runner", "background": True, **GREEDY}
    # two background responses as a server that died left them: one in progress (its
    # runner's heartbeat stale), one still queued (its pool gone with the process)
    made = []
    for status, runner, seen in (
        ("in_progress", "dead:1:x", timezone.now() - timedelta(seconds=float(settings.BATCH_RUNNER_STALE_S) + 5)),
        ("queued", None, None),
    ):
        body = {**sync.model_dump(), "id": f"resp_dead{status}", "status": status, "output": [], "usage": None}
        StoredResponse.objects.create(
            id=body["id"],
            status=status,
            body={**body, "background": True},
            input_items=[],
            background=True,
            request=data,
            policy="refuse",
            runner=runner,
            runner_seen_at=seen,
        )
        made.append(body["id"])
    assert sweep_once()["responses_resumed"] == 1  # the one whose runner died
    assert StoredResponse.objects.get(id=made[0]).resumes == 1
    done = wait_status(openai_client, made[0])
    assert done.status == sync.status and done.output_text == sync.output_text
    # the start-up of an embedded server queues every one not finished
    assert responses_resume(force=True) == 1
    again = wait_status(openai_client, made[1])
    assert again.status == sync.status and again.output_text == sync.output_text


class StoppableEngine(GatedEngine):
    """GatedEngine whose held generation sets ``stopped`` when it is cancelled (its runner
    stopped it) before it ever reached the engine."""

    def __init__(self, inner, hold: int) -> None:  # noqa: ANN001
        super().__init__(inner, hold)
        self.stopped = threading.Event()

    async def _held(self, job):  # noqa: ANN001
        try:
            async for event in super()._held(job):
                yield event
        except asyncio.CancelledError:
            self.stopped.set()
            raise


def test_deleting_a_running_background_response_stops_it(responses_server, openai_client):
    from core.runtime import runtime

    engine = StoppableEngine(runtime().engine, hold=1)
    try:
        with runtime().replaced(engine=engine):
            queued = openai_client.responses.create(model=MODEL, input="Delete me", background=True, **GREEDY)
            assert engine.reached.wait(60), "the background response never reached the engine"
            deleted = request(responses_server.base_url, "DELETE", f"/responses/{queued.id}")
            assert deleted.json() == {"id": queued.id, "object": "response", "deleted": True}
            assert engine.stopped.wait(60), "the runner did not stop the deleted response's generation"
    finally:
        engine.release.set()
    responses_server.wait_idle()
    assert not StoredResponse.objects.filter(id=queued.id).exists()  # nothing written back
    with pytest.raises(openai.NotFoundError):
        openai_client.responses.retrieve(queued.id)


def test_an_attackers_background_request_is_refused_or_stored_never_a_500(responses_server):
    """Headers and bodies at their limits: a long lease, an unknown load policy, a huge
    metadata value; each is a 4xx in OpenAI's shape or a stored response, never a 500."""
    base = responses_server.base_url
    body = {"model": MODEL, "input": "x", "background": True, **GREEDY}
    for headers in ({"X-miLLM-Lease": "l" * 2000}, {"X-miLLM-Load-Policy": "never-heard-of"}):
        answer = request(base, "POST", "/responses", body, headers=headers)
        assert answer.status < 500, (headers, answer.body[:300])
        if answer.status >= 400:
            assert "error" in answer.json()
    for path in ("/responses/" + "r" * 5000, "/responses/" + "r" * 5000 + "/input_items?after=" + "a" * 5000):
        assert_openai_error(request(base, "GET", path), 404, "response_not_found")
