"""The prefix cache on llama.cpp (PREFIX_CACHE_MAX_MB; the bookkeeping — keys, lookups,
LRU by bytes, counters — is ``gpu_engine.decode.prefix_cache``, shared with the
transformers backend).

A stored entry is a KV sequence of its own, resident in the context: llama.cpp's unified
KV cache lets several sequence ids own one cell, so keeping a finished request's KV is
``llama_memory_seq_cp`` of its cells to a spare sequence id (a cache slot) and reusing
it is ``llama_memory_seq_cp`` of the first ``length`` cells of that slot to the new
request's sequence — no KV is copied either way, the cells only gain an owner.  The new
request then prefills its prompt from ``length`` on, at positions ``length..``, through
the same decodes, eval callback and steering as any prompt rows (steering windows and
monitors see the suffix rows at their own positions).  The reused cells are the ones an
earlier request computed from the same tokens under the same prompt steering (the key),
so they hold what a prefill of that prefix would (up to the kernels' summation order
over a differently split batch).

An entry's bytes are its tokens × the KV bytes per token (``_kv_bytes_per_token``): what
it would hold alone (cells shared with a live request or another entry count for each).
The cache lives in the context's spare cells — the KV is sized for every live row's full
window, so a live request never waits for it: a decode that finds no free cell evicts
entries, least recently used first, until it fits (``decode``).  Slots are few
(``CACHE_SLOTS`` sequence ids past the live rows and the scratch sequence), so the cache
also evicts by count.  The cache is emptied when the context is rebuilt (a new batch
size) and when an SAE is attached or detached (its keys name SAEs by id).
"""

from __future__ import annotations

from typing import Any

from ...api.errors import InsufficientMemory
from ...decode.prefix_cache import CachePlan, PrefixCache

# sequence ids kept for stored entries
CACHE_SLOTS = 16
# llama.cpp's LLAMA_MAX_SEQ (src/llama-cparams.h; not in the Python bindings): sequence
# ids a context may have in all, live rows and scratch first
MAX_SEQ = 256


class ResidentPrefixCache:
    """Stored prompt KV as resident sequences of ``backend``'s context (module doc)."""

    def __init__(self, backend: Any, max_mb: Any) -> None:
        self.backend = backend
        self.bytes_per_token = backend._kv_bytes_per_token()
        self.cache = PrefixCache.from_mb(max_mb, max_entries=CACHE_SLOTS, on_drop=self._drop)
        self.slots: list[int] = []
        self._free: list[int] = []

    @property
    def enabled(self) -> bool:
        return self.cache.enabled

    def n_slots(self, first_seq: int) -> int:
        """The slots a context whose live sequences are ``0..first_seq-1`` keeps."""
        return max(0, min(CACHE_SLOTS, MAX_SEQ - first_seq)) if self.enabled else 0

    def reset(self, first_seq: int) -> None:
        """A new context: its slots are ``first_seq..``; every entry is gone with the old
        one's KV."""
        self.slots = []
        self._free = []
        self.cache.clear()
        self.slots = list(range(first_seq, first_seq + self.n_slots(first_seq)))
        self._free = list(reversed(self.slots))

    def clear(self) -> None:
        """Forget every entry (its slot's cells freed): an SAE attached or detached."""
        self.cache.clear()

    def _drop(self, slot: int) -> None:
        if slot not in self.slots:  # an entry of a context replaced since
            return
        ctx = self.backend.context
        if ctx is not None:
            ctx.seq_clear(slot)
        self._free.append(slot)

    def evict_one(self) -> bool:
        """Drop the least recently used entry, freeing its cells; False: none left."""
        return self.cache.evict_lru()

    # ------------------------------------------------------------------ requests

    def admit(self, seq: Any, prefix_plan: CachePlan | None) -> None:
        """Note on ``seq`` what the cache does for it (the runtime's ``plan`` of its job);
        without one (a direct caller) it neither reads nor writes the cache."""
        seq.cache_plan = prefix_plan if self.enabled else None
        seq.kv_ready = False

    def reuse(self, seq: Any) -> int:
        """Give ``seq``'s (empty) KV sequence the longest stored prefix of its prompt
        under its key; returns the tokens reused (0: prefill it all)."""
        p = getattr(seq, "cache_plan", None)
        if p is None:
            return 0
        if not p.lookup:
            self.cache.bypass(p.klass)
            return 0
        hit = self.cache.lookup(namespace=p.namespace, key=p.key, tokens=seq.prompt_ids, klass=p.klass)
        if hit is None:
            return 0
        self.backend.context.seq_cp(hit.payload, seq.seq_id, 0, hit.length)
        return hit.length

    def keep(self, seq: Any) -> None:
        """Store ``seq``'s KV before its sequence is cleared: the prompt's, and the
        generated tokens fed through the model (all but the last) where the steering
        treats them as it would prompt rows."""
        p = getattr(seq, "cache_plan", None)
        if p is None or not getattr(seq, "kv_ready", False):
            return
        fed = max(len(seq.generated) - 1, 0) if p.store_generated else 0
        n = seq.n_prompt + fed
        tokens = (list(seq.prompt_ids) + list(seq.generated))[:n]
        key = p.store_key(n)
        ns = p.namespace
        if not self.cache.wants(namespace=ns, key=key, tokens=tokens):
            return
        while not self._free:
            if not self.evict_one():
                return
        slot = self._free.pop()
        ctx = self.backend.context
        ctx.seq_clear(slot)
        ctx.seq_cp(seq.seq_id, slot, 0, n)
        if not self.cache.store(
            namespace=ns, key=key, tokens=tokens, payload=slot, nbytes=int(n * self.bytes_per_token)
        ):
            self._drop(slot)

    # ------------------------------------------------------------------ decodes

    def decode(self, tokens: list[tuple[int, int, int, bool]]) -> None:
        """``llama_decode`` of ``tokens``, evicting entries while the KV has no free cell
        for them (llama.cpp refuses such a batch before computing anything)."""
        ctx = self.backend.context
        while True:
            try:
                ctx.decode(tokens)
                return
            except InsufficientMemory:
                if not self.evict_one():
                    raise


__all__ = ["CACHE_SLOTS", "ResidentPrefixCache"]
