"""Feature dashboard runs end to end on the real engine (docs/features.md, "How a dashboard
run works"): tiny-llama resident in this process, its ReLU SAE attached at layer 1, the
run queued by ``features.services.dashboard_start`` on the in-process ``dashboards`` pool.

Every figure is checked against the test's own computation: the contexts are the test's
own (the model's tokenizer read with ``transformers``, packed by hand), each token's
activations come from a separate engine request per context (a plain ``features=[...]``
monitor, not the packed one the run uses), and density, mean, max and histogram are
recomputed from those in float64; the logit effects are ``W_dec @ W_U.T`` from the
safetensors; a stored top context, run again alone, gives the stored activation at its
max token.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests import background
from tests.background import TERMINAL, run_ended, runner_by_hand
from tests.envelope import refused
from tests.v1.conftest import _register_assets
from tests.fixtures.served import GatedEngine

pytestmark = pytest.mark.django_db(transaction=True)

SAE_NAME = "tiny-llama-L1-relu"
LAYER = 1
BUDGET = 640
CONTEXT = 32
FIELDS = ("count", "density", "mean", "max", "histogram", "top_contexts", "quantile_samples", "logit_top")


@pytest.fixture(scope="session")
def engine_client(django_db_setup, django_db_blocker, tiny_assets):
    """One embedded engine for the module, float32 on CPU, as the server's."""
    from django.conf import settings
    from django.db import connections

    from core.engine_client import EmbeddedEngineClient
    from core.runtime import runtime

    saved = settings.MILLM_ENGINE_DEVICE, settings.MILLM_ENGINE_DTYPE
    settings.MILLM_ENGINE_DEVICE, settings.MILLM_ENGINE_DTYPE = "cpu", "float32"
    client = EmbeddedEngineClient()
    with runtime().replaced(engine=client):
        yield client
    client.shutdown()
    settings.MILLM_ENGINE_DEVICE, settings.MILLM_ENGINE_DTYPE = saved
    connections.close_all()


@pytest.fixture
def sae(engine_client, transactional_db, settings, tmp_path):
    """tiny-llama resident with its L1 ReLU SAE attached (nothing else); every run ended
    after the test."""
    from features.models import DashboardRun
    from orchestration.services import model_load, sae_attach, sae_detach
    from registry.models import SAE, Model
    from registry.services import model_set_status

    settings.DASHBOARD_DIR = str(tmp_path / "dashboards")
    _register_assets()
    row = Model.objects.get(name="tiny-llama")
    if engine_client.status().model_id != "tiny-llama":
        model_load(model=row)
    elif row.status != Model.Status.LOADED:
        model_set_status(model=row, status=Model.Status.LOADED)
    for attached in SAE.objects.filter(status=SAE.Status.ATTACHED):
        sae_detach(sae=attached)
    engine_client.detach(None)
    found = SAE.objects.get(name=SAE_NAME)
    sae_attach(sae=found, layer=LAYER)
    yield found
    for run in DashboardRun.objects.exclude(status__in=TERMINAL):
        DashboardRun.objects.filter(id=run.id).update(status="cancelling")
    wait_until(lambda: not DashboardRun.objects.exclude(status__in=TERMINAL).exists(), "every run to end")


def wait_until(check, what: str, timeout_s: float = 180.0) -> Any:
    return background.wait_until(check, what, timeout_s)


def wait_run(run_id: str) -> Any:
    from features.models import DashboardRun

    return run_ended(DashboardRun, run_id, 180.0)


def principal() -> Any:
    from core.auth import ANONYMOUS

    return ANONYMOUS


def start(sae_row: Any, **kwargs: Any) -> Any:
    from features.services import dashboard_start

    args = {"token_budget": BUDGET, "context_tokens": CONTEXT, "top_k": 5, "window": 4, **kwargs}
    return dashboard_start(sae_id=sae_row.id, principal=principal(), **args)


# --------------------------------------------------------------------------- the test's own


def own_contexts(tiny_assets, budget: int = BUDGET, context: int = CONTEXT) -> list[list[int]]:
    """The sample corpus tokenized by the model's own tokenizer (transformers) and cut by
    hand: documents concatenated, contexts of ``context`` tokens up to ``budget``."""
    from transformers import AutoTokenizer

    from features.corpus import SAMPLE_PATH

    tok = AutoTokenizer.from_pretrained(str(tiny_assets.models["tiny-llama"].path))
    lines = [x.strip() for x in Path(SAMPLE_PATH).read_text(encoding="utf-8").splitlines() if x.strip()]
    flat: list[int] = []
    for line in lines:
        flat.extend(tok(line, add_special_tokens=False)["input_ids"])
        if len(flat) >= budget:
            break
    flat = flat[:budget]
    out = [flat[i : i + context] for i in range(0, len(flat), context)]
    return [c for c in out if len(c) >= 2]


def encode(client: Any, sae_id: str, context: list[int], d_sae: int) -> np.ndarray:
    """[tokens, d_sae] activations of one context, alone at the engine, through a plain
    monitor entry naming every feature (not the packed one a run uses)."""
    from gpu_engine.api.protocol import (
        FinishEvent,
        GenerationJob,
        MonitorEntry,
        MonitorSpec,
        SamplingParams,
        SteeringSpec,
    )

    job = GenerationJob(
        request_id=f"ref-{uuid.uuid4().hex[:8]}",
        prompt_token_ids=context,
        add_special_tokens=False,
        sampling=SamplingParams(max_tokens=1, temperature=0),
        monitor=MonitorSpec(
            [
                MonitorEntry(
                    sae_id=sae_id,
                    layer=LAYER,
                    features=list(range(d_sae)),
                    positions="prompt",
                    read_point="pre_steering",
                )
            ]
        ),
        steering=SteeringSpec(),
    )
    out = np.full((len(context), d_sae), np.nan)
    events = list(client.generate(job).events(120))
    finish = events[-1]
    assert isinstance(finish, FinishEvent), finish
    records = [r for e in events for r in (getattr(e, "activations", None) or [])]
    for record in records:
        for fa in record.features:
            out[record.position, fa.feature_index] = fa.activation
    assert not np.isnan(out).any(), "the reference monitor left a token unread"
    return out


# --------------------------------------------------------------------------- tests


def test_a_run_over_the_sample_matches_the_tests_own_computation(sae, engine_client, tiny_assets):
    from safetensors.numpy import load_file

    from features.models import DashboardRun, FeatureDashboard
    from features.selectors import feature_dashboard, search_features
    from features.services import workdir

    run = start(sae)
    assert run.status == "queued" and run.layer == LAYER
    done = wait_run(run.id)
    assert done.status == "completed" and done.complete, done.error
    # the working folder goes with the run's end (deleted once the results are committed)
    wait_until(lambda: not workdir(run.id).exists(), "the working folder to go")

    contexts = own_contexts(tiny_assets)
    assert done.contexts_total == done.contexts_done == len(contexts)
    tokens = sum(len(c) for c in contexts)
    assert done.tokens_done == tokens == done.summary["tokens"]

    d_sae = sae.d_sae or 256
    acts = np.concatenate([encode(engine_client, sae.id, c, d_sae) for c in contexts]).astype(np.float64)
    rows = {r.index: r for r in FeatureDashboard.objects.filter(run=done)}
    fired = np.flatnonzero((acts > 0).any(axis=0))
    assert fired.size > 10, "a corpus where few features fire tests little"
    # positive control: the comparison below can fail (another corpus, other figures)
    assert (acts > 0).sum() > 100
    for f in range(d_sae):
        col = acts[:, f]
        nz = col[col > 0]
        row = rows.get(f)
        assert row is not None, f"feature {f} has no row (every feature has its logit effect)"
        assert row.count == nz.size, f
        assert row.density == pytest.approx(nz.size / tokens, rel=1e-12), f
        if not nz.size:
            assert row.max == 0 and row.top_contexts == []
            continue
        assert row.max == pytest.approx(nz.max(), rel=1e-5, abs=1e-6), f
        assert row.mean == pytest.approx(nz.mean(), rel=1e-5, abs=1e-6), f
        counts, edges = np.histogram(nz, bins=len(row.histogram["counts"]), range=(0.0, float(row.max)))
        assert row.histogram["counts"] == counts.tolist(), f
        assert np.allclose(row.histogram["edges"], edges, rtol=1e-6), f
    summary = done.summary
    assert summary["dead"] == d_sae - fired.size
    l0 = (acts > 0).sum(axis=1)
    assert summary["l0"]["mean"] == pytest.approx(l0.mean(), rel=1e-9)

    # top contexts: the highest-max contexts, each run again alone gives the stored value
    best = int(fired[np.argmax([rows[f].count for f in fired])])
    row = feature_dashboard(sae.id, best)
    assert row is not None and row.run_id == done.id
    per_context = [encode(engine_client, sae.id, c, d_sae)[:, best].max() for c in contexts]
    expected = [c for c in sorted(range(len(contexts)), key=lambda c: (-per_context[c], c)) if per_context[c] > 0]
    assert [t["context"] for t in row.top_contexts] == expected[: done.top_k]
    for top in row.top_contexts:
        ctx = contexts[top["context"]]
        at = top["start"] + top["max_position"]
        assert top["token_ids"] == ctx[top["start"] : top["start"] + len(top["token_ids"])]
        again = encode(engine_client, sae.id, ctx[: at + 1], d_sae)
        assert again[at, best] == pytest.approx(top["max_activation"], rel=1e-4, abs=1e-5)
        assert again[at, best] == pytest.approx(top["activations"][top["max_position"]], rel=1e-4, abs=1e-5)

    # logit effects: W_dec[i] @ W_U.T from the files
    w_dec = load_file(str(Path(sae.local_path) / "sae_weights.safetensors"))["W_dec"].astype(np.float64)
    w_u = load_file(str(Path(tiny_assets.models["tiny-llama"].path) / "model.safetensors"))["lm_head.weight"]
    effects = w_dec @ w_u.astype(np.float64).T
    for f in (0, best, d_sae - 1):
        top = rows[f].logit_top
        want = np.argsort(-effects[f], kind="stable")[: len(top)]
        assert [e["token_id"] for e in top] == want.tolist(), f
        assert [e["value"] for e in top] == pytest.approx(effects[f, want].tolist(), rel=1e-4, abs=1e-5)
        bottom = rows[f].logit_bottom
        low = np.argsort(effects[f], kind="stable")[: len(bottom)]
        assert [e["token_id"] for e in bottom] == low.tolist(), f

    # search by a token of the feature's strongest logit effect finds it
    token = rows[best].logit_top[0]["token"].strip()
    if token:
        found = search_features(sae.id, None, token, 500, 0)
        assert best in [h["index"] for h in found["features"]]
    # a later complete run is the one read; the older one stays
    again_run = wait_run(start(sae).id)
    assert again_run.complete and DashboardRun.objects.filter(sae=sae, complete=True).count() == 2
    assert feature_dashboard(sae.id, best).run_id == again_run.id


def test_a_cancelled_run_stores_nothing(sae, engine_client, settings):
    from core.runtime import runtime
    from features import runner
    from features.models import DashboardRun, FeatureDashboard
    from features.services import dashboard_cancel, workdir

    settings.DASHBOARD_ENGINE_ROWS = 2
    gate = GatedEngine(engine_client, hold=5)
    ahead = runner.AHEAD * 2  # contexts read past the held one before the runner waits for it
    try:
        with runtime().replaced(engine=gate):
            run = start(sae)
            assert gate.reached.wait(120), "the fifth context never reached the engine"
            # the others go on until AHEAD x rows contexts wait for the held one (index 4)
            wait_until(lambda: gate.calls == 4 + ahead, "the runner to wait for the held context")
            assert dashboard_cancel(run_id=run.id, principal=principal()).status == "cancelling"
            # seen at the runner's next heartbeat, with the context still held
            ended = wait_until(lambda: (r := DashboardRun.objects.get(id=run.id)).status == "cancelled" and r, "cancel")
            gate.release.set()
            done = wait_run(run.id)
    finally:
        gate.release.set()
    assert ended.contexts_done <= 4  # at most the four before the held one; the rest never counted
    assert done.status == "cancelled" and not done.complete and done.contexts_total > 4 + ahead
    assert gate.calls == 4 + ahead  # nothing more went to the engine: not one context after the cancel
    assert not FeatureDashboard.objects.filter(run_id=run.id).exists()
    wait_until(lambda: not workdir(run.id).exists(), "the working folder to go")
    # its contexts were let go at the engine (a cancel takes effect at its next step)
    wait_until(lambda: engine_client.status().in_flight == 0, "the engine to let the contexts go", 60)
    # an ended run cannot be cancelled again
    from features.errors import DashboardNotCancellable
    from features.services import dashboard_start

    finished = wait_run(dashboard_start(sae_id=sae.id, principal=principal(), token_budget=64, context_tokens=32).id)
    with pytest.raises(DashboardNotCancellable):
        dashboard_cancel(run_id=finished.id, principal=principal())


def test_a_crashed_run_resumes_from_its_checkpoint_with_the_same_figures(sae, engine_client, settings, monkeypatch):
    from core.runtime import runtime
    from features import runner
    from features.models import DashboardRun, FeatureDashboard
    from features.services import dashboards_resume

    settings.DASHBOARD_ENGINE_ROWS = 2
    monkeypatch.setattr(runner, "CHECKPOINT_CONTEXTS", 3)
    reference = wait_run(start(sae).id)
    assert reference.status == "completed"

    # the same run, its runner called by hand (no queued task beside it)
    run = DashboardRun.objects.create(
        sae=sae, layer=LAYER, token_budget=BUDGET, context_tokens=CONTEXT, top_k=5, window=4
    )
    gate = GatedEngine(engine_client, hold=9)
    with runner_by_hand(gate, lambda stop: runner.dashboard_run(run_id=run.id, stop=stop)) as (stop, outcome, _):
        assert gate.reached.wait(120), "the ninth context never reached the engine"
        # checkpoints at 3 and 6 contexts were written before the ninth was sent
        wait_until(lambda: DashboardRun.objects.get(id=run.id).contexts_done >= 6, "six contexts in")
        stop.set()
    assert outcome == ["stopped"]
    crashed = DashboardRun.objects.get(id=run.id)
    assert crashed.status == "running" and not crashed.complete and crashed.checkpoint_path
    assert not FeatureDashboard.objects.filter(run=crashed).exists()
    saved = int(Path(crashed.checkpoint_path).stem.split("-")[1])
    assert saved >= 6

    # a restarted server's start-up (millm_site/asgi.py) takes it over (force) and resumes
    # from the checkpoint
    counter = GatedEngine(engine_client, hold=0)
    with runtime().replaced(engine=counter):
        assert dashboards_resume(force=True) == 1
        done = wait_run(run.id)
    assert done.status == "completed" and done.complete
    assert counter.calls == done.contexts_total - saved  # only the contexts after it ran again
    ours = {r.index: r for r in FeatureDashboard.objects.filter(run=done)}
    theirs = {r.index: r for r in FeatureDashboard.objects.filter(run=reference)}
    assert ours.keys() == theirs.keys()
    for index, row in ours.items():
        for field in FIELDS:
            assert getattr(row, field) == getattr(theirs[index], field), (index, field)
    assert {k: v for k, v in done.summary.items()} == reference.summary


def test_an_sae_not_attached_is_409_and_a_detach_mid_run_fails_it(sae, engine_client, settings):
    from rest_framework.test import APIClient

    from core.runtime import runtime
    from features.models import DashboardRun, FeatureDashboard
    from orchestration.services import sae_detach
    from registry.models import SAE

    api = APIClient()
    other = SAE.objects.get(name="tiny-llama-L3-relu")
    error = refused(
        api.post(f"/api/saes/{other.id}/dashboards", {"corpus": "sample", "token_budget": 64}, format="json"),
        409,
        "SAE_NOT_ATTACHED",
    )
    assert error["details"]["layers"] == []
    error = refused(
        api.post(f"/api/saes/{sae.id}/dashboards", {"corpus": "sample", "token_budget": 64, "layer": 2}, format="json"),
        409,
        "SAE_NOT_ATTACHED",
    )
    assert error["details"]["layers"] == [LAYER]
    assert not DashboardRun.objects.exists()  # nothing queued

    settings.DASHBOARD_ENGINE_ROWS = 1
    gate = GatedEngine(engine_client, hold=3)
    try:
        with runtime().replaced(engine=gate):
            run = start(sae)
            assert gate.reached.wait(120)
            sae_detach(sae=SAE.objects.get(id=sae.id))
            gate.release.set()
            done = wait_run(run.id)
    finally:
        gate.release.set()
    assert done.status == "failed" and not done.complete
    assert done.error["code"] == "SAE_NOT_ATTACHED", done.error
    assert not FeatureDashboard.objects.filter(run=done).exists()


def test_the_sweeper_resumes_a_run_whose_runner_died_and_ends_a_cancel_nobody_ran(sae):
    from datetime import timedelta

    from django.utils import timezone

    from features.models import DashboardRun
    from features.sweeper import sweep_once

    long_ago = timezone.now() - timedelta(hours=1)
    dead = DashboardRun.objects.create(
        sae=sae,
        layer=LAYER,
        token_budget=64,
        context_tokens=32,
        status="running",
        runner="gone:1",
        runner_seen_at=long_ago,
        started_at=long_ago,
    )
    cancelled = DashboardRun.objects.create(
        sae=sae, layer=LAYER, token_budget=64, status="cancelling", runner="gone:2", runner_seen_at=long_ago
    )
    # a heartbeat an hour ahead: live however long the dead run takes to resume (one sent
    # now goes stale after BATCH_RUNNER_STALE_S, and a slow enough machine's second sweep
    # would take the run over)
    ahead = timezone.now() + timedelta(hours=1)
    alive = DashboardRun.objects.create(
        sae=sae, layer=LAYER, token_budget=64, status="running", runner="here:3", runner_seen_at=ahead
    )
    assert sweep_once() == {"cancelled": 1, "resumed": 1}
    done = wait_run(dead.id)
    assert done.status == "completed" and done.complete and done.contexts_done == 2
    assert DashboardRun.objects.get(id=cancelled.id).status == "cancelled"
    assert DashboardRun.objects.get(id=alive.id).runner == "here:3"  # a live runner keeps its run
    assert sweep_once() == {"cancelled": 0, "resumed": 0}
    DashboardRun.objects.filter(id=alive.id).update(status="cancelled", runner=None)


def test_a_run_over_a_file_reads_its_text_field_and_a_bad_file_is_refused(sae, tiny_assets):
    import json

    from transformers import AutoTokenizer

    from batches.files import file_create
    from core.auth import Principal
    from features.errors import InvalidCorpus
    from features.services import dashboard_start

    texts = [f"The {word} sat by the river at dawn, counting boats." for word in ("heron", "fisher", "child", "dog")]
    rows = [json.dumps({"body": t, "text": "not this field"}) for t in texts]
    upload = file_create(filename="c.jsonl", purpose="batch", content="\n".join(rows).encode(), owner="key:alice")
    alice = Principal(owner="key:alice", label="alice", admin=False)
    run = dashboard_start(
        sae_id=sae.id,
        principal=alice,
        corpus="file",
        file_id=upload.id,
        text_field="body",
        token_budget=10_000,
        context_tokens=16,
    )
    done = wait_run(run.id)
    assert done.status == "completed" and done.owner == "key:alice", done.error
    tok = AutoTokenizer.from_pretrained(str(tiny_assets.models["tiny-llama"].path))
    flat = [i for t in texts for i in tok(t, add_special_tokens=False)["input_ids"]]
    kept = [c for c in (flat[i : i + 16] for i in range(0, len(flat), 16)) if len(c) >= 2]
    assert done.contexts_total == done.contexts_done == len(kept)
    assert done.tokens_done == sum(len(c) for c in kept) == done.summary["tokens"]

    # a field the rows lack, and another owner's file: refused before anything is queued
    with pytest.raises(InvalidCorpus) as refused_field:
        dashboard_start(
            sae_id=sae.id, principal=alice, corpus="file", file_id=upload.id, text_field="title", token_budget=64
        )
    assert refused_field.value.status == 400 and refused_field.value.details["param"] == "text_field"
    from batches.errors import FileNotFound

    bob = Principal(owner="key:bob", label="bob", admin=False)
    with pytest.raises(FileNotFound) as other:
        dashboard_start(sae_id=sae.id, principal=bob, corpus="file", file_id=upload.id, token_budget=64)
    assert other.value.details["param"] == "file_id"
    from features.models import DashboardRun

    assert DashboardRun.objects.count() == 1


def test_a_model_unloaded_mid_run_fails_it_with_the_engines_code(sae, engine_client, settings):
    from core.runtime import runtime
    from features.models import FeatureDashboard
    from orchestration.services import model_unload
    from registry.models import Model

    settings.DASHBOARD_ENGINE_ROWS = 1
    gate = GatedEngine(engine_client, hold=3)
    try:
        with runtime().replaced(engine=gate):
            run = start(sae)
            assert gate.reached.wait(120)
            wait_until(lambda: engine_client.status().in_flight == 0, "the two contexts before it to end")
            Model.objects.filter(name="tiny-llama").update(locked=False)  # attaching locked it
            model_unload(model=Model.objects.get(name="tiny-llama"))
            assert engine_client.status().model_id is None
            gate.release.set()
            done = wait_run(run.id)
    finally:
        gate.release.set()
    assert done.status == "failed" and not done.complete, done
    assert done.error["code"] == "MODEL_NOT_LOADED" and done.error["message"], done.error
    assert done.contexts_done <= 2
    assert not FeatureDashboard.objects.filter(run=done).exists()
