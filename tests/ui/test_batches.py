"""The batches page (issue 18, item 4): a batch running on the served engine is listed and
its progress bar follows the server's counts as ``batch:progress`` events arrive — never
ahead of what ``GET /v1/batches/{id}`` says, moving through several values without the page
re-reading the list each time — and ends with the server's final counts; Cancel asks
first and the row ends ``cancelled`` with what the server answered."""

from __future__ import annotations

import json
import time
import urllib.request
import uuid

from tests.ui.conftest import screenshot

ROW = "#batches tr[data-batch-id='{id}']"
SHOWN = """(id) => {
  const tr = document.querySelector(`#batches tr[data-batch-id="${id}"]`);
  if (!tr) return null;
  const bar = tr.querySelector('progress');
  return {status: tr.dataset.status, completed: Number(tr.dataset.completed),
          failed: Number(tr.dataset.failed), total: Number(tr.dataset.total),
          bar: bar ? Number(bar.value) : null,
          text: tr.querySelector('.progress-cell span').textContent,
          cancel: Boolean(tr.querySelector('button.danger'))};
}"""


def _upload(server, lines: list[dict]) -> str:
    """POST /v1/files (multipart, purpose=batch); the file's id."""
    boundary = uuid.uuid4().hex
    content = "".join(json.dumps(x) + "\n" for x in lines).encode()
    body = (
        (
            f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; '
            f'filename="in.jsonl"\r\nContent-Type: application/jsonl\r\n\r\n'
        ).encode()
        + content
        + f"\r\n--{boundary}--\r\n".encode()
    )
    request = urllib.request.Request(server.url + "/v1/files", data=body, method="POST")
    request.add_header("Content-Type", f"multipart/form-data; boundary={boundary}")
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())["id"]


def _create(server, n: int, max_tokens: int) -> str:
    lines = [
        {
            "custom_id": f"ui-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "tiny-llama",
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "messages": [{"role": "user", "content": f"line {i}"}],
            },
        }
        for i in range(n)
    ]
    status, batch = server.call(
        "POST",
        "/v1/batches",
        {"input_file_id": _upload(server, lines), "endpoint": "/v1/chat/completions", "completion_window": "24h"},
    )
    assert status == 200, batch
    return batch["id"]


def _server_batch(server, batch_id: str) -> dict:
    status, batch = server.call("GET", f"/v1/batches/{batch_id}")
    assert status == 200, batch
    return batch


def test_the_progress_bar_follows_a_running_batch(server, page):
    lists: list[str] = []
    page.on(
        "request",
        lambda r: lists.append(r.url) if r.method == "GET" and r.url.split("?")[0].endswith("/v1/batches") else None,
    )
    page.goto(server.url + "/batches/")
    page.wait_for_function("document.querySelector('#ws-status').textContent.includes('live')")
    page.wait_for_selector("#batches tr", state="attached")
    n = 24
    # long enough lines that the run spans several PROGRESS_EVERY_S intervals however fast
    # the engine decodes (16 tokens a line finished in ~1 s once serial decoding got
    # faster: one event between 0 and n)
    batch_id = _create(server, n, max_tokens=96)
    page.wait_for_selector(ROW.format(id=batch_id))
    seen: list[dict] = []
    deadline = time.monotonic() + 300  # 2 shared cores: a loaded machine is slow
    while True:
        shown = page.evaluate(SHOWN, batch_id)
        after = _server_batch(server, batch_id)  # read after the page: never behind it
        done = after["request_counts"]["completed"] + after["request_counts"]["failed"]
        assert shown["completed"] + shown["failed"] <= done, (shown, after)
        assert shown["total"] == n
        assert shown["bar"] == (100 * (shown["completed"] + shown["failed"])) // n, shown
        seen.append(shown)
        if shown["status"] == "completed":
            break
        assert time.monotonic() < deadline, (shown, after)
        page.wait_for_timeout(100)
    final = _server_batch(server, batch_id)
    assert final["status"] == "completed"
    last = seen[-1]
    assert (last["completed"], last["failed"], last["total"]) == (
        final["request_counts"]["completed"],
        final["request_counts"]["failed"],
        n,
    )
    assert last["bar"] == 100 and last["text"].startswith(f"{n} of {n}")
    assert not last["cancel"]  # a finished batch cannot be cancelled
    values = [s["completed"] for s in seen]
    assert values == sorted(values)  # forward only
    moving = sorted({v for v in values if 0 < v < n})
    assert len(moving) >= 2, values  # the bar moved through the run, not just at its end
    # the moves came from batch:progress events: the page read the list a few times only
    # (at load, for the batch it had not listed yet, and for the finished batch's files)
    assert len(lists) <= 4, lists
    assert len(lists) < len(moving) + 2
    # the finished batch's output file, named by the list the page read again
    page.wait_for_selector(f"{ROW.format(id=batch_id)} [data-file=output][title='{final['output_file_id']}']")
    screenshot(page, "batches")
    page.console.assert_clean()


def test_cancel_asks_first_and_the_row_ends_cancelled(server, page):
    page.goto(server.url + "/batches/")
    page.wait_for_function("document.querySelector('#ws-status').textContent.includes('live')")
    batch_id = _create(server, 400, max_tokens=16)
    row = page.locator(ROW.format(id=batch_id))
    row.wait_for()
    asked: list[str] = []

    def answer(dialog):
        asked.append(dialog.message)
        if len(asked) == 1:
            dialog.dismiss()  # the first time: changed my mind
        else:
            dialog.accept()

    page.on("dialog", answer)
    row.get_by_role("button", name=f"Cancel batch {batch_id}").click()
    page.wait_for_timeout(300)
    assert len(asked) == 1 and batch_id in asked[0]
    assert _server_batch(server, batch_id)["status"] in ("validating", "in_progress")
    row.get_by_role("button", name=f"Cancel batch {batch_id}").click()
    page.wait_for_function(
        f"""(() => {{ const tr = document.querySelector(
        "{ROW.format(id=batch_id)}"); return tr && tr.dataset.status === 'cancelled'; }})()""",
        timeout=60_000,
    )
    final = _server_batch(server, batch_id)
    assert final["status"] == "cancelled"
    shown = page.evaluate(SHOWN, batch_id)
    assert (shown["completed"], shown["failed"]) == (
        final["request_counts"]["completed"],
        final["request_counts"]["failed"],
    )
    assert final["request_counts"]["completed"] < 400 and not shown["cancel"]
    page.console.assert_clean()
