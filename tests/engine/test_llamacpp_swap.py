"""The llama.cpp backend's fallback for per-request steering: control vectors swapped
between requests (``steering_mode: control_vector_swap``).

Where writing a row in the eval callback cannot be trusted (a GPU ggml backend, a
llama.cpp that fuses the layer's output), requests with different steering must never
share a ``llama_decode``.  The tests watch llama.cpp's own entry points, independently of
the backend's bookkeeping: ``llama_decode`` (which sequences, tokens and positions each
call holds) and ``llama_set_adapter_cvec`` (the control vector in force at each call).
From that log alone, with each request identified by its prompt, they check that no call
mixes two steerings, that the control vector in force is the call's steering computed
here from the SAE files, and that every steering group keeps getting turns.  Each
request's tokens must equal its solo run, the eval-callback mode's mixed run, and (for a
steered, pre-steering-monitored request) the transformers backend.

The fallback runs two ways: forced by the load option, and chosen by the load's
self-check on a stand-in for a graph whose layer output the callback cannot write (the
callback is handed a copy of the rows, so a write never reaches the next layer, as with a
fused node) — where the eval-callback mode would silently lose every per-row delta.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from gpu_engine.runtime.engine import Engine
from gpu_engine.api.errors import InvalidParameter
from gpu_engine.api.protocol import (
    AttachSpec,
    BatchingOptions,
    FinishEvent,
    GenerationResult,
    MonitorEntry,
    MonitorSpec,
    SteeringSpec,
    TokenEvent,
)

from .helpers import RefSAE
from .test_llamacpp import ENCODE_ATOL, assert_same_generation, gguf_job, greedy

SWAP, PER_ROW = "control_vector_swap", "eval_callback_per_row"
# distinct prompts: a request is recognised in the decode log by its prompt
TEXTS = [
    "the cat sat on the mat and",
    "a quick brown fox jumps over",
    "one two three four",
    "hello there my old friend",
    "red green blue yellow",
    "rain falls on the quiet town",
]


def copying_host_array():
    """The stand-in: the callback reads and writes a copy of each layer output, so reads
    are right and writes never reach the graph (as where the node was fused away)."""
    from gpu_engine.backends.llamacpp import taps

    real = taps.EvalTaps._host_array

    def copy(tensor, shape, what):
        arr, _ = real(tensor, shape, what)
        return arr.copy(), True

    return copy


def lost_writes(monkeypatch) -> None:
    """Every eval callback made from now on gets the stand-in (the load's self-check)."""
    from gpu_engine.backends.llamacpp import taps

    monkeypatch.setattr(taps.EvalTaps, "_host_array", staticmethod(copying_host_array()))


@pytest.fixture(scope="module", params=["forced", "self_check_failed"])
def swap_engine(request, tiny_gguf):
    eng = Engine(batching=BatchingOptions(enabled=True, max_batch_size=8))
    if request.param == "forced":
        eng.load_model(gguf_job(tiny_gguf, steering_mode=SWAP))
    else:
        with pytest.MonkeyPatch.context() as mp:
            lost_writes(mp)
            eng.load_model(gguf_job(tiny_gguf))
        # and this model's callback keeps losing its writes (other engines are left alone)
        eng.backend.taps._host_array = copying_host_array()
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def per_row_engine(tiny_gguf):
    eng = Engine(batching=BatchingOptions(enabled=True, max_batch_size=8))
    eng.load_model(gguf_job(tiny_gguf))
    yield eng
    eng.shutdown()


class DecodeLog:
    """Every ``llama_decode`` while installed: its (token, position, sequence) rows and
    the control vector in force on that context (None: cleared), as llama.cpp was told."""

    def __init__(self, monkeypatch) -> None:
        import llama_cpp.llama_cpp as lc

        self.calls: list[tuple[list[tuple[int, int, int]], tuple | None]] = []
        self._cvec: dict[object, tuple | None] = {}
        real_decode, real_cvec = lc.llama_decode, lc.llama_set_adapter_cvec

        def decode(ctx, batch):
            rows = [(batch.token[i], batch.pos[i], batch.seq_id[i][0]) for i in range(batch.n_tokens)]
            self.calls.append((rows, self._cvec.get(ctx)))
            return real_decode(ctx, batch)

        def set_cvec(ctx, data, length, n_embd, il_start, il_end):
            if not data or length == 0:
                self._cvec[ctx] = None
            else:
                flat = np.ctypeslib.as_array(data, shape=(length,)).copy()
                self._cvec[ctx] = (flat.reshape(-1, n_embd), il_start, il_end)
            return real_cvec(ctx, data, length, n_embd, il_start, il_end)

        monkeypatch.setattr(lc, "llama_decode", decode)
        monkeypatch.setattr(lc, "llama_set_adapter_cvec", set_cvec)

    def owned(self, prompts: dict[str, list[int]]) -> list[tuple[list[str], tuple | None, bool]]:
        """Per call: the requests in it (recognised by the prompt a sequence starts
        with), the control vector, and whether it is a decode step (every row past its
        request's prompt)."""
        owner: dict[int, str] = {}
        out = []
        for rows, cvec in self.calls:
            for seq in {s for _, p, s in rows if p == 0}:
                toks = [t for t, _, s in sorted(rows, key=lambda r: r[1]) if s == seq]
                (name,) = [n for n, ids in prompts.items() if ids == toks]
                owner[seq] = name
            names = [owner[s] for s in sorted({s for *_, s in rows})]
            step = all(p >= len(prompts[owner[s]]) for _, p, s in rows)
            out.append((names, cvec, step))
        return out


def control_vector(steering: dict, saes: dict, n_layer: int, d: int) -> np.ndarray | None:
    """llama.cpp's control vector for ``steering`` ({(sae, layer): features}), from the SAE
    files: row L-1 holds layer L's summed decoder rows."""
    if not steering:
        return None
    data = np.zeros((n_layer - 1, d))
    for (name, layer), features in steering.items():
        data[layer - 1] += RefSAE(saes[name]).delta(features)
    return data


def collect(eng, job, into: list):
    stream = eng.generate(job)
    stream.deliver_to(into.append)
    return stream


def wait_for(cond, timeout_s: float = 60) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.001)


def mixed_run(eng, jobs, first: int) -> list[GenerationResult]:
    """``jobs[:first]`` submitted together, the rest joining once each of those has
    produced a few tokens (while they still run)."""
    events: list[list] = [[] for _ in jobs]
    for job, into in zip(jobs[:first], events):
        collect(eng, job, into)
    wait_for(lambda: all(sum(isinstance(e, TokenEvent) for e in ev) >= 3 for ev in events[:first]))
    for job, into in zip(jobs[first:], events[first:]):
        collect(eng, job, into)
    wait_for(lambda: all(ev and isinstance(ev[-1], FinishEvent) for ev in events), 120)
    return [GenerationResult.from_events(ev) for ev in events]


def test_a_mixed_batch_never_mixes_steering_in_one_decode_and_equals_the_solo_runs(
    swap_engine, per_row_engine, engine, tiny_assets, monkeypatch
):
    l1, l2 = tiny_assets.saes["tiny-llama-L1-relu"], tiny_assets.saes["tiny-llama-L2-jumprelu"]
    saes = {l1.name: l1, l2.name: l2}
    for eng in (swap_engine, per_row_engine):
        eng.detach(None)
        for a in (l1, l2):
            eng.attach(AttachSpec(a.name, str(a.path), a.layer))
    caps = swap_engine.status().batching["capabilities"]
    assert caps["steering_mode"] == SWAP
    assert per_row_engine.status().batching["capabilities"]["steering_mode"] == PER_ROW
    ids = {f"r{i}": swap_engine.backend.encode_text(t) for i, t in enumerate(TEXTS)}
    steer = {
        "r0": {},
        "r1": {(l2.name, 2): {5: 4.0}},
        "r2": {(l1.name, 1): {3: -5.0}},
        "r3": {(l1.name, 1): {3: 5.0}, (l2.name, 2): {9: 2.0}},
        "r4": {(l2.name, 2): {5: 4.0}},  # steered as r1: the same group
        "r5": {},
    }
    # r2 monitors its steered layer before and after the steering
    monitor = MonitorSpec(
        [
            MonitorEntry(l1.name, 1, top_k=4, positions="all", read_point=rp, features=[3, 7])
            for rp in ("pre_steering", "post_steering")
        ]
    )
    jobs = [
        greedy(
            name,
            ids[name],
            n=24 if i < 3 else 12,
            steering=SteeringSpec.from_mapping(steer[name]) if steer[name] else None,
            monitor=monitor if name == "r2" else None,
        )
        for i, name in enumerate(steer)
    ]
    solo = [swap_engine.generate_sync(j) for j in jobs]
    per_row = mixed_run(per_row_engine, jobs, first=3)
    swap_engine.generate_sync(greedy("warm", ids["r0"], n=1))  # the control vector cleared
    log = DecodeLog(monkeypatch)
    mixed = mixed_run(swap_engine, jobs, first=3)
    monkeypatch.undo()

    for got, want, other in zip(mixed, solo, per_row):
        assert_same_generation(got, want, atol=2e-5)
        assert_same_generation(got, other, atol=2e-5)
        assert [c.count for c in got.steering_apply_count] == [got.forward_passes] * len(got.steering_apply_count)
        assert len(got.activations) == len(want.activations)
        for g, w in zip(got.activations, want.activations):
            assert (g.read_point, g.position) == (w.read_point, w.position)
            np.testing.assert_allclose(
                [f.activation for f in g.features], [f.activation for f in w.features], atol=2e-5
            )
    # the monitored request against the transformers backend (before/after its steering)
    engine.attach(AttachSpec(l1.name, str(l1.path), 1))
    try:
        want = engine.generate_sync(jobs[2])
    finally:
        engine.detach(None)
    got = mixed[2]
    assert_same_generation(got, want)
    for g, w in zip(got.activations, want.activations):
        assert (g.read_point, g.position) == (w.read_point, w.position)
        np.testing.assert_allclose(
            [f.activation for f in g.features], [f.activation for f in w.features], atol=ENCODE_ATOL
        )
    pre = [a for a in got.activations if a.read_point == "pre_steering"]
    post = [a for a in got.activations if a.read_point == "post_steering"]
    assert (
        max(abs(f.activation - g.activation) for a, b in zip(pre, post) for f, g in zip(a.features, b.features)) > 1e-3
    )  # the two reads do differ

    # what llama.cpp was asked to do
    backend = swap_engine.backend
    calls = log.owned(ids)
    sig = {name: tuple(sorted((k, tuple(sorted(v.items()))) for k, v in s.items())) for name, s in steer.items()}
    joined_late = False
    for names, cvec, _ in calls:
        assert len({sig[n] for n in names}) == 1, f"one decode mixed steering: {names}"
        want_cvec = control_vector(steer[names[0]], saes, backend.num_layers, backend.hidden_size)
        if want_cvec is None:
            assert cvec is None, names
        else:
            data, il_start, il_end = cvec
            np.testing.assert_allclose(data, want_cvec, atol=1e-5)
            assert all(il_start <= layer <= il_end for _, layer in steer[names[0]])
    for i, (names, _, step) in enumerate(calls):
        late = {"r3", "r4", "r5"} & set(names)
        if not step and late:  # a late prefill while an early request is still running
            joined_late |= any(n in {"r0", "r1", "r2"} for later in calls[i + 1 :] for n in later[0])
    assert joined_late
    # every steering group keeps its turn: from a request's prefill to its first step and
    # between two of its steps, at most one step of each other group
    groups = len(set(sig.values()))
    for name in steer:
        mine = [i for i, (names, _, _) in enumerate(calls) if name in names]
        waits = [sum(step for _, _, step in calls[a + 1 : b]) for a, b in zip(mine, mine[1:])]
        assert len(mine) > 1 and max(waits) <= groups - 1, (name, waits)

    # the observer does see mixing: the eval-callback mode puts several steerings in a call
    log = DecodeLog(monkeypatch)
    mixed_run(per_row_engine, jobs[:3], first=3)
    monkeypatch.undo()
    assert any(len({sig[n] for n in names}) > 1 for names, _, _ in log.owned(ids))


def test_the_load_chooses_the_mode_and_reports_it(tiny_gguf, monkeypatch):
    with Engine() as eng:
        eng.load_model(gguf_job(tiny_gguf))
        caps = eng.status().batching["capabilities"]
        # this CPU build: a row written in the callback is seen to reach the next layer
        assert caps["steering_mode"] == PER_ROW
        assert "self-check" in caps["steering_mode_reason"]
        eng.load_model(gguf_job(tiny_gguf, steering_mode=SWAP))
        caps = eng.status().batching["capabilities"]
        assert caps["steering_mode"] == SWAP and "forced" in caps["steering_mode_reason"]
        lost_writes(monkeypatch)
        eng.load_model(gguf_job(tiny_gguf))
        caps = eng.status().batching["capabilities"]
        assert caps["steering_mode"] == SWAP
        assert "did not reach the next layer" in caps["steering_mode_reason"]
        with pytest.raises(InvalidParameter) as exc:
            eng.load_model(gguf_job(tiny_gguf, steering_mode="per_row"))
        assert exc.value.param == "options.steering_mode"


def test_layer_zero_steering_is_refused_by_name_in_the_swap_mode(swap_engine, tiny_assets):
    """No control vector reaches layer 0: refused before anything runs, while the same SAE
    steering at layer 1 runs."""
    asset = tiny_assets.saes["tiny-llama-L1-relu"]
    swap_engine.detach(None)
    swap_engine.attach(AttachSpec(asset.name, str(asset.path), 0))
    swap_engine.attach(AttachSpec(asset.name, str(asset.path), 1))
    ids = swap_engine.backend.encode_text(TEXTS[2])
    with pytest.raises(InvalidParameter) as exc:
        swap_engine.generate_sync(greedy("l0", ids, steering=SteeringSpec.from_mapping({(asset.name, 0): {3: 6.0}})))
    assert exc.value.param == "steering"
    assert (exc.value.details["layer"], exc.value.details["steering_mode"]) == (0, SWAP)
    out = swap_engine.generate_sync(greedy("l1", ids, steering=SteeringSpec.from_mapping({(asset.name, 1): {3: 6.0}})))
    assert out.steering_apply_count[0].count == out.forward_passes
    # monitoring at layer 0 only reads: it runs
    out = swap_engine.generate_sync(
        greedy("m0", ids, monitor=MonitorSpec([MonitorEntry(asset.name, 0, top_k=3, positions="all")]))
    )
    assert len(out.activations) == len(ids) + 10 - 1
    swap_engine.detach(None)


def test_cancelling_a_waiting_group_leaves_the_others_running(swap_engine, tiny_assets):
    """A request cancelled while its group waits for its turn ends; the other group runs
    on to its solo tokens."""
    asset = tiny_assets.saes["tiny-llama-L2-jumprelu"]
    swap_engine.detach(None)
    swap_engine.attach(AttachSpec(asset.name, str(asset.path), 2))
    ids = swap_engine.backend.encode_text(TEXTS[1])
    steered = greedy("s", ids, n=40, steering=SteeringSpec.from_mapping({(asset.name, 2): {5: 4.0}}))
    plain = greedy("p", ids, n=40)
    want = swap_engine.generate_sync(plain)
    got: list = []
    collect(swap_engine, plain, got)
    stream = swap_engine.generate(steered)
    done = threading.Event()
    events: list = []

    def take(ev):
        events.append(ev)
        if sum(isinstance(e, TokenEvent) for e in events) == 3:
            stream.cancel()
        if isinstance(ev, FinishEvent):
            done.set()

    stream.deliver_to(take)
    assert done.wait(60)
    assert events[-1].finish_reason == "cancelled"
    wait_for(lambda: got and isinstance(got[-1], FinishEvent))
    assert GenerationResult.from_events(got).token_ids == want.token_ids
    swap_engine.detach(None)
