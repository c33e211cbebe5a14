"""What every built-in analyzer reads the same way: the keys of its params (an unknown
one is refused, naming the known ones) and the length of the captured prompt."""

from __future__ import annotations

from typing import Any

from .registry import params_error


def prompt_len(capture: Any) -> int:
    return len(capture.meta["prompt_token_ids"])


def unknown_keys(params: dict[str, Any], allowed: set[str], analyzer: str) -> None:
    if not isinstance(params, dict):
        raise params_error(analyzer, "params must be an object")
    extra = sorted(set(params) - allowed)
    if extra:
        raise params_error(analyzer, f"unknown params {extra}; known: {sorted(allowed)}")
