"""Attribution of a next-token logit to SAE features (docs/experiments.md, "Attribution"):
``POST /api/experiments/attribution`` runs ``attribution_run``, synchronously.

The engine's ``attribution`` command does the arithmetic (``gpu_engine.api.jobs.
AttributionJob``): with the SAE spliced in at its hook point and its error term kept (the
forward is the model's own), feature ``i``'s attribution at prompt position ``p`` is
``f_i(x_p) * d logit_target / d f_i(x_p)``, the logit being the last position's logit of
the target token (None: the greedy next token). The ``top_n`` features by the magnitude of
their attribution summed over the positions come back, the first ``ablate_top`` of them
checked by zeroing each at every position and measuring the logit again.

This module checks what the command needs before anything runs, and shapes its answer for
a reader (the UI's heat strip, the Python client):

- the SAE exists (404 ``SAE_NOT_FOUND``), has features (a steering vector: 422), and is
  attached to the resident model (409 ``SAE_NOT_ATTACHED`` naming the layers it is at;
  at several layers ``layer`` picks one, else 422 naming it);
- a model is loaded (400 ``MODEL_NOT_LOADED``) on a backend that reports ``gradients``
  (else 400 ``ATTRIBUTION_UNSUPPORTED`` naming the backend and its reason: vLLM and
  llama.cpp run no backward pass);
- a target given as a string is the text of exactly one token of the model's vocabulary
  (the engine's tokenizer says; else 422 naming ``target_token``);
- it takes an admission slot as a /v1 generation does (503 ``QUEUE_FULL`` with
  Retry-After when the queue is full): a backward pass is the dearest thing one request
  can ask of the model.

The answer (``attribution_run``'s dict, the envelope's ``data``):

- ``tokens``: the prompt as the model read it, ``[{id, text}]`` by position, and
  ``target``: ``{id, text, logit, greedy}``;
- ``heat``: per position, ``total`` (the sum over features of ``|attribution|``), ``sum``
  (signed) and its ``HEAT_TOP`` largest features by magnitude ``[{index, attribution,
  label}]`` — what the UI draws over the prompt;
- ``features``: the top features, largest first: ``index``, ``attribution`` (summed over
  positions), ``activation_sum``, ``max_position`` and ``max_attribution``, the ablation
  check ``ablation_delta`` (logit with the feature zeroed minus the clean logit; null
  beyond ``ablate_top``), ``label`` (``registry.labels``) and ``dashboard`` (the feature's
  page, ``/features/<sae>/<index>/``).

The token texts are the engine's tokenizer's (each id decoded alone), never the web
tier's.
"""

from __future__ import annotations

import uuid
from typing import Any

import numpy as np
import structlog
from asgiref.sync import async_to_sync
from django.urls import reverse

from core.errors import MillmError, ModelNotLoaded, ValidationFailed, from_engine_error
from core.runtime import runtime
from features.services import attached_layer
from gpu_engine.api.errors import EngineError
from gpu_engine.api.monitoring import unpack
from gpu_engine.api.protocol import (
    AttributionJob,
    AttributionResult,
    TokenizeJob,
)
from registry import labels
from registry.engines import addressing_sae
from registry.models import SAE
from registry.selectors import sae_get

log = structlog.get_logger(__name__)

# a prompt's characters (a text, or the messages' contents together) and messages: the
# backward pass keeps every layer's activations of every position after the hook point
MAX_PROMPT_CHARS = 16_384
MAX_MESSAGES = 64
MAX_TARGET_CHARS = 100
HEAT_TOP = 3  # features listed per position of the heat strip


class AttributionUnsupported(MillmError):
    """The loaded backend runs no backward pass (capability ``gradients`` off: vLLM,
    llama.cpp); ``details.backend`` names it, ``details.reason`` says why."""

    code, status = "ATTRIBUTION_UNSUPPORTED", 400


def _target_error(message: str) -> ValidationFailed:
    return ValidationFailed(message, details={"param": "target_token", "fields": {"target_token": [message]}})


def _check_backend(status: Any) -> None:
    if status.state != "ready" or not status.model_id:
        raise ModelNotLoaded("No model is loaded; attribution runs on the resident model", details={"param": "sae_id"})
    caps = status.capabilities
    if caps is None or caps.gradients is not True:
        reason = (getattr(caps, "gradients_reason", None) or None) if caps is not None else None
        raise AttributionUnsupported(
            f"The {status.backend} backend cannot run attribution: it computes no gradients"
            + (f" ({reason})" if reason else "")
            + "; load the model on the transformers backend",
            details={"param": None, "backend": status.backend, "capability": "gradients", "reason": reason},
        )


def _target_id(target: int | str | None, vocab_size: int | None) -> int | None:
    """The target token's id: an id as given (inside the vocabulary), a string as the one
    token the engine's tokenizer reads it as, None for the greedy next token."""
    if target is None:
        return None
    if isinstance(target, int):
        if vocab_size is not None and target >= vocab_size:
            raise _target_error(f"token id {target} is outside the vocabulary (0 .. {vocab_size - 1})")
        return target
    try:
        ids = runtime().engine.tokenize(TokenizeJob(request_id=f"attr-tok-{uuid.uuid4().hex[:12]}", texts=[target]))
    except EngineError as exc:
        raise from_engine_error(exc) from exc
    found = list(ids.token_ids[0])
    if len(found) != 1:
        raise _target_error(
            f"{target!r} is {len(found)} tokens for this model's tokenizer ({found}), not one: "
            "give the text of exactly one token (a leading space is part of it) or its id"
        )
    return int(found[0])


def _heat(result: AttributionResult, positions: int) -> tuple[list[dict[str, Any]], set[int]]:
    """Per position: the summed |attribution|, the signed sum and the HEAT_TOP largest
    features by magnitude (labels filled in later); and the features those name."""
    row_ptr, indices, values = unpack(result.attributions)
    heat: list[dict[str, Any]] = []
    named: set[int] = set()
    for p in range(positions):
        lo, hi = (int(row_ptr[p]), int(row_ptr[p + 1])) if p < result.attributions.rows else (0, 0)
        vals = values[lo:hi].astype(np.float64)
        idx = indices[lo:hi]
        order = np.argsort(-np.abs(vals), kind="stable")[:HEAT_TOP]
        top = [{"index": int(idx[j]), "attribution": float(vals[j])} for j in order]
        named.update(t["index"] for t in top)
        heat.append({"position": p, "total": float(np.abs(vals).sum()), "sum": float(vals.sum()), "top": top})
    return heat, named


def attribution_run(
    *,
    sae_id: str,
    layer: int | None = None,
    prompt: str | None = None,
    messages: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    target_token: int | str | None = None,
    top_n: int = 10,
    ablate_top: int = 5,
) -> dict[str, Any]:
    """Attribute the target logit after the prompt to the SAE's features (module
    docstring): the answer, or a refusal before anything runs."""
    if (prompt is None) == (messages is None):
        raise ValidationFailed(
            "give exactly one of prompt or messages", details={"param": "prompt", "fields": {"prompt": ["required"]}}
        )
    sae = sae_get(sae_id=sae_id)
    if sae.format == SAE.Format.VECTOR:
        raise ValidationFailed(
            f"{sae.id} is a steering vector: it has no features to attribute",
            details={"param": "sae_id", "fields": {"sae_id": ["a steering vector has no features"]}},
        )
    with addressing_sae(sae.id):  # the engine holding the SAE's model (registry.engines)
        engine = runtime().engine
        status = engine.status()
        _check_backend(status)
        attachment = attached_layer(sae_id=sae.id, layer=layer, attachments=list(status.attachments))
        target_id = _target_id(target_token, status.vocab_size)
    job = AttributionJob(
        request_id=f"attr-{uuid.uuid4().hex}",
        sae_id=sae.id,
        layer=attachment.layer,
        prompt=prompt,
        messages=messages,
        target_token_id=target_id,
        top_n=top_n,
        ablate_top=ablate_top,
        add_generation_prompt=add_generation_prompt,
    )
    permit = async_to_sync(runtime().admission.acquire)()
    try:
        result = engine.attribution(job)
    except EngineError as exc:
        raise from_engine_error(exc) from exc
    finally:
        permit.release()
    ids = [int(t) for t in result.prompt_token_ids]
    heat, named = _heat(result, len(ids))
    named.update(f.index for f in result.top)
    names = labels.labels_for(sae.id, sorted(named))
    for row in heat:
        for t in row["top"]:
            t["label"] = names.get(t["index"])
    features = [
        {
            "index": f.index,
            "attribution": float(f.attribution),
            "activation_sum": float(f.activation_sum),
            "max_position": f.max_position,
            "max_attribution": float(f.max_attribution),
            "ablation_delta": None if f.ablation_delta is None else float(f.ablation_delta),
            "label": names.get(f.index),
            "dashboard": reverse("ui-feature", kwargs={"sae_id": sae.id, "index": str(f.index)}),
        }
        for f in result.top
    ]
    log.info("attribution_run", sae_id=sae.id, layer=attachment.layer, positions=len(ids), top=len(features))
    return {
        "sae_id": sae.id,
        "layer": attachment.layer,
        "backend": status.backend,
        "model": status.model_id,
        "tokens": [{"id": i, "text": t} for i, t in zip(ids, result.prompt_tokens, strict=True)],
        "target": {
            "id": int(result.target_token_id),
            "text": result.target_token,
            "logit": float(result.target_logit),
            "greedy": target_id is None,
        },
        "heat": heat,
        "features": features,
        "top_n": top_n,
        "ablate_top": ablate_top,
    }


__all__ = ["HEAT_TOP", "MAX_MESSAGES", "MAX_PROMPT_CHARS", "AttributionUnsupported", "attribution_run"]
