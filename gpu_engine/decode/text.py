"""Backend-agnostic text handling: incremental detokenisation, stop sequences, and how a
chat template writes tool calls."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

# Prompt tokens decoded in front of the first generated token, so that a leading space
# (SentencePiece "▁x") survives the detokeniser's start-of-text stripping.
_PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Text deltas from a growing token list, holding back incomplete UTF-8 sequences.

    Decodes a short sliding window (prefix + new tokens) and emits the difference, which is
    what vLLM and TGI do: a whole-sequence decode per token would be quadratic.
    """

    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int]) -> None:
        self.tok = tokenizer
        self.ids: list[int] = list(prompt_ids[-_PROMPT_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def step(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return full[len(prefix) :]
        return ""

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the very end)."""
        if self.read_offset >= len(self.ids):
            return ""
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix) :] if full.startswith(prefix) else ""


class StopMatcher:
    """Finds the earliest stop sequence in generated text and how much must be held back.

    Text that could still become a stop sequence is not released while streaming, so a
    client never sees a stop sequence's first characters.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self.max_len = max((len(s) for s in self.stops), default=0)

    def find(self, text: str, new_from: int) -> int:
        """Index where the earliest stop sequence starts, searching only where new text can
        complete one; -1 if none."""
        if not self.stops:
            return -1
        start = max(0, new_from - self.max_len + 1)
        best = -1
        for s in self.stops:
            i = text.find(s, start)
            if i != -1 and (best == -1 or i < best):
                best = i
        return best

    def holdback(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop."""
        hold = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(text)), hold, -1):
                if text.endswith(s[:n]):
                    hold = n
                    break
        return hold


# a tool for probing a chat template: rendering with it must differ from rendering without
_PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "millm_probe_tool",
        "description": "probe",
        "parameters": {"type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]},
    },
}


def tool_template_format(template: Any, render: Callable[..., str]) -> str | None:
    """How a chat template (its source ``template``, rendered to text by ``render(messages,
    add_generation_prompt=True, **kwargs)``) writes tool calls (``TOOL_CALL_FORMATS``), or
    None when it does not render tools: a template that ignores ``tools`` renders the
    same text with and without one.  ``hermes`` when the template speaks of
    ``<tool_call>`` (Hermes, Qwen 2.5/3, SmolLM3), else ``json`` (a bare JSON object)."""
    if not template or not isinstance(template, str):
        return None
    messages = [{"role": "user", "content": "probe"}]
    try:
        plain = render(messages, add_generation_prompt=True)
        with_tool = render(messages, add_generation_prompt=True, tools=[_PROBE_TOOL])
    except Exception:  # noqa: BLE001 - a template that fails on tools does not support them
        return None
    if plain == with_tool or "millm_probe_tool" not in with_tool:
        return None
    return "hermes" if "<tool_call>" in template else "json"


__all__ = ["IncrementalDetokenizer", "StopMatcher", "tool_template_format"]
