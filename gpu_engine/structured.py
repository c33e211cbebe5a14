"""Constrained decoding for ``response_format`` and tool calls (``SamplingParams.structured``),
on xgrammar: one grammar per request, whichever backend runs it.

xgrammar (the grammar engine vLLM and SGLang use) turns a JSON schema into a grammar over
a model's vocabulary and keeps, per request, a matcher that says which tokens may come
next.  ``grammar_for`` is the one place a ``StructuredOutput`` becomes a grammar, so every
backend enforces the same one:

- the transformers and llama.cpp backends sample themselves: per loaded model,
  ``Grammars`` holds the vocabulary's ``TokenizerInfo`` (from the Hugging Face tokenizer,
  or from the GGUF's vocabulary as raw bytes: ``Grammars.from_vocabulary``) and compiled
  grammars by spec; per request, ``RequestGrammar`` holds the matcher and its one-row
  token bitmask.  The request's ``Sampler`` masks only its own row's logits with it
  before choosing (greedy or sampled), and ``Sequence`` feeds every chosen token back
  and finishes with ``stop`` once the grammar is complete;
- the vLLM backend hands the same grammar, as xgrammar EBNF text (``grammar_text``), to
  vLLM's own structured outputs (its xgrammar backend), per request in its
  ``SamplingParams``, so vLLM's scheduler keeps batching and masks that request's row.

A grammar's end is one of the model's EOS tokens, which the mask allows only there.

JSON is compact (xgrammar's ``", "``/``": "`` separators, no other whitespace): a small
model cannot pad its answer with newlines until ``max_tokens``, and the output is the
same JSON.  ``json_schema`` is strict (no properties or items the schema does not name,
OpenAI's strict); ``json_object`` is any JSON object.

Tool calls (``tool_call``): a call is the envelope the chat template's family writes
(``TOOL_CALL_FORMATS``) around arguments valid for the function's ``parameters``.
``hermes``: ``<tool_call>\\n{"name": "<f>", "arguments": <args>}\\n</tool_call>``, built
as xgrammar structural tags, one tag per function (the name a literal of its begin
string): ``required`` is one of those tags and nothing else, ``auto`` is free text in
which each ``<tool_call>`` the model writes dispatches to them (``triggered_tags``;
``auto_single`` ends the output after the first call).
``json``: one ``{"name": …, "arguments": …}`` object, an ``anyOf`` over the functions.
"""

from __future__ import annotations

import functools
import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch
import xgrammar as xg

from .errors import ResponseFormatUnsupported
from .protocol import StructuredOutput

# compiled grammars kept per model (spec → grammar); a compiled JSON grammar of a small
# schema is tens of kB
GRAMMAR_CACHE_SIZE = 128
# json_object: any JSON object (extra keys allowed, the schema names none)
_ANY_OBJECT = '{"type": "object"}'
# the hermes envelope around a call's name and arguments
HERMES_TRIGGER = "<tool_call>"
HERMES_BEGIN = '<tool_call>\n{"name": '
HERMES_END = "}\n</tool_call>"


def _unsupported(exc: Exception) -> ResponseFormatUnsupported:
    reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return ResponseFormatUnsupported(f"response_format: the schema cannot be compiled to a grammar: {reason}",
                                     reason=reason)


# xgrammar 0.2.8 writes a string with a length bound as repetitions of this class, which
# lets raw control characters (U+0000-U+001F other than CR/LF) into the string: invalid
# JSON.  JSON's own string characters are the class below it.
_LOOSE_STRING_CHAR = r'[^\"\\\r\n]'
_JSON_STRING_CHAR = r'[^\0-\x1f\"\\]'


def _json(schema: str, *, strict: bool) -> xg.Grammar:
    grammar = xg.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=strict)
    text = str(grammar)
    if _LOOSE_STRING_CHAR not in text:
        return grammar
    return xg.Grammar.from_ebnf(text.replace(_LOOSE_STRING_CHAR, _JSON_STRING_CHAR))


def _tool_call(spec: StructuredOutput) -> xg.Grammar:
    functions = json.loads(spec.schema)
    if spec.tool_format == "json":
        envelopes = [{"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": f["parameters"]},
                      "required": ["name", "arguments"]} for f in functions]
        return _json(json.dumps({"anyOf": envelopes}), strict=True)
    tags = [{"type": "tag", "begin": HERMES_BEGIN + json.dumps(f["name"]) + ', "arguments": ',
             "content": {"type": "grammar", "grammar": str(_json(json.dumps(f["parameters"]), strict=True))},
             "end": HERMES_END} for f in functions]
    if spec.tool_mode == "required":
        fmt: dict[str, Any] = tags[0] if len(tags) == 1 else {"type": "or", "elements": tags}
    else:
        fmt = {"type": "triggered_tags", "triggers": [HERMES_TRIGGER], "tags": tags,
               "stop_after_first": spec.tool_mode == "auto_single"}
    return xg.Grammar.from_structural_tag(json.dumps({"type": "structural_tag", "format": fmt}))


def grammar_for(spec: StructuredOutput) -> xg.Grammar:
    """The grammar ``spec`` constrains an output to (see the module doc); a schema xgrammar
    cannot turn into one is ``ResponseFormatUnsupported``."""
    try:
        if spec.type == "tool_call":
            return _tool_call(spec)
        if spec.type == "json_object":
            return _json(_ANY_OBJECT, strict=False)
        return _json(spec.schema, strict=True)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise _unsupported(exc) from None


@functools.lru_cache(maxsize=GRAMMAR_CACHE_SIZE)
def grammar_text(spec: StructuredOutput) -> str:
    """``grammar_for(spec)`` as xgrammar EBNF text (what a grammar engine elsewhere, vLLM's,
    compiles back to the same grammar)."""
    return str(grammar_for(spec))


class Grammars:
    """One loaded model's grammar compiler: its vocabulary info and an LRU of compiled
    grammars by spec (built at the model's first structured request)."""

    def __init__(self, info: xg.TokenizerInfo, *, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.info = info
        # its own cache stays off: ours is bounded and keyed by what the request sent
        self.compiler = xg.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        self._compiled: OrderedDict[StructuredOutput, xg.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def from_huggingface(cls, tokenizer: Any, *, vocab_size: int, stop_token_ids: set[int]) -> Grammars:
        """From a Hugging Face tokenizer (xgrammar reads its vocabulary type itself)."""
        return cls(xg.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                     stop_token_ids=sorted(stop_token_ids)), vocab_size=vocab_size)

    @classmethod
    def from_vocabulary(cls, pieces: Sequence[bytes], *, stop_token_ids: set[int]) -> Grammars:
        """From each token's bytes as it decodes (``pieces[id]``; ``b""`` for a token that
        never appears in text, such as a control token: the mask allows it nowhere, or
        only at the end where it is a stop token)."""
        info = xg.TokenizerInfo(list(pieces), xg.VocabType.RAW, vocab_size=len(pieces),
                                stop_token_ids=sorted(stop_token_ids))
        return cls(info, vocab_size=len(pieces))

    def compile(self, spec: StructuredOutput) -> xg.CompiledGrammar:
        with self._lock:
            hit = self._compiled.get(spec)
            if hit is not None:
                self._compiled.move_to_end(spec)
                return hit
        grammar = grammar_for(spec)
        try:
            compiled = self.compiler.compile_grammar(grammar)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise _unsupported(exc) from None
        with self._lock:
            self._compiled[spec] = compiled
            while len(self._compiled) > GRAMMAR_CACHE_SIZE:
                self._compiled.popitem(last=False)
        return compiled

    def matcher(self, spec: StructuredOutput) -> RequestGrammar:
        return RequestGrammar(self.compile(spec), vocab_size=self.vocab_size)


class RequestGrammar:
    """One request's matcher and token bitmask (host memory; copied to the logits' device
    when they live elsewhere)."""

    def __init__(self, compiled: xg.CompiledGrammar, *, vocab_size: int) -> None:
        self.matcher = xg.GrammarMatcher(compiled)
        self.vocab_size = vocab_size
        self.bitmask = xg.allocate_token_bitmask(1, vocab_size)

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` (V,) float32, owned by the caller, with every token the grammar does
        not allow next set to -inf (in place; returned)."""
        self.matcher.fill_next_token_bitmask(self.bitmask)
        bitmask = self.bitmask if logits.device.type == "cpu" else self.bitmask.to(logits.device, non_blocking=True)
        xg.apply_token_bitmask_inplace(logits.view(1, -1), bitmask, vocab_size=self.vocab_size)
        return logits

    def accept(self, token_id: int) -> None:
        if not self.matcher.accept_token(token_id):
            # the mask allowed only grammar tokens: a refusal here is a bug, not the model's
            raise RuntimeError(f"the grammar refused token {token_id} chosen under its own mask")

    @property
    def terminated(self) -> bool:
        return self.matcher.is_terminated()


__all__ = ["GRAMMAR_CACHE_SIZE", "Grammars", "RequestGrammar", "grammar_for", "grammar_text"]
