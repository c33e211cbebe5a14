"""How big a capture may get, before anything runs: the rows a positions mode can take
(``rows_for``), the loaded model's attention heads (``AttentionGeometry``) and the
worst-case bytes of a request's artifact (``estimate_bytes``, checked against
``CaptureSpec.max_bytes``)."""

from __future__ import annotations

from dataclasses import dataclass

from ...api.protocol import CaptureSpec

ROW_META_BYTES = 16  # positions + token_ids, int64 each
QK_ROW_META_BYTES = 8  # q_positions / k_positions, int64


def rows_for(positions: str, prompt_len: int, max_tokens: int) -> int:
    """The most rows a capture can take: ``last`` and ``last_prompt`` one, ``prompt`` the
    prompt, ``completion`` one per generated token, ``all`` every row computed (the final
    token is never fed)."""
    if positions in ("last", "last_prompt"):
        return 1
    if positions == "prompt":
        return prompt_len
    if positions == "completion":
        return max(max_tokens, 1)
    return prompt_len + max(max_tokens, 1) - 1


@dataclass(frozen=True)
class AttentionGeometry:
    """The loaded model's attention heads, for Q/K capture."""

    num_heads: int
    num_kv_heads: int
    head_dim: int

    @property
    def group(self) -> int:
        return self.num_heads // self.num_kv_heads

    def kv_heads_for(self, heads: list[int]) -> list[int]:
        """The KV heads query ``heads`` read (transformers' ``repeat_kv`` order)."""
        return sorted({h // self.group for h in heads})


def estimate_bytes(
    spec: CaptureSpec,
    *,
    prompt_len: int,
    max_tokens: int,
    hidden_size: int,
    itemsize: int,
    geometry: AttentionGeometry | None = None,
) -> tuple[int, int]:
    """(worst-case tensor bytes of the artifact, rows of the largest part)."""
    rows = rows_for(spec.positions, prompt_len, max_tokens) if spec.layers else 0
    total = rows * (len(spec.layers) * hidden_size * itemsize + ROW_META_BYTES)
    att = spec.attention
    if att is not None and geometry is not None:
        heads = att.heads if att.heads is not None else list(range(geometry.num_heads))
        q_rows = rows_for(att.query_positions, prompt_len, max_tokens)
        k_rows = rows_for(att.positions, prompt_len, max_tokens)
        width = geometry.head_dim * itemsize * len(att.layers)
        total += q_rows * (len(heads) * width + QK_ROW_META_BYTES)
        total += k_rows * (len(geometry.kv_heads_for(heads)) * width + QK_ROW_META_BYTES)
        rows = max(rows, q_rows, k_rows)
    return total, rows
