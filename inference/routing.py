"""Which engine a /v1 request addresses: the engine of the model it names (``core.engines``,
ENGINE_MODELS). Its own module: it reads the registry through ``inference.selectors``,
which builds on ``inference.residency``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from asgiref.sync import sync_to_async

from core.engines import route_model, several_engines, using_engine
from inference.selectors import model_resolve


@asynccontextmanager
async def routed(name: str | None) -> AsyncIterator[None]:
    """Address the engine of the model a /v1 request names (``core.engines``) for what it
    wraps. With one engine (ENGINE_MODELS unset) nothing changes. An unknown model is 404
    ``model_not_found`` as before; a registered model no engine may hold is 409
    ``model_not_routable``. ``None`` (no name): nothing to route, validation decides."""
    if name is None or not several_engines():
        yield
        return
    ref, _ = await sync_to_async(model_resolve)(name=name)
    with using_engine(route_model(ref.name)):
        yield
