"""Automatic explanations of SAE features (docs/features.md, "Explanations"): an
OpenAI-compatible endpoint (``EXPLAINER_BASE_URL``, the server's own /v1 works) reads a
feature's top contexts from its dashboard and says in a phrase what the feature detects; a
held-out scoring pass then asks it, context by context, whether a text matches that
explanation, and scores how well the answers separate contexts where the feature fires from
contexts where it does not.

Runs in the request (``POST /api/saes/{id}/explanations/generate``), one feature after
another, each stored as it is done: at most ``MAX_FEATURES`` features, a fixed number of
calls each (1 to explain, at most ``SCORE_POSITIVES + SCORE_NEGATIVES`` to score).

- Explaining: the feature's first ``EXPLAIN_CONTEXTS`` top contexts (the newest complete
  dashboard run's), each as its text with the max-activating token marked ``<<token>>``
  and the activation of every token > 0 listed after it.
- Scoring: positives are the dashboard's quantile samples (contexts where the feature
  fires, below its top contexts, never shown to the explainer); negatives are other
  features' top contexts of the same run that are not among this feature's stored
  contexts (an approximation: the dashboard keeps a feature's activations only on its own
  contexts, so a context is taken as negative when the feature did not make it one of its
  own). Each is asked "does this text match the explanation? answer yes or no"; the score
  is the balanced accuracy ((true-positive rate + true-negative rate) / 2: 1.0 perfect,
  0.5 chance, an explainer that always says yes). Without at least one positive and one
  negative there is no score (``score_detail.reason`` says why).
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass
from typing import Any

import httpx2
import structlog
from django.conf import settings
from django.utils import timezone

from audit.services import audited
from core.errors import MillmError
from features.models import FeatureDashboard
from features.selectors import latest_run
from registry import explanations
from registry.labels import explanation_out
from registry.models import SAE, FeatureExplanation

log = structlog.get_logger(__name__)

PROMPT_VERSION = "millm-explain-1"
MAX_FEATURES = 64
EXPLAIN_CONTEXTS = 10
SCORE_POSITIVES = 5
SCORE_NEGATIVES = 5
MAX_LABEL_CHARS = 200

SYSTEM = (
    "You are studying one feature of a sparse autoencoder trained on a language model's "
    "activations. You are shown text excerpts where the feature activates. In each excerpt "
    "the token where it activates most is marked <<like this>>, and the activation of each "
    "token where it is above zero is listed after the excerpt. Say in one short phrase "
    "(at most 12 words) what the feature detects. Answer with the phrase only."
)
SCORE_SYSTEM = (
    "You check whether a text matches the explanation of a language model feature. Answer yes or no, nothing else."
)


class ExplainerNotConfigured(MillmError):
    code, status = "EXPLAINER_NOT_CONFIGURED", 409


class DashboardMissing(MillmError):
    code, status = "DASHBOARD_MISSING", 409


class ExplainerFailed(MillmError):
    code, status = "EXPLAINER_FAILED", 502


@dataclass
class Explainer:
    """One OpenAI-compatible endpoint, its model resolved."""

    base_url: str
    model: str
    client: httpx2.Client

    @classmethod
    def from_settings(cls) -> Explainer:
        base = (settings.EXPLAINER_BASE_URL or "").strip().rstrip("/")
        if not base:
            raise ExplainerNotConfigured(
                "No explainer is configured: set EXPLAINER_BASE_URL to an OpenAI-compatible /v1 base URL",
                details={"setting": "EXPLAINER_BASE_URL"},
            )
        headers = {"Authorization": f"Bearer {settings.EXPLAINER_API_KEY}"} if settings.EXPLAINER_API_KEY else {}
        client = httpx2.Client(base_url=base, headers=headers, timeout=float(settings.EXPLAINER_TIMEOUT_S))
        model = (settings.EXPLAINER_MODEL or "").strip()
        if not model:
            body = _call(client, "GET", "/models")
            data = body.get("data") if isinstance(body, dict) else None
            if not data or not isinstance(data[0], dict) or not isinstance(data[0].get("id"), str):
                client.close()
                raise ExplainerFailed(
                    "The explainer lists no model at /models: set EXPLAINER_MODEL", details={"base_url": base}
                )
            model = data[0]["id"]
        return cls(base, model, client)

    def close(self) -> None:
        self.client.close()

    def chat(self, system: str, user: str, *, max_tokens: int) -> str:
        body = _call(
            self.client,
            "POST",
            "/chat/completions",
            {
                "model": self.model,
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
                "temperature": 0,
                "max_tokens": max_tokens,
            },
        )
        try:
            content = body["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError) as exc:
            raise ExplainerFailed(
                "The explainer's answer has no choices[0].message.content",
                details={"base_url": str(self.client.base_url)},
            ) from exc
        return content if isinstance(content, str) else ""


def _call(client: httpx2.Client, method: str, path: str, json: Any = None) -> Any:
    try:
        response = client.request(method, path, json=json)
    except httpx2.HTTPError as exc:
        raise ExplainerFailed(
            f"The explainer could not be reached: {type(exc).__name__}", details={"base_url": str(client.base_url)}
        ) from exc
    if response.status_code != 200:
        raise ExplainerFailed(
            f"The explainer answered {path} with HTTP {response.status_code}",
            details={"base_url": str(client.base_url), "status": response.status_code},
        )
    try:
        return response.json()
    except ValueError as exc:
        raise ExplainerFailed(
            f"The explainer's answer to {path} is not JSON", details={"base_url": str(client.base_url)}
        ) from exc


# --------------------------------------------------------------------------- prompts


def context_text(window: dict[str, Any], *, mark: bool = True) -> str:
    """A context's tokens joined, the max-activating one marked ``<<token>>``."""
    tokens = [str(t) for t in window.get("tokens", [])]
    at = window.get("max_position")
    if mark and isinstance(at, int) and 0 <= at < len(tokens):
        tokens[at] = f"<<{tokens[at]}>>"
    return "".join(tokens)


def _activation_list(window: dict[str, Any]) -> str:
    pairs = [
        f"{tok!r}={act:.2f}"
        for tok, act in zip(window.get("tokens", []), window.get("activations", []))
        if isinstance(act, (int, float)) and act > 0
    ]
    return ", ".join(pairs)


def explain_prompt(contexts: list[dict[str, Any]]) -> str:
    parts = []
    for n, window in enumerate(contexts, start=1):
        parts.append(
            f"Excerpt {n} (max activation {float(window.get('max_activation', 0.0)):.2f}):\n"
            f"{context_text(window)}\nActivations: {_activation_list(window)}"
        )
    return "\n\n".join(parts) + "\n\nWhat does the feature detect?"


def score_prompt(explanation: str, window: dict[str, Any]) -> str:
    return (
        f"Explanation: {explanation}\n\nText: {context_text(window, mark=False)}\n\n"
        "Does this text match the explanation? Answer yes or no."
    )


def clean_answer(text: str) -> str:
    """The explainer's answer as a label: its first non-empty line, without a leading
    "Explanation:"-like prefix, quotes or list marks, whitespace collapsed, ≤ 200 chars."""
    line = next((ln for ln in (text or "").splitlines() if ln.strip()), "")
    line = re.sub(r"^\s*(?:[-*•]|\d+[.)])\s*", "", line)
    line = re.sub(r"^\s*(?:explanation|answer|feature|label)\s*:\s*", "", line, flags=re.IGNORECASE)
    line = " ".join(line.split()).strip(" \"'`")
    return line[:MAX_LABEL_CHARS].rstrip()


def parse_yes(text: str) -> bool:
    """True for an answer that starts with yes (anything else, no)."""
    word = re.match(r"\W*(\w+)", text or "")
    return bool(word) and word.group(1).lower() in ("yes", "y", "true")


def balanced_accuracy(expected: list[bool], predicted: list[bool]) -> float | None:
    pos = [p for e, p in zip(expected, predicted) if e]
    neg = [p for e, p in zip(expected, predicted) if not e]
    if not pos or not neg:
        return None
    tpr = sum(pos) / len(pos)
    tnr = sum(not p for p in neg) / len(neg)
    return (tpr + tnr) / 2


# --------------------------------------------------------------------------- runs


def dashboards_for(sae: SAE, features: list[int]) -> tuple[str, dict[int, FeatureDashboard]]:
    """Each feature's row of the newest complete run, or 409 DASHBOARD_MISSING naming the
    first feature without one (no complete run, or no top context)."""
    run = latest_run(sae.id)
    rows = {}
    if run is not None:
        rows = {r.index: r for r in FeatureDashboard.objects.filter(run=run, index__in=features)}
    for index in features:
        row = rows.get(index)
        if row is None or not row.top_contexts:
            raise DashboardMissing(
                f"Feature {index} of SAE {sae.id} has no complete dashboard with top contexts: "
                "build one first (POST /api/saes/{id}/dashboards)",
                details={"index": index, "sae_id": sae.id, "run_id": run.id if run else None},
            )
    return run.id, rows  # type: ignore[union-attr]


def held_out(row: FeatureDashboard, limit_pos: int, limit_neg: int) -> tuple[list[dict], list[dict]]:
    """Held-out positives (the quantile samples) and negatives (other features' top
    contexts of the run that are none of this feature's stored contexts)."""
    own = {w.get("context") for w in row.top_contexts}
    positives = []
    for band in row.quantile_samples or []:
        for window in band.get("contexts", []) if isinstance(band, dict) else []:
            if window.get("context") not in own and len(positives) < limit_pos:
                positives.append(window)
    own |= {w.get("context") for w in positives}
    for band in row.quantile_samples or []:
        for window in band.get("contexts", []) if isinstance(band, dict) else []:
            own.add(window.get("context"))
    negatives: list[dict] = []
    seen: set[Any] = set()
    others = FeatureDashboard.objects.filter(run_id=row.run_id).exclude(index=row.index).order_by("index")
    for other in others.only("top_contexts").iterator(chunk_size=200):
        for window in other.top_contexts[:1]:
            ctx = window.get("context")
            if ctx in own or ctx in seen:
                continue
            seen.add(ctx)
            negatives.append(window)
        if len(negatives) >= limit_neg:
            break
    return positives, negatives


def explain_one(
    explainer: Explainer, *, sae: SAE, row: FeatureDashboard, run_id: str, score: bool, created_by: str, batch: str = ""
) -> FeatureExplanation:
    contexts = list(row.top_contexts[:EXPLAIN_CONTEXTS])
    answer = clean_answer(explainer.chat(SYSTEM, explain_prompt(contexts), max_tokens=60))
    if not answer:
        raise ExplainerFailed("The explainer answered with no text", details={"index": row.index})
    provenance = {
        "base_url": explainer.base_url,
        "model": explainer.model,
        "prompt_version": PROMPT_VERSION,
        "run_id": run_id,
        "batch": batch,
        "contexts": [w.get("context") for w in contexts],
        "created": timezone.now().isoformat().replace("+00:00", "Z"),
    }
    value: float | None = None
    detail: dict[str, Any] = {}
    if score:
        positives, negatives = held_out(row, SCORE_POSITIVES, SCORE_NEGATIVES)
        predictions = []
        for expected, window in [(True, w) for w in positives] + [(False, w) for w in negatives]:
            reply = explainer.chat(SCORE_SYSTEM, score_prompt(answer, window), max_tokens=3)
            predictions.append(
                {
                    "context": window.get("context"),
                    "expected": expected,
                    "predicted": parse_yes(reply),
                    "answer": reply[:20],
                }
            )
        value = balanced_accuracy([p["expected"] for p in predictions], [p["predicted"] for p in predictions])
        detail = {
            "method": "balanced_accuracy",
            "positives": len(positives),
            "negatives": len(negatives),
            "predictions": predictions,
        }
        if value is None:
            detail["reason"] = "needs at least one held-out positive and one negative context"
    return explanations.explanation_store(
        sae=sae,
        index=row.index,
        description=answer,
        source=FeatureExplanation.Source.EXPLAINER,
        explainer_model=explainer.model,
        provenance=provenance,
        score=value,
        score_detail=detail,
        created_by=created_by,
    )


@audited(
    "explanation.generate",
    lambda kw, r: ("sae", getattr(kw.get("sae"), "pk", ""), getattr(kw.get("sae"), "name", "") or ""),
    params=lambda kw: {"features": kw.get("features"), "score": kw.get("score")},
)
def generate(*, sae: SAE, features: list[int], score: bool, created_by: str = "") -> dict[str, Any]:
    """Explain (and score) each feature; every check comes before the first call: the
    explainer configured, every index of the SAE, every feature with a dashboard. A feature
    the explainer fails on is reported with its error; the others are stored."""
    if not settings.EXPLAINER_BASE_URL:
        raise ExplainerNotConfigured(
            "No explainer is configured: set EXPLAINER_BASE_URL to an OpenAI-compatible /v1 base URL",
            details={"setting": "EXPLAINER_BASE_URL"},
        )
    chosen = list(dict.fromkeys(features))
    for index in chosen:
        explanations.check_index(sae, index, param="features")
    run_id, rows = dashboards_for(sae, chosen)
    explainer = Explainer.from_settings()
    batch = f"expl_{secrets.token_hex(6)}"
    results = []
    try:
        for index in chosen:
            try:
                row = explain_one(
                    explainer, sae=sae, row=rows[index], run_id=run_id, score=score, created_by=created_by, batch=batch
                )
            except ExplainerFailed as exc:
                log.warning("explainer_failed", sae_id=sae.id, index=index, error=exc.message)
                results.append(
                    {"index": index, "status": "failed", "error": {"code": exc.code, "message": exc.message}}
                )
                continue
            results.append({"index": index, "status": "stored", "explanation": explanation_out(row)})
    finally:
        explainer.close()
    return {
        "sae_id": sae.id,
        "run_id": run_id,
        "model": explainer.model,
        "batch": batch,
        "results": results,
        "stored": sum(r["status"] == "stored" for r in results),
        "failed": sum(r["status"] == "failed" for r in results),
    }
