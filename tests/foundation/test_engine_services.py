"""Registry services that drive the embedded engine: load, attach (locks), detach
(unlocks), unload — and the rows always say what the engine holds."""

from __future__ import annotations

import threading

import pytest

from core.engine_client import EmbeddedEngineClient
from core.errors import ModelNotLoaded, SAEIncompatible, SAENotAttached
from core.runtime import runtime
from gpu_engine.api.protocol import ErrorEvent, GenerationJob, SamplingParams, TokenEvent
from orchestration import services as orchestration_services
from registry import services
from registry.errors import ModelLocked
from registry.models import SAE, Attachment, Model

pytestmark = pytest.mark.django_db


@pytest.fixture
def engine_client(settings):
    settings.MILLM_ENGINE_DEVICE = "cpu"
    settings.MILLM_ENGINE_DTYPE = "float32"
    client = EmbeddedEngineClient()
    with runtime().replaced(engine=client):
        yield client
    client.shutdown()


@pytest.fixture
def llama(tiny_assets):
    model = services.model_register_local(local_path=str(tiny_assets.models["tiny-llama"].path), name="tiny-llama")
    saes = {
        a.name: services.sae_register_local(local_path=str(a.path), name=a.name)
        for a in tiny_assets.saes_for("tiny-llama")
    }
    gpt2_sae = next(iter(tiny_assets.saes_for("tiny-gpt2")))
    saes["gpt2"] = services.sae_register_local(local_path=str(gpt2_sae.path), name="g")
    return model, saes


def test_load_attach_detach_unload(engine_client, llama):
    model, saes = llama
    with pytest.raises(ModelNotLoaded):
        orchestration_services.sae_attach(sae=saes["tiny-llama-L1-relu"], layer=1)
    orchestration_services.model_load(model=model)
    assert Model.objects.get(pk=model.pk).status == "loaded"
    status = engine_client.status()
    assert status.state == "ready" and status.model_id == "tiny-llama"

    result = orchestration_services.sae_attach(sae=saes["tiny-llama-L1-relu"], layer=1)
    assert result.layer_module_path == "model.layers.1"
    row = Attachment.objects.get()
    assert (row.sae_id, row.layer, row.layer_module_path) == (saes["tiny-llama-L1-relu"].id, 1, "model.layers.1")
    assert SAE.objects.get(pk=row.sae_id).status == "attached"
    assert Model.objects.get(pk=model.pk).locked
    assert [(a.sae_id, a.layer) for a in engine_client.attachments()] == [(row.sae_id, 1)]

    with pytest.raises(ModelLocked):
        orchestration_services.model_unload(model=model)
    orchestration_services.sae_detach(sae=saes["tiny-llama-L1-relu"])
    assert not Attachment.objects.exists()
    assert not Model.objects.get(pk=model.pk).locked
    assert engine_client.attachments() == []
    with pytest.raises(SAENotAttached):
        orchestration_services.sae_detach(sae=saes["tiny-llama-L1-relu"])

    orchestration_services.model_unload(model=model)
    assert Model.objects.get(pk=model.pk).status == "ready"
    assert engine_client.status().state == "empty"


def test_an_unload_past_its_grace_period_stops_the_running_requests(
    engine_client, llama, settings, monkeypatch, request
):
    """In embedded mode too: a generation that outlasts GRACEFUL_UNLOAD_TIMEOUT ends with
    engine_busy and the model is unloaded. The generation is held at its 2nd token (as
    tests/distributed/held_engine.py holds one) until the engine stops it, so it outlasts
    the grace period on any machine: 480 tiny-model steps took under 0.1 s on a fast one."""
    from gpu_engine.runtime.stream import GenerationStream
    from tests.distributed.held_engine import install_hold

    model, _ = llama
    settings.GRACEFUL_UNLOAD_TIMEOUT = 0.1
    released = threading.Event()
    request.addfinalizer(released.set)  # whatever the test's end, nothing stays held
    monkeypatch.setattr(GenerationStream, "_put", GenerationStream._put)  # restored after the test
    install_hold(lambda: not released.is_set(), at=2)
    orchestration_services.model_load(model=model)
    events = engine_client.generate(
        GenerationJob(
            "long",
            prompt_token_ids=[5, 17, 42],
            sampling=SamplingParams(max_tokens=480, temperature=0, ignore_eos=True),
        )
    ).events(30)
    assert isinstance(next(events), TokenEvent)
    orchestration_services.model_unload(model=model)
    rest = list(events)
    assert isinstance(rest[-1], ErrorEvent) and rest[-1].code == "engine_busy"
    assert rest[-1].details == {"reason": "unloading"}  # the engine stopped it, draining
    assert len(rest) - 1 < 479
    assert Model.objects.get(pk=model.pk).status == "ready"
    assert engine_client.status().state == "empty"


def test_attach_set_is_all_or_nothing(engine_client, llama):
    model, saes = llama
    orchestration_services.model_load(model=model)
    with pytest.raises(SAEIncompatible):
        # the GPT-2 SAE's d_in equals the llama hidden size, but layer 9 is out of range
        orchestration_services.sae_attach_set(items=[(saes["tiny-llama-L1-relu"], 1), (saes["gpt2"], 9)])
    assert not Attachment.objects.exists()
    assert engine_client.attachments() == []
    assert SAE.objects.filter(status="attached").count() == 0
    orchestration_services.sae_attach_set(items=[(saes["tiny-llama-L1-relu"], 1), (saes["tiny-llama-L3-relu"], 3)])
    assert sorted(Attachment.objects.values_list("layer", flat=True)) == [1, 3]
    assert len(engine_client.attachments()) == 2
