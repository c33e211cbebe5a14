"""Serving one /v1 embeddings request: the one execution of ``POST /v1/embeddings``, for
the route (``inference.views``) and for a batch line (``batches.lines``). The model is
checked before anything loads, the engine embeds on a worker thread (the event loop never
blocks), and the answer is OpenAI's ``CreateEmbeddingResponse``."""

from __future__ import annotations

import asyncio
import base64
import struct
import uuid
from typing import Any

from core.metrics import record_tokens
from core.runtime import runtime
from gpu_engine.api.protocol import EmbedJob
from inference.planning import resolve_model
from inference.policy import check_dimensions, ignored_headers
from inference.protocol import EmbeddingData, EmbeddingRequest, EmbeddingResponse, UsageInfo
from inference.routing import routed
from inference.residency import resident_model_id

ENGINE_CALL_TIMEOUT_S = 300.0


def _encode(vector: list[float], fmt: str) -> list[float] | str:
    if fmt == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()


async def serve_embeddings(
    *,
    req: EmbeddingRequest,
    ignored: list[str],
    policy: str,
    lease: str | None = None,
    priority: str = "interactive",
    admit: bool = True,
) -> tuple[dict[str, Any], dict[str, str]]:
    """The answer's body and headers. ``admit``: take an admission slot (the route); a
    batch line does not, and its job waits behind interactive work (``priority``)."""
    async with routed(req.model):  # with several engines: the model's engine
        return await _serve_embeddings(
            req=req, ignored=ignored, policy=policy, lease=lease, priority=priority, admit=admit
        )


async def _serve_embeddings(
    *, req: EmbeddingRequest, ignored: list[str], policy: str, lease: str | None, priority: str, admit: bool
) -> tuple[dict[str, Any], dict[str, str]]:
    client = runtime().engine
    residency = runtime().residency
    status = await residency.status()
    model, _ = await resolve_model(req.model, status)
    check_dimensions(req.dimensions, model.hidden_size)  # before anything loads, where known
    residency.check_policy(model, policy=policy, resident=resident_model_id(status), draining=status.draining)
    permit = await runtime().admission.acquire() if admit else None
    use = None
    try:
        # a status read before a wait in the queue may be stale: read it again then
        use = await residency.acquire(
            model, policy=policy, status=None if permit is not None and permit.waited else status, lease=lease
        )
        check_dimensions(req.dimensions, use.status.hidden_size)
        result = await asyncio.to_thread(
            client.embed,
            EmbedJob(
                request_id=f"embd-{uuid.uuid4().hex}",
                inputs=list(req.input),
                pooling="mean",
                normalize=True,
                priority=priority,
            ),
            timeout_s=ENGINE_CALL_TIMEOUT_S,
        )
    finally:
        if use is not None:
            use.release()
        if permit is not None:
            permit.release()
    record_tokens(model=model.name, completion_tokens=0, prompt_tokens=result.usage.prompt_tokens)
    body = EmbeddingResponse(
        data=[
            EmbeddingData(index=i, embedding=_encode(v, req.encoding_format)) for i, v in enumerate(result.embeddings)
        ],
        model=model.name,
        usage=UsageInfo(prompt_tokens=result.usage.prompt_tokens, total_tokens=result.usage.total_tokens),
    )
    return (
        body.model_dump(exclude={"usage": {"completion_tokens"}}),
        {"X-miLLM-Backend": client.backend_name, "X-miLLM-Steering": "none", **ignored_headers(ignored)},
    )
