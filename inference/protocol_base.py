"""The /v1 wire models' two bases and the limits they share: OpenAI-shaped bodies
(``_Wire``: unknown keys are ignored, then named by ``inference.policy``) and miLLM's own
extension objects (``_Strict``: a misspelt key is refused). ``inference.protocol`` is the
public face of the wire models."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator

from gpu_engine.api.protocol import SEED_MAX, SEED_MIN  # noqa: F401 - the engine's range, read from here

MAX_N = 16
MAX_TOKENS_LIMIT = 2**31 - 1
MAX_ACTIVATION_TOP_K = 64
MAX_ACTIVATION_FEATURES = 256
MAX_ACTIVATION_ENTRIES = 65_536
MAX_EMBEDDING_INPUTS = 2048
MAX_ALLOWED_TOKEN_IDS = 4096
MAX_EXTRA_CONVERSATIONS = 63


class _Wire(BaseModel):
    # strict: a number is a number and a boolean a boolean (``"n": "2"``, ``"stream":
    # "true"`` and ``"max_tokens": 2.0`` are 400 naming the field, as OpenAI answers them);
    # a float field still takes an integer
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, populate_by_name=True, strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        # OpenAI marks most optional fields nullable (n, stream, logprobs, echo, …), and
        # clients send null for "not given": an optional field's null is its default
        if isinstance(data, dict):
            fields = cls.model_fields
            return {k: v for k, v in data.items() if v is not None or k not in fields or fields[k].is_required()}
        return data

    def unread_fields(self) -> frozenset[str]:
        """Declared fields that this request leaves unread (``inference.policy`` names
        them as ignored when the request sends them)."""
        return frozenset()


class _Strict(BaseModel):
    """Extension objects are ours: a misspelt key is refused, not ignored."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)
