"""What the pages that start runs (dashboards, experiments) share in their tests: the runs
table's row, a recorder of every value its progress bars show, and a server of a test's
own with tiny-llama loaded and its layer-1 SAE attached."""

from __future__ import annotations

from typing import Any

ROW = "#runs tr[data-run-id='{id}']"
# every value the run's bar shows, recorded in the page as the rows change
RECORD = """() => {
  window.__bars = [];
  const seen = () => {
    for (const tr of document.querySelectorAll('#runs tr[data-run-id]')) {
      const bar = tr.querySelector('progress');
      window.__bars.push([tr.dataset.runId, tr.dataset.status, bar ? Number(bar.value) : null]);
    }
  };
  new MutationObserver(seen).observe(document.querySelector('#runs'), {childList: true, subtree: true});
}"""


def completed_row(page: Any, run_id: str) -> Any:
    """The run's row, once it shows the run completed (within 240 s)."""
    row = page.locator(ROW.format(id=run_id))
    row.wait_for()
    page.wait_for_selector(ROW.format(id=run_id) + "[data-status=completed]", timeout=240_000)
    return row


def refuse_first_confirm(page: Any) -> list[str]:
    """Every confirmation the page asks from now on, recorded: the first refused, the rest
    accepted."""
    asked: list[str] = []

    def answer(dialog):
        asked.append(dialog.message)
        dialog.dismiss() if len(asked) == 1 else dialog.accept()

    page.on("dialog", answer)
    return asked


def load_llama_and_attach(srv: Any) -> None:
    """tiny-llama loaded on ``srv`` and its layer-1 ReLU SAE attached (``srv.sae_id``)."""
    models = {m["name"]: m for m in srv.api("GET", "/api/models")["models"]}
    saes = {s["name"]: s for s in srv.api("GET", "/api/saes")["saes"]}
    model = models["tiny-llama"]["id"]
    srv.api("POST", f"/api/models/{model}/load")
    srv.wait_for("tiny-llama to load", lambda: srv.api("GET", f"/api/models/{model}")["status"] == "loaded")
    srv.sae_id = saes["tiny-llama-L1-relu"]["id"]
    srv.api("POST", f"/api/saes/{srv.sae_id}/attach", {"layer": 1})
