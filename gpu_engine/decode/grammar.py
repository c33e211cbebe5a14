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

import json
import logging
import os
import select
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch
import xgrammar as xg

from ..api.errors import EngineBusy, ResponseFormatUnsupported, SchemaTooComplex
from ..api.protocol import StructuredOutput

log = logging.getLogger("gpu_engine.decode.grammar")

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
    return ResponseFormatUnsupported(
        f"response_format: the schema cannot be compiled to a grammar: {reason}", reason=reason
    )


# xgrammar 0.2.8 writes a string with a length bound as repetitions of this class, which
# lets raw control characters (U+0000-U+001F other than CR/LF) into the string: invalid
# JSON.  JSON's own string characters are the class below it.
_LOOSE_STRING_CHAR = r"[^\"\\\r\n]"
_JSON_STRING_CHAR = r"[^\0-\x1f\"\\]"


def _json(schema: str, *, strict: bool) -> xg.Grammar:
    grammar = xg.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=strict)
    text = str(grammar)
    if _LOOSE_STRING_CHAR not in text:
        return grammar
    return xg.Grammar.from_ebnf(text.replace(_LOOSE_STRING_CHAR, _JSON_STRING_CHAR))


def _tool_call(spec: StructuredOutput) -> xg.Grammar:
    functions = json.loads(spec.schema)
    if spec.tool_format == "json":
        envelopes = [
            {
                "type": "object",
                "properties": {"name": {"const": f["name"]}, "arguments": f["parameters"]},
                "required": ["name", "arguments"],
            }
            for f in functions
        ]
        return _json(json.dumps({"anyOf": envelopes}), strict=True)
    tags = [
        {
            "type": "tag",
            "begin": HERMES_BEGIN + json.dumps(f["name"]) + ', "arguments": ',
            "content": {"type": "grammar", "grammar": str(_json(json.dumps(f["parameters"]), strict=True))},
            "end": HERMES_END,
        }
        for f in functions
    ]
    if spec.tool_mode == "required":
        fmt: dict[str, Any] = tags[0] if len(tags) == 1 else {"type": "or", "elements": tags}
    else:
        fmt = {
            "type": "triggered_tags",
            "triggers": [HERMES_TRIGGER],
            "tags": tags,
            "stop_after_first": spec.tool_mode == "auto_single",
        }
    return xg.Grammar.from_structural_tag(json.dumps({"type": "structural_tag", "format": fmt}))


def build_grammar(spec: StructuredOutput) -> xg.Grammar:
    """The grammar ``spec`` constrains an output to (see the module doc), built here and
    now (``GrammarBuilder`` runs this in its child process); a schema xgrammar cannot turn
    into one is ``ResponseFormatUnsupported``."""
    try:
        if spec.type == "tool_call":
            return _tool_call(spec)
        if spec.type == "json_object":
            return _json(_ANY_OBJECT, strict=False)
        return _json(spec.schema, strict=True)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise _unsupported(exc) from None


# grammars built for this process (by ``GrammarBuilder`` before the request reached the
# engine's worker, or by ``grammar_for`` itself), by spec: every backend reads them here
_BUILT: OrderedDict[StructuredOutput, xg.Grammar] = OrderedDict()
_BUILT_LOCK = threading.Lock()


def remember(spec: StructuredOutput, grammar: xg.Grammar) -> None:
    with _BUILT_LOCK:
        _BUILT[spec] = grammar
        _BUILT.move_to_end(spec)
        while len(_BUILT) > GRAMMAR_CACHE_SIZE:
            _BUILT.popitem(last=False)


def built(spec: StructuredOutput) -> xg.Grammar | None:
    with _BUILT_LOCK:
        grammar = _BUILT.get(spec)
        if grammar is not None:
            _BUILT.move_to_end(spec)
        return grammar


def grammar_for(spec: StructuredOutput) -> xg.Grammar:
    """``spec``'s grammar: the one ``GrammarBuilder`` built for it before the request
    reached the worker, else built here (a request that took no builder: a bounded schema,
    checked by the web tier's caps)."""
    grammar = built(spec)
    if grammar is None:
        grammar = build_grammar(spec)
        remember(spec, grammar)
    return grammar


def grammar_text(spec: StructuredOutput) -> str:
    """``grammar_for(spec)`` as xgrammar EBNF text (what a grammar engine elsewhere, vLLM's,
    compiles back to the same grammar)."""
    return str(grammar_for(spec))


# a child's start (Python, torch and xgrammar imports) is not the schema's cost: it has
# its own, generous bound
WORKER_START_TIMEOUT_S = 120.0
# children building grammars at once; a request finding all busy waits for one (its
# deadline running)
GRAMMAR_WORKERS = 2


class _Child:
    """One ``gpu_engine.decode.grammar_worker`` process and its pipes."""

    def __init__(self) -> None:
        env = dict(os.environ)
        # the directory above the gpu_engine package (this file is gpu_engine/decode/grammar.py)
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gpu_engine.decode.grammar_worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
            cwd=root,
        )
        self._buf = b""
        if self.read(time.monotonic() + WORKER_START_TIMEOUT_S) != {"ready": True}:
            self.kill()
            raise RuntimeError("the grammar worker did not start")

    def read(self, deadline: float) -> dict[str, Any] | None:
        """The next answer line, or None when ``deadline`` passed (or the child died)."""
        fd = self.proc.stdout.fileno()  # type: ignore[union-attr]
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                return None
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def ask(self, spec: StructuredOutput, deadline: float) -> dict[str, Any] | None:
        request = {
            "type": spec.type,
            "schema": spec.schema,
            "tool_format": spec.tool_format,
            "tool_mode": spec.tool_mode,
        }
        try:
            self.proc.stdin.write(json.dumps(request).encode() + b"\n")  # type: ignore[union-attr]
            self.proc.stdin.flush()  # type: ignore[union-attr]
        except OSError:
            return None
        return self.read(deadline)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()


# how many build deadlines a schema may wait for a free child (GRAMMAR_WORKERS busy with
# other schemas, each killed at its own deadline) before it is refused as engine_busy
WAIT_DEADLINES = 3


class GrammarBuilder:
    """Builds grammars off the engine's worker thread, with a deadline (the engine's
    ``STRUCTURED_COMPILE_TIMEOUT_S``): the schema-to-grammar conversion in a child process
    (``gpu_engine.decode.grammar_worker``, started at the first structured request and kept),
    killed when it overruns, so a costly schema ends as ``SchemaTooComplex`` and costs
    nothing after its deadline.  The deadline counts the schema's own build only, from
    when a child takes it: a schema that waited for a free child (others' schemas building)
    is not blamed for their time; one that finds none free within ``wait_s`` is
    ``EngineBusy`` (retry).  Built grammars are ``remember``-ed for every backend."""

    def __init__(self, *, timeout_s: float, workers: int = GRAMMAR_WORKERS, wait_s: float | None = None) -> None:
        self.timeout_s = timeout_s
        # the longest a schema waits for a free child before its own deadline starts:
        # past it the request is engine_busy (retry), never blamed on its schema
        self.wait_s = WAIT_DEADLINES * timeout_s if wait_s is None else wait_s
        self.workers = workers
        self._idle: list[_Child] = []
        self._started = 0
        self._cond = threading.Condition()
        self._closed = False
        self.stats = {"built": 0, "timed_out": 0, "building": 0}

    def _take(self, deadline: float) -> tuple[_Child | None, float]:
        """A free child (started now if none is and fewer than ``workers`` run) and the
        seconds its start took (not the schema's cost: the caller's deadline moves by
        them); (None, 0) when none came free before ``deadline``."""
        with self._cond:
            while True:
                if self._closed:
                    return None, 0.0
                if self._idle:
                    return self._idle.pop(), 0.0
                if self._started < self.workers:
                    self._started += 1
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    return None, 0.0
                self._cond.wait(left)
        started = time.monotonic()
        try:
            return _Child(), time.monotonic() - started
        except BaseException:
            with self._cond:
                self._started -= 1
                self._cond.notify()
            raise

    def _give_back(self, child: _Child | None) -> None:
        with self._cond:
            if child is None or self._closed:
                self._started -= 1
            else:
                self._idle.append(child)
            self._cond.notify()
        if child is not None and self._closed:
            child.kill()

    def build(self, spec: StructuredOutput) -> xg.Grammar:
        """``spec``'s grammar (also ``remember``-ed), ``ResponseFormatUnsupported`` when
        xgrammar refuses it, ``SchemaTooComplex`` when it is not built within the
        deadline from when a child took it, ``EngineBusy`` when no child came free within
        ``wait_s``."""
        hit = built(spec)
        if hit is not None:
            return hit
        with self._cond:
            self.stats["building"] += 1
        try:
            child, _ = self._take(time.monotonic() + self.wait_s)
            if child is None:  # none taken, none started: nothing to give back
                raise EngineBusy(
                    f"response_format: every grammar builder ({self.workers}) was busy with "
                    f"other schemas for {self.wait_s:g} s; retry",
                    details={"reason": "grammar_builders_busy", "wait_s": self.wait_s},
                )
            # the schema's own deadline starts now, its child in hand (started, if it was
            # new, before this line: its start is not the schema's cost)
            answer = child.ask(spec, time.monotonic() + self.timeout_s)
            if answer is None:
                child.kill()  # overran (or died): its work is abandoned with it
                self._give_back(None)
                with self._cond:
                    self.stats["timed_out"] += 1
                raise SchemaTooComplex(
                    f"response_format: the schema's grammar was not built within "
                    f"{self.timeout_s:g} s (STRUCTURED_COMPILE_TIMEOUT_S); simplify it "
                    f"(fewer or shorter patterns, smaller repetition bounds)",
                    timeout_s=self.timeout_s,
                )
            self._give_back(child)
        finally:
            with self._cond:
                self.stats["building"] -= 1
        if "error" in answer:
            raise ResponseFormatUnsupported(answer["error"], reason=answer.get("reason", ""))
        grammar = xg.Grammar.deserialize_json(answer["grammar"])
        remember(spec, grammar)
        with self._cond:
            self.stats["built"] += 1
        return grammar

    def close(self) -> None:
        with self._cond:
            self._closed = True
            idle, self._idle = self._idle, []
            self._cond.notify_all()
        for child in idle:
            child.kill()


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
        return cls(
            xg.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_token_ids)),
            vocab_size=vocab_size,
        )

    @classmethod
    def from_vocabulary(cls, pieces: Sequence[bytes], *, stop_token_ids: set[int]) -> Grammars:
        """From each token's bytes as it decodes (``pieces[id]``; ``b""`` for a token that
        never appears in text, such as a control token: the mask allows it nowhere, or
        only at the end where it is a stop token)."""
        info = xg.TokenizerInfo(
            list(pieces), xg.VocabType.RAW, vocab_size=len(pieces), stop_token_ids=sorted(stop_token_ids)
        )
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


__all__ = [
    "GRAMMAR_CACHE_SIZE",
    "GrammarBuilder",
    "Grammars",
    "RequestGrammar",
    "build_grammar",
    "grammar_for",
    "grammar_text",
    "remember",
]
