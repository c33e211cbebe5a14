"""One truth across backends: the demo SmolLM2-135M on the same float32 weights — the
transformers checkpoint, the same directory on vLLM (float32, eager) and its float32 GGUF
copy on llama.cpp (``steering_mode: eval_callback_per_row``) — runs the same batch of
concurrent requests (one unsteered, a plain add, a clamp, a scale with an ablate, a
conditional control, a phase- and window-limited one), each monitored top-k on the demo
SAE, greedy for a fixed number of tokens.  Every backend gives the same tokens, the same
monitored activations within ``PARITY_ACT_*`` (tests/engine/tolerances.py), the same
conditional gate positions, and per-mode ``steering_apply_count`` equal to the request's
forward passes.

The backends load one at a time, each shut down and freed before the next loads (one
copy of the weights in memory at a time).  Prompts go in as token ids, so the three
tokenizers cannot make the inputs differ; the tokenizer parity of each backend is
tests/engine/test_llamacpp.py's and tests/vllm/'s business.

Needs the demo package (``MILLM_REQUIRE_DEMO=1`` fails instead of skipping), vLLM and
llama-cpp-python (``MILLM_REQUIRE_VLLM=1`` / ``MILLM_REQUIRE_LLAMACPP=1`` likewise).
"""

from __future__ import annotations

import gc
from pathlib import Path

import numpy as np
import pytest

from gpu_engine.api.protocol import (
    AttachSpec,
    BatchingOptions,
    FeatureControl,
    GenerationJob,
    LoadModelJob,
    MonitorEntry,
    MonitorSpec,
    PositionRange,
    SamplingParams,
    SteeringCondition,
    SteeringEntry,
    SteeringSpec,
)
from gpu_engine.runtime.engine import Engine
from tests.fixtures.backends import require_backend
from tests.fixtures.llamacpp import gguf_copy

from .tolerances import PARITY_ACT_ATOL, PARITY_ACT_RTOL

N_TOKENS = 10
TOP_K = 5
PROMPTS = {
    "none": "The weather today is",
    "add": "My favourite place to visit is",
    "clamp": "Write a short note to your friend about",
    "scale": "The committee reviewed the budget and",
    "cond": "The ocean waves crashed against the shore while the children",
    "gated": "Tell me a story about a small town where",
}


def greedy() -> SamplingParams:
    return SamplingParams(max_tokens=N_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def demo(demo_assets):
    require_backend("vllm")
    require_backend("llamacpp")
    from offline_assets import DEMO_MODEL_NAME, DEMO_SAE_NAME

    model = demo_assets.models[DEMO_MODEL_NAME]
    sae = demo_assets.saes[DEMO_SAE_NAME]
    return model, sae, gguf_copy(Path(model.path))


def run_batch(load: LoadModelJob, sae, jobs: dict[str, GenerationJob], **caps) -> dict:
    """Load, attach the demo SAE, submit every job at once (one continuous batch), collect,
    shut the engine down and free it before the caller loads the next backend."""
    eng = Engine(batching=BatchingOptions(enabled=True, max_batch_size=8), drain_timeout_s=300)
    try:
        eng.load_model(load)
        eng.attach(AttachSpec(sae.name, str(sae.path), sae.layer))
        have = eng.status().batching["capabilities"]
        assert {k: have[k] for k in caps} == caps, (load.backend, have)
        streams = {name: eng.generate(job) for name, job in jobs.items()}
        return {name: s.result(300) for name, s in streams.items()}
    finally:
        eng.shutdown()
        del eng
        gc.collect()


def demo_loads(model, gguf) -> tuple[LoadModelJob, LoadModelJob, LoadModelJob]:
    """The demo's one set of float32 weights as each backend loads it: transformers, vLLM
    (eager, in-process), llama.cpp (its f32 GGUF, f32 KV, no flash attention)."""
    hf_load = LoadModelJob(model.name, str(model.path), dtype="float32", device="cpu", max_context_length=512)
    vllm_load = LoadModelJob(
        model.name,
        str(model.path),
        dtype="float32",
        device="cpu",
        backend="vllm",
        max_context_length=512,
        options={"distributed_executor_backend": "uni", "max_num_seqs": 8, "enforce_eager": True},
    )
    gguf_load = LoadModelJob(
        model.name,
        str(gguf),
        device="cpu",
        backend="llamacpp",
        max_context_length=512,
        options={"kv_cache_type": "f32", "flash_attention": False},
    )
    return hf_load, vllm_load, gguf_load


def solo_reference(hf_load: LoadModelJob, sae, prompts: dict[str, str], specs: dict) -> tuple[dict, dict, dict]:
    """On the transformers backend, each prompt run alone: its token ids, its tokens under
    ``specs[name]`` and its unsteered tokens (the positive control's)."""
    hf = Engine()
    try:
        hf.load_model(hf_load)
        hf.attach(AttachSpec(sae.name, str(sae.path), sae.layer))
        ids = {name: hf.backend.encode_text(text) for name, text in prompts.items()}
        want = {
            name: hf.generate_sync(GenerationJob(name, prompt_token_ids=ids[name], sampling=greedy(), steering=spec))
            for name, spec in specs.items()
        }
        plain = {
            name: hf.generate_sync(GenerationJob(name, prompt_token_ids=ids[name], sampling=greedy())).token_ids
            for name in prompts
        }
    finally:
        hf.shutdown()
        del hf
        gc.collect()
    return ids, want, plain


def assert_every_backend_steers_as_alone(demo, jobs: dict[str, GenerationJob], want: dict, plain: dict) -> None:
    """``jobs`` in one concurrent batch on each backend (llama.cpp in its per-row eval
    callback) give the tokens ``want`` has, differ from ``plain`` and steer every pass."""
    model, sae, gguf = demo
    hf_load, vllm_load, gguf_load = demo_loads(model, gguf)
    results = {"transformers": run_batch(hf_load, sae, jobs)}
    results["vllm"] = run_batch(vllm_load, sae, jobs)
    results["llamacpp"] = run_batch(gguf_load, sae, jobs, steering_mode="eval_callback_per_row")
    for backend, got in results.items():
        for name in jobs:
            assert got[name].token_ids == want[name].token_ids, (backend, name)
            assert got[name].token_ids != plain[name], (backend, name)
            (applied,) = got[name].steering_apply_count
            assert applied.count == got[name].forward_passes, (backend, name)


def choose_trigger(hf: Engine, sae, ids: list[int]) -> tuple[int, float]:
    """A feature that fires at some of the prompt's rows and not at others (read before
    the steering), and a threshold in the widest gap between its values there: no row
    sits near it, so float rounding cannot decide the gate."""
    probe = hf.generate_sync(
        GenerationJob(
            "probe",
            prompt_token_ids=ids,
            sampling=SamplingParams(max_tokens=1, temperature=0.0),
            monitor=MonitorSpec(
                [
                    MonitorEntry(
                        sae.name,
                        sae.layer,
                        features=list(range(sae.d_sae)),
                        read_point="pre_steering",
                        positions="prompt",
                    )
                ]
            ),
        )
    )
    acts = np.array([[f.activation for f in r.features] for r in probe.activations])
    best = None
    for j in range(acts.shape[1]):
        # row 0, the first token (no BOS here), reads hundreds where the rest read ~1
        values = np.unique(acts[1:, j])
        if values.size < 2 or values[-1] <= 0:
            continue
        gaps = np.diff(values)
        k = int(np.argmax(gaps))
        if best is None or gaps[k] > best[0]:
            best = (float(gaps[k]), j, float(values[k] + gaps[k] / 2))
    assert best is not None and best[0] > 0.5, best
    return best[1], best[2]


def most_active(hf: Engine, sae, ids: list[int]) -> int:
    out = hf.generate_sync(
        GenerationJob(
            "probe",
            prompt_token_ids=ids,
            sampling=SamplingParams(max_tokens=1, temperature=0.0),
            monitor=MonitorSpec(
                [MonitorEntry(sae.name, sae.layer, top_k=1, read_point="pre_steering", positions="prompt")]
            ),
        )
    )
    return max(
        (f for r in out.activations[1:] for f in r.top_k),  # not the first token's outliers
        key=lambda f: f.activation,
    ).feature_index


def build_jobs(ids: dict[str, list[int]], sae, trigger: int, threshold: float, scaled: int) -> dict[str, GenerationJob]:
    key = (sae.name, sae.layer)

    def steer(features=None, controls=()) -> SteeringSpec:
        return SteeringSpec([SteeringEntry(key[0], key[1], features or {}, list(controls))])

    def monitor(*extra: MonitorEntry) -> MonitorSpec:
        return MonitorSpec([MonitorEntry(key[0], key[1], top_k=TOP_K, positions="all"), *extra])

    n_gated = len(ids["gated"])
    steering = {
        "none": None,
        # the demo SAE's labelled features (offline_assets/demo.py): 0 ocean, 1 happy,
        # 2 sad, 3 formal; strengths in its documented working range
        "add": steer({0: 10.0}),
        "clamp": steer(controls=[FeatureControl(1, mode="clamp", value=12.0)]),
        "scale": steer(controls=[FeatureControl(scaled, mode="scale", value=4.0), FeatureControl(3, mode="ablate")]),
        "cond": steer(controls=[FeatureControl(2, value=15.0, condition=SteeringCondition(trigger, threshold))]),
        "gated": steer(
            controls=[
                FeatureControl(0, value=12.0, phase="completion"),
                # from the prompt's third row to the third generated token's row
                FeatureControl(3, value=-10.0, window=PositionRange(2, n_gated + 3)),
            ]
        ),
    }
    extra = {"cond": [MonitorEntry(key[0], key[1], features=[trigger], read_point="pre_steering", positions="all")]}
    return {
        name: GenerationJob(
            name,
            prompt_token_ids=ids[name],
            sampling=greedy(),
            steering=steering[name],
            monitor=monitor(*extra.get(name, [])),
        )
        for name in PROMPTS
    }


def counts(result) -> list[tuple]:
    return [(c.sae_id, c.layer, c.count, c.modes) for c in result.steering_apply_count]


def fired(result) -> list[tuple]:
    return [(f.sae_id, f.layer, f.index, f.mode, f.positions) for f in result.steering_fired]


def act_diff(got, want) -> tuple[float, float, float]:
    """Over every monitored value of a request: the largest |got − want| / (ATOL +
    RTOL·|want|) (≤ 1 passes), the largest |got − want| where |want| ≤ 1 and the largest
    |got − want| / |want| where |want| > 1; the records must line up exactly first."""
    assert [(r.sae_id, r.layer, r.read_point, r.position, r.token_index) for r in got.activations] == [
        (r.sae_id, r.layer, r.read_point, r.position, r.token_index) for r in want.activations
    ]
    worst = small = relative = 0.0
    for g, w in zip(got.activations, want.activations):
        assert [f.feature_index for f in g.features] == [f.feature_index for f in w.features]
        pairs = [(a.activation, b.activation) for a, b in zip(g.features, w.features)]
        # top-k: by feature where both hold it; a feature only one side holds must sit at
        # the k-th value within the tolerance (a near-tie at the cut)
        gk = {f.feature_index: f.activation for f in g.top_k}
        wk = {f.feature_index: f.activation for f in w.top_k}
        assert len(gk) == len(wk)
        pairs += [(gk[i], wk[i]) for i in gk.keys() & wk.keys()]
        cut = min(wk.values(), default=0.0)
        pairs += [(gk[i], cut) for i in gk.keys() - wk.keys()]
        pairs += [(min(gk.values()), wk[i]) for i in wk.keys() - gk.keys()]
        for a, b in pairs:
            worst = max(worst, abs(a - b) / (PARITY_ACT_ATOL + PARITY_ACT_RTOL * abs(b)))
            if abs(b) <= 1:
                small = max(small, abs(a - b))
            else:
                relative = max(relative, abs(a - b) / abs(b))
    return worst, small, relative


def test_three_backends_give_the_same_tokens_activations_and_counts(demo):
    model, sae, gguf = demo
    hf_load, vllm_load, gguf_load = demo_loads(model, gguf)

    # the requests, from the transformers backend's tokenizer and unsteered reads
    hf = Engine()
    try:
        hf.load_model(hf_load)
        hf.attach(AttachSpec(sae.name, str(sae.path), sae.layer))
        ids = {name: hf.backend.encode_text(text) for name, text in PROMPTS.items()}
        trigger, threshold = choose_trigger(hf, sae, ids["cond"])
        scaled = most_active(hf, sae, ids["scale"])
        jobs = build_jobs(ids, sae, trigger, threshold, scaled)
        # positive control: every steered request's tokens differ from its unsteered run
        plain = {
            name: hf.generate_sync(GenerationJob(name, prompt_token_ids=ids[name], sampling=greedy())).token_ids
            for name, job in jobs.items()
            if job.steering is not None
        }
    finally:
        hf.shutdown()
        del hf
        gc.collect()

    results = {"transformers": run_batch(hf_load, sae, jobs)}
    results["vllm"] = run_batch(vllm_load, sae, jobs, steering_controls=True)
    # on the CPU the load's self-check picks the per-row eval callback
    results["llamacpp"] = run_batch(gguf_load, sae, jobs, steering_mode="eval_callback_per_row", steering_controls=True)

    want = results["transformers"]
    worst = {}
    for backend, got in results.items():
        for name, job in jobs.items():
            g, w = got[name], want[name]
            where = (backend, name)
            assert g.token_ids == w.token_ids, where
            assert g.forward_passes == N_TOKENS, where
            assert counts(g) == counts(w), where
            assert fired(g) == fired(w), where
            worst[where] = act_diff(g, w)
            if job.steering is None:
                assert g.steering_apply_count == [] and g.steering_fired == [], where
                continue
            # an independent expectation: each mode the request asked for, once per
            # forward pass (its gates decide rows, not whether the hook ran)
            (entry,) = job.steering.entries
            modes = {c.mode for c in entry.controls} | ({"add"} if entry.features else set())
            (applied,) = g.steering_apply_count
            assert applied.count == g.forward_passes and applied.modes == dict.fromkeys(modes, g.forward_passes), where
            assert g.token_ids != plain[name], where
    # measured: the largest difference over tolerance; below 1 absolute, above it relative
    print("activation differences:", {f"{b}/{n}": tuple(f"{x:.3g}" for x in v) for (b, n), v in worst.items()})
    assert max(v[0] for v in worst.values()) <= 1.0, worst

    # the conditional gate opened at some rows, not all, exactly where its trigger, read
    # before the steering, is above the threshold
    cond = want["cond"]
    (gate,) = cond.steering_fired
    rows = cond.usage.prompt_tokens + N_TOKENS - 1
    assert 0 < len(gate.positions) < rows
    above = sorted(
        r.position for r in cond.activations if r.read_point == "pre_steering" and r.features[0].activation > threshold
    )
    assert gate.positions == above
