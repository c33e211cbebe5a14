"""What the /api routes over runs share (experiments/apis.py, features/apis.py): a page of a
listing (``limit``/``offset`` in, ``{<items>: […], total}`` out), the ``{run}`` answer of a
start route, and the routes that read or cancel one run by its ``run_id``, each answered
in the envelope. Who may see which run stays the selectors' and services' rule."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.urls import URLPattern, re_path
from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.response import Response
from rest_framework.views import APIView

from core.api import envelope
from core.auth import principal
from core.schema import MAX_INDEX, MAX_LAYER


def page_fields(default: int, most: int) -> tuple[serializers.IntegerField, serializers.IntegerField]:
    """A query's ``limit`` (``default``, at most ``most``) and ``offset``, in that order."""
    return (
        serializers.IntegerField(required=False, default=default, min_value=1, max_value=most),
        serializers.IntegerField(required=False, default=0, min_value=0, max_value=MAX_INDEX),
    )


def layer_field(help_text: str = "null: attached") -> serializers.IntegerField:
    """A body's ``layer``: the attachment's, null for the SAE's one."""
    return serializers.IntegerField(
        required=False, allow_null=True, default=None, min_value=0, max_value=MAX_LAYER, help_text=help_text
    )


def output_of(output: type[serializers.Serializer], row: Any, **computed: Any) -> dict[str, Any]:
    """``output``'s answer for ``row``: each field the row's attribute of its name, but
    those given in ``computed``."""
    names = output().fields
    return output({name: computed[name] if name in computed else getattr(row, name) for name in names}).data


def listing(rows: Any, query: dict[str, Any], key: str, out: Callable[[Any], Any]) -> dict[str, Any]:
    """``{key: [out(row) …], total}``: the page ``query`` names of the queryset ``rows``,
    and how many rows there are in all."""
    total = rows.count()
    page = rows[query["offset"] : query["offset"] + query["limit"]]
    return {key: [out(row) for row in page], "total": total}


def listing_output(name: str, key: str, item: type[serializers.Serializer]) -> type[serializers.Serializer]:
    """The serializer of ``listing``'s answer, named ``name`` in the schema."""
    fields = {key: item(many=True), "total": serializers.IntegerField(), "__module__": item.__module__}
    return type(name, (serializers.Serializer,), fields)


def run_envelope_output(run: type[serializers.Serializer]) -> type[serializers.Serializer]:
    """``{run: <run>}``, a start route's answer (``RunEnvelopeOutput`` in the schema)."""
    return type("RunEnvelopeOutput", (serializers.Serializer,), {"run": run(), "__module__": run.__module__})


def run_route(
    name: str, method: str, act: Callable[..., Any], out: Callable[[Any], Any], **schema: Any
) -> type[APIView]:
    """An APIView whose one ``method`` answers ``out(act(run_id=…, principal=…))`` in the
    envelope: a selector's read of the route's run, or a service's action on it.
    ``schema`` is the operation's ``extend_schema``."""

    def handler(self: APIView, request: Any, run_id: str) -> Response:
        return envelope(out(act(run_id=run_id, principal=principal(request))))

    handler.__name__ = handler.__qualname__ = method
    return type(name, (APIView,), {method: extend_schema(**schema)(handler), "__module__": out.__module__})


def run_paths(prefix: str, run_id: str, name: str, views: dict[str, type[APIView]]) -> list[URLPattern]:
    """The routes of one run: ``^<prefix>/<run_id>$`` for ``views[""]`` (named
    ``<name>-detail``) and ``^<prefix>/<run_id>/<action>$`` for each other (named
    ``<name>-<action>``), in ``views``' order."""
    return [
        re_path(
            rf"^{prefix}/{run_id}{f'/{action}' if action else ''}$",
            view.as_view(),
            name=f"{name}-{action or 'detail'}",
        )
        for action, view in views.items()
    ]
