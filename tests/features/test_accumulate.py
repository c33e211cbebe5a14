"""features.accumulate: a dashboard's figures equal the test's own float64 computation.

The corpus is small and random: each context's activations are a dense matrix built here
(some values on a coarse grid so that ties happen, some negative entries that must count
as zero), fed to the accumulator as CSR rows exactly as the engine packs them. Every
figure (count, density, mean, max, histogram, top contexts and their windows, quantile
samples, L0, dead and dense features) is recomputed from the dense matrices.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from features import accumulate
from features.accumulate import FeatureAccumulator

D = 40
TOP_K = 4
WINDOW = 3
BINS = 8
BANDS = 3
SPB = 2


def make_corpus(seed: int = 0, contexts: int = 60) -> list[dict]:
    rng = np.random.default_rng(seed)
    corpus = []
    for c in range(contexts):
        n = int(rng.integers(2, 16))
        dense = np.zeros((n, D), np.float32)
        on = rng.random((n, D)) < rng.uniform(0.02, 0.4, size=D)  # feature-specific densities
        dense[on] = rng.gamma(2.0, 1.5, size=int(on.sum())).astype(np.float32)
        grid = rng.random((n, D)) < 0.5  # coarse values in the first half of features: ties
        grid[:, D // 2 :] = False
        dense[on & grid] = np.round(dense[on & grid] * 2) / 2
        dense[:, 0] = 0.0  # a dead feature
        dense[:, 1] = np.where(rng.random(n) < 0.9, 1.0, 0.0)  # a dense feature, all ties
        dense[:, 1][0] = 0.5  # ... never tied at the earliest position of every context
        token_ids = rng.integers(0, 500, size=n).tolist()
        corpus.append(
            {
                "context": c,
                "dense": dense,
                "token_ids": token_ids,
                "tokens": [f" Tok{t}" if t % 3 else f"tok\u00e9{t}" for t in token_ids],
            }
        )
    return corpus


def csr(dense: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The engine's CSR of a dense block, plus a few explicit negative entries (not above 0)."""
    noisy = dense.copy()
    zeros = noisy == 0
    noisy[zeros & (rng.random(noisy.shape) < 0.05)] = -0.25
    rows, cols = np.nonzero(noisy)
    row_ptr = np.zeros(dense.shape[0] + 1, np.int32)
    np.cumsum(np.bincount(rows, minlength=dense.shape[0]), out=row_ptr[1:])
    return row_ptr, cols.astype(np.int32), noisy[rows, cols].astype(np.float32)


def feed(acc: FeatureAccumulator, corpus: list[dict], seed: int = 1) -> None:
    rng = np.random.default_rng(seed)
    for item in corpus:
        acc.add(item["context"], item["token_ids"], item["tokens"], *csr(item["dense"], rng))


def new(tmp_path, name="work", **kw) -> FeatureAccumulator:
    args = {"top_k": TOP_K, "window": WINDOW, "bins": BINS, "bands": BANDS, "samples_per_band": SPB, "seed": 7}
    args.update(kw)
    return FeatureAccumulator(D, workdir=tmp_path / name, **args)


def reference_top(corpus: list[dict], f: int) -> list[tuple[int, float, int]]:
    """(context, max, first position of the max) of feature f's top-k contexts: the highest
    max first, ties to the lower context id."""
    per = []
    for item in corpus:
        col = item["dense"][:, f].astype(np.float64)
        if (col > 0).any():
            per.append((item["context"], float(col.max()), int(np.argmax(col))))
    per.sort(key=lambda t: (-t[1], t[0]))
    return per[:TOP_K]


def check_window(window: dict, item: dict, f: int, position: int) -> None:
    n = item["dense"].shape[0]
    lo, hi = max(0, position - WINDOW), min(n, position + WINDOW + 1)
    assert window["context"] == item["context"]
    assert window["start"] == lo
    assert window["max_position"] == position - lo
    assert window["token_ids"] == item["token_ids"][lo:hi]
    assert window["tokens"] == item["tokens"][lo:hi]
    assert window["activations"] == [float(v) for v in item["dense"][lo:hi, f]]
    assert window["max_activation"] == float(item["dense"][position, f])


def test_figures_equal_a_float64_recomputation(tmp_path, monkeypatch):
    monkeypatch.setattr(accumulate, "SHARD_ROWS", 50)  # several shards
    corpus = make_corpus()
    acc = new(tmp_path)
    feed(acc, corpus)
    rows, summary = acc.finish(None)
    assert json.loads(json.dumps([rows, summary])) == [rows, summary]  # plain JSON types, stored as they are

    allrows = np.concatenate([item["dense"] for item in corpus]).astype(np.float64)
    tokens = allrows.shape[0]
    by_index = {r["index"]: r for r in rows}
    alive = [f for f in range(D) if (allrows[:, f] > 0).any()]
    assert sorted(by_index) == alive and 0 not in by_index and 1 in by_index
    for f in alive:
        row, vals = by_index[f], allrows[:, f][allrows[:, f] > 0]
        assert row["count"] == vals.size
        assert row["density"] == pytest.approx(vals.size / tokens, rel=1e-12)
        assert row["mean"] == pytest.approx(vals.mean(), rel=1e-12)
        assert row["max"] == vals.max()
        counts, edges = np.histogram(vals, bins=BINS, range=(0.0, vals.max()))
        assert row["histogram"] == {"edges": edges.tolist(), "counts": counts.tolist()}
        ref = reference_top(corpus, f)
        assert [w["context"] for w in row["top_contexts"]] == [c for c, _, _ in ref]
        for window, (c, peak, position) in zip(row["top_contexts"], ref):
            check_window(window, corpus[c], f, position)
            assert window["max_activation"] == peak

    l0 = (allrows > 0).sum(axis=1)
    counts, edges = np.histogram(l0, bins=min(BINS, l0.max() + 1), range=(0.0, l0.max() + 1.0))
    assert summary["l0"]["histogram"] == {"edges": edges.tolist(), "counts": counts.tolist()}
    assert summary["l0"]["mean"] == pytest.approx(l0.mean(), rel=1e-12)
    assert summary["l0"]["max"] == l0.max()
    assert summary["tokens"] == tokens and summary["contexts"] == len(corpus)
    assert summary["dead"] == D - len(alive) and summary["dead_share"] == (D - len(alive)) / D
    density = (allrows > 0).mean(axis=0)
    assert summary["dense"] == np.flatnonzero(density > 0.1).tolist() and 1 in summary["dense"]


def test_quantile_samples_are_non_top_contexts_in_their_band(tmp_path):
    corpus = make_corpus(seed=3)
    acc = new(tmp_path)
    feed(acc, corpus)
    rows, _ = acc.finish(None)
    sampled = 0
    for row in rows:
        f, top = row["index"], {w["context"] for w in row["top_contexts"]}
        assert len(row["quantile_samples"]) == BANDS
        for b, band in enumerate(row["quantile_samples"]):
            lo, hi = band["band"]
            assert lo == pytest.approx(row["max"] * b / BANDS) and hi == pytest.approx(row["max"] * (b + 1) / BANDS)
            # the contexts, outside the top ones, with a value in the band: each its highest there
            eligible = {}
            for item in corpus:
                col = item["dense"][:, f].astype(np.float64)
                inside = (col > 0) & (col >= lo) & ((col < hi) | (b == BANDS - 1))
                if item["context"] not in top and inside.any():
                    eligible[item["context"]] = int(np.flatnonzero(inside)[np.argmax(col[inside])])
            got = [w["context"] for w in band["contexts"]]
            assert len(got) == min(SPB, len(eligible)) and len(set(got)) == len(got)
            for window in band["contexts"]:
                assert window["context"] in eligible
                check_window(window, corpus[window["context"]], f, eligible[window["context"]])
            sampled += len(got)
    assert sampled > 50  # positive control: the corpus does give samples


def test_samples_are_seeded(tmp_path):
    corpus = make_corpus(seed=4)

    def samples(name, seed):
        acc = new(tmp_path, name=name, seed=seed)
        feed(acc, corpus)
        rows, _ = acc.finish(None)
        return [[[w["context"] for w in b["contexts"]] for b in r["quantile_samples"]] for r in rows]

    assert samples("a", 7) == samples("b", 7)
    assert samples("a2", 7) != samples("c", 8)


def test_result_does_not_depend_on_the_order_of_contexts(tmp_path, monkeypatch):
    monkeypatch.setattr(accumulate, "SHARD_ROWS", 40)
    corpus = make_corpus(seed=5)
    first = new(tmp_path, name="a")
    feed(first, corpus)
    second = new(tmp_path, name="b")
    feed(second, corpus[::-1])
    assert first.finish(None) == second.finish(None)


def test_checkpoint_resume_equals_an_uninterrupted_run(tmp_path, monkeypatch):
    monkeypatch.setattr(accumulate, "SHARD_ROWS", 30)
    corpus = make_corpus(seed=6, contexts=50)
    whole = new(tmp_path, name="whole")
    feed(whole, corpus)
    expected = whole.finish(None)

    crashed = new(tmp_path, name="resumed")
    feed(crashed, corpus[:25])
    crashed.save(tmp_path / "ckpt.npz")
    workdir = tmp_path / "resumed"
    saved = {p.name for p in workdir.glob("shard_*.npz")}
    feed(crashed, corpus[25:40])  # work after the save, lost in the crash (its shards stay on disk)
    assert {p.name for p in workdir.glob("shard_*.npz")} > saved
    del crashed

    resumed = FeatureAccumulator.load(tmp_path / "ckpt.npz", workdir)
    assert {p.name for p in workdir.glob("shard_*.npz")} == saved  # the lost work's shards are gone
    assert resumed.contexts == 25 and resumed.is_done(24) and not resumed.is_done(25)
    with pytest.raises(ValueError, match="already added"):
        feed(resumed, corpus[24:25])
    feed(resumed, corpus[25:])
    assert resumed.finish(None) == expected
    # and a checkpoint taken at the very end loads to the same result again
    resumed.save(tmp_path / "end.npz")
    assert FeatureAccumulator.load(tmp_path / "end.npz", workdir).finish(None) == expected


def test_logit_effects_and_search_tokens(tmp_path):
    corpus = make_corpus(seed=8)
    acc = new(tmp_path)
    feed(acc, corpus)
    logits = {
        "features": [0, 5],
        "top_ids": [[11, 12], [21, 22]],
        "top_values": [[0.5, 0.25], [2.0, 1.0]],
        "bottom_ids": [[13], [23]],
        "bottom_values": [[-0.5], [-3.0]],
        "top_tokens": [[" Rain", "snow"], [" Cat", " cat"]],
        "bottom_tokens": [["sun"], [" DOG"]],
    }
    rows, _ = acc.finish(logits)
    by_index = {r["index"]: r for r in rows}
    dead = by_index[0]  # no activation anywhere, but a logit entry: its row is there
    assert dead["count"] == 0 and dead["top_contexts"] == [] and dead["histogram"] == {"edges": [], "counts": []}
    assert dead["logit_top"] == [
        {"token_id": 11, "token": " Rain", "value": 0.5},
        {"token_id": 12, "token": "snow", "value": 0.25},
    ]
    assert dead["logit_bottom"] == [{"token_id": 13, "token": "sun", "value": -0.5}]
    assert dead["search_tokens"] == "rain snow sun"
    five = by_index[5]
    words = []
    for window in five["top_contexts"]:
        words.append(window["tokens"][window["max_position"]].strip().lower())
    words += ["cat", "cat", "dog"]
    assert five["search_tokens"].split() == list(dict.fromkeys(words))
    assert by_index[6]["logit_top"] == [] and by_index[6]["search_tokens"]


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: {**a, "token_ids": a["token_ids"][:-1]}, "must agree"),
        (lambda a: {**a, "indices": np.r_[a["indices"][:-1], D]}, "outside"),
        (lambda a: {**a, "values": a["values"][:-1]}, "malformed"),
        (lambda a: {**a, "row_ptr": np.r_[a["row_ptr"][:-1], a["row_ptr"][-1] + 1]}, "malformed"),
        (lambda a: {**a, "indices": a["indices"][::-1].copy()}, "ascend"),
        (lambda a: {**a, "context": -1}, "non-negative"),
    ],
)
def test_malformed_input_is_refused_and_changes_nothing(tmp_path, change, message):
    item = make_corpus(seed=9, contexts=1)[0]
    item["dense"][:, 2] = 1.0  # several non-zeros in every row, so reversing breaks the order
    item["dense"][:, 3] = 2.0
    row_ptr, indices, values = csr(item["dense"], np.random.default_rng(0))
    args = {"context": 0, "token_ids": item["token_ids"], "tokens": item["tokens"]}
    args.update(row_ptr=row_ptr, indices=indices, values=values)
    acc = new(tmp_path)
    with pytest.raises(ValueError, match=message):
        acc.add(**change(args))
    assert acc.contexts == 0 and acc.tokens == 0
    acc.add(**args)  # positive control: the unchanged context is accepted, alone
    rows, summary = acc.finish(None)
    assert acc.contexts == 1 and summary["tokens"] == len(item["token_ids"])
    assert {r["index"]: r["count"] for r in rows}[2] == len(item["token_ids"])


def test_histogram_counts_values_on_and_beside_bin_edges_as_numpy_does(tmp_path):
    """Values at, just below and just above every bin edge (float32) land in the bin
    numpy.histogram puts them in (the left edge is in, the last bin holds the max)."""
    peak = np.float32(0.7)
    edges = np.linspace(0.0, float(peak), BINS + 1)
    near = [np.float32(e) for e in edges[1:]]
    near += [np.nextafter(v, np.float32(0)) for v in near] + [np.nextafter(v, np.float32(1)) for v in near[:-1]]
    values = np.array([v for v in near if 0 < v <= peak], np.float32)
    n = values.size
    dense = np.zeros((n, D), np.float32)
    dense[:, 5] = values
    dense[:, 6] = np.float32(0.1) * np.arange(1, n + 1, dtype=np.float32) / np.float32(3)
    acc = new(tmp_path)
    for c, lo in enumerate(range(0, n, 7)):
        block = dense[lo : lo + 7]
        if block.shape[0] < 2:
            continue
        acc.add(c, list(range(block.shape[0])), ["x"] * block.shape[0], *csr(block, np.random.default_rng(c)))
    rows, _ = acc.finish(None)
    fed = np.concatenate([dense[lo : lo + 7] for lo in range(0, n, 7) if dense[lo : lo + 7].shape[0] >= 2])
    for row in rows:
        vals = fed[:, row["index"]].astype(np.float64)
        vals = vals[vals > 0]
        counts, ref_edges = np.histogram(vals, bins=BINS, range=(0.0, vals.max()))
        assert row["histogram"] == {"edges": ref_edges.tolist(), "counts": counts.tolist()}


def test_token_texts_a_database_cannot_hold_are_made_safe(tmp_path):
    """A vocabulary may hold "\\x00" or half a surrogate pair; PostgreSQL's text and jsonb
    refuse both, so the stored windows, logit tokens and search tokens carry neither."""
    dense = np.zeros((3, D), np.float32)
    dense[:, 4] = [0.5, 2.0, 1.0]
    acc = new(tmp_path)
    acc.add(0, [1, 2, 3], ["a\x00b", "\ud800x", "plain"], *csr(dense, np.random.default_rng(0)))
    logits = {
        "features": [4],
        "top_ids": [[9]],
        "top_values": [[1.5]],
        "bottom_ids": [[8]],
        "bottom_values": [[-1.5]],
        "top_tokens": [["\x00"]],
        "bottom_tokens": [["end\udfff"]],
    }
    rows, _ = acc.finish(logits)
    (row,) = [r for r in rows if r["index"] == 4]
    assert row["top_contexts"][0]["tokens"] == ["a\u2400b", "?x", "plain"]
    assert row["top_contexts"][0]["max_position"] == 1
    assert row["logit_top"][0]["token"] == "\u2400" and row["logit_bottom"][0]["token"] == "end?"
    assert row["search_tokens"] == "?x \u2400 end?"
    text = json.dumps(rows, ensure_ascii=False)
    assert "\x00" not in text and "\\u0000" not in text
    text.encode("utf-8")  # no lone surrogate left


def test_any_context_ids_give_the_same_dashboards(tmp_path):
    """Context ids are labels: large, sparse ids (ranked as 0..n are) change nothing else."""
    corpus = make_corpus(seed=10, contexts=30)
    small = new(tmp_path, name="small")
    feed(small, corpus)
    big = new(tmp_path, name="big")
    feed(big, [{**item, "context": 10**15 + 7 * item["context"]} for item in corpus])
    rows_small, summary_small = small.finish(None)
    rows_big, summary_big = big.finish(None)
    assert summary_big == summary_small
    for row in rows_big:
        for window in row["top_contexts"] + [w for band in row["quantile_samples"] for w in band["contexts"]]:
            window["context"] = (window["context"] - 10**15) // 7
    # the samples' random keys hash the ids, so only the top contexts must match exactly
    for a, b in zip(rows_small, rows_big):
        assert {k: v for k, v in a.items() if k != "quantile_samples"} == {
            k: v for k, v in b.items() if k != "quantile_samples"
        }
