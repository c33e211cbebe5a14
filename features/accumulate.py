"""Exact per-feature statistics of a dashboard run, accumulated context by context.

Pure numpy: no Django model access, no torch. The runner feeds each context's SAE
activations as CSR rows (one row per token, the engine's packed monitoring records);
:class:`FeatureAccumulator` keeps, for every feature, its count of tokens above 0, the
sum and the max of those activations and its top-k contexts (by the context's max
activation, each context once) in arrays of ``d_sae`` rows, and the L0 (features above
0 per token) distribution, all updated with vectorised numpy per context. The contexts'
CSR rows go to shards in ``workdir`` (``shard_NNNNNN.npz``); :meth:`finish` reads them
twice: once for the exact histograms (``bins`` equal bins over [0, max], as
``numpy.histogram`` cuts them) and the seeded quantile samples, once for the token
windows around each chosen context's max token. Nothing holds a tokens x d_sae array.

:meth:`save` writes a checkpoint (npz) after flushing the buffered contexts to a shard;
:meth:`load` returns the accumulator as it was then (shards written after that save are
deleted), so a run resumed after a crash re-adds the contexts after the last saved one
and ends with the same result as an uninterrupted run. Every choice (tie-breaking by the
lower context id, the samples' pseudo-random keys) depends on the data and the seed
only, never on the order of adds or the shard boundaries.
"""

from __future__ import annotations

import contextlib
import gc
import os
import re
from pathlib import Path

import numpy as np

SHARD_ROWS = 1 << 14  # token rows buffered (and folded into the statistics) before a shard is written
CHECKPOINT_VERSION = 1
_SHARD_NAME = re.compile(r"^shard_\d{6}\.npz$")
_MASK = np.uint64(0xFFFFFFFFFFFFFFFF)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, element-wise on uint64 (wrapping arithmetic)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _stable_order(keys: np.ndarray, bound: int) -> np.ndarray:
    """``np.argsort(keys, kind="stable")`` for non-negative integer keys below ``bound``,
    as one or two 16-bit radix passes where the keys fit (several times faster)."""
    if bound <= 1 << 16:
        return np.argsort(keys.astype(np.uint16), kind="stable")
    if bound <= 1 << 32:
        order = np.argsort((keys & 0xFFFF).astype(np.uint16), kind="stable")
        return order[np.argsort((keys[order] >> 16).astype(np.uint16), kind="stable")]
    return np.argsort(keys, kind="stable")


@contextlib.contextmanager
def paused_gc():
    """The cyclic garbage collector off meanwhile (it was on: back on after). Building a
    dashboard's rows allocates a few hundred thousand lists and dicts, none of them in a
    cycle, and each allocation burst would otherwise trigger full collections that walk
    every object of the process (a server's are millions): a third of ``finish``."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _atomic_savez(path: Path, **arrays: np.ndarray) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as fh:
        np.savez(fh, **arrays)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


class FeatureAccumulator:
    """Per-feature dashboard statistics over a corpus; see the module docstring."""

    def __init__(
        self,
        d_sae: int,
        *,
        top_k: int = 10,
        window: int = 8,
        bins: int = 32,
        samples_per_band: int = 3,
        bands: int = 3,
        workdir: Path,
        seed: int = 0,
    ):
        for name, value, low in (
            ("d_sae", d_sae, 1),
            ("top_k", top_k, 1),
            ("window", window, 0),
            ("bins", bins, 1),
            ("samples_per_band", samples_per_band, 0),
            ("bands", bands, 1),
            ("seed", seed, 0),
        ):
            if int(value) != value or value < low:
                raise ValueError(f"{name} must be an integer of at least {low}")
        self.d_sae = int(d_sae)
        self.top_k = int(top_k)
        self.window = int(window)
        self.bins = int(bins)
        self.samples_per_band = int(samples_per_band)
        self.bands = int(bands)
        self.seed = int(seed)
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        d = self.d_sae
        self.count = np.zeros(d, np.int64)
        self.total = np.zeros(d, np.float64)
        self.max = np.zeros(d, np.float64)
        self.top_val = np.full((d, self.top_k), -np.inf)
        self.top_ctx = np.full((d, self.top_k), -1, np.int64)
        self.top_pos = np.full((d, self.top_k), -1, np.int64)
        self.l0_counts = np.zeros(d + 1, np.int64)
        self.tokens = 0
        self._done: list[int] = []
        self._done_set: set[int] = set()
        self.shards: list[str] = []
        self._shard_seq = 0
        self._buffer: list[tuple[int, np.ndarray, list[str], np.ndarray, np.ndarray, np.ndarray]] = []
        self._buffer_rows = 0

    # -- progress -----------------------------------------------------------------
    @property
    def contexts(self) -> int:
        """How many contexts were added."""
        return len(self._done)

    def is_done(self, context: int) -> bool:
        return int(context) in self._done_set

    # -- accumulation ---------------------------------------------------------------
    def add(self, context: int, token_ids, tokens, row_ptr, indices, values) -> None:
        """Add one context: its token ids and texts and its CSR activations (one row per
        token; activations <= 0 or NaN count as zero). A context id may be added once."""
        context = int(context)
        if context < 0:
            raise ValueError("context must be a non-negative integer")
        if context in self._done_set:
            raise ValueError(f"context {context} was already added")
        row_ptr = np.asarray(row_ptr, dtype=np.int64)
        indices = np.asarray(indices, dtype=np.int64)
        values = np.asarray(values, dtype=np.float32)
        token_ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
        tokens = [_clean(t) for t in tokens]
        rows = row_ptr.size - 1
        if rows < 1 or token_ids.size != rows or len(tokens) != rows:
            raise ValueError(
                f"context {context}: {rows} CSR rows, {token_ids.size} token ids and {len(tokens)} tokens must agree (>= 1)"
            )
        nnz = indices.size
        if row_ptr[0] != 0 or row_ptr[-1] != nnz or values.size != nnz or np.any(np.diff(row_ptr) < 0):
            raise ValueError(f"context {context}: malformed CSR (row_ptr, indices and values disagree)")
        if nnz and (indices.min() < 0 or indices.max() >= self.d_sae):
            raise ValueError(f"context {context}: a feature index is outside [0, {self.d_sae})")
        row_of = np.repeat(np.arange(rows, dtype=np.int64), np.diff(row_ptr))
        if nnz > 1:
            same = row_of[1:] == row_of[:-1]
            if np.any(indices[1:][same] <= indices[:-1][same]):
                raise ValueError(f"context {context}: feature indices must ascend within a row")
        keep = values > 0
        idx, val, row = indices[keep], values[keep], row_of[keep]
        l0 = np.bincount(row, minlength=rows)
        local_ptr = np.zeros(rows + 1, np.int64)
        np.cumsum(l0, out=local_ptr[1:])
        self._buffer.append((context, token_ids, tokens, local_ptr, idx.astype(np.int32), val))
        self._buffer_rows += rows
        self.tokens += rows
        self._done.append(context)
        self._done_set.add(context)
        if self._buffer_rows >= SHARD_ROWS:
            self._flush()

    def _flush(self) -> None:
        """Fold the buffered contexts into the statistics and write them as one shard."""
        if not self._buffer:
            return
        ctx = np.array([b[0] for b in self._buffer], np.int64)
        ntok = np.array([b[1].size for b in self._buffer], np.int64)
        token_ids = np.concatenate([b[1] for b in self._buffer])
        encoded = [t.encode("utf-8", "replace") for b in self._buffer for t in b[2]]
        token_len = np.array([len(e) for e in encoded], np.int64)
        token_bytes = np.frombuffer(b"".join(encoded), dtype=np.uint8)
        ptrs, offset = [np.zeros(1, np.int64)], 0
        for b in self._buffer:
            ptrs.append(b[3][1:] + offset)
            offset += int(b[3][-1])
        row_ptr = np.concatenate(ptrs)
        indices = np.concatenate([b[4] for b in self._buffer])
        values = np.concatenate([b[5] for b in self._buffer])
        self._update(ctx, ntok, row_ptr, indices, values)
        name = f"shard_{self._shard_seq:06d}.npz"
        _atomic_savez(
            self.workdir / name,
            ctx=ctx,
            ntok=ntok,
            token_ids=token_ids,
            token_len=token_len,
            token_bytes=token_bytes,
            row_ptr=row_ptr,
            indices=indices,
            values=values,
        )
        self._shard_seq += 1
        self.shards.append(name)
        self._buffer = []
        self._buffer_rows = 0

    def _update(self, ctx, ntok, row_ptr, indices, values) -> None:
        """The statistics of a batch of contexts (CSR over all their rows), vectorised."""
        d = self.d_sae
        self.l0_counts += np.bincount(np.diff(row_ptr), minlength=d + 1)
        if not indices.size:
            return
        idx = indices.astype(np.int64)
        val = values.astype(np.float64)
        self.count += np.bincount(idx, minlength=d)
        self.total += np.bincount(idx, weights=val, minlength=d)
        rows = int(ntok.sum())
        row_of = np.repeat(np.arange(rows, dtype=np.int64), np.diff(row_ptr))
        ctx_slot = np.repeat(np.arange(ctx.size, dtype=np.int64), ntok)[row_of]
        starts = np.zeros(ctx.size + 1, np.int64)
        np.cumsum(ntok, out=starts[1:])
        pos = row_of - starts[ctx_slot]
        # per (feature, context): the max and its first position (the CSR is row-major, so
        # a stable sort by feature keeps each feature's non-zeros in context and row order)
        order = _stable_order(idx, d)
        f_sorted, slot_sorted = idx[order], ctx_slot[order]
        v = val[order]
        first = np.flatnonzero(np.r_[True, (f_sorted[1:] != f_sorted[:-1]) | (slot_sorted[1:] != slot_sorted[:-1])])
        peak = np.maximum.reduceat(v, first)
        at_peak = v == np.repeat(peak, np.diff(np.r_[first, v.size]))
        where = np.minimum.reduceat(np.where(at_peak, np.arange(v.size), v.size), first)
        feats = f_sorted[first]
        c_ctx = ctx[slot_sorted[first]]
        c_pos = pos[order][where]
        f_first = np.flatnonzero(np.r_[True, feats[1:] != feats[:-1]])
        f_uniq = feats[f_first]
        self.max[f_uniq] = np.maximum(self.max[f_uniq], np.maximum.reduceat(peak, f_first))
        # top-k: the candidates that beat their feature's k-th, merged with its current list
        kth_val, kth_ctx = self.top_val[feats, -1], self.top_ctx[feats, -1]
        better = (peak > kth_val) | ((peak == kth_val) & ((kth_ctx < 0) | (c_ctx < kth_ctx)))
        if not better.any():
            return
        feats, peak, c_ctx, c_pos = feats[better], peak[better], c_ctx[better], c_pos[better]
        touched = np.unique(feats)
        old_f = np.repeat(touched, self.top_k)
        old_val = self.top_val[touched].ravel()
        old_ctx = self.top_ctx[touched].ravel()
        old_pos = self.top_pos[touched].ravel()
        live = old_ctx >= 0
        all_f = np.concatenate([old_f[live], feats])
        all_val = np.concatenate([old_val[live], peak])
        all_ctx = np.concatenate([old_ctx[live], c_ctx])
        all_pos = np.concatenate([old_pos[live], c_pos])
        # by feature, then value descending, then the lower context id
        order = np.lexsort((all_ctx, -all_val, all_f))
        all_f, all_val, all_ctx, all_pos = all_f[order], all_val[order], all_ctx[order], all_pos[order]
        first = np.flatnonzero(np.r_[True, all_f[1:] != all_f[:-1]])
        rank = np.arange(all_f.size) - np.repeat(first, np.diff(np.r_[first, all_f.size]))
        keep = rank < self.top_k
        self.top_val[touched], self.top_ctx[touched], self.top_pos[touched] = -np.inf, -1, -1
        f, r = all_f[keep], rank[keep]
        self.top_val[f, r], self.top_ctx[f, r], self.top_pos[f, r] = all_val[keep], all_ctx[keep], all_pos[keep]

    # -- checkpoint ------------------------------------------------------------------
    def save(self, path: Path) -> None:
        """Write a checkpoint (npz, atomically) of everything added so far."""
        self._flush()
        _atomic_savez(
            Path(path),
            version=np.array(CHECKPOINT_VERSION),
            config=np.array(
                [self.d_sae, self.top_k, self.window, self.bins, self.samples_per_band, self.bands, self.seed],
                np.int64,
            ),
            tokens=np.array(self.tokens, np.int64),
            shard_seq=np.array(self._shard_seq, np.int64),
            count=self.count,
            total=self.total,
            max=self.max,
            top_val=self.top_val,
            top_ctx=self.top_ctx,
            top_pos=self.top_pos,
            l0_counts=self.l0_counts,
            done=np.array(self._done, np.int64),
            shards=np.array(self.shards, dtype=np.str_),
        )

    @classmethod
    def load(cls, path: Path, workdir: Path) -> FeatureAccumulator:
        """The accumulator as :meth:`save` left it; shards in ``workdir`` written after
        that save (a crash before the next one) are deleted."""
        with np.load(Path(path), allow_pickle=False) as z:
            if int(z["version"]) != CHECKPOINT_VERSION:
                raise ValueError(f"checkpoint version {int(z['version'])} is not {CHECKPOINT_VERSION}")
            d_sae, top_k, window, bins, spb, bands, seed = (int(x) for x in z["config"])
            acc = cls(
                d_sae,
                top_k=top_k,
                window=window,
                bins=bins,
                samples_per_band=spb,
                bands=bands,
                workdir=workdir,
                seed=seed,
            )
            acc.tokens = int(z["tokens"])
            acc._shard_seq = int(z["shard_seq"])
            for name in ("count", "total", "max", "top_val", "top_ctx", "top_pos", "l0_counts"):
                setattr(acc, name, z[name].copy())
            acc._done = [int(c) for c in z["done"]]
            acc._done_set = set(acc._done)
            acc.shards = [str(s) for s in z["shards"]]
        kept = set(acc.shards)
        for name in acc.shards:
            if not (acc.workdir / name).is_file():
                raise FileNotFoundError(f"checkpoint shard {name} is missing from {acc.workdir}")
        for entry in acc.workdir.iterdir():
            if _SHARD_NAME.match(entry.name) and entry.name not in kept:
                entry.unlink()
        return acc

    # -- the second passes -------------------------------------------------------------
    def _shards(self, reuse: dict | None = None):
        """Each shard's arrays plus, per non-zero, its context id and position; ``reuse``
        (a shard this gave before) comes first, as it was, instead of being read again."""
        names = list(self.shards)
        if reuse is not None:
            names.remove(reuse["name"])
            yield reuse
        for name in names:
            with np.load(self.workdir / name, allow_pickle=False) as z:
                s = {k: z[k] for k in z.files}
            s["name"] = name
            ntok = s["ntok"]
            ctx_of_row = np.repeat(s["ctx"], ntok)
            starts = np.zeros(ntok.size + 1, np.int64)
            np.cumsum(ntok, out=starts[1:])
            pos_of_row = np.arange(int(starts[-1]), dtype=np.int64) - np.repeat(starts[:-1], ntok)
            row_of = np.repeat(np.arange(ntok.sum(), dtype=np.int64), np.diff(s["row_ptr"]))
            s["row_start"] = starts
            s["nz_ctx"] = ctx_of_row[row_of]
            s["nz_pos"] = pos_of_row[row_of]
            s["nz_row"] = row_of
            tok_off = np.zeros(s["token_len"].size + 1, np.int64)
            np.cumsum(s["token_len"], out=tok_off[1:])
            s["tok_off"] = tok_off
            yield s

    def finish(self, logits: dict | None = None) -> tuple[list[dict], dict]:
        """Per-feature rows (features above 0 somewhere, plus every feature with a logit
        entry) with the fields of FeatureDashboard, and the corpus summary."""
        with paused_gc():
            return self._finish(logits)

    def _finish(self, logits: dict | None) -> tuple[list[dict], dict]:
        self._flush()
        d, bins, bands, spb = self.d_sae, self.bins, self.bands, self.samples_per_band
        active = np.flatnonzero(self.count > 0)
        edges = np.zeros((d, bins + 1))
        if active.size:  # row by row as np.linspace(0, max, bins + 1) (all maxima are > 0)
            edges[active] = np.linspace(0.0, self.max[active], bins + 1, axis=1)
        hist = np.zeros(d * bins, np.int64)
        # (feature, context) pairs as one integer, by the context's rank among those added
        done = np.sort(np.array(self._done, np.int64))
        ctx_span = max(done.size, 1)
        valid_top = self.top_ctx >= 0
        top_rank = np.searchsorted(done, self.top_ctx)
        top_keys = np.unique((np.arange(d)[:, None] * ctx_span + top_rank)[valid_top])
        n_slots = d * bands * spb
        s_key = np.full(n_slots, _MASK, np.uint64)
        s_ctx = np.full(n_slots, -1, np.int64)
        s_pos = np.full(n_slots, -1, np.int64)
        seed = _mix(np.array([self.seed], np.uint64))[0]
        flat_edges = edges.ravel()
        last = None  # the last shard read, which the windows' pass reads first without reading it again
        for s in self._shards():
            last = s
            idx = s["indices"].astype(np.int64)
            if not idx.size:
                continue
            val = s["values"].astype(np.float64)
            ratio = val / self.max[idx]
            # numpy.histogram's uniform-bin arithmetic, per feature's [0, max]
            b = (ratio * bins).astype(np.intp)
            b[b == bins] -= 1
            at = idx * (bins + 1) + b  # edges[idx, b] as a flat index
            low = val < flat_edges[at]
            b[low] -= 1
            at[low] -= 1
            b[(val >= flat_edges[at + 1]) & (b != bins - 1)] += 1
            hist += np.bincount(idx * bins + b, minlength=d * bins)
            if not spb:
                continue
            ctx, pos = s["nz_ctx"], s["nz_pos"]
            band = (ratio * bands).astype(np.int64)
            band[band >= bands] = bands - 1
            # one candidate per (feature, band, context): its highest, earliest occurrence
            # there (the stable sort keeps each group's non-zeros in context and row order)
            group = idx * bands + band
            order = _stable_order(group, d * bands)
            g, c, v = group[order], ctx[order], val[order]
            first = np.flatnonzero(np.r_[True, (g[1:] != g[:-1]) | (c[1:] != c[:-1])])
            peak = np.maximum.reduceat(v, first)
            at_peak = v == np.repeat(peak, np.diff(np.r_[first, v.size]))
            where = np.minimum.reduceat(np.where(at_peak, np.arange(v.size), v.size), first)
            g, c, p = g[first], c[first], pos[order][where]
            # the feature's top contexts are not sampled again
            keep = ~np.isin((g // bands) * ctx_span + np.searchsorted(done, c), top_keys)
            g, c, p = g[keep], c[keep], p[keep]
            if not g.size:
                continue
            key = _mix(_mix(_mix(seed ^ g.astype(np.uint64)) ^ c.astype(np.uint64)))
            # only a key below its group's current last kept one can enter it
            last_key, last_ctx = s_key[g * spb + spb - 1], s_ctx[g * spb + spb - 1]
            enter = (key < last_key) | ((key == last_key) & ((last_ctx < 0) | (c < last_ctx)))
            g, c, p, key = g[enter], c[enter], p[enter], key[enter]
            if not g.size:
                continue
            old = np.flatnonzero(s_ctx >= 0)
            all_g = np.concatenate([old // spb, g])
            all_key = np.concatenate([s_key[old], key])
            all_ctx = np.concatenate([s_ctx[old], c])
            all_pos = np.concatenate([s_pos[old], p])
            order = np.lexsort((all_ctx, all_key, all_g))
            all_g, all_key, all_ctx, all_pos = all_g[order], all_key[order], all_ctx[order], all_pos[order]
            first = np.flatnonzero(np.r_[True, all_g[1:] != all_g[:-1]])
            rank = np.arange(all_g.size) - np.repeat(first, np.diff(np.r_[first, all_g.size]))
            ok = rank < spb
            slot = all_g[ok] * spb + rank[ok]
            s_key[:], s_ctx[:], s_pos[:] = _MASK, -1, -1
            s_key[slot], s_ctx[slot], s_pos[slot] = all_key[ok], all_ctx[ok], all_pos[ok]
        hist = hist.reshape(d, bins)

        # windows: every top context and sample, cut in one more pass
        top_f, top_slot = np.nonzero(valid_top)
        smp = np.flatnonzero(s_ctx >= 0)
        req_f = np.concatenate([top_f, smp // (bands * spb)])
        req_ctx = np.concatenate([self.top_ctx[top_f, top_slot], s_ctx[smp]])
        req_pos = np.concatenate([self.top_pos[top_f, top_slot], s_pos[smp]])
        windows: list[dict | None] = [None] * req_f.size
        span = np.arange(2 * self.window + 1, dtype=np.int64)
        for s in self._shards(reuse=last):
            slot_of = np.argsort(s["ctx"], kind="stable")
            sorted_ctx = s["ctx"][slot_of]
            found = np.searchsorted(sorted_ctx, req_ctx).clip(max=sorted_ctx.size - 1)
            wanted = np.flatnonzero(sorted_ctx[found] == req_ctx)
            if not wanted.size:
                continue
            slot = slot_of[found[wanted]]
            row0 = s["row_start"][slot]
            n = s["ntok"][slot]
            p = req_pos[wanted]
            lo = np.maximum(0, p - self.window)
            hi = np.minimum(n, p + self.window + 1)
            rows = row0[:, None] + lo[:, None] + span[None, :]  # [requests, 2 * window + 1]
            inside = (lo[:, None] + span[None, :]) < hi[:, None]
            rows = np.where(inside, rows, row0[:, None])
            # each non-zero's key row * d + feature ascends (rows in order, features ascend)
            keys = s["nz_row"] * d + s["indices"].astype(np.int64)
            query = rows * d + req_f[wanted][:, None]
            at = np.searchsorted(keys, query).clip(max=max(keys.size - 1, 0))
            hit = inside & (keys[at] == query) if keys.size else np.zeros_like(inside)
            acts = np.where(hit, s["values"][at] if keys.size else 0, 0).astype(np.float32).tolist()
            ids = s["token_ids"][rows].tolist()
            raw = s["token_bytes"].tobytes()
            off = s["tok_off"].tolist()
            texts = [raw[a:b].decode("utf-8") for a, b in zip(off[:-1], off[1:])]
            for r, c, a, b, first, at_max, ids_j, acts_j in zip(
                wanted.tolist(),
                req_ctx[wanted].tolist(),
                lo.tolist(),
                hi.tolist(),
                row0.tolist(),
                p.tolist(),
                ids,
                acts,
            ):
                width, peak_at = b - a, at_max - a
                windows[r] = {
                    "context": c,
                    "tokens": texts[first + a : first + b],
                    "token_ids": ids_j[:width],
                    "activations": acts_j[:width],
                    "max_position": peak_at,
                    "max_activation": acts_j[peak_at],
                    "start": a,
                }

        logit_rows: dict[int, int] = {}
        if logits:
            logit_rows = {int(f): i for i, f in enumerate(logits["features"])}
        n_top = top_f.size
        top_windows: dict[int, list[dict]] = {}
        for r in range(n_top):
            top_windows.setdefault(int(top_f[r]), []).append(windows[r])
        sample_windows: dict[tuple[int, int], list[dict]] = {}
        for j, slot in enumerate(smp):
            f, band = divmod(int(slot) // spb, bands)
            sample_windows.setdefault((f, band), []).append(windows[n_top + j])

        features = sorted(set(active.tolist()) | set(logit_rows))
        # per feature as Python numbers once (the same float64 arithmetic as numpy's)
        count_of, total_of, max_of = self.count.tolist(), self.total.tolist(), self.max.tolist()
        hist_of = dict(zip(active.tolist(), zip(edges[active].tolist(), hist[active].tolist())))
        clean: dict[str, str] = {}  # each logit token's text cleaned once
        rows: list[dict] = []
        for f in features:
            n = count_of[f]
            top = top_windows.get(f, [])
            row = {
                "index": f,
                "count": n,
                "density": n / self.tokens if self.tokens else 0.0,
                "mean": total_of[f] / n if n else 0.0,
                "max": max_of[f],
                "histogram": {"edges": hist_of[f][0], "counts": hist_of[f][1]} if n else {"edges": [], "counts": []},
                "top_contexts": top,
                "quantile_samples": [],
                "logit_top": [],
                "logit_bottom": [],
            }
            if n and spb:
                step = max_of[f] / bands
                row["quantile_samples"] = [
                    {
                        "band": [step * b, max_of[f] if b == bands - 1 else step * (b + 1)],
                        "contexts": sample_windows.get((f, b), []),
                    }
                    for b in range(bands)
                ]
            words = [w["tokens"][w["max_position"]] for w in top]
            if f in logit_rows:
                i = logit_rows[f]
                for side in ("top", "bottom"):
                    entries = [
                        {
                            "token_id": int(t),
                            "token": clean[tok] if tok in clean else clean.setdefault(tok, _clean(tok)),
                            "value": float(v),
                        }
                        for t, tok, v in zip(
                            logits[f"{side}_ids"][i], logits[f"{side}_tokens"][i], logits[f"{side}_values"][i]
                        )
                    ]
                    row[f"logit_{side}"] = entries
                    words += [e["token"] for e in entries]
            row["search_tokens"] = _search_tokens(words)
            rows.append(row)

        summary = self._summary()
        return rows, summary

    def _summary(self) -> dict:
        tokens = self.tokens
        dead = int(np.count_nonzero(self.count == 0))
        density = self.count / tokens if tokens else np.zeros(self.d_sae)
        present = np.flatnonzero(self.l0_counts)
        l0_max = int(present[-1]) if present.size else 0
        values = np.arange(self.l0_counts.size, dtype=np.float64)
        # one bin per L0 value while they are at most ``bins``; ``bins`` equal bins beyond
        counts, l0_edges = np.histogram(
            values, bins=min(self.bins, l0_max + 1), range=(0.0, float(l0_max + 1)), weights=self.l0_counts
        )
        return {
            "tokens": tokens,
            "contexts": self.contexts,
            "dead": dead,
            "dead_share": dead / self.d_sae,
            "dense": np.flatnonzero(density > 0.1).tolist(),
            "l0": {
                "mean": float((values * self.l0_counts).sum() / tokens) if tokens else 0.0,
                "max": l0_max,
                "histogram": {"edges": l0_edges.tolist(), "counts": [int(x) for x in counts]},
            },
        }


def _clean(token) -> str:
    """A token's text as a database text column takes it: NUL shown as U+2400 and a lone
    surrogate (half a character) as "?"."""
    text = str(token)
    if "\x00" in text:
        text = text.replace("\x00", "\u2400")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = text.encode("utf-8", "replace").decode("utf-8")
    return text


def _search_tokens(words: list[str]) -> str:
    seen: dict[str, None] = {}
    for word in words:
        for part in word.lower().split():
            seen.setdefault(part, None)
    return " ".join(seen)
