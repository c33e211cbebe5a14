"""Steering controls on the vLLM backend (clamp, scale, ablate, phases, windows,
conditions; docs/steering.md "Modes") against the transformers backend on the same fp32
weights: in one vLLM batch every request's greedy tokens, monitored activations (within
``VLLM_ACT_ATOL``), per-mode ``steering_apply_count`` and ``steering_fired`` positions are
the transformers backend's, and each steered request differs from its unsteered run
(positive control).  A raw vector adds and ablates; what a vector cannot run, or a control
that selects no position, is refused before anything runs.  One vLLM engine for the
module (tests/vllm/conftest.py)."""

from __future__ import annotations


import numpy as np
import pytest

from gpu_engine.api.errors import InvalidParameter
from gpu_engine.api.protocol import (
    AttachSpec,
    FeatureControl,
    GenerationJob,
    MonitorEntry,
    MonitorSpec,
    PositionRange,
    SamplingParams,
    SteeringCondition,
    SteeringEntry,
    SteeringSpec,
)
from gpu_engine.backends.vllm import wire

from .conftest import SAES
from .test_vllm_engine import VLLM_ACT_ATOL, assert_records_close

L1, L2 = (SAES[0], 1), (SAES[1], 2)
PROMPTS = {
    "clamp": "the cat sat on the mat and",
    "scale": "a quick brown fox jumps over the lazy dog while the sun",
    "ablate": "one two three four five six seven eight nine ten",
    "phase": "the dog ran over the hills and the cat sat on the mat",
    "window": "the sea and the sky are",
    "cond": "it was a dark and stormy night",
    "none": "the cat sat on the mat and then",
}


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def spec(key, features=None, controls=()) -> SteeringSpec:
    return SteeringSpec([SteeringEntry(key[0], key[1], features or {}, list(controls))])


def l2_reading(hf_engine, **prompt) -> np.ndarray:
    """Every L2 feature's activation at every prompt row, read from the unsteered residual
    arriving at the hook: (rows, d_sae)."""
    d_sae = next(a.d_sae for a in hf_engine.status().attachments if (a.sae_id, a.layer) == L2)
    probe = hf_engine.generate_sync(
        GenerationJob(
            "probe",
            **prompt,
            sampling=greedy(1),
            monitor=MonitorSpec(
                [MonitorEntry(L2[0], L2[1], features=list(range(d_sae)), read_point="pre_steering", positions="prompt")]
            ),
        )
    )
    return np.array([[f.activation for f in r.features] for r in probe.activations])


def choose_trigger(hf_engine, **prompt) -> tuple[int, float]:
    """A feature of L2 that fires at some of the prompt's rows and not at others, and a
    threshold in the widest gap between its values there: no prompt row sits near it."""
    acts = l2_reading(hf_engine, **prompt)
    best = None
    for j in range(acts.shape[1]):
        values = np.unique(acts[:, j])
        if values.size < 2 or values[-1] <= 0:
            continue
        gaps = np.diff(values)
        k = int(np.argmax(gaps))
        if best is None or gaps[k] > best[0]:
            best = (float(gaps[k]), j, float(values[k] + gaps[k] / 2))
    assert best is not None and best[0] > 0.05, best
    return best[1], best[2]


def mixed_jobs(trigger: int, threshold: float, scaled: int, n_prompt_window: int) -> dict[str, GenerationJob]:
    return {
        "clamp": GenerationJob(
            "clamp",
            prompt=PROMPTS["clamp"],
            sampling=greedy(14),
            steering=spec(
                L1, controls=[FeatureControl(3, mode="clamp", value=9.0), FeatureControl(17, mode="clamp", value=0.0)]
            ),
            monitor=MonitorSpec([MonitorEntry(L1[0], L1[1], top_k=4, features=[3, 17], positions="all")]),
        ),
        "scale": GenerationJob(
            "scale",
            prompt=PROMPTS["scale"],
            sampling=greedy(12),
            steering=spec(L2, controls=[FeatureControl(scaled, mode="scale", value=40.0)]),
        ),
        "ablate": GenerationJob(
            "ablate",
            prompt=PROMPTS["ablate"],
            sampling=greedy(13),
            steering=spec(L1, {5: 4.0}, [FeatureControl(40, mode="ablate")]),
            monitor=MonitorSpec(
                [
                    MonitorEntry(L1[0], L1[1], features=[40, 5], read_point="pre_steering", positions="all"),
                    MonitorEntry(L1[0], L1[1], features=[40, 5], positions="all"),
                ]
            ),
        ),
        "phase": GenerationJob(
            "phase",
            prompt=PROMPTS["phase"],
            sampling=greedy(12),
            steering=spec(L1, controls=[FeatureControl(3, value=12.0, phase="completion")]),
        ),
        "window": GenerationJob(
            "window",
            prompt=PROMPTS["window"],
            sampling=greedy(12),
            # from the prompt's third row to the fourth generated token's row
            steering=spec(L1, controls=[FeatureControl(17, value=-10.0, window=PositionRange(2, n_prompt_window + 3))]),
        ),
        "cond": GenerationJob(
            "cond",
            prompt=PROMPTS["cond"],
            sampling=greedy(12),
            steering=spec(
                L2, controls=[FeatureControl(7, value=15.0, condition=SteeringCondition(trigger, threshold))]
            ),
            monitor=MonitorSpec(
                [MonitorEntry(L2[0], L2[1], features=[trigger], read_point="pre_steering", positions="all")]
            ),
        ),
        "none": GenerationJob("none", prompt=PROMPTS["none"], sampling=greedy(10)),
    }


class BatchWatch:
    """A forward pre-hook on the vLLM worker's model (executor ``uni``: in this process)
    recording each forward's number of requests, and running ``at[n]`` just before
    forward ``n`` (1-based): a request submitted there is admitted after that step, so
    when it joins is exact, not a race with the test thread."""

    def __init__(self, engine) -> None:  # type: ignore[no-untyped-def]
        self.engine = engine
        self.sizes: list[int] = []
        self.at: dict[int, list] = {}
        self.handles: list = []

    def __enter__(self) -> BatchWatch:
        def install(worker):  # type: ignore[no-untyped-def]
            state = worker._millm_state

            def pre(module, args):  # type: ignore[no-untyped-def]
                self.sizes.append(int(state.runner.input_batch.num_reqs))
                for action in self.at.pop(len(self.sizes), []):
                    action()

            self.handles.append(state.model.register_forward_pre_hook(pre))

        self.engine.backend.engine.collective_rpc(install)
        return self

    def __exit__(self, *exc) -> None:  # type: ignore[no-untyped-def]
        for handle in self.handles:
            handle.remove()


def test_the_backend_reports_steering_controls(vllm_engine):
    caps = vllm_engine.status().batching["capabilities"]
    assert caps["steering_controls"] is True and caps["per_request_steering"] is True


def test_compiled_the_backend_still_reports_every_control():
    """``VLLM_ENFORCE_EAGER=false``: the layers' taps run the same hooks inside the compiled
    graph (test_vllm_compiled.py runs them), so steering and its controls stay on and a
    request with a control passes the engine's check; Q/K capture, whose hook sits on the
    Attention module inside the graph, is off and says why (no vLLM started: the backend's
    own capabilities and the engine's check)."""
    from gpu_engine.backends.vllm.backend import VllmBackend
    from gpu_engine.runtime.prepare import check_capabilities

    for eager in (False, True):
        backend = VllmBackend.__new__(VllmBackend)
        backend.enforce_eager, backend.tool_call_format, backend.worker_device = eager, None, "cpu"
        caps = backend.capabilities()
        assert caps.steering_controls is True and caps.per_request_steering is True
        assert caps.torch_compile is (not eager) and caps.cuda_graphs is False  # no CUDA here
        job = GenerationJob("g", prompt="x", steering=spec(L1, controls=[FeatureControl(3, mode="clamp", value=2.0)]))
        check_capabilities(backend, job)  # runs


def test_a_mixed_batch_of_every_mode_equals_transformers(vllm_engine, hf_engine):
    assert_mixed_batch_equals_transformers(vllm_engine, hf_engine)


def assert_mixed_batch_equals_transformers(vllm_engine, hf_engine):
    """Every mode in one vLLM batch, each request against the transformers backend (eager
    here; compiled in test_vllm_compiled.py)."""
    trigger, threshold = choose_trigger(hf_engine, prompt=PROMPTS["cond"])
    # the scaled feature: L2's most active one on its prompt (a scale of zero is nothing)
    scaled = int(l2_reading(hf_engine, prompt=PROMPTS["scale"]).sum(axis=0).argmax())
    jobs = mixed_jobs(trigger, threshold, scaled, len(hf_engine.backend.encode_text(PROMPTS["window"])))
    want = {name: hf_engine.generate_sync(j, timeout_s=120) for name, j in jobs.items()}

    order = list(jobs)
    streams = {}
    with BatchWatch(vllm_engine) as watch:
        # four start; the others join while those decode (their prefill beside decodes)
        for name in order[4:]:
            watch.at.setdefault(2, []).append(
                lambda name=name: streams.__setitem__(name, vllm_engine.generate(jobs[name]))
            )
        for name in order[:4]:
            streams[name] = vllm_engine.generate(jobs[name])
        got = {name: streams[name].result(120) for name in order[:4]}
        got.update({name: streams[name].result(120) for name in order[4:]})
    assert max(watch.sizes) >= 6, watch.sizes  # they really shared forward passes

    for name, job in jobs.items():
        g, w = got[name], want[name]
        assert g.token_ids == w.token_ids, name
        assert g.forward_passes == w.forward_passes == len(w.token_ids), name
        assert [(c.sae_id, c.layer, c.count, c.modes) for c in g.steering_apply_count] == [
            (c.sae_id, c.layer, c.count, c.modes) for c in w.steering_apply_count
        ], name
        assert [(f.sae_id, f.layer, f.index, f.mode, f.positions) for f in g.steering_fired] == [
            (f.sae_id, f.layer, f.index, f.mode, f.positions) for f in w.steering_fired
        ], name
        assert_records_close(g.activations, w.activations)
        if job.steering is None:
            assert g.steering_apply_count == [] and g.steering_fired == []
            continue
        # the counts are the modes the request asked for, once per forward pass (an
        # independent expectation: transformers could share a counting bug)
        (entry,) = job.steering.entries
        modes = {c.mode for c in entry.controls} | ({"add"} if entry.features else set())
        assert g.steering_apply_count[0].modes == dict.fromkeys(modes, g.forward_passes), name
        # positive control: the steering changed the request's tokens
        plain = GenerationJob(f"{name}-plain", prompt=job.prompt, sampling=job.sampling)
        assert vllm_engine.generate_sync(plain, timeout_s=120).token_ids != g.token_ids, name

    # the conditional fired at some rows, not all: exactly where its trigger, read before
    # the steering (the request's own pre_steering monitor), is above the threshold
    (fired,) = got["cond"].steering_fired
    read = {r.position: r.features[0].activation for r in want["cond"].activations}
    assert fired.positions == sorted(p for p, a in read.items() if a > threshold)
    assert 0 < len(fired.positions) < len(read)
    for p, a in read.items():
        assert abs(a - threshold) > 10 * VLLM_ACT_ATOL, (p, a, threshold)  # no row decided by rounding
    # the completion-phase steer left the prompt's rows alone: its first token (read from
    # the prompt's last row) is the plain run's, a later one is not
    phase_plain = vllm_engine.generate_sync(GenerationJob("pp", prompt=PROMPTS["phase"], sampling=greedy(12)))
    assert got["phase"].token_ids[0] == phase_plain.token_ids[0] and got["phase"].token_ids != phase_plain.token_ids


def test_a_conditional_request_never_reads_its_prompt_from_the_cache(vllm_engine, hf_engine):
    """Its gates are reported for every row: a second identical request computes its
    prompt again (no cached tokens) and reports the same positions, while an identical
    request steered without a condition does reuse the cache (positive control)."""
    block = vllm_engine.backend.engine.vllm_config.cache_config.block_size
    words = "it was a dark and stormy night and the rain fell on the sea while a bird sang ".split()
    text = " ".join(words[i % len(words)] for i in range(3 * block))
    ids = vllm_engine.backend.encode_text(text)[: 2 * block + 5]
    assert len(ids) == 2 * block + 5 < vllm_engine.backend.context_length - 4
    trigger, threshold = choose_trigger(hf_engine, prompt_token_ids=ids)
    gated = spec(L2, controls=[FeatureControl(7, value=15.0, condition=SteeringCondition(trigger, threshold))])
    windowed = spec(L2, controls=[FeatureControl(7, value=15.0, window=PositionRange(3, 40))])

    def run(rid: str, steering: SteeringSpec, engine=vllm_engine):
        return engine.generate_sync(
            GenerationJob(rid, prompt_token_ids=ids, steering=steering, sampling=greedy(4)), timeout_s=120
        )

    batch = vllm_engine._scheduler.backend
    want = run("ref", gated, hf_engine)
    assert want.steering_fired[0].positions  # it fires somewhere
    for rid in ("c1", "c2"):
        got = run(rid, gated)
        assert batch.cached_tokens[rid] == 0
        assert got.token_ids == want.token_ids
        assert [f.positions for f in got.steering_fired] == [f.positions for f in want.steering_fired]
    run("w1", windowed)
    again = run("w2", windowed)
    assert batch.cached_tokens["w2"] >= block
    assert again.token_ids == run("wref", windowed, hf_engine).token_ids


def test_a_phase_steer_is_cached_per_prompt_length():
    """Where a prompt ends decides which rows a phase steers, and a cached block does not
    record it: the salt of a phase-dependent steering holds the prompt length; a steering
    without phases is shared across lengths (torch-free: wire only)."""
    gen = {L1: "sae#1"}

    def args(control: FeatureControl):
        return wire.request_args(GenerationJob("x", prompt="p", steering=spec(L1, controls=[control])))

    phased = args(FeatureControl(3, value=2.0, phase="completion"))
    assert wire.steering_salt(phased, gen, n_prompt=20) != wire.steering_salt(phased, gen, n_prompt=30)
    assert wire.steering_salt(phased, gen, n_prompt=20) == wire.steering_salt(phased, gen, n_prompt=20)
    windowed = args(FeatureControl(3, value=2.0, window=PositionRange(0, 8)))
    assert wire.steering_salt(windowed, gen, n_prompt=20) == wire.steering_salt(windowed, gen, n_prompt=30)
    assert not wire.keeps_gates(windowed)
    assert wire.keeps_gates(args(FeatureControl(3, value=2.0, condition=SteeringCondition(4, 0.5))))


def test_a_raw_vector_adds_and_ablates_and_refuses_what_needs_an_encoder(vllm_engine, hf_engine, tmp_path):
    """A file with vectors for two layers, attached at layer 2 on both backends: add and
    ablate equal transformers' and change the output; clamp, scale and a condition are
    refused naming the field, before anything runs."""
    from safetensors.numpy import save_file

    d = vllm_engine.backend.hidden_size
    rng = np.random.default_rng(11)
    path = tmp_path / "v.safetensors"
    save_file({f"layer.{L}": (rng.normal(size=d) * 6).astype(np.float32) for L in (1, 2)}, str(path))
    for eng in (vllm_engine, hf_engine):
        eng.attach(AttachSpec("vec", str(path), 2))
    try:
        key = ("vec", 2)
        plain = vllm_engine.generate_sync(GenerationJob("vp", prompt=PROMPTS["clamp"], sampling=greedy(10)))
        for name, steering in (
            ("add", spec(key, {0: 3.0})),
            ("ablate", spec(key, controls=[FeatureControl(0, mode="ablate")])),
            ("phase", spec(key, controls=[FeatureControl(0, value=-4.0, phase="completion")])),
        ):
            job = GenerationJob(f"v-{name}", prompt=PROMPTS["clamp"], sampling=greedy(10), steering=steering)
            got = vllm_engine.generate_sync(job, timeout_s=120)
            want = hf_engine.generate_sync(job)
            assert got.token_ids == want.token_ids, name
            assert [(c.count, c.modes) for c in got.steering_apply_count] == [
                (c.count, c.modes) for c in want.steering_apply_count
            ], name
            assert got.token_ids != plain.token_ids, name
        batch = vllm_engine._scheduler.backend
        steps = batch.steps
        for control, param in (
            (FeatureControl(0, mode="clamp", value=1.0), "steering.features.mode"),
            (FeatureControl(0, mode="scale", value=2.0), "steering.features.mode"),
            (FeatureControl(0, value=1.0, condition=SteeringCondition(0, 0.0)), "steering.features.condition"),
        ):
            job = GenerationJob(
                "v-bad", prompt=PROMPTS["clamp"], sampling=greedy(4), steering=spec(key, controls=[control])
            )
            with pytest.raises(InvalidParameter) as err:
                vllm_engine.generate_sync(job, timeout_s=60)
            assert err.value.details["param"] == param
            assert "raw steering vector" in err.value.message and "encoder" in err.value.message
        assert batch.steps == steps  # nothing ran
    finally:
        for eng in (vllm_engine, hf_engine):
            eng.detach("vec")


def test_a_control_that_selects_no_position_is_refused_before_anything_runs(vllm_engine):
    batch = vllm_engine._scheduler.backend
    steps = batch.steps
    window = vllm_engine.backend.context_length
    for control in (
        FeatureControl(3, value=2.0, window=PositionRange(window)),
        FeatureControl(3, value=2.0, phase="prompt", window=PositionRange(40, 50)),
    ):
        job = GenerationJob("bad", prompt=PROMPTS["clamp"], sampling=greedy(4), steering=spec(L1, controls=[control]))
        with pytest.raises(InvalidParameter) as err:
            vllm_engine.generate_sync(job, timeout_s=60)
        assert err.value.details["param"] == "steering.features.window"
    assert batch.steps == steps and vllm_engine.status().in_flight == 0
