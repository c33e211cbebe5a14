"""``Engine.attribution``: each SAE feature's activation × gradient of one logit, checked
against the test's own float64 model.

The reference is a second copy of each tiny checkpoint loaded by transformers in float64,
its SAE encoded by the test's own numpy formulas (``RefSAE``), hooked by the test:

- every reported value ``f_i(x_p) · ∂logit/∂f_i(x_p)`` equals ``f_i(x_p)`` times the
  central difference of the target logit when the test moves feature i's activation at
  position p by ±eps (the row written there moves by ±eps · W_dec[i]);
- every reported ``ablation_delta`` equals the test's own forward with that feature's
  ``f_i · W_dec[i]`` taken out of every row, minus the clean one;
- with no target the greedy next token is attributed (the float64 argmax, and the
  engine's own greedy generation);
- refusals before anything runs: a backend without gradients (named), an SAE not
  attached, a target outside the vocabulary, a prompt past the context, bad ranges;
- between the steps of a running batch it disturbs nothing (the batch's tokens equal
  the same request alone), and it leaves no hook, grad mode or parameter flag behind,
  also when it fails midway.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from gpu_engine.api import backends
from gpu_engine.api.errors import (
    ContextLengthExceeded,
    GenerationFailed,
    InvalidParameter,
    SAENotAttached,
)
from gpu_engine.api.monitoring import unpack
from gpu_engine.api.protocol import (
    AttachSpec,
    AttributionJob,
    BatchingOptions,
    GenerationJob,
    LoadModelJob,
    SamplingParams,
    SteeringSpec,
    TokenEvent,
)
from gpu_engine.backends import BackendEntry
from gpu_engine.backends.transformers.runner import TransformersRunner
from gpu_engine.runtime.engine import Engine
from tests.engine.helpers import RefSAE
from tests.engine.tolerances import (
    ATTRIBUTION_ABLATION_ATOL,
    ATTRIBUTION_ATOL,
    ATTRIBUTION_FD_STEP,
    ATTRIBUTION_RTOL,
    LOGPROB_ATOL,
)
from tests.fixtures.backends import require_backend

PROMPT_IDS = [5, 17, 42, 9, 33, 8, 101, 64, 12]
# (model, SAE): the three architectures and the three activations of the tiny set
CASES = [
    ("tiny-llama", "tiny-llama-L1-relu"),
    ("tiny-llama", "tiny-llama-L2-topk"),
    ("tiny-llama", "tiny-llama-L2-jumprelu"),
    ("tiny-gemma2", "tiny-gemma2-L1-jumprelu"),
    ("tiny-gpt2", "tiny-gpt2-L1-relu"),
]


# --------------------------------------------------------------------------- the reference


class Reference:
    """A float64 copy of the checkpoint and its SAE, hooked by the test."""

    def __init__(self, model_asset, sae_asset) -> None:
        self.model = AutoModelForCausalLM.from_pretrained(str(model_asset.path), dtype=torch.float64).eval()
        self.block = self.model.get_submodule(model_asset.layer_module_path(sae_asset.layer))
        self.sae = RefSAE(sae_asset)
        self.w_dec = torch.tensor(self.sae.W_dec)

    def _forward(self, ids: list[int], rows: int, edit=None) -> torch.Tensor:
        """The last position's logits (rows, vocab) of ``rows`` copies of ``ids``, each
        block output passed through ``edit(hidden) -> hidden`` where given."""

        def hook(_module, _args, output):
            hidden = output[0] if isinstance(output, tuple) else output
            new = edit(hidden)
            return (new, *output[1:]) if isinstance(output, tuple) else new

        handle = self.block.register_forward_hook(hook) if edit is not None else None
        try:
            with torch.no_grad():
                return self.model(torch.tensor([ids] * rows), use_cache=False).logits[:, -1]
        finally:
            if handle is not None:
                handle.remove()

    def clean(self, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """(last-position logits, the SAE's activations at every position)."""
        seen = {}

        def keep(hidden):
            seen["x"] = hidden[0].numpy().copy()
            return hidden

        logits = self._forward(ids, 1, keep)[0].numpy()
        return logits, self.sae.encode(seen["x"])

    def finite_difference(self, ids: list[int], target: int, entries: list[tuple[int, int]]) -> np.ndarray:
        """∂logit/∂f_i(x_p) for each (p, i): the row written at p moved by ±h · W_dec[i],
        central differences at h and h/2 combined (Richardson: the h² terms cancel). A
        larger step than float64 alone would take: the tiny models' norms compute in
        float32 even in a float64 model, so a small step measures their rounding."""
        h = ATTRIBUTION_FD_STEP
        steps = (h, -h, h / 2, -h / 2)
        out = np.zeros(len(entries))
        for lo in range(0, len(entries), 32):
            chunk = entries[lo : lo + 32]
            delta = torch.zeros(len(steps) * len(chunk), len(ids), self.w_dec.shape[1], dtype=torch.float64)
            for k, (p, i) in enumerate(chunk):
                for j, step in enumerate(steps):
                    delta[len(steps) * k + j, p] = step * self.w_dec[i]
            logits = self._forward(ids, len(delta), lambda x, d=delta: x + d)[:, target].numpy()
            wide = (logits[0::4] - logits[1::4]) / (2 * h)
            narrow = (logits[2::4] - logits[3::4]) / h
            out[lo : lo + len(chunk)] = (4 * narrow - wide) / 3
        return out

    def ablated(self, ids: list[int], target: int, feature: int) -> float:
        """The target logit with ``f_i(x_p) · W_dec[i]`` taken out of every row."""

        def ablate(hidden):
            acts = self.sae.encode(hidden[0].numpy())[:, feature]
            return hidden - torch.tensor(acts)[None, :, None] * self.w_dec[feature]

        return float(self._forward(ids, 1, ablate)[0, target])


@pytest.fixture(scope="module")
def references(tiny_assets):
    cache = {}

    def get(model_name: str, sae_name: str) -> Reference:
        if (model_name, sae_name) not in cache:
            cache[model_name, sae_name] = Reference(tiny_assets.models[model_name], tiny_assets.saes[sae_name])
        return cache[model_name, sae_name]

    return get


@pytest.fixture(scope="module")
def engines(tiny_assets):
    """One serial float32 engine per tiny model, every SAE of the case list attached."""
    made: dict[str, Engine] = {}

    def get(model_name: str) -> Engine:
        if model_name not in made:
            eng = Engine(drain_timeout_s=60)
            asset = tiny_assets.models[model_name]
            eng.load_model(LoadModelJob(model_name, str(asset.path), dtype="float32", device="cpu"))
            eng.attach_set(
                [
                    AttachSpec(sae, str(tiny_assets.saes[sae].path), tiny_assets.saes[sae].layer)
                    for m, sae in CASES
                    if m == model_name
                ]
            )
            made[model_name] = eng
        return made[model_name]

    yield get
    for eng in made.values():
        eng.shutdown()


def _job(sae_asset, rid: str = "a", **kw) -> AttributionJob:
    kw.setdefault("prompt_token_ids", PROMPT_IDS)
    return AttributionJob(rid, sae_asset.name, sae_asset.layer, **kw)


def _dense(result, d_sae: int) -> np.ndarray:
    row_ptr, indices, values = unpack(result.attributions)
    out = np.zeros((result.attributions.rows, d_sae))
    for p in range(result.attributions.rows):
        out[p, indices[row_ptr[p] : row_ptr[p + 1]]] = values[row_ptr[p] : row_ptr[p + 1]]
    return out


# --------------------------------------------------------------------------- the figures


@pytest.mark.parametrize(("model_name", "sae_name"), CASES)
def test_attribution_equals_the_finite_difference_and_ablation_its_own_forward(
    tiny_assets, engines, references, model_name, sae_name
):
    sae_asset = tiny_assets.saes[sae_name]
    ref = references(model_name, sae_name)
    eng = engines(model_name)
    logits, acts = ref.clean(PROMPT_IDS)
    order = np.argsort(-logits)
    # the greedy token (no target given) and the third most likely one (given)
    for target in (None, int(order[2])):
        result = eng.attribution(_job(sae_asset, top_n=12, ablate_top=5, target_token_id=target))
        want = int(order[0]) if target is None else target
        if target is None:
            assert logits[order[0]] - logits[order[1]] > 1e-3, "a near tie: the greedy token is not defined"
        assert result.target_token_id == want
        assert result.target_logit == pytest.approx(logits[want], abs=LOGPROB_ATOL)
        assert result.prompt_token_ids == PROMPT_IDS and result.attributions.rows == len(PROMPT_IDS)

        # every (position, feature) the SAE activates is reported, and only those
        got = _dense(result, acts.shape[1])
        active = acts > 0
        assert active.sum() > len(PROMPT_IDS), "the SAE activates too little to test anything"
        clear = np.abs(acts) > 1e-5  # away from the activation's edge, where float32 may part
        assert ((got != 0) == active)[clear].all()

        entries = [tuple(e) for e in np.argwhere(active)]
        grads = ref.finite_difference(PROMPT_IDS, want, entries)
        expected = np.zeros_like(acts)
        for (p, i), g in zip(entries, grads):
            expected[p, i] = acts[p, i] * g
        np.testing.assert_allclose(got, expected, atol=ATTRIBUTION_ATOL, rtol=ATTRIBUTION_RTOL)

        # the top features: by the magnitude of their sum over positions, largest first
        sums = expected.sum(0)
        top = result.top
        assert len(top) == 12
        assert [abs(f.attribution) for f in top] == sorted((abs(f.attribution) for f in top), reverse=True)
        rest = np.delete(np.abs(sums), [f.index for f in top])
        assert abs(top[-1].attribution) >= rest.max() - 2 * ATTRIBUTION_ATOL * len(PROMPT_IDS)
        for f in top:
            assert f.attribution == pytest.approx(sums[f.index], abs=ATTRIBUTION_ATOL * len(PROMPT_IDS), rel=1e-3)
            assert f.activation_sum == pytest.approx(acts[:, f.index].sum(), abs=1e-4, rel=1e-4)
            assert f.max_attribution == pytest.approx(expected[f.max_position, f.index], abs=ATTRIBUTION_ATOL)
            assert abs(f.max_attribution) >= np.abs(expected[:, f.index]).max() - 2 * ATTRIBUTION_ATOL

        # the ablation check: the first five, against the test's own forward
        clean = logits[want]
        for f in top[:5]:
            assert f.ablation_delta == pytest.approx(
                ref.ablated(PROMPT_IDS, want, f.index) - clean, abs=ATTRIBUTION_ABLATION_ATOL
            )
        assert all(f.ablation_delta is None for f in top[5:])


def test_no_target_is_the_token_greedy_generation_picks(tiny_assets, engines):
    sae_asset = tiny_assets.saes["tiny-llama-L1-relu"]
    eng = engines("tiny-llama")
    tok = AutoTokenizer.from_pretrained(str(tiny_assets.models["tiny-llama"].path))
    text = "The cat sat on the mat and"
    result = eng.attribution(_job(sae_asset, prompt_token_ids=None, prompt=text, ablate_top=0))
    greedy = eng.generate_sync(
        GenerationJob("g", prompt=text, sampling=SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    )
    assert result.prompt_token_ids == tok(text)["input_ids"]
    assert [result.target_token_id] == greedy.token_ids
    assert result.prompt_tokens == [tok.decode([i]) for i in result.prompt_token_ids]
    assert result.target_token == tok.decode([result.target_token_id])
    assert all(f.ablation_delta is None for f in result.top)


def test_a_chat_prompt_is_rendered_by_the_models_template(tiny_assets, engines):
    sae_asset = tiny_assets.saes["tiny-llama-L1-relu"]
    eng = engines("tiny-llama")
    messages = [{"role": "user", "content": "What is the weather like?"}]
    tok = AutoTokenizer.from_pretrained(str(tiny_assets.models["tiny-llama"].path))
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    chat = eng.attribution(_job(sae_asset, prompt_token_ids=None, messages=messages, ablate_top=2))
    same = eng.attribution(_job(sae_asset, prompt_token_ids=ids, ablate_top=2))
    assert chat.prompt_token_ids == ids
    assert chat.target_token_id == same.target_token_id and chat.top == same.top
    bare = eng.attribution(
        _job(sae_asset, prompt_token_ids=None, messages=messages, add_generation_prompt=False, ablate_top=0)
    )
    bare_text = tok.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    assert bare.prompt_token_ids == tok(bare_text, add_special_tokens=False)["input_ids"] != ids


# --------------------------------------------------------------------------- refusals


def test_bad_input_is_refused_by_name_before_anything_runs(tiny_assets, engines):
    sae_asset = tiny_assets.saes["tiny-llama-L1-relu"]
    eng = engines("tiny-llama")
    vocab = eng.status().vocab_size
    with pytest.raises(InvalidParameter) as err:
        eng.attribution(_job(sae_asset, target_token_id=vocab))
    assert err.value.param == "target_token_id" and str(vocab) in err.value.message
    with pytest.raises(InvalidParameter) as err:
        _job(sae_asset, target_token_id=-1)
    assert err.value.param == "target_token_id"
    with pytest.raises(SAENotAttached):
        eng.attribution(AttributionJob("x", "no-such-sae", 1, prompt_token_ids=PROMPT_IDS))
    with pytest.raises(SAENotAttached):
        eng.attribution(AttributionJob("x", sae_asset.name, sae_asset.layer + 2, prompt_token_ids=PROMPT_IDS))
    with pytest.raises(ContextLengthExceeded) as err:
        eng.attribution(_job(sae_asset, prompt_token_ids=[5] * (eng.status().context_length + 1)))
    assert err.value.details["context_length"] == eng.status().context_length
    with pytest.raises(InvalidParameter) as err:
        eng.attribution(_job(sae_asset, prompt_token_ids=[5, vocab]))
    assert err.value.param == "prompt"
    with pytest.raises(InvalidParameter) as err:
        eng.attribution(_job(sae_asset, prompt_token_ids=None, prompt="", add_special_tokens=False))
    assert err.value.param == "prompt"
    with pytest.raises(InvalidParameter) as err:  # the template reads a content it does not find
        eng.attribution(_job(sae_asset, prompt_token_ids=None, messages=[{"role": "user"}]))
    assert err.value.param == "messages"
    for kw, param in (
        ({"top_n": 0}, "top_n"),
        ({"top_n": 101}, "top_n"),
        ({"ablate_top": 21}, "ablate_top"),
        ({"prompt": "also"}, "prompt"),
        ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs.tokenize"),
    ):
        with pytest.raises(InvalidParameter) as err:
            _job(sae_asset, **kw)
        assert err.value.param == param
    # the engine serves on
    assert eng.attribution(_job(sae_asset, ablate_top=0)).top


def test_a_steering_vector_has_no_features_to_attribute(tiny_assets, engines, tmp_path):
    from safetensors.numpy import save_file

    eng = engines("tiny-llama")
    path = tmp_path / "direction.safetensors"
    d = tiny_assets.models["tiny-llama"].hidden_size
    save_file({"layer.1": np.random.default_rng(3).normal(size=d).astype(np.float32)}, str(path))
    eng.attach(AttachSpec("vec", str(path), 1, layout="vector"))
    try:
        with pytest.raises(InvalidParameter) as err:
            eng.attribution(AttributionJob("v", "vec", 1, prompt_token_ids=PROMPT_IDS))
    finally:
        eng.detach("vec", 1)
    assert err.value.param == "sae_id" and "encoder" in err.value.message


class _NoGradients:
    """A loaded transformers runner that reports no gradients (and keeps the method: the
    engine must read the capability, not only the member)."""

    def __init__(self, inner: TransformersRunner) -> None:
        self._inner = inner
        self.name = "nograd"

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def __dir__(self):
        return dir(self._inner)

    def capabilities(self):
        import msgspec

        return msgspec.structs.replace(
            self._inner.capabilities(), gradients=False, gradients_reason="its kernels run forward only"
        )


def load_without_gradients(job, *, hooks):
    return _NoGradients(TransformersRunner(job, hooks))


def test_a_backend_without_gradients_is_refused_naming_it(tiny_assets, monkeypatch):
    monkeypatch.setitem(
        backends._BACKENDS,
        "nograd",
        BackendEntry(
            name="nograd",
            summary="test",
            requires=("torch",),
            install="scripts/setup nograd",
            loader="tests.engine.test_attribution:load_without_gradients",
        ),
    )
    model, sae_asset = tiny_assets.models["tiny-llama"], tiny_assets.saes["tiny-llama-L1-relu"]
    with Engine() as eng:
        eng.load_model(LoadModelJob("m", str(model.path), dtype="float32", device="cpu", backend="nograd"))
        eng.attach(AttachSpec(sae_asset.name, str(sae_asset.path), sae_asset.layer))
        assert eng.status().capabilities.gradients is False
        with pytest.raises(InvalidParameter) as err:
            eng.attribution(_job(sae_asset))
    assert err.value.param == "backend"
    assert "nograd" in err.value.message and "its kernels run forward only" in err.value.message
    assert err.value.details["capability"] == "gradients" and err.value.details["backend"] == "nograd"


def test_a_quantized_load_reports_no_gradients_and_is_refused(tiny_assets):
    """Q8's int8 kernels carry no gradient: the load says so and the command is refused
    by the backend's name, with that reason."""
    model, sae_asset = tiny_assets.models["tiny-llama"], tiny_assets.saes["tiny-llama-L1-relu"]
    with Engine() as eng:
        eng.load_model(
            LoadModelJob("m", str(model.path), dtype="float32", device="cpu", options={"quantization": "Q8"})
        )
        eng.attach(AttachSpec(sae_asset.name, str(sae_asset.path), sae_asset.layer))
        caps = eng.status().capabilities
        with pytest.raises(InvalidParameter) as err:
            eng.attribution(_job(sae_asset))
    assert caps.gradients is False and "Q8" in caps.gradients_reason
    assert err.value.param == "backend" and "transformers" in err.value.message and "Q8" in err.value.message


@pytest.mark.parametrize("backend", ["vllm", "llamacpp"])
def test_vllm_and_llamacpp_refuse_attribution_by_name(tiny_assets, backend):
    require_backend(backend)
    sae_asset = tiny_assets.saes["tiny-llama-L1-relu"]
    model_dir = Path(tiny_assets.models["tiny-llama"].path)
    if backend == "vllm":
        load = LoadModelJob(
            "m",
            str(model_dir),
            dtype="float32",
            device="cpu",
            backend="vllm",
            options={"distributed_executor_backend": "uni", "max_num_seqs": 2, "enforce_eager": True},
        )
    else:
        from tests.fixtures.llamacpp import gguf_copy

        load = LoadModelJob("m", str(gguf_copy(model_dir)), device="cpu", backend="llamacpp")
    eng = Engine(batching=BatchingOptions(enabled=True, max_batch_size=2), drain_timeout_s=300)
    try:
        eng.load_model(load)
        eng.attach(AttachSpec(sae_asset.name, str(sae_asset.path), sae_asset.layer))
        caps = eng.status().capabilities
        assert caps.gradients is False and caps.gradients_reason
        with pytest.raises(InvalidParameter) as err:
            eng.attribution(_job(sae_asset))
    finally:
        eng.shutdown()
    assert err.value.param == "backend" and err.value.details["backend"] == backend
    assert backend.replace("llamacpp", "llama.cpp") in err.value.message or backend in err.value.message


# --------------------------------------------------------------------------- leaving the engine as it was


def _hook_counts(model: torch.nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def _grad_enabled_on_worker(eng: Engine) -> bool:
    return eng._work(torch.is_grad_enabled, 10)


def test_it_runs_between_the_steps_of_a_batch_and_disturbs_nothing(tiny_assets, engines):
    """A steered greedy generation is running in a continuous batch when the attribution
    comes: it is answered while the generation still runs (between two steps), equals
    the serial engine's, and the generation's tokens equal the same request alone."""
    model, sae_asset = tiny_assets.models["tiny-llama"], tiny_assets.saes["tiny-llama-L1-relu"]
    steering = SteeringSpec.from_mapping({(sae_asset.name, sae_asset.layer): {3: 4.0}})

    def long_job(rid: str, max_tokens: int) -> GenerationJob:
        return GenerationJob(
            rid,
            prompt_token_ids=PROMPT_IDS,
            steering=steering,
            sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
        )

    serial = engines("tiny-llama").attribution(_job(sae_asset, top_n=8, ablate_top=3))
    eng = Engine(batching=BatchingOptions(enabled=True, max_batch_size=4), drain_timeout_s=60)
    try:
        eng.load_model(LoadModelJob("tiny-llama", str(model.path), dtype="float32", device="cpu"))
        eng.attach(AttachSpec(sae_asset.name, str(sae_asset.path), sae_asset.layer))
        runner_model = eng.backend.model
        hooks_before = _hook_counts(runner_model)
        flags_before = [p.requires_grad for p in runner_model.parameters()]
        grad_before = _grad_enabled_on_worker(eng)

        stream = eng.generate(long_job("long", 480))
        events = stream.events(30)
        first = next(events)
        assert isinstance(first, TokenEvent)
        batched = eng.attribution(_job(sae_asset, top_n=8, ablate_top=3))
        # the generation had not finished: the attribution ran between its steps
        tokens = [first.token_id]
        for ev in events:
            if isinstance(ev, TokenEvent):
                tokens.append(ev.token_id)
                if len(tokens) == 24:
                    stream.cancel()
            else:
                assert ev.finish_reason == "cancelled", "the generation ended before the attribution was answered"
                break
        alone = eng.generate_sync(long_job("alone", len(tokens)))
        assert tokens == alone.token_ids

        assert _hook_counts(runner_model) == hooks_before
        assert [p.requires_grad for p in runner_model.parameters()] == flags_before
        assert _grad_enabled_on_worker(eng) == grad_before
    finally:
        eng.shutdown()
    assert batched.target_token_id == serial.target_token_id
    assert batched.target_logit == pytest.approx(serial.target_logit, abs=1e-5)
    assert [f.index for f in batched.top] == [f.index for f in serial.top]
    for a, b in zip(batched.top, serial.top):
        assert a.attribution == pytest.approx(b.attribution, abs=1e-5)
        assert a.ablation_delta == pytest.approx(b.ablation_delta, abs=1e-5)


def test_a_failure_midway_leaves_no_hook_grad_mode_or_flag_behind(tiny_assets, engines, monkeypatch):
    sae_asset = tiny_assets.saes["tiny-llama-L1-relu"]
    eng = engines("tiny-llama")
    model = eng.backend.model
    hooks_before = _hook_counts(model)
    flags_before = [p.requires_grad for p in model.parameters()]
    grad_before = _grad_enabled_on_worker(eng)
    real = torch.autograd.grad
    worker = {}

    def broken(*args, **kwargs):
        # inside the backward pass: the hook is in place and the parameters are frozen
        worker["hooks"] = _hook_counts(model)
        worker["frozen"] = not any(p.requires_grad for p in model.parameters())
        worker["thread"] = threading.current_thread().name
        raise RuntimeError("the backward broke")

    monkeypatch.setattr(torch.autograd, "grad", broken)
    with pytest.raises(GenerationFailed) as err:
        eng.attribution(_job(sae_asset))
    monkeypatch.setattr(torch.autograd, "grad", real)
    assert "the backward broke" in err.value.message
    assert worker == {"hooks": hooks_before + 1, "frozen": True, "thread": "millm-engine"}
    assert _hook_counts(model) == hooks_before
    assert [p.requires_grad for p in model.parameters()] == flags_before
    assert _grad_enabled_on_worker(eng) == grad_before
    assert eng.attribution(_job(sae_asset, ablate_top=1)).top[0].ablation_delta is not None
