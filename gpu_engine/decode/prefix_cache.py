"""The prefix cache's bookkeeping, the same for every backend that keeps its own KV
(transformers, llama.cpp; vLLM has its own): which stored prompt KV a new request may
reuse, how much, and what to evict (docs/engine.md, "Prefix cache").

An entry is the KV of a token sequence, computed as a prompt under some steering: keyed
by (namespace, prompt-steering key, token ids).  A lookup finds the stored entry under the
same namespace and steering key whose tokens share the longest prefix with the new
prompt, and reuses that prefix less at least one token (the request still prefills its
last prompt token, so it gets its own logits and its own last-row reads).  Entries are
evicted least recently used first when their bytes pass the budget.  What an entry holds
is the backend's: an opaque payload and its size in bytes.

Which requests may look up, and what their key is, is decided here too (``plan``), once
for every backend: steering that changes a prompt row's residual gets its own key (the
canonical steering hash of the controls that touch the prompt); a request that reads
prompt rows (monitoring or capture of prompt positions, prompt logprobs, attention
capture) recomputes its whole prompt (no lookup) but may store.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..api.steering import FeatureControl, SteeringEntry, SteeringSpec

# the classes a lookup is counted under
CLASSES = ("unsteered", "prompt_steered", "decode_only")
# the steering key of KV computed without steering (decode-only steering shares it)
UNSTEERED = ""
# PREFIX_CACHE_MAX_MB when unset
DEFAULT_MAX_MB = 256


def _touches_prompt(control: FeatureControl, prompt_len: int) -> bool:
    """Whether ``control`` may change a residual row below ``prompt_len``: not when it is
    gated to the completion, nor when its window starts at or after the prompt's end.  A
    condition counts as touching (conservative: its gate reads rows)."""
    if control.no_op:
        return False
    if control.phase == "completion":
        return False
    if control.window is not None and control.window.start >= prompt_len and control.condition is None:
        return False
    return True


def prompt_steering(spec: SteeringSpec | None, prompt_len: int) -> SteeringSpec:
    """The part of ``spec`` that changes rows ``0..prompt_len-1`` (empty: none does)."""
    if spec is None:
        return SteeringSpec()
    entries = []
    for e in spec.entries:
        controls = [c for c in e.controls if _touches_prompt(c, prompt_len)]
        features = {i: s for i, s in e.features.items() if s != 0}
        vectors = [v for v in e.vectors if not v.no_op and v.phase != "completion"]
        if e.splice is not None:  # replaces every row, the prompt's too
            entries.append(SteeringEntry(e.sae_id, e.layer, splice=e.splice))
        elif features or controls or vectors:
            entries.append(SteeringEntry(e.sae_id, e.layer, features, controls, vectors))
    return SteeringSpec(entries)


def steering_key(spec: SteeringSpec | None, prompt_len: int) -> str:
    """The cache key of KV computed as a ``prompt_len``-token prompt under ``spec``:
    ``UNSTEERED`` when nothing touches the prompt, else the canonical steering hash of
    what does (docs/steering.md, "The steering hash")."""
    part = prompt_steering(spec, prompt_len)
    return UNSTEERED if part.is_empty() else part.canonical_hash()


def phase_free(spec: SteeringSpec | None) -> bool:
    """Whether ``spec`` steers a generated row exactly as it would the same row in a
    prompt (no control gated by phase): then the KV of generated tokens may be stored
    with the prompt's, as if the whole sequence had been a prompt."""
    if spec is None:
        return True
    return all(c.phase == "all" or c.no_op for e in spec.entries for c in e.controls) and all(
        v.phase == "all" or v.no_op for e in spec.entries for v in e.vectors
    )


def _reads_prompt_rows(positions: Any, prompt_len: int) -> bool:
    if isinstance(positions, str):
        return positions in ("prompt", "all", "last_prompt")
    start = getattr(positions, "start", 0)
    return start < prompt_len


@dataclass(frozen=True)
class CachePlan:
    """What one request does with the cache: its class, its steering key, whether it
    may look up (``lookup``) and how many of its final tokens' KV it may store
    (``store_generated``: the generated tokens' too, or the prompt's only)."""

    klass: str
    key: str
    lookup: bool
    store_generated: bool
    steering: SteeringSpec | None = None
    namespace: str | None = None  # GenerationJob.cache_namespace

    def store_key(self, length: int) -> str:
        """The key to store KV of ``length`` tokens under (the steering that touches the
        first ``length`` rows, as if they had all been a prompt)."""
        return steering_key(self.steering, length)


def plan(job: Any, prompt_len: int) -> CachePlan:
    """``job`` (a ``GenerationJob``)'s use of the cache, for a ``prompt_len``-token prompt."""
    spec = job.steering
    key = steering_key(spec, prompt_len)
    if key != UNSTEERED:
        klass = "prompt_steered"
    elif spec is not None and not spec.is_empty():
        klass = "decode_only"
    else:
        klass = "unsteered"
    lookup = True
    monitor = job.monitor
    if monitor is not None and any(_reads_prompt_rows(e.positions, prompt_len) for e in monitor.entries):
        lookup = False
    if job.capture is not None:  # any capture: its rows (and attention) are read whole
        lookup = False
    if spec is not None and any(c.condition is not None for e in spec.entries for c in e.controls):
        lookup = False  # a condition reports where it fired, prompt rows included
    sampling = job.sampling
    if getattr(sampling, "prompt_logprobs", False) or getattr(sampling, "echo", False):
        lookup = False
    # distributions read the prompt rows' logits, which stored KV does not hold
    if getattr(job, "distributions_from", None) is not None:
        lookup = False
    return CachePlan(
        klass=klass,
        key=key,
        lookup=lookup,
        store_generated=phase_free(spec),
        steering=spec,
        namespace=job.cache_namespace,
    )


def prefix_kwargs(backend: Any, job: Any, prompt_ids: Sequence[int]) -> dict[str, Any]:
    """What the runtime adds to ``generate`` / ``new_sequence`` for a backend that keeps a
    prefix cache (its ``prefix_cache`` attribute, on): ``prefix_plan``, this request's
    ``CachePlan``; nothing for any other backend."""
    cache = getattr(backend, "prefix_cache", None)
    if cache is None or not cache.enabled:
        return {}
    return {"prefix_plan": plan(job, len(prompt_ids))}


@dataclass(frozen=True)
class PrefixHit:
    """A lookup's answer: reuse the first ``length`` tokens of ``payload`` (an entry of
    ``stored`` tokens, ``length <= stored``); prefill the prompt from ``length`` on."""

    payload: Any
    length: int
    stored: int


@dataclass
class _Entry:
    tokens: tuple[int, ...]
    payload: Any
    nbytes: int


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefixCache:
    """Stored prompt KV, LRU by bytes under ``max_bytes`` (0: off: lookups miss and
    stores drop), with per-class counters.  Thread-safe; a payload handed out by
    ``lookup`` stays valid for its holder even if the entry is evicted meanwhile (the
    cache only drops its reference)."""

    def __init__(
        self, max_bytes: int, *, max_entries: int | None = None, on_drop: Callable[[Any], None] | None = None
    ) -> None:
        self.max_bytes = max(0, int(max_bytes))
        # a backend whose entries are scarce handles (llama.cpp: KV sequence ids) caps
        # their number, and is handed each dropped entry's payload to free it (``on_drop``,
        # called outside the lock for every entry superseded, evicted or cleared)
        self.max_entries = max_entries
        self.on_drop = on_drop
        self._dropped: list[Any] = []
        self._lock = threading.Lock()
        self._entries: OrderedDict[tuple[str, str, tuple[int, ...]], _Entry] = OrderedDict()
        self._bytes = 0
        self._counters = {k: {"lookups": 0, "hits": 0, "tokens_reused": 0, "bypassed": 0} for k in CLASSES}
        self._stores = 0
        self._evictions = 0
        self._clears = 0

    @classmethod
    def from_mb(cls, mb: Any, **kw: Any) -> PrefixCache:
        """A cache of ``mb`` MiB (None: ``DEFAULT_MAX_MB``); ``kw``: ``max_entries``, ``on_drop``."""
        return cls(int((DEFAULT_MAX_MB if mb is None else float(mb)) * 1024 * 1024), **kw)

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def lookup(self, *, namespace: str | None, key: str, tokens: Sequence[int], klass: str) -> PrefixHit | None:
        """The longest stored prefix of ``tokens`` under (namespace, key), at most
        ``len(tokens) - 1`` tokens; counted under ``klass``.  None: nothing to reuse."""
        if not self.enabled:
            return None
        ns = namespace or ""
        limit = len(tokens) - 1
        with self._lock:
            self._counters[klass]["lookups"] += 1
            best: tuple[int, tuple[str, str, tuple[int, ...]]] | None = None
            for k, entry in self._entries.items():
                if k[0] != ns or k[1] != key:
                    continue
                n = min(_common(entry.tokens, tokens), limit)
                if n > 0 and (best is None or n > best[0]):
                    best = (n, k)
            if best is None:
                return None
            n, k = best
            entry = self._entries[k]
            self._entries.move_to_end(k)
            self._counters[klass]["hits"] += 1
            self._counters[klass]["tokens_reused"] += n
            return PrefixHit(payload=entry.payload, length=n, stored=len(entry.tokens))

    def bypass(self, klass: str) -> None:
        """Count a request of ``klass`` that recomputed its prompt without looking up."""
        with self._lock:
            self._counters[klass]["bypassed"] += 1

    def wants(self, *, namespace: str | None, key: str, tokens: Sequence[int]) -> bool:
        """Whether ``store`` of ``tokens`` would keep anything (not when the cache is off,
        or an entry already holds ``tokens`` or a longer sequence starting with them):
        a backend asks before it copies KV out."""
        if not self.enabled or not tokens:
            return False
        ns, t = namespace or "", tuple(tokens)
        with self._lock:
            for k, entry in self._entries.items():
                if k[0] == ns and k[1] == key and len(entry.tokens) >= len(t) and entry.tokens[: len(t)] == t:
                    self._entries.move_to_end(k)
                    return False
        return True

    def store(self, *, namespace: str | None, key: str, tokens: Sequence[int], payload: Any, nbytes: int) -> bool:
        """Keep ``payload`` (the KV of ``tokens``, ``nbytes`` bytes) under (namespace,
        key); entries it extends (their tokens a prefix of ``tokens``) are dropped, then
        the least recently used until the total fits.  False: not kept (off, larger
        than the budget, or already covered)."""
        if not self.enabled or not tokens or nbytes > self.max_bytes:
            return False
        try:
            return self._store(namespace, key, tuple(tokens), payload, int(nbytes))
        finally:
            self._release()

    def _store(self, namespace: str | None, key: str, t: tuple[int, ...], payload: Any, nbytes: int) -> bool:
        ns = namespace or ""
        with self._lock:
            for k, entry in list(self._entries.items()):
                if k[0] != ns or k[1] != key:
                    continue
                if len(entry.tokens) >= len(t) and entry.tokens[: len(t)] == t:
                    self._entries.move_to_end(k)
                    return False
                if t[: len(entry.tokens)] == entry.tokens:
                    self._drop(k)
            self._entries[(ns, key, t)] = _Entry(t, payload, int(nbytes))
            self._bytes += int(nbytes)
            self._stores += 1
            while self._bytes > self.max_bytes or (
                self.max_entries is not None and len(self._entries) > self.max_entries
            ):
                self._drop(next(iter(self._entries)))
                self._evictions += 1
            return True

    def _drop(self, k: tuple[str, str, tuple[int, ...]]) -> None:
        entry = self._entries.pop(k)
        self._bytes -= entry.nbytes
        self._dropped.append(entry.payload)

    def _release(self) -> None:
        """Hand the dropped entries' payloads to ``on_drop``, outside the lock."""
        with self._lock:
            dropped, self._dropped = self._dropped, []
        if self.on_drop is not None:
            for payload in dropped:
                self.on_drop(payload)

    def evict_lru(self) -> bool:
        """Drop the least recently used entry (counted as an eviction): a backend that
        needs its room back (llama.cpp: a decode with no free KV cell).  False: none."""
        with self._lock:
            if not self._entries:
                return False
            self._drop(next(iter(self._entries)))
            self._evictions += 1
        self._release()
        return True

    def clear(self) -> None:
        """Forget every entry (a model load or unload, an attachment change)."""
        with self._lock:
            if self._entries:
                self._clears += 1
            self._dropped.extend(e.payload for e in self._entries.values())
            self._entries.clear()
            self._bytes = 0
        self._release()

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def status(self) -> dict[str, Any]:
        """Budget, bytes, entries, and per class: lookups, hits, tokens reused, bypasses
        and the hit rate (hits / lookups, None before any lookup)."""
        with self._lock:
            classes = {}
            for k, c in self._counters.items():
                classes[k] = dict(c, hit_rate=(c["hits"] / c["lookups"]) if c["lookups"] else None)
            return {
                "enabled": self.enabled,
                "budget_bytes": self.max_bytes,
                "bytes": self._bytes,
                "entries": len(self._entries),
                "stores": self._stores,
                "evictions": self._evictions,
                "clears": self._clears,
                "classes": classes,
            }


__all__ = [
    "CLASSES",
    "DEFAULT_MAX_MB",
    "UNSTEERED",
    "CachePlan",
    "PrefixCache",
    "PrefixHit",
    "phase_free",
    "plan",
    "prefix_kwargs",
    "prompt_steering",
    "steering_key",
]
