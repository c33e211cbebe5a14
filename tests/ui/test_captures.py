"""The captures page (issue 15, item 5): a capture stored through /v1 is listed; opening it
plots per-layer hidden-state norms and draws one head's attention token by token, and
both are checked against the test's own numpy computation from the downloaded file —
never against the page's code; delete asks first and removes it from /api/captures. The
page's safetensors reader is also checked on F16, BF16 and F32 files the test writes."""

from __future__ import annotations

import base64
import urllib.request

import numpy as np
import pytest

from gpu_engine.api.artifacts import load_capture
from tests.ui.conftest import screenshot
from tests.ui.test_pages import UNLABELLED

RTOL = 1e-9  # float64 in the page and here; only the order of the sums differs
ATOL = 1e-12
CAPTURE = {"layers": [0, 1, 2, 3], "positions": "all", "attention": {"layers": [1, 3], "positions": "prompt"}}


def _store_capture(server, content: str, capture: dict) -> tuple[str, str]:
    """(capture id, the response's id)."""
    status, out = server.call(
        "POST",
        "/v1/chat/completions",
        {
            "model": "tiny-llama",
            "max_tokens": 5,
            "temperature": 0,
            "ignore_eos": True,
            "messages": [{"role": "user", "content": content}],
            "capture": capture,
        },
        timeout=60,
    )
    assert status == 200, out
    obj = out["millm"]["capture"]
    assert obj["inline"] is False, obj  # the UI server stores every capture
    return obj["id"], out["id"]


def _download(server, capture_id: str) -> bytes:
    with urllib.request.urlopen(f"{server.url}/api/captures/{capture_id}/download", timeout=30) as response:
        return response.read()


def _listed(server) -> list[str]:
    return [c["id"] for c in server.api("GET", "/api/captures?limit=1000")["captures"]]


def _open(server, page, capture_id: str) -> None:
    page.goto(server.url + "/captures/")
    page.locator(f"#captures tr[data-capture-id='{capture_id}'] button", has_text="Open").click()
    page.wait_for_selector(f"#detail[data-state=ready][data-capture-id='{capture_id}']")


def _reference_attention(cap, layer: int, head: int) -> np.ndarray:
    """softmax(q·Kᵀ·scale) of one query head, causal, NaN where masked — from the file."""
    att = cap.meta["attention"]
    kv_head = head // (att["num_heads"] // att["num_kv_heads"])
    q = cap.q[layer][:, att["heads"].index(head), :].astype(np.float64)
    k = cap.k[layer][:, att["kv_heads"].index(kv_head), :].astype(np.float64)
    scores = q @ k.T * att["scaling"][str(layer)]
    masked = cap.k_positions[None, :] > cap.q_positions[:, None]
    scores[masked] = -np.inf
    weights = np.exp(scores - scores.max(axis=1, keepdims=True))
    weights /= weights.sum(axis=1, keepdims=True)
    weights[masked] = np.nan
    return weights


CELLS = """(sel) => [...document.querySelectorAll(sel)].map((td) =>
  [Number(td.dataset.q), Number(td.dataset.k), Number(td.dataset.value)])"""


def _heat_map(page, layer: int, head: int, cap) -> np.ndarray:
    page.select_option("#att-layer", str(layer))
    page.select_option("#att-head", str(head))
    page.wait_for_selector(f"#att-map[data-layer='{layer}'][data-head='{head}'] td")
    shown = np.full((len(cap.q_positions), len(cap.k_positions)), np.nan)
    q_row = {int(p): i for i, p in enumerate(cap.q_positions)}
    k_col = {int(p): j for j, p in enumerate(cap.k_positions)}
    for q, k, value in page.evaluate(CELLS, "#att-map td[data-value]"):
        shown[q_row[q], k_col[k]] = value
    return shown


def _check_norms(page, cap, layers: list[int]) -> None:
    """Every (row, layer) cell of the norm table and the plotted mean and highlighted
    lines equal the L2 norms of the file's rows, computed here."""
    expected = {layer: np.linalg.norm(cap.hidden[layer].astype(np.float64), axis=1) for layer in layers}
    cells = page.evaluate("""() => [...document.querySelectorAll(
        '#norm-table tbody td[data-norm]')].map((td) => [Number(td.closest('tr').dataset.row),
        Number(td.dataset.layer), Number(td.dataset.norm)])""")
    assert len(cells) == len(cap.positions) * len(layers)
    for r, layer, norm in cells:
        np.testing.assert_allclose(norm, expected[layer][r], rtol=RTOL, atol=ATOL)
    plotted = page.evaluate("""() => [...document.querySelectorAll('#norm-plot circle.dot.mean')]
        .map((c) => [Number(c.dataset.layer), Number(c.dataset.norm)])""")
    assert [layer for layer, _ in plotted] == layers
    for layer, norm in plotted:
        np.testing.assert_allclose(norm, expected[layer].mean(), rtol=RTOL, atol=ATOL)
    last = len(cap.positions) - 1  # the highlighted row by default
    chosen = page.evaluate("""() => [...document.querySelectorAll('#norm-plot circle.dot.chosen')]
        .map((c) => Number(c.dataset.norm))""")
    np.testing.assert_allclose(chosen, [expected[layer][last] for layer in layers], rtol=RTOL, atol=ATOL)


def test_norm_plot_and_heat_map_equal_the_downloaded_file(server, page):
    capture_id, response_id = _store_capture(server, "Show me where the attention goes.", CAPTURE)
    cap = load_capture(_download(server, capture_id))
    assert cap.meta["attention"]["num_kv_heads"] < cap.meta["attention"]["num_heads"]  # GQA
    _open(server, page, capture_id)
    row = page.locator(f"#captures tr[data-capture-id='{capture_id}']")
    assert response_id in row.inner_text()
    figures = page.inner_text("#detail-figures")
    assert response_id in figures and cap.meta["request_id"] in figures and "tiny-llama" in figures
    assert page.evaluate(UNLABELLED) == []  # the detail's selects too

    _check_norms(page, cap, CAPTURE["layers"])

    # the heat map of query head 1 (it reads KV head 0) at layer 3, cell by cell
    want = _reference_attention(cap, 3, 1)
    shown = _heat_map(page, 3, 1, cap)
    np.testing.assert_array_equal(np.isnan(shown), np.isnan(want))  # causal: same mask
    np.testing.assert_allclose(shown[~np.isnan(want)], want[~np.isnan(want)], rtol=RTOL, atol=ATOL)
    # labels: the token id at each key's position, from the sidecar
    tokens = cap.meta["prompt_token_ids"] + cap.meta["completion_token_ids"]
    labels = page.locator("#att-map thead th.key").all_inner_texts()
    assert labels == [f"{tokens[int(p)]}@{int(p)}" for p in cap.k_positions]
    screenshot(page, "captures-detail")
    # the check discriminates: head 0 and layer 1 are other maps, and the page follows
    assert not np.allclose(np.nan_to_num(want), np.nan_to_num(_reference_attention(cap, 3, 0)))
    for layer, head in ((3, 0), (1, 1)):
        shown = _heat_map(page, layer, head, cap)
        want = _reference_attention(cap, layer, head)
        np.testing.assert_allclose(shown[~np.isnan(want)], want[~np.isnan(want)], rtol=RTOL, atol=ATOL)
    page.console.assert_clean()


def test_a_tensor_parallel_capture_is_drawn_from_its_shards(server, page):
    """A capture written by two tensor-parallel vLLM ranks holds per-rank Q/K shards
    (docs/capture.md). The test re-packs a stored capture's file that way by hand — query
    head h on rank h, the one KV head on both — and the page's heat maps must equal the
    unsharded file's, computed here."""
    import json

    from safetensors.numpy import load, save

    from gpu_engine.api.artifacts import SIDECAR_KEY

    capture_id, _ = _store_capture(server, "Split the heads over two ranks.", CAPTURE)
    data = _download(server, capture_id)
    cap = load_capture(data)
    meta = cap.meta
    assert meta["attention"]["heads"] == [0, 1] and meta["attention"]["kv_heads"] == [0]
    tensors = load(data)
    for layer in CAPTURE["attention"]["layers"]:
        q, k = tensors.pop(f"q.{layer}"), tensors.pop(f"k.{layer}")
        for rank in (0, 1):
            tensors[f"q.{layer}.tp{rank}"] = np.ascontiguousarray(q[:, [rank]])
            tensors[f"k.{layer}.tp{rank}"] = np.ascontiguousarray(k[:, [0]])
    meta["attention"]["shards"] = [
        {"rank": 0, "heads": [0], "kv_heads": [0]},
        {"rank": 1, "heads": [1], "kv_heads": [0]},
    ]
    sharded = save(tensors, metadata={SIDECAR_KEY: json.dumps(meta)})
    merged = load_capture(sharded)  # the Python reader merges them back
    assert all(np.array_equal(merged.q[layer], cap.q[layer]) for layer in cap.q)
    stored = server.log.parent / "captures"  # the server's CAPTURE_DIR: the file and its sidecar
    (stored / f"{capture_id}.safetensors").write_bytes(sharded)
    (stored / f"{capture_id}.json").write_text(json.dumps(meta))
    assert _download(server, capture_id) == sharded
    _open(server, page, capture_id)
    for layer, head in ((3, 1), (3, 0), (1, 1)):
        want = _reference_attention(cap, layer, head)
        shown = _heat_map(page, layer, head, cap)
        np.testing.assert_array_equal(np.isnan(shown), np.isnan(want))
        np.testing.assert_allclose(shown[~np.isnan(want)], want[~np.isnan(want)], rtol=RTOL, atol=ATOL)
    page.console.assert_clean()


def test_the_form_captures_a_prompt_through_v1_and_opens_it(server, page):
    before = set(_listed(server))
    page.goto(server.url + "/captures/")
    page.wait_for_selector("#c-model option[value='tiny-llama']", state="attached")
    page.wait_for_function("document.querySelector('#c-layers').value === '0, 1, 2, 3'")
    page.fill("#c-prompt", "Capture me from the page.")
    page.fill("#c-layers", "1, 3")
    page.select_option("#c-positions", "completion")
    page.fill("#c-att-layers", "2")
    page.click("#c-send")
    page.wait_for_selector("#detail[data-state=ready]")
    capture_id = page.get_attribute("#detail", "data-capture-id")
    assert set(_listed(server)) - before == {capture_id}  # stored, and listed in the page
    page.wait_for_selector(f"#captures tr.selected[data-capture-id='{capture_id}']")
    cap = load_capture(_download(server, capture_id))
    assert cap.meta["layers"] == [1, 3] and cap.meta["positions"] == "completion"
    assert cap.meta["attention"]["layers"] == [2]
    assert cap.meta["prompt_token_ids"]  # the page's prompt went through the chat template
    _check_norms(page, cap, [1, 3])
    shown = _heat_map(page, 2, 0, cap)
    want = _reference_attention(cap, 2, 0)
    np.testing.assert_allclose(shown[~np.isnan(want)], want[~np.isnan(want)], rtol=RTOL, atol=ATOL)
    page.console.assert_clean()


def test_an_empty_max_tokens_is_said_not_replaced(server, page):
    sent = []
    page.on("request", lambda r: sent.append(r.url) if r.url.endswith("/v1/chat/completions") else None)
    page.goto(server.url + "/captures/")
    page.wait_for_selector("#c-model option[value='tiny-llama']", state="attached")
    page.fill("#c-prompt", "Capture me.")
    page.fill("#c-layers", "1")
    page.fill("#c-max", "")  # (0 or 600 the browser's own form check stops)
    page.click("#c-send")
    error = page.locator(".notice.error")
    error.wait_for()
    assert "Max tokens must be a whole number from 1 to 512 (it is empty)" in error.inner_text()
    assert page.get_attribute("#c-max", "aria-invalid") == "true" and sent == []


def test_delete_asks_first_and_removes_the_capture(server, page):
    capture_id, _ = _store_capture(server, "A capture to delete.", {"layers": [2], "positions": "last"})
    deletes: list[str] = []
    page.on("request", lambda r: deletes.append(r.url) if r.method == "DELETE" else None)
    page.goto(server.url + "/captures/")
    delete = page.locator(f"#captures tr[data-capture-id='{capture_id}'] button", has_text="Delete")
    page.once("dialog", lambda dialog: dialog.dismiss())
    delete.click()
    assert deletes == [] and capture_id in _listed(server)  # dismissed: nothing sent

    page.once("dialog", lambda dialog: dialog.accept())
    delete.click()
    page.wait_for_selector(f"#captures tr[data-capture-id='{capture_id}']", state="detached")
    assert capture_id not in _listed(server)
    status, body = server.call("GET", f"/api/captures/{capture_id}")
    assert status == 404 and body["error"]["code"] == "CAPTURE_NOT_FOUND"
    page.console.assert_clean()


READ = """async (b64) => {
  const { parseSafetensors } = await import('/static/ui/js/safetensors.js');
  const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
  const { tensors, metadata } = parseSafetensors(bytes.buffer);
  const out = {};
  for (const [name, t] of Object.entries(tensors)) {
    out[name] = { dtype: t.dtype, shape: t.shape, data: Array.from(t.data) };
  }
  return { tensors: out, metadata };
}"""


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_the_pages_safetensors_reader_widens_every_float_dtype(server, page, dtype):
    import torch
    from safetensors.torch import save

    torch_dtype = getattr(torch, dtype)
    info = torch.finfo(torch_dtype)
    special = torch.tensor(
        [0.0, -0.0, 1.0, -2.5, info.tiny, info.tiny / 4, info.max, -info.max, float("inf"), float("-inf")],
        dtype=torch.float64,
    )
    values = torch.cat(
        [special, torch.randn(3, 6, generator=torch.Generator().manual_seed(0), dtype=torch.float64).flatten()]
    ).to(torch_dtype)
    data = save(
        {"x": values.reshape(-1, 2), "ids": torch.arange(5, dtype=torch.int64) * 10**12},
        metadata={"note": "written by the test"},
    )
    page.goto(server.url + "/captures/")
    read = page.evaluate(READ, base64.b64encode(data).decode())
    assert read["metadata"] == {"note": "written by the test"}
    x = read["tensors"]["x"]
    assert x["dtype"] == {"float16": "F16", "bfloat16": "BF16", "float32": "F32"}[dtype]
    assert x["shape"] == [len(values) // 2, 2]
    assert x["data"] == values.to(torch.float64).tolist()  # exact, signed zero aside
    assert [np.signbit(v) for v in x["data"]] == [bool(np.signbit(v)) for v in values.to(torch.float64).tolist()]
    assert read["tensors"]["ids"]["data"] == [i * 10**12 for i in range(5)]
    page.console.assert_clean()
