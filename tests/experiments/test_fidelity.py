"""SAE fidelity (issue 35, part 3; docs/experiments.md "SAE fidelity"): per request through
/v1's ``monitoring: {"fidelity": true}`` (the official ``openai`` client's ``extra_body``,
raw HTTP, streaming) and per corpus as a ``fidelity`` experiment. Every figure is compared
with the test's own float64 computation on the tiny model (``fidelity_reference``): its own
hooked forward, its own SAE encode/decode from the SAE's file, its own spliced forwards
for loss recovered."""

from __future__ import annotations

import time

import numpy as np
import pytest

from tests.background import runner_by_hand
from tests.experiments.conftest import wait_run, wait_until
from tests.experiments.fidelity_reference import FidelityReference
from tests.fixtures.served import GatedEngine
from tests.v1.conftest import _v1_db, attach, llama, openai_client, v1_server  # noqa: F401 - fixtures
from tests.v1.helpers import assert_openai_error, request

pytestmark = pytest.mark.django_db(transaction=True)

L1 = "tiny-llama-L1-relu"
L2 = "tiny-llama-L2-topk"
PROMPT = "the sea and the sky"
FIGURES = ("l0", "mse", "explained_variance")


@pytest.fixture(scope="module")
def refs(tiny_assets):
    return {name: FidelityReference(tiny_assets, name) for name in (L1, L2)}


def _complete(server, **extra):
    body = {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True, **extra}
    return request(server.base_url, "POST", "/completions", body)


def _read(server, **job) -> tuple[list[int], str]:
    """The tokens a greedy generation reads (its prompt, by the engine's tokenizer, and
    its completion) and its text, from the engine directly; the text is checked against
    the /v1 answer by the caller."""
    from gpu_engine.api.protocol import GenerationJob, SamplingParams

    max_tokens = job.pop("max_tokens", 6)
    result = server.engine.generate_sync(
        GenerationJob(
            request_id="fidelity-ref",
            sampling=SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
            **job,
        ),
        timeout_s=60,
    )
    backend = server.engine.backend
    if "messages" in job:
        prompt = backend.encode_messages(job["messages"], add_generation_prompt=True)
    else:
        prompt = backend.encode_text(job["prompt"])
    return [*prompt, *result.token_ids], result.text


def _assert_equal_reference(entry: dict, ref: FidelityReference, sequences: list[list[int]]) -> None:
    """One ``millm.sae_fidelity`` entry against the reference: the rows read are every row
    each generation computed (its tokens less the last, which no forward read), the
    losses over each generation's every token."""
    x = np.concatenate([ref.residual(s)[: len(s) - 1] for s in sequences])
    want = ref.figures(x)
    assert entry["rows"] == want["rows"]
    for name in FIGURES:
        assert entry[name] == pytest.approx(want[name], rel=1e-4, abs=1e-6), name
    losses = ref.losses(sequences)
    assert entry["loss_tokens"] == losses["tokens"]
    for name in ("clean", "spliced", "zero"):
        assert entry[f"loss_{name}"] == pytest.approx(losses[name], rel=1e-4), name
    assert entry["loss_recovered"] == pytest.approx(losses["recovered"], rel=1e-4, abs=1e-3)
    assert entry["loss_recovered_unavailable"] is None


def test_per_request_fidelity_equals_the_float64_reference(llama, openai_client, refs):  # noqa: F811
    """A completion through the official client: one entry for the one attached SAE, every
    figure equal to the reference over the prompt and completion the request read."""
    sae = attach(L1, 1)
    out = openai_client.completions.create(
        model="tiny-llama",
        prompt=PROMPT,
        max_tokens=6,
        temperature=0,
        extra_body={"ignore_eos": True, "monitoring": {"fidelity": True}},
    )
    fidelity = out.model_extra["millm"]["sae_fidelity"]
    assert [(e["sae_id"], e["layer"], e["read_point"]) for e in fidelity] == [(sae.id, 1, "pre_steering")]
    ids, text = _read(llama, prompt=PROMPT)
    assert text == out.choices[0].text
    _assert_equal_reference(fidelity[0], refs[L1], [ids])
    # a request without monitoring carries none
    plain = _complete(llama).json()
    assert "sae_fidelity" not in (plain.get("millm") or {})


def test_chat_streamed_and_not_carry_the_same_figures_for_each_attachment(llama, refs):  # noqa: F811
    """Raw HTTP chat with two SAEs attached: no sae_id measures both, ``layer`` picks one;
    the stream's last chunk before [DONE] carries the same object as the JSON answer."""
    l1, l2 = attach(L1, 1), attach(L2, 2)
    messages = [{"role": "user", "content": PROMPT}]
    body = {"model": "tiny-llama", "messages": messages, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    both = request(llama.base_url, "POST", "/chat/completions", {**body, "monitoring": {"fidelity": True}})
    assert both.status == 200, both.body[:300]
    fidelity = both.json()["millm"]["sae_fidelity"]
    assert sorted((e["sae_id"], e["layer"]) for e in fidelity) == sorted([(l1.id, 1), (l2.id, 2)])
    ids, text = _read(llama, messages=messages, max_tokens=5)
    assert text == both.json()["choices"][0]["message"]["content"]
    by_layer = {e["layer"]: e for e in fidelity}
    _assert_equal_reference(by_layer[1], refs[L1], [ids])
    _assert_equal_reference(by_layer[2], refs[L2], [ids])

    one = request(llama.base_url, "POST", "/chat/completions", {**body, "monitoring": {"fidelity": True, "layer": 2}})
    assert one.json()["millm"]["sae_fidelity"] == [by_layer[2]]
    events = request(
        llama.base_url, "POST", "/chat/completions", {**body, "stream": True, "monitoring": {"fidelity": True}}
    ).events()
    assert events[-1] == "[DONE]" and events[-2]["choices"] == []
    assert events[-2]["millm"]["sae_fidelity"] == fidelity


def test_several_choices_pool_their_rows_and_tokens(llama, refs):  # noqa: F811
    """Two prompts in one completions request: the figures are over both choices' rows,
    loss recovered over both choices' tokens."""
    sae = attach(L1, 1)
    prompts = [PROMPT, "a quiet morning in the hills"]
    resp = _complete(llama, prompt=prompts, max_tokens=4, monitoring={"fidelity": True, "sae_id": sae.id})
    assert resp.status == 200, resp.body[:300]
    entry = resp.json()["millm"]["sae_fidelity"][0]
    read = [_read(llama, prompt=p, max_tokens=4) for p in prompts]
    assert [t for _, t in read] == [c["text"] for c in resp.json()["choices"]]
    _assert_equal_reference(entry, refs[L1], [ids for ids, _ in read])


def test_refusals_name_the_field(llama):  # noqa: F811
    """Nothing attached, an unknown SAE, a layer where it is not attached, a monitoring
    object asking for nothing or misspelt, and scoring mode: 400 naming the field, before
    anything runs."""
    asked = {"fidelity": True}
    assert_openai_error(_complete(llama, monitoring=asked), 400, "sae_not_attached", "monitoring")
    sae = attach(L1, 1)
    error = assert_openai_error(
        _complete(llama, monitoring={**asked, "sae_id": "no-such-sae"}), 400, "sae_not_attached", "monitoring.sae_id"
    )
    assert f"{sae.id}@1" in error["message"]  # names what is attached
    assert_openai_error(
        _complete(llama, monitoring={**asked, "sae_id": sae.id, "layer": 3}),
        400,
        "sae_not_attached",
        "monitoring.layer",
    )
    assert_openai_error(_complete(llama, monitoring={"fidelity": False}), 400, "invalid_parameter", "monitoring")
    assert_openai_error(_complete(llama, monitoring={"fidelty": True}), 400, "invalid_parameter")
    assert_openai_error(_complete(llama, monitoring={"fidelity": "yes"}), 400, "invalid_parameter")
    assert_openai_error(
        _complete(llama, monitoring=asked, max_tokens=1, allowed_token_ids=[1, 2]),
        400,
        "invalid_parameter",
        "monitoring",
    )
    assert llama.engine.status().in_flight == 0


# --------------------------------------------------------------------------- per corpus


def _api(server, method: str, path: str, body=None):
    resp = request(server.url, method, path, body)
    return resp.status, resp.json()


def _wait(server, run_id: str, timeout_s: float = 240) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        status, body = _api(server, "GET", f"/api/experiments/{run_id}")
        assert status == 200, body
        run = body["data"]
        if run["status"] in ("completed", "failed", "cancelled"):
            return run
        assert time.monotonic() < deadline, f"still {run['status']} after {timeout_s} s"
        time.sleep(0.1)


def _contexts(tiny_assets, texts: list[str], context_tokens: int, budget: int) -> list[list[int]]:
    """The test's own reading of a corpus: each text by the model's own tokenizer (from its
    files, no special tokens), concatenated in order and cut into contexts of
    ``context_tokens`` up to ``budget`` tokens (a last one of 2 or more kept)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_assets.models["tiny-llama"].path))
    flat: list[int] = []
    for text in texts:
        flat += tok(text, add_special_tokens=False)["input_ids"]
        if len(flat) >= budget:
            break
    flat = flat[:budget]
    contexts = [flat[i : i + context_tokens] for i in range(0, len(flat), context_tokens)]
    return [c for c in contexts if len(c) >= 2]


@pytest.mark.parametrize(("name", "layer", "dense"), [(L1, 1, 0.3), (L2, 2, 0.05)])
def test_corpus_fidelity_equals_the_float64_reference(llama, refs, tiny_assets, name, layer, dense):  # noqa: F811
    """``POST /api/experiments/fidelity`` over the offline sample: every corpus figure
    equals the test's own over the same contexts — L0 (mean and distribution), MSE,
    explained variance, the clean / spliced / zero-ablated losses and loss recovered, the
    dead and dense features — and ``GET /api/saes/{id}/fidelity`` answers it."""
    from features.corpus import sample_texts

    sae = attach(name, layer)
    status, body = _api(llama, "GET", f"/api/saes/{sae.id}/fidelity")
    assert (status, body["data"]["fidelity"], body["data"]["run_id"]) == (200, None, None)
    budget, size = 300, 32
    asked = {"sae_id": sae.id, "token_budget": budget, "context_tokens": size, "dense_threshold": dense}
    status, body = _api(llama, "POST", "/api/experiments/fidelity", asked)
    assert status == 202, body
    run = _wait(llama, body["data"]["run"]["id"])
    assert run["status"] == "completed", run
    got = run["result"]

    ref = refs[name]
    contexts = _contexts(tiny_assets, sample_texts(), size, budget)
    assert got["contexts"] == len(contexts) and got["tokens"] == sum(map(len, contexts))
    x = np.concatenate([ref.residual(c) for c in contexts])  # every row of every context
    want = ref.figures(x)
    assert got["rows"] == want["rows"] == budget
    for name in FIGURES:
        assert got[name] == pytest.approx(want[name], rel=1e-4, abs=1e-6), name
    stats = ref.stats(x)
    values, counts = np.unique(stats["l0"], return_counts=True)
    assert got["l0_distribution"] == {"l0": values.tolist(), "rows": counts.tolist()}
    fired = stats["active"].sum(axis=0)
    assert got["dead_features"] == np.flatnonzero(fired == 0).tolist()
    assert got["dead_count"] == int((fired == 0).sum())
    assert got["dense_features"] == np.flatnonzero(fired / len(x) > dense).tolist()
    assert got["dense_count"] == len(got["dense_features"]) and got["dense_threshold"] == dense
    # not trivially none or all: relu's dense features, top-k's dead and dense ones
    assert 0 < got["dead_count"] + got["dense_count"] and got["dense_count"] < ref.sae.W_dec.shape[0]
    losses = ref.losses(contexts)
    assert got["loss_tokens"] == losses["tokens"]
    for name in ("clean", "spliced", "zero"):
        assert got[f"loss_{name}"] == pytest.approx(losses[name], rel=1e-4), name
    assert got["loss_recovered"] == pytest.approx(losses["recovered"], rel=1e-4, abs=1e-3)
    assert got["loss_recovered_unavailable"] is None

    status, body = _api(llama, "GET", f"/api/saes/{sae.id}/fidelity")
    assert status == 200 and body["data"]["run_id"] == run["id"] and body["data"]["layer"] == layer
    assert body["data"]["fidelity"] == got
    assert body["data"]["corpus"] == {"corpus": "sample", "token_budget": budget, "context_tokens": size}


def _fidelity_run(sae, **extra):
    from core.auth import ANONYMOUS
    from core.runtime import runtime
    from experiments.fidelity import fidelity_check
    from experiments.services import experiment_start

    data = {"sae_id": sae.id, "corpus": "sample", "token_budget": 300, "context_tokens": 8, **extra}
    plan = fidelity_check(data=data, status=runtime().engine.status(), principal=ANONYMOUS)
    return plan, experiment_start(
        kind="fidelity", spec=plan.spec, principal=ANONYMOUS, total=plan.total, sae_id=plan.sae_id, layer=plan.layer
    )


def test_a_crashed_corpus_run_resumes_with_only_the_groups_missing(llama, settings):  # noqa: F811
    """38 contexts in groups of 16: a runner stopped after two groups were stored is
    resumed by the next, which measures only the third (its 6 contexts × 3 passes), and
    the figures equal an uninterrupted run's exactly."""
    from core.runtime import runtime
    from experiments import runner
    from experiments.models import ExperimentPoint, ExperimentRun
    from experiments.services import experiments_resume

    sae = attach(L1, 1)
    _, first = _fidelity_run(sae)
    reference = wait_run(first.id, 240)
    assert reference.status == "completed" and reference.total == 3, (reference.error, reference.total)
    assert ExperimentPoint.objects.filter(run_id=reference.id).count() == 3

    run = ExperimentRun.objects.create(kind="fidelity", spec=dict(reference.spec), sae_id=sae.id, layer=1)
    inner = runtime().engine
    gate = GatedEngine(inner, hold=97)  # two groups of 16 contexts × 3 passes at once: the third's first
    with runner_by_hand(gate, lambda stop: runner.experiment_run(run_id=run.id, stop=stop)) as (stop, outcome, _):
        assert gate.reached.wait(240), "the third group never reached the engine"
        wait_until(lambda: ExperimentPoint.objects.filter(run_id=run.id).count() == 2, "two groups stored", 240)
        stop.set()
        # the crash cancels the held pass: the third group is never complete
        assert gate.cancelled.wait(60), "the stopped runner did not cancel its jobs"
    assert outcome == ["stopped"]
    assert ExperimentRun.objects.get(id=run.id).status == "running"

    counter = GatedEngine(inner, hold=0)
    with runtime().replaced(engine=counter):
        assert experiments_resume(force=True) == 1
        done = wait_run(run.id, 240)
    assert done.status == "completed" and not done.partial and done.resumes == 1, done.error
    assert counter.calls == 6 * 3
    assert done.result == reference.result


def test_a_backend_without_splice_reports_why_and_sends_no_splice(llama, monkeypatch, refs, tiny_assets):  # noqa: F811
    """Where the loaded backend reports no ``splice``: /v1 and the corpus run keep every
    other figure, leave the spliced and zero-ablated losses and loss recovered null with
    the backend's reason, and never send the engine a spliced pass."""
    import msgspec

    from core.runtime import runtime

    reason = "this backend swaps control vectors: it cannot replace rows"
    engine = runtime().engine
    real_status, real_generate = engine.status, engine.agenerate

    def status():
        got = real_status()
        caps = msgspec.structs.replace(got.capabilities, splice=False, splice_reason=reason)
        return msgspec.structs.replace(
            got, batching={**(got.batching or {}), "capabilities": msgspec.to_builtins(caps)}
        )

    spliced: list[str] = []

    def agenerate(job):
        spliced.extend(e.splice for e in (job.steering.entries if job.steering else []) if e.splice)
        return real_generate(job)

    monkeypatch.setattr(engine, "status", status)
    monkeypatch.setattr(engine, "agenerate", agenerate)
    sae = attach(L1, 1)
    entry = _complete(llama, monitoring={"fidelity": True}).json()["millm"]["sae_fidelity"][0]
    ids, _ = _read(llama, prompt=PROMPT)
    x = refs[L1].residual(ids)[: len(ids) - 1]
    assert entry["l0"] == pytest.approx(refs[L1].figures(x)["l0"], rel=1e-4)
    assert entry["loss_recovered"] is None and entry["loss_recovered_unavailable"] == reason
    assert (entry["loss_spliced"], entry["loss_zero"]) == (None, None)

    _, run = _fidelity_run(sae, context_tokens=32)
    done = wait_run(run.id, 240)
    assert done.status == "completed", done.error
    got = done.result
    assert got["loss_recovered"] is None and got["loss_recovered_unavailable"] == reason
    assert (got["loss_spliced"], got["loss_zero"]) == (None, None)
    from features.corpus import sample_texts

    contexts = _contexts(tiny_assets, sample_texts(), 32, 300)
    assert got["loss_clean"] == pytest.approx(refs[L1].losses(contexts)["clean"], rel=1e-4)
    assert spliced == []


def test_a_raw_steering_vector_has_nothing_to_reconstruct_with(llama, tiny_assets, tmp_path):  # noqa: F811
    """A raw steering vector attached beside an SAE: named, it is refused (no encoder);
    unnamed, only the SAE is measured."""
    from safetensors.numpy import save_file

    from gpu_engine.api.protocol import AttachSpec

    sae = attach(L1, 1)
    path = tmp_path / "direction.safetensors"
    d = tiny_assets.models["tiny-llama"].hidden_size
    save_file({"layer.2": np.random.default_rng(3).normal(size=d).astype(np.float32)}, str(path))
    llama.engine.attach(AttachSpec("vec", str(path), 2, layout="vector"))
    try:
        error = assert_openai_error(
            _complete(llama, monitoring={"fidelity": True, "sae_id": "vec"}),
            400,
            "invalid_parameter",
            "monitoring.sae_id",
        )
        assert "encoder" in error["message"]
        both = _complete(llama, monitoring={"fidelity": True})
        assert [(e["sae_id"], e["layer"]) for e in both.json()["millm"]["sae_fidelity"]] == [(sae.id, 1)]
    finally:
        llama.engine.detach("vec", 2)
