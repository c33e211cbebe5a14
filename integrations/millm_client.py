"""A Python client for miLLM's extensions, on top of the official ``openai`` package.

No Django: it needs ``openai``, ``numpy``, ``safetensors`` and miLLM's light
``gpu_engine.api.artifacts`` reader (the repository, or the ``gpu_engine`` package, on the
path). The original's served client offered ``capture()``, ``analyze()`` and
``load_capture()``; so does this one::

    from integrations.millm_client import MillmClient

    client = MillmClient("http://localhost:8000", api_key=None)
    text, cap = client.capture("demo", messages=[{"role": "user", "content": "hi"}],
                               layers=[0, 6], positions="last")
    cap.hidden[6]                      # (rows, hidden_size) numpy array
    result = client.analyze("demo", "hidden_states", params={"layers": [6], "reduce": "norm"},
                            messages=[{"role": "user", "content": "hi"}])
    client.score_probes(["some text"], probes=["toxicity"])  # per input, each probe's verdict

Steering experiments (docs/experiments.md) run on the server; the client starts them,
waits for them and downloads their points::

    run = client.sweep(prompts=["The weather today"], strengths=[0, 4, 8],
                       variants=[{"sae_id": sae, "index": 3}], max_tokens=32)
    run = client.wait_experiment(run["id"])            # completed / failed / cancelled
    points = client.download_experiment(run["id"])     # jsonl rows; "csv", "parquet" too
    cal = client.wait_experiment(client.calibrate(prompts=[...], variant={...}, target_kl=0.1)["id"])
    cal["result"]["strength"]
    fid = client.fidelity(sae_id=sae, token_budget=4096)          # corpus L0, MSE, EV, loss recovered
    attr = client.attribution(sae, prompt="The capital of France is")  # synchronous
    attr["features"][0]                # index, attribution, ablation_delta, label, dashboard

Everything else a request can carry (``steering``, ``profile``, ``return_sae_activations``,
sampling fields) passes through as keyword arguments. Captures come back inline (base64
in the response) or stored on the server (``/api/captures/<id>/download``); ``capture()``
returns the tensors either way.
"""

from __future__ import annotations

import base64
import json
import os
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

from openai import OpenAI

from gpu_engine.api.artifacts import CaptureData, load_capture


@dataclass
class Completion:
    """One generation: its text, the raw ``openai`` response, and the ``millm`` object."""

    text: str
    response: Any
    millm: dict[str, Any]


class MillmClient:
    def __init__(
        self, base_url: str = "http://localhost:8000", api_key: str | None = None, **openai_kwargs: Any
    ) -> None:
        self.base_url = base_url.rstrip("/")
        if self.base_url.endswith("/v1"):
            self.base_url = self.base_url[: -len("/v1")]
        self.api_key = api_key
        self.openai = OpenAI(base_url=self.base_url + "/v1", api_key=api_key or "not-needed", **openai_kwargs)

    # ------------------------------------------------------------------ generation

    def generate(
        self, model: str, *, messages: list[dict[str, Any]] | None = None, prompt: str | None = None, **extra: Any
    ) -> Completion:
        """A chat completion (``messages``) or a completion (``prompt``) with miLLM's
        extension fields (``steering``, ``capture``, ``analyze``, …) in ``extra``; OpenAI's
        own fields (``max_tokens``, ``temperature``, …) too."""
        if (messages is None) == (prompt is None):
            raise ValueError("give messages or prompt")
        own = {k: extra.pop(k) for k in list(extra) if k in _OPENAI_FIELDS}
        if messages is not None:
            resp = self.openai.chat.completions.create(model=model, messages=messages, extra_body=extra, **own)
            text = resp.choices[0].message.content or ""
        else:
            resp = self.openai.completions.create(model=model, prompt=prompt, extra_body=extra, **own)
            text = resp.choices[0].text
        return Completion(text, resp, dict((resp.model_extra or {}).get("millm") or {}))

    def capture(
        self,
        model: str,
        *,
        layers: list[int] | None = None,
        positions: str = "last",
        attention: dict[str, Any] | None = None,
        messages: list[dict[str, Any]] | None = None,
        prompt: str | None = None,
        **extra: Any,
    ) -> tuple[str, CaptureData]:
        """Generate with a capture armed; ``(text, tensors)``. ``attention``: ``{layers,
        heads?, positions?}`` for Q/K (docs/capture.md)."""
        spec: dict[str, Any] = {"positions": positions}
        if layers is not None:
            spec["layers"] = list(layers)
        if attention is not None:
            spec["attention"] = attention
        out = self.generate(model, messages=messages, prompt=prompt, capture=spec, **extra)
        return out.text, self.fetch_capture(out.millm["capture"])

    def analyze(
        self,
        model: str,
        name: str,
        *,
        params: dict[str, Any] | None = None,
        messages: list[dict[str, Any]] | None = None,
        prompt: str | None = None,
        **extra: Any,
    ) -> dict[str, Any]:
        """Generate with analyzer ``name`` (its capture armed by the server) and return its
        result (``millm.analysis``)."""
        out = self.generate(
            model, messages=messages, prompt=prompt, analyze={"name": name, "params": params or {}}, **extra
        )
        (entry,) = [a for a in out.millm.get("analysis", []) if a.get("name") == name]
        return entry

    # ------------------------------------------------------------------ stored captures

    def fetch_capture(self, obj: dict[str, Any]) -> CaptureData:
        """The tensors of a ``millm.capture`` object: decoded when inline, downloaded when
        stored."""
        if obj.get("inline"):
            return load_capture(base64.b64decode(obj["data"]))
        return load_capture(self._get(obj["url"]))

    def download_capture(self, capture_id: str) -> CaptureData:
        return load_capture(self._get(f"/api/captures/{capture_id}/download"))

    def analyze_capture(self, capture_id: str, name: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        """Run analyzer ``name`` on a stored capture (``POST /api/captures/<id>/analyze``)."""
        body = json.dumps({"name": name, "params": params or {}}).encode()
        return self._envelope(self._request(f"/api/captures/{capture_id}/analyze", body))

    # ------------------------------------------------------------------ probes

    def score_probes(
        self, inputs: list[Any], probes: list[Any] | None = None, *, model: str | None = None
    ) -> list[list[dict[str, Any]]]:
        """Score ``inputs`` (texts, or ``{"text"}``, ``{"messages"}``, ``{"token_ids"}``
        objects) with ``probes`` (names, ids or ``{"name", "positions"}``; None: the armed
        set) in one forward pass each, nothing generated (``POST /api/probes/score``):
        per input, each probe's verdict (``score``, ``probability``, ``verdict``,
        ``threshold``, ``rows``)."""
        body: dict[str, Any] = {"inputs": list(inputs)}
        if probes is not None:
            body["probes"] = list(probes)
        if model is not None:
            body["model"] = model
        data = self._envelope(self._request("/api/probes/score", json.dumps(body).encode()))
        return [item["probes"] for item in data["data"]]

    # ------------------------------------------------------------------ experiments

    def sweep(self, spec: dict[str, Any] | None = None, **fields: Any) -> dict[str, Any]:
        """Start a sweep (``POST /api/experiments/sweep``: prompts × steering variants ×
        strengths, each prompt's unsteered DEFAULT beside them; docs/experiments.md): the
        run as queued (``id``, ``status``, ``total``, …). ``spec`` and ``fields`` make the
        body together."""
        return self._start("sweep", spec, fields)

    def calibrate(self, spec: dict[str, Any] | None = None, **fields: Any) -> dict[str, Any]:
        """Start a calibration (``POST /api/experiments/calibrate``: the strength whose mean
        KL meets ``target_kl``): the run as queued."""
        return self._start("calibrate", spec, fields)

    def fidelity(self, spec: dict[str, Any] | None = None, **fields: Any) -> dict[str, Any]:
        """Start a corpus fidelity run of an SAE (``POST /api/experiments/fidelity``: L0,
        MSE, explained variance, loss recovered): the run as queued."""
        return self._start("fidelity", spec, fields)

    def attribution(
        self,
        sae_id: str,
        *,
        prompt: str | None = None,
        messages: list[dict[str, Any]] | None = None,
        target_token: int | str | None = None,
        top_n: int = 10,
        ablate_top: int = 5,
        layer: int | None = None,
        **fields: Any,
    ) -> dict[str, Any]:
        """Attribute the next token's logit after ``prompt`` (or ``messages``) to the SAE's
        features (``POST /api/experiments/attribution``, transformers only): ``tokens``,
        ``target``, per-position ``heat`` and the top ``features`` with their ablation
        check, labels and dashboard paths. ``target_token``: an id or the text of one
        token; None: the greedy next token."""
        if (messages is None) == (prompt is None):
            raise ValueError("give messages or prompt")
        body: dict[str, Any] = {"sae_id": sae_id, "top_n": top_n, "ablate_top": ablate_top, **fields}
        body["messages" if messages is not None else "prompt"] = messages if messages is not None else prompt
        if target_token is not None:
            body["target_token"] = target_token
        if layer is not None:
            body["layer"] = layer
        return self._envelope(self._request("/api/experiments/attribution", json.dumps(body).encode()))

    def experiment(self, run_id: str) -> dict[str, Any]:
        """A run (``GET /api/experiments/<id>``): status, progress, result."""
        return self._envelope(self._get(f"/api/experiments/{quote(run_id, safe='')}"))

    def cancel_experiment(self, run_id: str) -> dict[str, Any]:
        """Cancel a queued or running run; the points already done stay (``partial``)."""
        return self._envelope(self._request(f"/api/experiments/{quote(run_id, safe='')}/cancel", b"{}"))

    def wait_experiment(self, run_id: str, *, timeout_s: float = 600.0, poll_s: float = 0.5) -> dict[str, Any]:
        """Poll the run until it ends (completed, failed or cancelled) and return it;
        TimeoutError after ``timeout_s``. A failed run is returned, not raised: its
        ``error`` says why and its points are still readable."""
        deadline = time.monotonic() + timeout_s
        while True:
            run = self.experiment(run_id)
            if run["status"] in EXPERIMENT_TERMINAL:
                return run
            if time.monotonic() >= deadline:
                raise TimeoutError(f"experiment {run_id} still {run['status']} after {timeout_s:g} s")
            time.sleep(poll_s)

    def download_experiment(
        self, run_id: str, format: str = "jsonl", path: str | os.PathLike[str] | None = None
    ) -> Any:
        """A run's points (``GET /api/experiments/<id>/download?format=``): ``jsonl`` as a
        list of dicts, ``csv`` as text, ``parquet`` as bytes; with ``path`` the file is
        written there as downloaded and its path returned."""
        if format not in ("jsonl", "csv", "parquet"):
            raise ValueError("format is jsonl, csv or parquet")
        data = self._get(f"/api/experiments/{quote(run_id, safe='')}/download?format={format}")
        if path is not None:
            Path(path).write_bytes(data)
            return Path(path)
        if format == "jsonl":
            return [json.loads(line) for line in data.decode("utf-8").splitlines() if line.strip()]
        return data.decode("utf-8") if format == "csv" else data

    def _start(self, kind: str, spec: dict[str, Any] | None, fields: dict[str, Any]) -> dict[str, Any]:
        body = {**(spec or {}), **fields}
        data = self._envelope(self._request(f"/api/experiments/{kind}", json.dumps(body).encode()))
        return data.get("run", data) if isinstance(data, dict) else data

    # ------------------------------------------------------------------ plumbing

    def _request(self, path: str, body: bytes | None = None) -> bytes:
        headers = {"Content-Type": "application/json"} if body is not None else {}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(
            self.base_url + path, data=body, headers=headers, method="POST" if body is not None else "GET"
        )
        try:
            with urllib.request.urlopen(req, timeout=120) as resp:  # noqa: S310 - our server
                return resp.read()
        except urllib.error.HTTPError as exc:
            raise MillmError.from_http(exc) from None

    def _get(self, path: str) -> bytes:
        return self._request(path)

    @staticmethod
    def _envelope(data: bytes) -> dict[str, Any]:
        body = json.loads(data)
        if not body.get("success", False):
            raise MillmError(
                body.get("error", {}).get("code", "error"),
                body.get("error", {}).get("message", ""),
                body.get("error", {}),
            )
        return body["data"]


class MillmError(Exception):
    """An ``/api`` refusal: its documented ``code``, ``message`` and the whole error."""

    def __init__(self, code: str, message: str, error: dict[str, Any]) -> None:
        super().__init__(f"{code}: {message}")
        self.code, self.message, self.error = code, message, error

    @classmethod
    def from_http(cls, exc: urllib.error.HTTPError) -> MillmError:
        try:
            error = json.loads(exc.read()).get("error") or {}
        except ValueError:
            error = {}
        return cls(error.get("code", f"HTTP_{exc.code}"), error.get("message", str(exc)), error)


# the states a run ends in (``wait_experiment``)
EXPERIMENT_TERMINAL = frozenset({"completed", "failed", "cancelled"})

# fields the openai methods take as arguments (the rest travel in extra_body)
_OPENAI_FIELDS = {
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "n",
    "stop",
    "seed",
    "logprobs",
    "top_logprobs",
    "presence_penalty",
    "frequency_penalty",
    "stream",
    "logit_bias",
    "user",
    "echo",
    "timeout",
}

__all__ = ["Completion", "MillmClient", "MillmError", "load_capture"]
