"""Files and batches across keys, quotas, memory and dying runners (issue 31, items 6, 7,
10 and 11), against the live daphne of tests/v1 with the official ``openai`` client:

- one key's file or batch is a 404 for another key (retrieve, content, delete, cancel,
  a batch made from it) and is never listed; the owner's object is untouched; an admin
  key sees everything; a batch's output files are its owner's;
- an upload past the per-key or the total quota is refused (413 files_quota_exceeded,
  507 insufficient_storage) and stores nothing;
- creating a batch from a file of many MiB, and writing its output, keeps the peak of
  Python's allocations within a few chunks (tracemalloc; computed, not timed);
- a runner process killed mid-batch (SIGKILL) is swept: the batch is resumed and ends
  ``completed``; a batch past its window that no runner holds ends ``expired``; one left
  ``finalizing`` by a dead finalizer ends; one whose runners keep dying ends ``failed``.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
import tracemalloc
from datetime import timedelta
from typing import Any

import openai
import pytest
from django.utils import timezone

from batches.models import Batch, BatchLine, File, FileChunk
from tests.served import database_url
from tests.v1.conftest import _v1_db, keyed, llama, openai_client, v1_server  # noqa: F401
from tests.v1.test_batches import TERMINAL, batch_server, chat_line, jsonl, upload, wait_status  # noqa: F401

pytestmark = pytest.mark.django_db(transaction=True)


def test_one_keys_files_and_batches_are_a_404_for_another(batch_server, keyed):  # noqa: F811
    alice, bob, root = keyed["alice"], keyed["bob"], keyed["root"]
    rows = [chat_line(i) for i in range(3)]
    file = upload(alice, rows)
    bobs = upload(bob, rows[:1])
    assert File.objects.get(id=file.id).owner == "key:alice"
    # bob can neither read, list, delete nor use alice's file
    for attempt in (
        lambda: bob.files.retrieve(file.id),
        lambda: bob.files.content(file.id),
        lambda: bob.files.delete(file.id),
        lambda: bob.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"),
    ):
        with pytest.raises(openai.NotFoundError) as info:
            attempt()
        assert info.value.status_code == 404 and file.id in info.value.message
    assert [f.id for f in bob.files.list()] == [bobs.id]
    with pytest.raises(openai.NotFoundError):  # nor page after it
        bob.files.list(after=file.id)
    assert File.objects.filter(id=file.id, complete=True).exists()  # nothing happened
    assert not Batch.objects.exists()
    assert alice.files.content(file.id).content == jsonl(rows)

    batch = alice.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h")
    for attempt in (lambda: bob.batches.retrieve(batch.id), lambda: bob.batches.cancel(batch.id)):
        with pytest.raises(openai.NotFoundError):
            attempt()
    assert batch.id not in [b.id for b in bob.batches.list()]
    done = wait_status(alice, batch.id, TERMINAL)
    assert done.status == "completed" and done.cancelling_at is None  # bob's cancel did nothing
    out = done.output_file_id
    assert File.objects.get(id=out).owner == "key:alice"  # the output is the batch owner's
    for attempt in (lambda: bob.files.retrieve(out), lambda: bob.files.content(out)):
        with pytest.raises(openai.NotFoundError):
            attempt()
    assert out not in [f.id for f in bob.files.list()]
    assert len(alice.files.content(out).content.splitlines()) == 3
    # an admin key sees and reads everything
    assert {file.id, bobs.id, out} <= {f.id for f in root.files.list()}
    assert root.batches.retrieve(batch.id).id == batch.id
    assert root.files.content(out).content == alice.files.content(out).content


def test_uploads_past_a_quota_are_refused_and_store_nothing(
    batch_server,
    keyed,  # noqa: F811
    settings,
):
    alice, bob = keyed["alice"], keyed["bob"]
    rows = [chat_line(i) for i in range(4)]
    size = len(jsonl(rows))
    settings.FILES_MAX_BYTES_PER_OWNER = 2 * size + 10
    settings.FILES_MAX_BYTES_TOTAL = 0
    upload(alice, rows)
    upload(alice, rows)
    before = (File.objects.count(), FileChunk.objects.count())
    with pytest.raises(openai.APIStatusError) as info:
        upload(alice, rows)
    assert info.value.status_code == 413
    assert info.value.code == "files_quota_exceeded" and info.value.body["param"] == "file"
    assert "FILES_MAX_BYTES_PER_OWNER" in info.value.message
    assert (File.objects.count(), FileChunk.objects.count()) == before
    upload(bob, rows)  # a quota per key: bob's is untouched
    # the server's total: what all keys hold together
    settings.FILES_MAX_BYTES_PER_OWNER = 0
    settings.FILES_MAX_BYTES_TOTAL = 4 * size
    before = (File.objects.count(), FileChunk.objects.count())
    with pytest.raises(openai.InternalServerError) as info:
        upload(bob, rows + rows)
    assert info.value.status_code == 507 and info.value.code == "insufficient_storage"
    assert "FILES_MAX_BYTES_TOTAL" in info.value.message
    assert (File.objects.count(), FileChunk.objects.count()) == before
    upload(bob, rows)  # what still fits is taken
    assert File.objects.filter(owner="key:bob").count() == 2


def test_creating_and_finalizing_a_batch_holds_a_few_chunks_not_the_file(
    v1_server,  # noqa: F811
    monkeypatch,
):
    """A 16 MiB input file becomes a batch, and as many answers become its output file,
    with Python's peak allocation under 12 chunks (3 MiB, a fifth of the file): the whole
    file parsed at once took about 24 times its size."""
    from batches import services

    monkeypatch.setattr(services, "enqueue", lambda *a, **k: None)  # no runner: we finalize
    filler = "x" * 1500
    rows = [{**chat_line(i), "body": {**chat_line(i)["body"], "user": filler}} for i in range(11000)]
    content = jsonl(rows)
    assert len(content) > 16 * 1024 * 1024
    limit = 12 * services.CHUNK_BYTES

    stream = io.BytesIO(content)  # the upload, as Django spools it: a file, not memory
    del content, rows
    tracemalloc.start()
    try:
        file = services.file_create(filename="big.jsonl", purpose="batch", content=stream)
        _, peak_upload = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        batch = services.batch_create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h")
        _, peak_create = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert batch.status == "in_progress" or batch.status == "validating"
    assert BatchLine.objects.filter(batch_id=batch.id).count() == 11000
    assert peak_upload < limit, peak_upload
    assert peak_create < limit, peak_create

    # every line answered with a 1.5 KB body: the output is written a chunk at a time
    answer = {"object": "chat.completion", "choices": [{"message": {"content": filler}}]}
    BatchLine.objects.filter(batch_id=batch.id).update(status="done", status_code=200, response=answer, headers={})
    tracemalloc.start()
    try:
        done = services.batch_finalize(batch_id=batch.id, outcome="completed")
        _, peak_finalize = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert done.status == "completed"
    out = File.objects.get(id=done.output_file_id)
    assert out.lines == 11000 and out.bytes > 16 * 1024 * 1024
    assert peak_finalize < limit, peak_finalize
    assert FileChunk.objects.filter(file=out).count() == -(-out.bytes // services.CHUNK_BYTES)


def test_a_killed_runner_process_is_swept_and_its_batch_completes(
    batch_server,  # noqa: F811
    openai_client,
    settings,
    tmp_path,
):
    """A runner in another process (its own engine, on which the model is not resident:
    it waits, beating its heartbeat) is SIGKILLed. The sweeper finds its heartbeat stale
    and queues a new runner (here: this server's), which answers every line."""
    from django.db import connection

    from batches import services
    from tests.conftest import REPO

    if connection.vendor != "postgresql":
        pytest.skip("another process shares the database only on PostgreSQL")
    settings.BATCH_RUNNER_STALE_S = 1.0
    rows = [chat_line(i) for i in range(3)]
    file = upload(openai_client, rows)
    with pytest.MonkeyPatch.context() as patch:  # the runner is the other process
        patch.setattr(services, "enqueue", lambda *a, **k: None)
        batch = openai_client.batches.create(
            input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "TMPDIR", "PYTHONPATH")}
    env.update(
        {
            "DATABASE_URL": database_url(),
            "SECRET_KEY": "x" * 50,
            "MILLM_ENV_FILE": "/nonexistent/.env",
            "MILLM_DATA_DIR": str(tmp_path),
            "BATCH_RUNNER_STALE_S": "1",
            "MILLM_ENGINE_DEVICE": "cpu",
        }
    )
    code = f"import django; django.setup(); from batches.runner import batch_run; batch_run(batch_id={batch.id!r})"
    runner = subprocess.Popen(
        [sys.executable, str(REPO / "manage.py"), "shell", "-c", code],
        env=env,
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while not (Batch.objects.filter(id=batch.id, runner__contains=f":{runner.pid}:").exists()):
            assert runner.poll() is None, "the runner process ended on its own"
            assert time.monotonic() < deadline, "the other process never took the batch"
            time.sleep(0.1)
        time.sleep(1.5)  # it holds the batch, beating
        held = Batch.objects.get(id=batch.id)
        assert held.status == "in_progress" and held.completed == 0
    finally:
        runner.send_signal(signal.SIGKILL)
        runner.wait(30)
    time.sleep(1.2)  # its heartbeat goes stale
    done = services.batches_sweep()
    assert done["resumed"] == 1, done
    finished = wait_status(openai_client, batch.id, TERMINAL, timeout_s=120)
    assert finished.status == "completed", finished
    assert (finished.request_counts.completed, finished.request_counts.failed) == (3, 0)
    assert Batch.objects.get(id=batch.id).resumes == 1


def test_sweeper_ends_expired_stuck_and_hopeless_batches(
    batch_server,
    openai_client,  # noqa: F811
    settings,
    monkeypatch,
):
    from batches import services

    settings.BATCH_RUNNER_STALE_S = 1.0
    settings.BATCH_MAX_RESUMES = 2
    monkeypatch.setattr(services, "enqueue", lambda *a, **k: None)  # no runner ever comes

    def make(n: int) -> str:
        file = upload(openai_client, [chat_line(i) for i in range(n)])
        return openai_client.batches.create(
            input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"
        ).id

    long_ago = timezone.now() - timedelta(seconds=30)
    # 1. its window is over and no runner holds it: expired, every line batch_expired
    expired = make(3)
    Batch.objects.filter(id=expired).update(expires_at=timezone.now() - timedelta(seconds=1))
    # 2. a runner that died while finalizing (two lines answered, one never)
    stuck = make(3)
    Batch.objects.filter(id=stuck).update(
        status="finalizing", runner="dead:1:x", runner_seen_at=long_ago, finalizing_at=long_ago, in_progress_at=long_ago
    )
    lines = list(BatchLine.objects.filter(batch_id=stuck).order_by("line"))
    for line in lines[:2]:
        services.batch_line_answer(line_id=line.id, status_code=200, response={"object": "chat.completion"}, headers={})
    # 3. its runners keep dying: resumed BATCH_MAX_RESUMES times, then failed
    hopeless = make(2)
    # 4. alive: a fresh heartbeat is left alone
    alive = make(2)
    Batch.objects.filter(id=alive).update(
        status="in_progress", runner="live:1:x", runner_seen_at=timezone.now() + timedelta(hours=1)
    )

    for resume in range(3):
        Batch.objects.filter(id=hopeless).update(status="in_progress", runner=f"dead:{resume}", runner_seen_at=long_ago)
        services.batches_sweep()
    got = {b: openai_client.batches.retrieve(b) for b in (expired, stuck, hopeless, alive)}
    assert got[expired].status == "expired" and got[expired].expired_at
    assert [x["error"]["code"] for x in _lines(openai_client, got[expired].error_file_id)] == ["batch_expired"] * 3
    assert got[stuck].status == "completed"
    assert len(_lines(openai_client, got[stuck].output_file_id)) == 2
    assert [x["error"]["code"] for x in _lines(openai_client, got[stuck].error_file_id)] == ["batch_failed"]
    assert got[hopeless].status == "failed" and got[hopeless].failed_at
    assert got[hopeless].errors.data[0].code == "batch_runner_failed"
    assert Batch.objects.get(id=hopeless).resumes == 2
    assert got[alive].status == "in_progress"
    Batch.objects.filter(id=alive).update(runner=None)  # let the fixture cancel it


def _lines(client, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(x) for x in client.files.content(file_id).content.splitlines()]
