"""Tokens through llama.cpp's own vocabulary, and the GGUF's chat template.

``LlamaTokenizer`` is the small part of a Hugging Face tokenizer that the shared
``Sequence`` and ``IncrementalDetokenizer`` call (``decode``); ``grammar_vocabulary`` is
the vocabulary as xgrammar reads it (``gpu_engine.decode.grammar``).  The chat template is the
file's ``tokenizer.chat_template``, rendered the way transformers renders one (a
sandboxed Jinja environment with ``trim_blocks``/``lstrip_blocks``, ``raise_exception``)
so a chat prompt is the same text on both backends.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ...api.errors import InvalidParameter
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


def grammar_vocabulary(native: NativeModel) -> list[bytes]:
    """Each token's bytes as it decodes (``llama_token_to_piece``, no leading space
    stripped), indexed by id, for xgrammar's ``TokenizerInfo`` (``VocabType.RAW``): the
    GGUF's own vocabulary whatever its tokenizer family (byte-level BPE, SentencePiece with
    byte fallback).  Control, unknown and unused tokens never appear in text (the engine's
    detokeniser skips them): ``b""``, which the grammar allows nowhere, or only at the end
    where it is a stop token."""
    import ctypes

    from llama_cpp import llama_cpp as lc

    hidden = lc.LLAMA_TOKEN_ATTR_CONTROL | lc.LLAMA_TOKEN_ATTR_UNKNOWN | lc.LLAMA_TOKEN_ATTR_UNUSED
    buf = ctypes.create_string_buffer(256)
    pieces: list[bytes] = []
    for tok in range(native.n_vocab):
        if lc.llama_vocab_get_attr(native.vocab, tok) & hidden:
            pieces.append(b"")
            continue
        n = lc.llama_token_to_piece(native.vocab, tok, buf, len(buf), 0, True)
        if n < 0:  # longer than the buffer: -n bytes
            big = ctypes.create_string_buffer(-n)
            n = lc.llama_token_to_piece(native.vocab, tok, big, len(big), 0, True)
            pieces.append(big.raw[:n])
        else:
            pieces.append(buf.raw[:n])
    return pieces


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

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
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

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool, **kwargs: Any) -> str:
        if self._template is None:
            raise InvalidParameter("this model has no chat template; send a prompt instead", param="messages")
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos,
                eos_token=self.eos,
                **kwargs,
            )
        except Exception as exc:  # jinja errors for malformed messages
            raise InvalidParameter(f"cannot apply the chat template: {exc}", param="messages") from exc


__all__ = ["ChatTemplate", "LlamaTokenizer", "grammar_vocabulary"]
