"""``POST /api/probes/score`` (docs/api.md, docs/monitoring.md "Scoring inputs with
probes"): a plain async view rather than DRF's, since it waits on the engine and a sync
view would hold the one thread every sync view shares. It answers the /api envelope
(``core.api``) itself, so a refusal has the shape every /api error has."""

from __future__ import annotations

import json
from typing import Any

from django.http import HttpRequest, JsonResponse
from django.views.decorators.csrf import csrf_exempt

from core.api import error_json
from core.errors import MillmError, from_engine_error
from gpu_engine.api.errors import EngineError
from inference.probe_scoring import probe_score, probe_score_parse
from inference.quotas import api_ticket
from monitoring.errors import ProbeScoreRequestInvalid
from monitoring.ownership import Scope


def _body(request: HttpRequest) -> Any:
    try:
        return json.loads(request.body.decode("utf-8") or "{}")
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ProbeScoreRequestInvalid(
            f"the body is not valid JSON: {type(exc).__name__}", details={"param": None}
        ) from None


@csrf_exempt
async def probe_score_api(request: HttpRequest) -> JsonResponse:
    if request.method != "POST":
        response = error_json("METHOD_NOT_ALLOWED", f"Method {request.method} not allowed", status_code=405)
        response["Allow"] = "POST"  # RFC 9110
        return response
    ticket = None
    try:
        ticket = await api_ticket(request)  # 429 RATE_LIMIT_EXCEEDED over the key's quota, before any work
        body, headers = await probe_score(probe_score_parse(_body(request)), scope=Scope.of_request(request))
        if ticket is not None:
            ticket.charge(ticket.estimate)  # scored: its estimate stands as its tokens
    except (MillmError, EngineError) as exc:
        err = from_engine_error(exc) if isinstance(exc, EngineError) else exc
        return error_json(
            err.code, err.message, status_code=err.status, details=err.details, retry_after=err.retry_after
        )
    finally:
        if ticket is not None:
            ticket.release()
    return JsonResponse({"success": True, "data": body, "error": None}, headers=headers)


__all__ = ["probe_score_api"]
