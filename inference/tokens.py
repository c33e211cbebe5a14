"""Token texts for response fields the engine reports by id only (echoed prompt tokens,
the token at each activation position).

The web tier must not need torch, so this reads the checkpoint's ``tokenizer.json`` with
the ``tokenizers`` library (no torch) when the files are on this machine; where they are
not (a web host in the distributed topology) callers fall back to ``token_id:<id>``.
"""

from __future__ import annotations

import functools
import threading
from pathlib import Path
from typing import Any

_lock = threading.Lock()


@functools.lru_cache(maxsize=4)
def _load(path: str) -> Any:
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return None
    file = Path(path) / "tokenizer.json"
    if not file.is_file():
        return None
    try:
        return Tokenizer.from_file(str(file))
    except Exception:  # noqa: BLE001 - an unreadable tokenizer only costs the texts
        return None


class TokenTexts:
    def __init__(self, model_path: str | None) -> None:
        with _lock:
            self._tok = _load(model_path) if model_path else None

    @property
    def available(self) -> bool:
        return self._tok is not None

    def token(self, token_id: int) -> str:
        if self._tok is None:
            return f"token_id:{token_id}"
        return self._tok.decode([int(token_id)], skip_special_tokens=False)

    def text(self, ids: list[int]) -> str:
        if self._tok is None:
            return ""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)
