"""Splice (``SteeringEntry.splice``): every row at an attachment's hook replaced by the
SAE's reconstruction ``decode(encode(x))`` or by zeros — what "loss recovered" reads.

On the demo SmolLM2-135M with its layer-12 SAE (float32), on each backend that splices —
transformers serial and batched, vLLM, llama.cpp (``MILLM_REQUIRE_VLLM`` /
``MILLM_REQUIRE_LLAMACPP`` make those required) — one concurrent batch holds the same
prompt clean, spliced with the reconstruction and spliced with zeros (each asking for
``prompt_logprobs``), beside a request clamping a feature at the same attachment (so a
batch's control table mixes a splice with another request's operations).  The reference
is the test's own: a float32 transformers forward of the checkpoint whose block-12 output
the test replaces itself, by the reconstruction it computes in float64 from the SAE file's
weights (``tests/engine/helpers.RefSAE``, decoded here) or by zeros, and its own float64
``log_softmax``.  Loss recovered computed from the engine's logprobs equals the one from
the test's.  The positive control: a splice moves the logprobs.  ``steering_apply_count``
counts mode ``splice`` once per forward pass.

Also: the prefix cache keys a splice (KV computed spliced never serves a clean request,
nor the reverse), and the refusals name ``steering.splice``.
"""

from __future__ import annotations

import gc
import json
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from gpu_engine.api.capabilities import Capabilities
from gpu_engine.api.errors import InvalidParameter
from gpu_engine.api.protocol import (
    AttachSpec,
    BatchingOptions,
    FeatureControl,
    GenerationJob,
    SamplingParams,
    SteeringEntry,
    SteeringSpec,
    from_json,
)
from gpu_engine.runtime.engine import Engine
from gpu_engine.runtime.prepare import check_capabilities
from tests.fixtures.backends import require_backend
from tests.fixtures.llamacpp import gguf_copy

from .helpers import RefSAE
from .test_backend_parity import demo_loads

PROMPT = "The ocean waves crashed against the old pier while the fishermen mended their nets"
CLAMP = 8.0  # feature 0 ("ocean") clamped to this value in the neighbouring request
# the engine's prompt logprobs vs the test's own forward (float32 through 30 layers of a
# 576-wide residual, the splice's reconstruction in float32 against the test's float64,
# rounded once into the stream): measured ≤ 6.8e-5 (transformers serial and batched,
# vLLM; a zero splice ≤ 4.3e-7), so 5e-4 leaves ≥ 7× headroom
LOGPROB_ATOL = 5e-4
BACKENDS = ["transformers-serial", "transformers", "vllm", "llamacpp"]


@pytest.fixture(scope="module")
def demo(demo_assets):
    from offline_assets import DEMO_MODEL_NAME, DEMO_SAE_NAME

    return demo_assets.models[DEMO_MODEL_NAME], demo_assets.saes[DEMO_SAE_NAME]


def decode(ref: RefSAE, acts: np.ndarray) -> np.ndarray:
    """The demo SAE's reconstruction (SAELens ``decode``: no norm rescaling in its cfg)."""
    return acts @ ref.W_dec + ref.b_dec


@pytest.fixture(scope="module")
def reference(demo):
    """The checkpoint in float32 (plain transformers, no engine): the prompt tokens'
    float64 log-probabilities with block ``layer``'s output replaced by ``edit(x)``
    (float64 rows in, rows out), and greedy continuations."""
    model, sae = demo
    hf = AutoModelForCausalLM.from_pretrained(str(model.path), torch_dtype=torch.float32)
    hf.eval()
    block = hf.model.layers[sae.layer]

    def forward(ids: list[int], edit=None) -> np.ndarray:
        def hook(mod, args, output):
            hidden = output[0] if isinstance(output, tuple) else output
            new = torch.from_numpy(edit(hidden[0].double().numpy())).to(hidden.dtype)[None]
            return (new, *output[1:]) if isinstance(output, tuple) else new

        handle = block.register_forward_hook(hook) if edit is not None else None
        try:
            with torch.inference_mode():
                logits = hf(torch.tensor([ids])).logits[0].double()
        finally:
            if handle is not None:
                handle.remove()
        return logits.numpy()

    def prompt_logprobs(ids: list[int], edit=None) -> np.ndarray:
        logits = forward(ids, edit)
        top = logits.max(-1, keepdims=True)
        lsm = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
        return np.array([lsm[p - 1, ids[p]] for p in range(1, len(ids))])

    def greedy(ids: list[int], n: int, edit=None) -> list[int]:
        seq = list(ids)
        for _ in range(n):
            seq.append(int(forward(seq, edit)[-1].argmax()))
        return seq[len(ids) :]

    return prompt_logprobs, greedy


def tokenizer_of(model):
    tok = AutoTokenizer.from_pretrained(str(model.path))
    return lambda text: tok(text)["input_ids"]


def loads(model, backend: str, **options):
    gguf = gguf_copy(Path(model.path)) if backend == "llamacpp" else None
    hf_load, vllm_load, gguf_load = demo_loads(model, gguf)
    load = {"vllm": vllm_load, "llamacpp": gguf_load}.get(backend, hf_load)
    return msgspec.structs.replace(load, options={**load.options, **options}) if options else load


def splice_spec(key, mode: str) -> SteeringSpec:
    return SteeringSpec([SteeringEntry(*key, splice=mode)])


def losses(lps) -> float:
    """The mean next-token loss over the prompt (its first token predicts nothing)."""
    return float(-np.mean(lps))


@pytest.mark.parametrize("backend", BACKENDS)
def test_splice_gives_the_tests_own_spliced_forward(demo, reference, backend):
    model, sae_asset = demo
    if backend in ("vllm", "llamacpp"):
        require_backend(backend)
    ref_lp, _ = reference
    ref = RefSAE(sae_asset)
    key = (sae_asset.name, sae_asset.layer)
    ids = tokenizer_of(model)(PROMPT)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, prompt_logprobs=True)
    jobs = {
        "clean": GenerationJob("clean", prompt_token_ids=ids, sampling=one),
        "recon": GenerationJob(
            "recon", prompt_token_ids=ids, sampling=one, steering=splice_spec(key, "reconstruction")
        ),
        "zero": GenerationJob("zero", prompt_token_ids=ids, sampling=one, steering=splice_spec(key, "zero")),
        "clamp": GenerationJob(
            "clamp",
            prompt_token_ids=ids,
            sampling=one,
            steering=SteeringSpec([SteeringEntry(*key, controls=[FeatureControl(0, "clamp", CLAMP)])]),
        ),
    }
    eng = Engine(
        batching=BatchingOptions(enabled=backend != "transformers-serial", max_batch_size=8), drain_timeout_s=300
    )
    try:
        eng.load_model(loads(model, backend))
        eng.attach(AttachSpec(sae_asset.name, str(sae_asset.path), sae_asset.layer))
        assert eng.status().batching["capabilities"]["splice"] is True
        streams = {name: eng.generate(job) for name, job in jobs.items()}
        got = {name: s.result(600) for name, s in streams.items()}
    finally:
        eng.shutdown()
        del eng
        gc.collect()

    def recon(x):
        return decode(ref, ref.encode(x))

    def clamp(x):
        return x + (CLAMP - ref.encode(x)[:, :1]) * ref.W_dec[0]

    want = {
        "clean": ref_lp(ids),
        "recon": ref_lp(ids, recon),
        "zero": ref_lp(ids, np.zeros_like),
        "clamp": ref_lp(ids, clamp),
    }
    lps = {}
    for name, res in got.items():
        assert res.prompt_logprobs[0] is None and len(res.prompt_logprobs) == len(ids)
        lps[name] = np.array(res.prompt_logprobs[1:], dtype=np.float64)
        err = np.abs(lps[name] - want[name]).max()
        print(backend, name, "largest |engine - reference| logprob:", err)
        np.testing.assert_allclose(lps[name], want[name], atol=LOGPROB_ATOL, rtol=0)
    # positive control: each splice moves the logprobs well beyond the tolerance
    assert np.abs(lps["recon"] - lps["clean"]).max() > 20 * LOGPROB_ATOL
    assert np.abs(lps["zero"] - lps["clean"]).max() > 20 * LOGPROB_ATOL
    # loss recovered, from the engine's three passes and from the test's
    lr = (losses(lps["zero"]) - losses(lps["recon"])) / (losses(lps["zero"]) - losses(lps["clean"]))
    lr_ref = (losses(want["zero"]) - losses(want["recon"])) / (losses(want["zero"]) - losses(want["clean"]))
    print(backend, "loss recovered", lr, "reference", lr_ref)
    assert abs(lr - lr_ref) < 1e-2
    # counted once per forward, under mode "splice"
    for name in ("recon", "zero"):
        res = got[name]
        assert res.forward_passes >= 1
        (count,) = res.steering_apply_count
        assert (count.sae_id, count.layer) == key
        assert count.count == res.forward_passes and count.modes == {"splice": res.forward_passes}
    assert got["clean"].steering_apply_count == []


@pytest.mark.parametrize("backend", ["transformers", "vllm", "llamacpp"])
def test_the_prefix_cache_keeps_spliced_kv_apart(demo, reference, backend):
    """KV computed under a splice is stored under its own key, apart for each mode: run in
    turns on one prompt, zero-spliced, reconstruction-spliced and clean requests each
    decode their own greedy tokens (the test's own forward's for clean and
    reconstruction)."""
    model, sae_asset = demo
    if backend in ("vllm", "llamacpp"):
        require_backend(backend)
    _, ref_greedy = reference
    key = (sae_asset.name, sae_asset.layer)
    # longer than two of vLLM's cache blocks (its cache keeps whole blocks only)
    ids = tokenizer_of(model)(PROMPT + ". " + " ".join([PROMPT] * 30))[:300]
    n = 4
    sampling = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    eng = Engine(batching=BatchingOptions(enabled=True, max_batch_size=4), drain_timeout_s=300)
    try:
        eng.load_model(loads(model, backend, **({} if backend == "vllm" else {"prefix_cache_max_mb": 64})))
        eng.attach(AttachSpec(sae_asset.name, str(sae_asset.path), sae_asset.layer))
        assert eng.status().batching["capabilities"]["prefix_caching"] is True

        got = {}
        for name, steering in (
            ("zero1", splice_spec(key, "zero")),
            ("recon1", splice_spec(key, "reconstruction")),
            ("clean", None),
            ("recon2", splice_spec(key, "reconstruction")),
            ("zero2", splice_spec(key, "zero")),
            ("clean2", None),
        ):
            job = GenerationJob(name, prompt_token_ids=ids, sampling=sampling, steering=steering)
            got[name] = eng.generate_sync(job, timeout_s=600).token_ids
        if backend == "vllm":
            # control: the cache is used (the second reconstruction reads the first's KV)
            cached = eng._scheduler.backend.cached_tokens
            assert cached["recon2"] >= eng.backend.engine.vllm_config.cache_config.block_size
            assert cached["recon1"] == cached["clean"] == 0
    finally:
        eng.shutdown()
        del eng
        gc.collect()
    want = ref_greedy(ids, n)
    ref = RefSAE(sae_asset)
    want_recon = ref_greedy(ids, n, lambda x: decode(ref, ref.encode(x)))
    assert got["clean"] == want and got["clean2"] == want
    assert got["recon1"] == want_recon and got["recon2"] == want_recon
    assert got["zero1"] == got["zero2"]
    # positive controls: the three give three texts
    assert len({tuple(want), tuple(want_recon), tuple(got["zero1"])}) == 3


def test_splice_takes_no_features_controls_or_vectors():
    vector = {"data": np.ones(4, dtype="<f4").tobytes()}
    for extra in (
        {"features": {1: 2.0}},
        {"features": {1: 0.0}},
        {"controls": [FeatureControl(1, "ablate")]},
        {"vectors": [vector]},
    ):
        with pytest.raises(InvalidParameter) as refused:
            SteeringEntry("s", 0, splice="reconstruction", **extra)
        assert refused.value.param == "steering.splice"
    body = {"sae_id": "s", "layer": 0, "splice": "zero", "features": {"3": 1.0}}
    with pytest.raises(InvalidParameter) as refused:
        from_json(json.dumps(body), SteeringEntry)
    assert refused.value.param == "steering.splice"
    with pytest.raises(InvalidParameter) as refused:
        from_json(json.dumps({"sae_id": "s", "layer": 0, "splice": "mean"}), SteeringEntry)
    assert refused.value.param == "steering.splice"
    # alone it is a steering that is not empty
    assert not SteeringSpec([SteeringEntry("s", 0, splice="zero")]).is_empty()


def test_the_canonical_text_names_the_splice():
    spec = SteeringSpec(
        [SteeringEntry("b", 3, {5: 1.0}), SteeringEntry("a", 2, splice="zero"), SteeringEntry("b", 1, splice="zero")]
    )
    assert spec.canonical_text() == ("a\t2\tsplice=zero\nb\t1\tsplice=zero\nb\t3\t5\t3ff0000000000000\n")
    rec = SteeringSpec([SteeringEntry("a", 2, splice="reconstruction")])
    zero = SteeringSpec([SteeringEntry("a", 2, splice="zero")])
    assert len({rec.canonical_hash(), zero.canonical_hash(), SteeringSpec().canonical_hash()}) == 3


class _Backend:
    name = "plain"

    def __init__(self, caps: Capabilities) -> None:
        self.caps = caps

    def capabilities(self) -> Capabilities:
        return self.caps


def test_a_backend_without_splice_refuses_it_by_name():
    job = GenerationJob("j", prompt="x", steering=SteeringSpec([SteeringEntry("s", 0, splice="zero")]))
    # a backend that does not report the key refuses, as one that reports it off with a reason
    for caps, reason in ((Capabilities(), None), (Capabilities(splice=False, splice_reason="no rows"), "no rows")):
        with pytest.raises(InvalidParameter) as refused:
            check_capabilities(_Backend(caps), job)
        details = refused.value.details
        assert details["param"] == "steering.splice" and details["capability"] == "splice"
        assert details.get("reason") == reason
    check_capabilities(_Backend(Capabilities(splice=True)), job)  # positive control


def test_the_engine_refuses_a_splice_its_backend_cannot_run(demo, monkeypatch):
    """Through the engine: the backend's report (here turned off) is read before anything
    runs, and the request fails naming the field; a raw vector cannot reconstruct."""
    model, sae_asset = demo
    eng = Engine()
    try:
        eng.load_model(loads(model, "transformers-serial"))
        eng.attach(AttachSpec(sae_asset.name, str(sae_asset.path), sae_asset.layer))
        key = (sae_asset.name, sae_asset.layer)
        job = GenerationJob(
            "j", prompt="Hello", sampling=SamplingParams(max_tokens=2), steering=splice_spec(key, "zero")
        )
        assert eng.generate_sync(job).token_ids  # positive control: it runs here
        off = Capabilities(splice=False, splice_reason="switched off by the test")
        monkeypatch.setattr(eng.backend, "capabilities", lambda: off)
        with pytest.raises(InvalidParameter) as refused:
            eng.generate_sync(msgspec.structs.replace(job, request_id="k"))
        assert refused.value.param == "steering.splice"
        assert refused.value.details["reason"] == "switched off by the test"
    finally:
        eng.shutdown()
        del eng
        gc.collect()


@pytest.mark.parametrize("case", ["resid_pre_0", "resid_post", "attn_out", "mlp_transcoder"])
@pytest.mark.parametrize("mode", ["reconstruction", "zero"])
def test_a_splice_replaces_what_its_hook_point_writes(engine, tiny_assets, tmp_path, case, mode):
    """On tiny-llama (transformers, serial), at each kind of hook point: the module's
    output after the engine's hook is the test's own float64 reconstruction of what the
    SAE reads there (its raw output; a transcoder's MLP input, its output replaced), or
    zeros — at every forward, prompt and decode steps alike."""
    from .test_hook_points import EXPECTED, _capture_input, greedy, sae_at

    path, ref, layer = sae_at(tmp_path, tiny_assets, case)
    _, _, _, module_path, reads_input = EXPECTED[case]
    engine.attach(AttachSpec("hp", str(path), layer))
    module = engine.backend.model.get_submodule(module_path)
    from .helpers import capture

    inputs, handle = _capture_input(module) if reads_input else ([], None)
    steering = SteeringSpec([SteeringEntry("hp", layer, splice=mode)])
    try:
        with capture(module, before_engine=True) as raw, capture(module) as post:
            res = engine.generate_sync(greedy("s", steering, max_tokens=4))
    finally:
        if handle is not None:
            handle.remove()
    assert len(raw) == len(post) == res.forward_passes == 4
    for i, (x, got) in enumerate(zip(raw, post)):
        read = inputs[i] if reads_input else x
        want = decode(ref, ref.encode(read)) if mode == "reconstruction" else np.zeros_like(x)
        if mode == "zero":
            assert (got == 0).all()
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)
        assert np.abs(got - x).max() > 1e-3  # positive control: the rows changed
    (count,) = res.steering_apply_count
    assert count.count == 4 and count.modes == {"splice": 4}


def test_a_raw_vector_cannot_reconstruct_and_a_transcoder_has_no_fidelity(engine, tiny_assets, tmp_path):
    from safetensors.numpy import save_file

    from gpu_engine.api.protocol import MonitorEntry, MonitorSpec

    from .test_hook_points import greedy, sae_at

    d = tiny_assets.models["tiny-llama"].hidden_size
    vec = tmp_path / "v.safetensors"
    save_file({"layer.1": np.ones(d, dtype=np.float32)}, str(vec), metadata={"model_name": "tiny-llama"})
    engine.attach(AttachSpec("vec", str(vec), 1, layout="vector"))
    with pytest.raises(InvalidParameter) as refused:
        engine.generate_sync(greedy("r", SteeringSpec([SteeringEntry("vec", 1, splice="reconstruction")])))
    assert refused.value.param == "steering.splice"
    # zeros need no encoder (positive control)
    assert engine.generate_sync(greedy("z", SteeringSpec([SteeringEntry("vec", 1, splice="zero")]))).token_ids

    path, _, layer = sae_at(tmp_path, tiny_assets, "mlp_transcoder")
    engine.attach(AttachSpec("tc", str(path), layer))
    monitor = MonitorSpec([MonitorEntry("tc", layer, fidelity=True, positions="all")])
    with pytest.raises(InvalidParameter) as refused:
        engine.generate_sync(greedy("f", monitor=monitor))
    assert refused.value.param == "monitor.fidelity"


@pytest.mark.parametrize("batched", [False, True])
def test_the_llamacpp_swap_mode_refuses_a_splice_naming_field_backend_and_reason(
    tiny_gguf, tiny_assets, monkeypatch, batched
):
    """A control vector adds one vector to every row: a llama.cpp load in
    ``control_vector_swap`` reports ``splice`` off with the reason and refuses a splice
    before any decode runs (llama.cpp's own ``llama_decode`` is never called); the backend
    refuses it too when handed the plans directly."""
    import llama_cpp.llama_cpp as lc

    from gpu_engine.interp.plans import build_hooks

    from .test_llamacpp import gguf_job

    swap = "control_vector_swap"
    sae = tiny_assets.saes["tiny-llama-L1-relu"]
    key = (sae.name, sae.layer)
    eng = Engine(batching=BatchingOptions(enabled=True, max_batch_size=4)) if batched else Engine()
    try:
        eng.load_model(gguf_job(tiny_gguf, steering_mode=swap))
        eng.attach(AttachSpec(sae.name, str(sae.path), sae.layer))
        caps = eng.status().batching["capabilities"]
        assert caps["splice"] is False and swap in caps["splice_reason"]
        decodes = []
        real = lc.llama_decode
        monkeypatch.setattr(lc, "llama_decode", lambda ctx, batch: decodes.append(1) or real(ctx, batch))
        job = GenerationJob(
            "s", prompt="the cat", sampling=SamplingParams(max_tokens=2), steering=splice_spec(key, "zero")
        )
        with pytest.raises(InvalidParameter) as refused:
            eng.generate_sync(job)
        assert refused.value.param == "steering.splice"
        assert refused.value.details["backend"] == "llamacpp" and swap in refused.value.details["reason"]
        assert decodes == []
        hooks = build_hooks(
            {key: eng._attachments[key].sae},
            "d",
            [SteeringEntry(*key, splice="reconstruction")],
            [],
            n_prompt=3,
            dtype=torch.float32,
            device="cpu",
        )
        with pytest.raises(InvalidParameter) as refused:
            eng.backend._check_steering(hooks)
        assert refused.value.param == "steering.splice" and swap in refused.value.details["reason"]
    finally:
        eng.shutdown()
