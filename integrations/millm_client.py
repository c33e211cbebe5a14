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

Everything else a request can carry (``steering``, ``profile``, ``return_sae_activations``,
sampling fields) passes through as keyword arguments. Captures come back inline (base64
in the response) or stored on the server (``/api/captures/<id>/download``); ``capture()``
returns the tensors either way.
"""

from __future__ import annotations

import base64
import json
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

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
