"""Tokens through llama.cpp's own vocabulary, and the GGUF's chat template.

``LlamaTokenizer`` is the small part of a Hugging Face tokenizer that the shared
``Sequence`` and ``IncrementalDetokenizer`` call (``decode``).  The chat template is the
file's ``tokenizer.chat_template``, rendered the way transformers renders one (a
sandboxed Jinja environment with ``trim_blocks``/``lstrip_blocks``, ``raise_exception``)
so a chat prompt is the same text on both backends.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ...errors import InvalidParameter
from .native import NativeModel


class LlamaTokenizer:
    def __init__(self, native: NativeModel) -> None:
        self.native = native

    def decode(
        self,
        ids: Sequence[int],
        skip_special_tokens: bool = False,
        clean_up_tokenization_spaces: bool = False,
    ) -> str:
        return self.native.detokenize(list(ids), skip_special=skip_special_tokens)


class ChatTemplate:
    def __init__(self, source: str | None, *, bos: str, eos: str) -> None:
        self.source = source
        self.bos = bos
        self.eos = eos
        self._template = None
        if source:
            from jinja2.ext import loopcontrols
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message: str) -> None:
                raise ValueError(message)

            env = ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
            )
            env.globals["raise_exception"] = raise_exception
            self._template = env.from_string(source)

    @classmethod
    def from_model(cls, native: NativeModel, tokenizer: LlamaTokenizer) -> ChatTemplate:
        from llama_cpp import llama_cpp as lc

        def text(tok: int) -> str:
            return tokenizer.decode([tok]) if tok >= 0 else ""

        return cls(
            native.meta("tokenizer.chat_template"),
            bos=text(lc.llama_vocab_bos(native.vocab)),
            eos=text(lc.llama_vocab_eos(native.vocab)),
        )

    def render(
        self, messages: list[dict[str, Any]], *, add_generation_prompt: bool, **kwargs: Any
    ) -> str:
        if self._template is None:
            raise InvalidParameter(
                "this model has no chat template; send a prompt instead", param="messages"
            )
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos,
                eos_token=self.eos,
                **kwargs,
            )
        except Exception as exc:  # jinja errors for malformed messages
            raise InvalidParameter(
                f"cannot apply the chat template: {exc}", param="messages"
            ) from exc


__all__ = ["ChatTemplate", "LlamaTokenizer"]
