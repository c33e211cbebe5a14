"""Stored responses of the Responses API (issue 36), against the live daphne of tests/v1
with the official ``openai`` client and raw HTTP:

- a stored response is retrieved as it was answered, its input items listed and paged
  as OpenAI's list, deleted (then a 404, and a 404 to chain to);
- with keys on, another key can neither retrieve, delete, cancel, list nor chain to it
  (one 404, as an unknown id, and nothing changes); an admin key sees it;
- ``store: false`` keeps nothing; a response past RESPONSES_MAX_STORED_BYTES is refused and
  nothing is kept; the sweeper deletes what is older than RESPONSES_RETENTION_DAYS;
- a chain is walked oldest first, at most CHAIN_MAX_DEPTH links, never into a response
  still running;
- a background response whose runner died is resumed, or failed after BATCH_MAX_RESUMES.

The end-to-end runs (chaining through POST /v1/responses, background runs and their
cancel) are in tests/v1/test_responses_background.py.
"""

from __future__ import annotations

import time
import uuid
from datetime import timedelta
from typing import Any

import openai
import pytest
from asgiref.sync import async_to_sync
from django.utils import timezone

from inference.errors import OpenAIError
from inference.models import StoredResponse
from inference.responses_store import (
    CHAIN_MAX_DEPTH,
    load_chain,
    save_response,
    save_response_sync,
)
from monitoring.ownership import Scope
from tests.v1.helpers import assert_openai_error, request

pytestmark = pytest.mark.django_db(transaction=True)

ANON = Scope()
ALICE = Scope(owner="key:alice", all=False)
BOB = Scope(owner="key:bob", all=False)


def user_item(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


def response_body(text: str, previous: str | None = None, **fields: Any) -> dict[str, Any]:
    """A Response object as POST /v1/responses answers one (OpenAI's fields)."""
    return {
        "id": f"resp_{uuid.uuid4().hex}",
        "object": "response",
        "created_at": int(time.time()),
        "status": "completed",
        "background": False,
        "error": None,
        "incomplete_details": None,
        "instructions": None,
        "max_output_tokens": None,
        "model": "tiny-llama",
        "output": [
            {
                "type": "message",
                "id": f"msg_{uuid.uuid4().hex}",
                "status": "completed",
                "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": []}],
            }
        ],
        "parallel_tool_calls": True,
        "previous_response_id": previous,
        "store": True,
        "temperature": 0.0,
        "text": {"format": {"type": "text"}},
        "tool_choice": "auto",
        "tools": [],
        "top_p": 1.0,
        "truncation": "disabled",
        "usage": {"input_tokens": 3, "output_tokens": 2, "total_tokens": 5},
        "metadata": {},
        **fields,
    }


def stored(scope: Scope, question: str, answer: str, previous: str | None = None) -> dict[str, Any]:
    body = response_body(answer, previous)
    save_response_sync(body, [user_item(question)], scope, store=True)
    return body


def test_retrieve_page_and_delete_through_the_official_client(v1_server, openai_client):
    items = [user_item(f"question {i}") for i in range(5)]
    body = response_body("an answer")
    async_to_sync(save_response)(body, items, ANON, store=True)

    got = openai_client.responses.retrieve(body["id"])
    assert got.model_dump(exclude_unset=True) == body
    # input items: ids given to each, listed newest first by default, then paged
    ids = [x["id"] for x in StoredResponse.objects.get(id=body["id"]).input_items]
    assert len(set(ids)) == 5 and all(i.startswith("msg_") for i in ids)
    page = openai_client.responses.input_items.list(body["id"])
    assert [x.id for x in page.data] == ids[::-1]
    assert [x.content[0].text for x in page.data] == [f"question {i}" for i in range(4, -1, -1)]
    first = openai_client.responses.input_items.list(body["id"], order="asc", limit=2)
    assert [x.id for x in first.data] == ids[:2] and first.has_more and first.last_id == ids[1]
    rest = openai_client.responses.input_items.list(body["id"], order="asc", limit=2, after=ids[1])
    assert [x.id for x in rest.data] == ids[2:4] and rest.has_more
    last = openai_client.responses.input_items.list(body["id"], order="asc", limit=2, after=ids[3])
    assert [x.id for x in last.data] == ids[4:] and not last.has_more
    # the client's own pager walks every page
    assert [x.id for x in openai_client.responses.input_items.list(body["id"], order="asc", limit=2)] == ids
    raw = request(v1_server.base_url, "GET", f"/responses/{body['id']}/input_items?order=desc&limit=1")
    assert raw.status == 200 and raw.json() == {
        "object": "list",
        "data": [StoredResponse.objects.get(id=body["id"]).input_items[-1]],
        "first_id": ids[-1],
        "last_id": ids[-1],
        "has_more": True,
    }

    assert openai_client.responses.delete(body["id"]) is None  # the client reads no body
    with pytest.raises(openai.NotFoundError) as info:
        openai_client.responses.retrieve(body["id"])
    assert info.value.body["code"] == "response_not_found"
    with pytest.raises(OpenAIError) as chain:
        async_to_sync(load_chain)(body["id"], ANON)
    assert (chain.value.status, chain.value.code, chain.value.param) == (
        404,
        "response_not_found",
        "previous_response_id",
    )
    assert not StoredResponse.objects.exists()


def test_delete_answers_openais_deleted_object_and_bad_queries_are_400s(v1_server):
    body = stored(ANON, "q", "a")
    base = v1_server.base_url
    for query, param in (
        ("limit=0", "limit"),
        ("limit=101", "limit"),
        ("limit=two", "limit"),
        ("order=up", "order"),
        ("after=msg_nothere", "after"),
        ("include=file_search_call.results", "include"),
    ):
        assert_openai_error(
            request(base, "GET", f"/responses/{body['id']}/input_items?{query}"), 400, "invalid_parameter", param
        )
    for query, param in (("stream=true", "stream"), ("starting_after=3", "starting_after")):
        assert_openai_error(request(base, "GET", f"/responses/{body['id']}?{query}"), 400, "invalid_parameter", param)
    assert_openai_error(request(base, "PUT", f"/responses/{body['id']}", {}), 405, "method_not_allowed")
    # a response that was not created with background=true cannot be cancelled (OpenAI)
    assert_openai_error(request(base, "POST", f"/responses/{body['id']}/cancel"), 400, "invalid_parameter")
    assert StoredResponse.objects.get(id=body["id"]).status == "completed"
    deleted = request(base, "DELETE", f"/responses/{body['id']}")
    assert deleted.status == 200 and deleted.json() == {"id": body["id"], "object": "response", "deleted": True}
    for method, path in (("GET", ""), ("DELETE", ""), ("POST", "/cancel"), ("GET", "/input_items")):
        assert_openai_error(request(base, method, f"/responses/{body['id']}{path}"), 404, "response_not_found")


def test_another_keys_response_is_a_404_everywhere_and_unchanged(keyed):
    alice, bob, root = keyed["alice"], keyed["bob"], keyed["root"]
    mine = stored(ALICE, "alice asks", "alice's answer")
    running = response_body("", status="in_progress", background=True, output=[], usage=None)
    save_response_sync(running, [user_item("alice waits")], ALICE, store=True)
    StoredResponse.objects.filter(id=running["id"]).update(status="in_progress", background=True)
    before = {row.id: (row.status, row.body, row.input_items) for row in StoredResponse.objects.all()}
    for response_id in (mine["id"], running["id"]):
        for attempt in (
            lambda rid=response_id: bob.responses.retrieve(rid),
            lambda rid=response_id: bob.responses.delete(rid),
            lambda rid=response_id: bob.responses.cancel(rid),
            lambda rid=response_id: bob.responses.input_items.list(rid),
        ):
            with pytest.raises(openai.NotFoundError) as info:
                attempt()
            assert info.value.body["code"] == "response_not_found"
        # chaining to it is the same 404 as an unknown id
        with pytest.raises(OpenAIError) as chain:
            async_to_sync(load_chain)(response_id, BOB)
        with pytest.raises(OpenAIError) as nothing:
            async_to_sync(load_chain)(f"resp_{uuid.uuid4().hex}", BOB)
        assert (chain.value.status, chain.value.code, chain.value.param) == (
            nothing.value.status,
            nothing.value.code,
            nothing.value.param,
        )
    assert {row.id: (row.status, row.body, row.input_items) for row in StoredResponse.objects.all()} == before
    # the owner and an admin key see it; the owner's chain is whole
    assert alice.responses.retrieve(mine["id"]).id == mine["id"]
    assert root.responses.retrieve(mine["id"]).id == mine["id"]
    assert [x.get("role") for x in async_to_sync(load_chain)(mine["id"], ALICE)] == ["user", "assistant"]
    # the owner cancels its background response; the answer is the stored object
    cancelled = alice.responses.cancel(running["id"])
    assert cancelled.status == "cancelled" and alice.responses.retrieve(running["id"]).status == "cancelled"
    assert alice.responses.cancel(running["id"]).status == "cancelled"  # again: as it is
    alice.responses.delete(mine["id"])
    assert not StoredResponse.objects.filter(id=mine["id"]).exists()


def test_chain_is_walked_oldest_first_within_its_depth(v1_server):
    first = stored(ANON, "one", "uno")
    second = stored(ANON, "two", "dos", previous=first["id"])
    third = stored(ANON, "three", "tres", previous=second["id"])
    items = async_to_sync(load_chain)(third["id"], ANON)
    texts = [(x["role"], x["content"][0]["text"]) for x in items]
    assert texts == [
        ("user", "one"),
        ("assistant", "uno"),
        ("user", "two"),
        ("assistant", "dos"),
        ("user", "three"),
        ("assistant", "tres"),
    ]
    # a deleted link in the middle breaks the chain with a 404 naming it
    StoredResponse.objects.filter(id=second["id"]).delete()
    with pytest.raises(OpenAIError) as info:
        async_to_sync(load_chain)(third["id"], ANON)
    assert info.value.status == 404 and second["id"] in info.value.message

    chain: list[str] = []
    for i in range(CHAIN_MAX_DEPTH + 1):
        chain.append(stored(ANON, f"q{i}", f"a{i}", previous=chain[-1] if chain else None)["id"])
    # CHAIN_MAX_DEPTH responses are followed; one more is refused
    items = async_to_sync(load_chain)(chain[CHAIN_MAX_DEPTH - 1], ANON)
    assert [x["content"][0]["text"] for x in items[::2]] == [f"q{i}" for i in range(CHAIN_MAX_DEPTH)]
    with pytest.raises(OpenAIError) as deep:
        async_to_sync(load_chain)(chain[-1], ANON)
    assert (deep.value.status, deep.value.param) == (400, "previous_response_id")
    assert str(CHAIN_MAX_DEPTH) in deep.value.message


def test_store_false_and_the_size_cap_keep_nothing(v1_server, settings):
    body = response_body("not kept")
    async_to_sync(save_response)(body, [user_item("q")], ANON, store=False)
    assert not StoredResponse.objects.exists()
    assert request(v1_server.base_url, "GET", f"/responses/{body['id']}").status == 404

    settings.RESPONSES_MAX_STORED_BYTES = 4096
    big = response_body("x" * 5000)
    with pytest.raises(OpenAIError) as info:
        async_to_sync(save_response)(big, [user_item("q")], ANON, store=True)
    assert (info.value.status, info.value.code) == (400, "response_too_large")
    assert "RESPONSES_MAX_STORED_BYTES" in info.value.message
    assert not StoredResponse.objects.exists()
    small = response_body("y" * 100)
    async_to_sync(save_response)(small, [user_item("q")], ANON, store=True)
    assert StoredResponse.objects.filter(id=small["id"]).exists()


def test_the_sweeper_deletes_responses_past_the_retention(v1_server, settings):
    from batches.sweeper import sweep_once

    old, fresh = stored(ANON, "old", "a"), stored(ANON, "fresh", "b")
    StoredResponse.objects.filter(id=old["id"]).update(created_at=timezone.now() - timedelta(days=31))
    settings.RESPONSES_RETENTION_DAYS = 0  # kept until deleted
    assert sweep_once()["responses_expired"] == 0
    assert StoredResponse.objects.count() == 2
    settings.RESPONSES_RETENTION_DAYS = 30
    assert sweep_once()["responses_expired"] == 1
    assert list(StoredResponse.objects.values_list("id", flat=True)) == [fresh["id"]]
    assert request(v1_server.base_url, "GET", f"/responses/{old['id']}").status == 404


def test_a_running_response_cannot_be_continued_and_a_dead_runner_is_failed(v1_server, settings):
    from batches.sweeper import sweep_once

    body = response_body("", status="in_progress", background=True, output=[], usage=None)
    save_response_sync(body, [user_item("q")], ANON, store=True)
    stale = timezone.now() - timedelta(seconds=float(settings.BATCH_RUNNER_STALE_S) + 5)
    StoredResponse.objects.filter(id=body["id"]).update(
        status="in_progress",
        background=True,
        runner="gone:1:x",
        runner_seen_at=stale,
        resumes=int(settings.BATCH_MAX_RESUMES),
    )
    with pytest.raises(OpenAIError) as info:
        async_to_sync(load_chain)(body["id"], ANON)
    assert (info.value.status, info.value.param) == (400, "previous_response_id")
    # its runner died once too often: failed, with OpenAI's error object
    assert sweep_once()["responses_failed"] == 1
    got = request(v1_server.base_url, "GET", f"/responses/{body['id']}").json()
    assert got["status"] == "failed" and got["error"]["code"] == "response_runner_failed"
    assert StoredResponse.objects.get(id=body["id"]).runner is None
    # a live runner's response is left alone
    live = response_body("", status="in_progress", background=True, output=[], usage=None)
    save_response_sync(live, [user_item("q")], ANON, store=True)
    StoredResponse.objects.filter(id=live["id"]).update(
        status="in_progress", background=True, runner="alive:1:x", runner_seen_at=timezone.now()
    )
    assert sweep_once()["responses_failed"] == 0
    assert StoredResponse.objects.get(id=live["id"]).status == "in_progress"


def test_a_cancel_that_lands_while_the_answer_comes_wins(v1_server):
    """The runner's answer arrives after the cancel was recorded: nothing of it is kept,
    and the runner's claim ends (nothing waits for its heartbeat)."""
    from inference.responses_runner import finish, take_over
    from inference.responses_store import response_cancel

    body = response_body("", status="queued", background=True, output=[], usage=None)
    save_response_sync(body, [user_item("q")], ANON, store=True)
    StoredResponse.objects.filter(id=body["id"]).update(status="queued", background=True)
    row = take_over(response_id=body["id"], runner="me:1:x")
    assert row is not None and row.status == "in_progress"
    assert take_over(response_id=body["id"], runner="other:1:y") is None  # one runner at a time
    assert response_cancel(body["id"], ANON)["status"] == "cancelled"
    answered = response_body("the answer nobody wants")
    assert finish(response_id=body["id"], runner="me:1:x", body=answered) is False
    row = StoredResponse.objects.get(id=body["id"])
    assert (row.status, row.runner, row.body["output"], row.body["usage"]) == ("cancelled", None, [], None)


def test_the_admin_lists_stored_responses_read_only(v1_server, staff_client):
    body = stored(ALICE, "admin sees", "this")
    listing = staff_client.get("/admin/inference/storedresponse/")
    assert listing.status_code == 200 and body["id"].encode() in listing.content
    page = staff_client.get(f"/admin/inference/storedresponse/{body['id']}/change/")
    assert page.status_code == 200 and b"key:alice" in page.content
    assert staff_client.get("/admin/inference/storedresponse/add/").status_code == 403
    # a POST to the change page changes nothing
    staff_client.post(f"/admin/inference/storedresponse/{body['id']}/change/", {"owner": "key:bob", "status": "failed"})
    row = StoredResponse.objects.get(id=body["id"])
    assert (row.owner, row.status) == ("key:alice", "completed")
