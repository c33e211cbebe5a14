"""The routes of a stored response (Responses API): ``GET`` and ``DELETE
/v1/responses/{id}``, ``POST /v1/responses/{id}/cancel`` and ``GET
/v1/responses/{id}/input_items``. Each is the caller's own (``Scope.of_request``): another
key's response is a 404 exactly as an unknown one (``inference.responses_store``)."""

from __future__ import annotations

from asgiref.sync import sync_to_async
from django.http import HttpRequest, JsonResponse

from inference import responses_store as store
from inference.errors import OpenAIError, openai_view
from monitoring.ownership import Scope

_TRUE = ("true", "1")


def _refuse_unbuilt(request: HttpRequest) -> None:
    """GET's ``stream`` (a replay of the events) and ``include`` are not built: a request
    that asks for them is refused naming the parameter, never answered as if it had not."""
    if (request.GET.get("stream") or "").lower() in _TRUE:
        raise OpenAIError(
            "stream=true is not available when retrieving a response: GET it without stream",
            status=400,
            code="invalid_parameter",
            param="stream",
        )
    for name in ("starting_after", "include", "include[]"):
        if request.GET.get(name):
            raise OpenAIError(
                f"{name.rstrip('[]')} is not available when retrieving a stored response",
                status=400,
                code="invalid_parameter",
                param=name.rstrip("[]"),
            )


@openai_view("GET", "DELETE")
async def response_detail(request: HttpRequest, response_id: str):
    scope = Scope.of_request(request)
    if request.method == "DELETE":
        return JsonResponse(await sync_to_async(store.response_delete)(response_id, scope))
    _refuse_unbuilt(request)
    return JsonResponse(await sync_to_async(store.response_get)(response_id, scope))


@openai_view("POST")
async def response_cancel(request: HttpRequest, response_id: str):
    return JsonResponse(await sync_to_async(store.response_cancel)(response_id, Scope.of_request(request)))


@openai_view("GET")
async def response_input_items(request: HttpRequest, response_id: str):
    if request.GET.get("include") or request.GET.get("include[]"):
        raise OpenAIError(
            "include is not available when listing input items", status=400, code="invalid_parameter", param="include"
        )
    page = await sync_to_async(store.response_input_items)(
        response_id,
        Scope.of_request(request),
        limit=request.GET.get("limit"),
        order=request.GET.get("order"),
        after=request.GET.get("after"),
    )
    return JsonResponse(page)
