"""Constrained decoding for ``response_format`` (``SamplingParams.structured``), on xgrammar.

xgrammar (the grammar engine vLLM and SGLang use) turns a JSON schema into a grammar over
this model's vocabulary and keeps, per request, a matcher that says which tokens may come
next.  Per loaded model, ``Grammars`` builds the tokenizer's vocabulary info once and
keeps compiled grammars by schema text; per request, ``RequestGrammar`` holds the matcher
and its one-row token bitmask.  The request's ``Sampler`` masks only its own row's logits
with it before choosing (greedy or sampled), and ``Sequence`` feeds every chosen token
back and finishes with ``stop`` once the grammar is complete.  A grammar's end is one of
the model's EOS tokens, which the mask allows only there.

Tool calls (``tool_call``): a call is the envelope the chat template's family writes
(``TOOL_CALL_FORMATS``) around arguments valid for the function's ``parameters``.
``hermes``: ``<tool_call>\n{"name": "<f>", "arguments": <args>}\n</tool_call>``, built
as xgrammar structural tags, one tag per function (the name a literal of its begin
string): ``required`` is one of those tags and nothing else, ``auto`` is free text in
which each ``<tool_call>`` the model writes dispatches to them (``triggered_tags``;
``auto_single`` ends the output after the first call).
``json``: one ``{"name": …, "arguments": …}`` object, an ``anyOf`` over the functions.
The arguments are compact JSON (xgrammar's ``", "``/``": "`` separators, no other
whitespace), as for ``response_format``.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

import torch
import xgrammar as xg

from ...errors import ResponseFormatUnsupported
from ...protocol import StructuredOutput

# compiled grammars kept per model (schema text → grammar); a compiled JSON grammar of a
# small schema is tens of kB
GRAMMAR_CACHE_SIZE = 128
# json_object: any JSON object (extra keys allowed, the schema names none)
_ANY_OBJECT = '{"type": "object"}'
# the hermes envelope around a call's name and arguments
HERMES_TRIGGER = "<tool_call>"
HERMES_BEGIN = '<tool_call>\n{"name": '
HERMES_END = "}\n</tool_call>"


class Grammars:
    """One loaded model's grammar compiler: its vocabulary info (built once, at the first
    structured request) and an LRU of compiled grammars by (type, schema text)."""

    def __init__(self, tokenizer: Any, *, vocab_size: int, stop_token_ids: set[int]) -> None:
        self.vocab_size = vocab_size
        self.info = xg.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                      stop_token_ids=sorted(stop_token_ids))
        # its own cache stays off: ours is bounded and keyed by what the request sent
        self.compiler = xg.GrammarCompiler(self.info, max_threads=2, cache_enabled=False)
        self._compiled: OrderedDict[tuple[str, ...], xg.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, spec: StructuredOutput) -> xg.CompiledGrammar:
        key = (spec.type, spec.schema, spec.tool_format, spec.tool_mode)
        with self._lock:
            hit = self._compiled.get(key)
            if hit is not None:
                self._compiled.move_to_end(key)
                return hit
        try:
            # compact JSON (no free whitespace): a small model cannot pad its answer with
            # newlines until max_tokens, and the output is the same JSON
            if spec.type == "tool_call":
                compiled = self._tool_call(spec)
            elif spec.type == "json_object":
                compiled = self.compiler.compile_json_schema(_ANY_OBJECT, any_whitespace=False, strict_mode=False)
            else:
                # strict: no properties or items the schema does not name (OpenAI's strict)
                compiled = self.compiler.compile_json_schema(spec.schema, any_whitespace=False, strict_mode=True)
        except (RuntimeError, ValueError, TypeError) as exc:
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ResponseFormatUnsupported(f"response_format: the schema cannot be compiled to a grammar: {reason}",
                                            reason=reason) from None
        with self._lock:
            self._compiled[key] = compiled
            while len(self._compiled) > GRAMMAR_CACHE_SIZE:
                self._compiled.popitem(last=False)
        return compiled

    def _tool_call(self, spec: StructuredOutput) -> xg.CompiledGrammar:
        functions = json.loads(spec.schema)
        if spec.tool_format == "json":
            envelopes = [{"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": f["parameters"]},
                          "required": ["name", "arguments"]} for f in functions]
            return self.compiler.compile_json_schema(json.dumps({"anyOf": envelopes}), any_whitespace=False,
                                                     strict_mode=True)
        tags = [{"type": "tag", "begin": HERMES_BEGIN + json.dumps(f["name"]) + ', "arguments": ',
                 "content": {"type": "grammar", "grammar": str(xg.Grammar.from_json_schema(
                     json.dumps(f["parameters"]), any_whitespace=False, strict_mode=True))},
                 "end": HERMES_END} for f in functions]
        if spec.tool_mode == "required":
            fmt: dict[str, Any] = tags[0] if len(tags) == 1 else {"type": "or", "elements": tags}
        else:
            fmt = {"type": "triggered_tags", "triggers": [HERMES_TRIGGER], "tags": tags,
                   "stop_after_first": spec.tool_mode == "auto_single"}
        return self.compiler.compile_structural_tag(json.dumps({"type": "structural_tag", "format": fmt}))

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


__all__ = ["GRAMMAR_CACHE_SIZE", "Grammars", "RequestGrammar"]
