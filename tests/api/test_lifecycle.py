"""Load, unload, attach, detach, attach-set, attachments and the compatibility dry run,
against the embedded engine on the tiny models (CPU, float32). The background jobs are run
in the test's thread, where the test's transaction is visible."""

from __future__ import annotations

import time

import pytest

from orchestration import tasks
from registry.models import SAE, Attachment, Job, Model
from tests.api.conftest import ok, refused, run_job

pytestmark = pytest.mark.django_db


def _load(api, model) -> dict:
    data = ok(api.post(f"/api/models/{model.id}/load"), 202)
    assert data["job"]["kind"] == "model_load" and data["job"]["status"] == "queued"
    assert run_job(tasks.model_load_task, data["job"]["id"]) == "succeeded"
    return data


def test_load_and_unload_in_the_background(api, engine_client, tiny_llama, published):
    data = _load(api, tiny_llama)
    row = Model.objects.get(pk=tiny_llama.id)
    assert (row.status, row.device, row.dtype) == ("loaded", "cpu", "float32")
    assert row.loaded_at is not None
    job = Job.objects.get(pk=data["job"]["id"])
    assert (job.status, job.progress) == ("succeeded", 100)
    assert engine_client.status().model_id == "tiny-llama"

    load_events = [(n, d) for n, d in published if n.startswith("model:load:")]
    assert [n for n, _ in load_events][-1] == "model:load:complete"
    progress = [d["percent"] for n, d in load_events if n == "model:load:progress"]
    assert len(progress) >= 2 and progress == sorted(progress)
    stages = [d["stage"] for n, d in load_events if n == "model:load:progress"]
    assert stages == ["preparing", "checking memory", "loading weights", "recorded"]
    detail = ok(api.get(f"/api/models/{tiny_llama.id}"))
    assert (detail["status"], detail["device"], detail["dtype"]) == ("loaded", "cpu", "float32")
    assert ok(api.get("/api/models"))["loaded_model_id"] == tiny_llama.id

    refused(api.post(f"/api/models/{tiny_llama.id}/load"), 400, "MODEL_ALREADY_LOADED")
    refused(api.delete(f"/api/models/{tiny_llama.id}"), 409, "MODEL_LOADED")

    unload = ok(api.post(f"/api/models/{tiny_llama.id}/unload"), 202)
    assert unload["job"]["kind"] == "model_unload"
    assert tasks.model_unload_task(unload["job"]["id"]) == "succeeded"
    row.refresh_from_db()
    assert (row.status, row.device, row.dtype) == ("ready", "", "")
    assert engine_client.status().state == "empty"
    assert published[-1] == ("model:unload:complete", {"model_id": tiny_llama.id, "reason": "unload"})
    refused(api.post(f"/api/models/{tiny_llama.id}/unload"), 400, "MODEL_NOT_LOADED")


def test_load_is_idempotent_while_queued(api, engine_client, tiny_llama):
    first = ok(api.post(f"/api/models/{tiny_llama.id}/load"), 202)
    second = ok(api.post(f"/api/models/{tiny_llama.id}/load"), 202)
    assert first["job"]["id"] == second["job"]["id"]
    # an unload while the load is pending is refused with the load's Retry-After
    Model.objects.filter(pk=tiny_llama.id).update(status="loaded")
    response = api.post(f"/api/models/{tiny_llama.id}/unload")
    refused(response, 503, "MODEL_BUSY")
    assert response["Retry-After"] == "15"


def test_an_unload_while_another_models_load_is_pending_is_refused(api, engine_client, tiny_assets, tiny_llama):
    from registry import services

    gpt2 = services.model_register_local(local_path=str(tiny_assets.models["tiny-gpt2"].path), name="tiny-gpt2")
    _load(api, tiny_llama)
    queued = ok(api.post(f"/api/models/{gpt2.id}/load"), 202)  # not run yet: still queued
    response = api.post(f"/api/models/{tiny_llama.id}/unload")
    error = refused(response, 503, "MODEL_BUSY")
    assert error["details"]["loading"] == "tiny-gpt2" and response["Retry-After"] == "15"
    assert not Job.objects.filter(kind="model_unload").exists()
    assert run_job(tasks.model_load_task, queued["job"]["id"]) == "succeeded"
    assert Model.objects.get(pk=tiny_llama.id).status == "ready"


def test_load_refusals(api, engine_client, tiny_assets, tiny_llama):
    from registry import services

    refused(api.post("/api/models/31337/load"), 404, "MODEL_NOT_FOUND")
    q2 = services.model_register_local(
        local_path=str(tiny_assets.models["tiny-gpt2"].path), name="gpt2-q2", quantization="Q2"
    )
    error = refused(api.post(f"/api/models/{q2.id}/load"), 400, "UNSUPPORTED_QUANTIZATION")
    assert error["details"]["quantization"] == "Q2"
    downloading = Model.objects.create(name="half", source="huggingface", repo_id="a/b", status="downloading")
    refused(api.post(f"/api/models/{downloading.id}/load"), 400, "MODEL_INVALID")
    assert not Job.objects.filter(kind="model_load").exists()


def test_a_load_refuses_as_the_api_route_does(api, engine_client, tiny_assets, tiny_llama):
    """The /v1 on-demand load and the Celery task call the service directly: each refusal
    the API gives before queueing a job, the service gives with the same code, status and
    details."""
    from core.errors import MillmError
    from orchestration.services import model_load
    from registry import services

    def both(model) -> tuple[tuple, tuple]:
        response = api.post(f"/api/models/{model.id}/load")
        error = refused(response, response.status_code, response.json()["error"]["code"])
        with pytest.raises(MillmError) as exc:
            model_load(model=model)
        direct = exc.value
        return ((response.status_code, error["code"], error["details"]), (direct.status, direct.code, direct.details))

    downloading = Model.objects.create(name="half", source="huggingface", repo_id="a/b", status="downloading")
    # a GGUF file pinned to the transformers backend (GGUF loads on llamacpp only)
    gguf = Model.objects.create(
        name="g",
        source="local",
        format="gguf",
        status="ready",
        backend="transformers",
        local_path=str(tiny_assets.models["tiny-gpt2"].path),
    )
    q2 = services.model_register_local(
        local_path=str(tiny_assets.models["tiny-gpt2"].path), name="gpt2-q2", quantization="Q2"
    )
    expected = {
        downloading.id: (400, "MODEL_INVALID", {"model_id": downloading.id, "status": "downloading"}),
        gguf.id: (400, "UNSUPPORTED_MODEL", {"model_id": gguf.id, "format": "gguf", "backend": "transformers"}),
        q2.id: (
            400,
            "UNSUPPORTED_QUANTIZATION",
            {
                "model_id": q2.id,
                "quantization": "Q2",
                "backend": "transformers",
                "supported": ["FP32", "FP16", "Q4", "Q8"],
            },
        ),
    }
    for model in (downloading, gguf, q2):
        via_api, direct = both(model)
        assert via_api == expected[model.id], via_api
        assert direct == expected[model.id], direct
    message = refused(api.post(f"/api/models/{gguf.id}/load"), 400, "UNSUPPORTED_MODEL")["message"]
    assert message == (
        "Model 'g' is a gguf model and its backend is transformers: GGUF models "
        "load on the llamacpp backend only (set the model's backend: "
        "PATCH /api/models/{id})"
    )
    # a locked resident model: refused on both routes, naming the resident one
    _load(api, tiny_llama)
    ok(api.post(f"/api/models/{tiny_llama.id}/lock"))
    gpt2 = services.model_register_local(local_path=str(tiny_assets.models["tiny-gpt2"].path), name="tiny-gpt2")
    via_api, direct = both(gpt2)
    assert via_api == direct == (409, "MODEL_LOCKED", {"model_id": tiny_llama.id})
    assert not Job.objects.filter(kind="model_load", model__in=[downloading, gguf, q2, gpt2]).exists()
    assert Model.objects.get(pk=gpt2.id).status == "ready"
    assert engine_client.status().model_id == "tiny-llama"


def test_loading_another_model_replaces_the_resident_one(api, engine_client, tiny_assets, tiny_llama, published):
    from registry import services

    gpt2 = services.model_register_local(local_path=str(tiny_assets.models["tiny-gpt2"].path), name="tiny-gpt2")
    _load(api, tiny_llama)
    ok(api.post(f"/api/models/{tiny_llama.id}/lock"))
    refused(api.post(f"/api/models/{gpt2.id}/load"), 409, "MODEL_LOCKED")
    ok(api.post(f"/api/models/{tiny_llama.id}/unlock"))
    _load(api, gpt2)
    assert Model.objects.get(pk=tiny_llama.id).status == "ready"
    assert Model.objects.get(pk=gpt2.id).status == "loaded"
    assert ("model:unload:complete", {"model_id": tiny_llama.id, "reason": "replaced"}) in published


def test_a_failed_load_that_dropped_the_resident_model_says_so(
    api, engine_client, tiny_assets, tiny_llama, llama_saes, published, tmp_path, django_capture_on_commit_callbacks
):
    """The engine frees the resident model before loading the next; when the next one's
    files are broken, the rows must not go on claiming the old model, its attachments and
    its live steering (and a lease on it) while the engine holds nothing."""
    import shutil

    from leases.models import Lease
    from leases.services import lease_grant
    from registry import services
    from steering.models import LiveSteering

    broken_dir = tmp_path / "broken"
    shutil.copytree(tiny_assets.models["tiny-llama"].path, broken_dir)
    broken = services.model_register_local(local_path=str(broken_dir), name="broken")
    weights = broken_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    _load(api, tiny_llama)
    sae = llama_saes["tiny-llama-L1-relu"]
    ok(api.post(f"/api/saes/{sae.id}/attach", {"layer": 1}, format="json"))
    ok(api.post("/api/saes/steering", {"feature_idx": 3, "value": 5}, format="json"))
    ok(api.post(f"/api/models/{tiny_llama.id}/unlock"))
    _, lease_id = lease_grant(model=Model.objects.get(pk=tiny_llama.id), holder="h", reason="r")
    published.clear()

    data = ok(api.post(f"/api/models/{broken.id}/load", HTTP_X_MILLM_LEASE=lease_id), 202)
    with django_capture_on_commit_callbacks(execute=True):
        assert run_job(tasks.model_load_task, data["job"]["id"]) == "failed"
    assert Model.objects.get(pk=broken.id).status == "error"
    held = engine_client.status().model_id
    assert held is None  # what this test is about: the engine lost the old model
    assert Model.objects.get(pk=tiny_llama.id).status == "ready"
    assert not Attachment.objects.exists() and not LiveSteering.objects.exists()
    assert SAE.objects.get(pk=sae.id).status == "ready"
    assert not Lease.objects.filter(ended_at__isnull=True).exists()
    assert ok(api.get("/api/models"))["loaded_model_id"] is None
    assert ("sae:detached", {"sae_id": sae.id, "layer": 1, "reason": "load_failed"}) in published
    assert ("model:unload:complete", {"model_id": tiny_llama.id, "reason": "load_failed"}) in published


def test_unloading_publishes_each_attachments_detach(
    api, engine_client, tiny_llama, llama_saes, published, django_capture_on_commit_callbacks
):
    _load(api, tiny_llama)
    relu, topk = llama_saes["tiny-llama-L1-relu"], llama_saes["tiny-llama-L2-topk"]
    ok(
        api.post(
            "/api/saes/attach-set",
            {"attachments": [{"sae_id": relu.id, "layer": 1}, {"sae_id": topk.id, "layer": 2}]},
            format="json",
        )
    )
    ok(api.post(f"/api/models/{tiny_llama.id}/unlock"))
    published.clear()
    unload = ok(api.post(f"/api/models/{tiny_llama.id}/unload"), 202)
    with django_capture_on_commit_callbacks(execute=True):
        assert tasks.model_unload_task(unload["job"]["id"]) == "succeeded"
    detached = sorted((d["sae_id"], d["layer"], d["reason"]) for n, d in published if n == "sae:detached")
    assert detached == sorted([(relu.id, 1, "unload"), (topk.id, 2, "unload")])
    assert ("model:unload:complete", {"model_id": tiny_llama.id, "reason": "unload"}) in published


def test_attach_detach_and_attachment_status(api, engine_client, tiny_llama, llama_saes, published):
    sae = llama_saes["tiny-llama-L1-relu"]
    refused(api.post(f"/api/saes/{sae.id}/attach", {"layer": 1}, format="json"), 400, "MODEL_NOT_LOADED")
    _load(api, tiny_llama)
    data = ok(api.post(f"/api/saes/{sae.id}/attach", {"layer": 1}, format="json"))
    assert data == {
        "status": "attached",
        "sae_id": sae.id,
        "layer": 1,
        "layer_module_path": "model.layers.1",
        "hook_point": "resid_post",
        "memory_usage_mb": data["memory_usage_mb"],
        "warnings": [],
    }
    assert data["memory_usage_mb"] > 0
    row = Attachment.objects.get()
    assert (row.sae_id, row.layer, row.layer_module_path) == (sae.id, 1, "model.layers.1")
    assert SAE.objects.get(pk=sae.id).status == "attached"
    assert Model.objects.get(pk=tiny_llama.id).locked  # attaching locks the model
    assert published[-1][0] == "sae:attached"
    refused(api.post(f"/api/saes/{sae.id}/attach", {"layer": 1}, format="json"), 409, "SAE_ALREADY_ATTACHED")
    refused(api.delete(f"/api/saes/{sae.id}"), 409, "SAE_ALREADY_ATTACHED")
    refused(api.post(f"/api/models/{tiny_llama.id}/unload"), 409, "MODEL_LOCKED")

    # a steered generation makes steering_apply_count visible
    from gpu_engine.api.protocol import GenerationJob, SamplingParams, SteeringSpec

    handle = engine_client.generate(
        GenerationJob(
            request_id="r1",
            prompt="hello",
            sampling=SamplingParams(max_tokens=3, temperature=0),
            steering=SteeringSpec.from_mapping({(sae.id, 1): {3: 5.0}}),
        )
    )
    finish = list(handle.events(timeout_s=30))[-1]
    passes = finish.forward_passes
    status = ok(api.get("/api/saes/attachment"))
    assert status["is_attached"] and status["sae_id"] == sae.id and status["layer"] == 1
    assert status["steering_apply_count"] == passes > 0
    # the original's shape: is_attached, count, entries, total_memory_usage_mb
    listed = ok(api.get("/api/saes/attachments"))
    assert (listed["is_attached"], listed["count"], listed["total"]) == (True, 1, 1)
    assert listed["entries"][0]["steering_apply_count"] == passes
    assert listed["entries"][0]["layer_module_path"] == "model.layers.1"
    assert listed["total_memory_usage_mb"] == listed["entries"][0]["memory_usage_mb"] > 0
    assert ok(api.get("/api/saes"))["attachment"]["steering_apply_count"] == passes
    assert ok(api.get(f"/api/saes/{sae.id}"))["attached_layers"] == [1]

    detached = ok(api.post(f"/api/saes/{sae.id}/detach", {}, format="json"))
    assert (detached["status"], detached["layers"]) == ("detached", [1])
    assert not Attachment.objects.exists()
    assert SAE.objects.get(pk=sae.id).status == "ready"
    assert not Model.objects.get(pk=tiny_llama.id).locked  # detaching the last unlocks
    assert engine_client.attachments() == []
    assert published[-1] == ("sae:detached", {"sae_id": sae.id, "layer": 1, "reason": "detach"})
    refused(api.post(f"/api/saes/{sae.id}/detach", {}, format="json"), 400, "SAE_NOT_ATTACHED")
    # an operator's own lock outlives an attach and detach
    ok(api.post(f"/api/models/{tiny_llama.id}/lock"))
    ok(api.post(f"/api/saes/{sae.id}/attach", {"layer": 1}, format="json"))
    ok(api.post(f"/api/saes/{sae.id}/detach", {}, format="json"))
    assert Model.objects.get(pk=tiny_llama.id).locked
    ok(api.post(f"/api/models/{tiny_llama.id}/unlock"))
    assert not Model.objects.get(pk=tiny_llama.id).locked
    assert ok(api.get("/api/saes/attachment"))["is_attached"] is False
    assert ok(api.get("/api/saes/attachments")) == {
        "is_attached": False,
        "count": 0,
        "entries": [],
        "total": 0,
        "total_memory_usage_mb": 0.0,
    }


def test_attach_reports_warnings_and_refuses_incompatible(api, engine_client, tiny_llama, llama_saes, mismatched_sae):
    _load(api, tiny_llama)
    sae = llama_saes["tiny-llama-L1-relu"]
    data = ok(api.post(f"/api/saes/{sae.id}/attach", {"layer": 2}, format="json"))
    assert data["warnings"] and "layer" in " ".join(data["warnings"])
    error = refused(
        api.post(f"/api/saes/{mismatched_sae.id}/attach", {"layer": 1}, format="json"), 400, "SAE_INCOMPATIBLE"
    )
    assert error["details"]["errors"]
    refused(api.post(f"/api/saes/{sae.id}/attach", {"layer": 9}, format="json"), 400, "SAE_INCOMPATIBLE")
    assert list(Attachment.objects.values_list("sae_id", "layer")) == [(sae.id, 2)]


def test_compatibility_dry_run(api, engine_client, tiny_llama, llama_saes, mismatched_sae):
    sae = llama_saes["tiny-llama-L1-relu"]
    refused(api.get(f"/api/saes/{sae.id}/compatibility?layer=1"), 400, "MODEL_NOT_LOADED")
    _load(api, tiny_llama)
    data = ok(api.get(f"/api/saes/{sae.id}/compatibility?layer=1"))
    assert (data["compatible"], data["errors"], data["layer"]) == (True, [], 1)
    assert data["model_id"] == tiny_llama.id
    out_of_range = ok(api.get(f"/api/saes/{sae.id}/compatibility?layer=40"))
    assert out_of_range["compatible"] is False and out_of_range["errors"]
    mismatch = ok(api.get(f"/api/saes/{mismatched_sae.id}/compatibility?layer=1"))
    assert mismatch["compatible"] is False and "d_in" in " ".join(mismatch["errors"])
    refused(api.get(f"/api/saes/{sae.id}/compatibility"), 422, "VALIDATION_ERROR")
    assert not Attachment.objects.exists()  # a dry run changes nothing
    assert engine_client.attachments() == []


def test_attach_set_is_all_or_nothing_and_idempotent(api, engine_client, tiny_llama, llama_saes, mismatched_sae):
    _load(api, tiny_llama)
    l1, l3 = llama_saes["tiny-llama-L1-relu"], llama_saes["tiny-llama-L3-relu"]
    refused(
        api.post(
            "/api/saes/attach-set",
            {"attachments": [{"sae_id": l1.id, "layer": 1}, {"sae_id": mismatched_sae.id, "layer": 2}]},
            format="json",
        ),
        400,
        "SAE_INCOMPATIBLE",
    )
    assert not Attachment.objects.exists() and engine_client.attachments() == []
    refused(
        api.post(
            "/api/saes/attach-set",
            {"attachments": [{"sae_id": l1.id, "layer": 1}, {"sae_id": "sae_nope", "layer": 2}]},
            format="json",
        ),
        404,
        "SAE_NOT_FOUND",
    )

    refused(
        api.post(
            "/api/saes/attach-set",
            {"attachments": [{"sae_id": l1.id, "layer": 1}], "saes": [{"sae_id": l3.id, "layer": 3}]},
            format="json",
        ),
        422,
        "VALIDATION_ERROR",
    )
    refused(api.post("/api/saes/attach-set", {}, format="json"), 422, "VALIDATION_ERROR")
    # the original's clients send the set as "saes"
    items = {"saes": [{"sae_id": l1.id, "layer": 1}, {"sae_id": l3.id, "layer": 3}]}
    data = ok(api.post("/api/saes/attach-set", items, format="json"))
    assert [(a["sae_id"], a["layer"], a["status"], a["layer_module_path"]) for a in data["attachments"]] == [
        (l1.id, 1, "attached", "model.layers.1"),
        (l3.id, 3, "attached", "model.layers.3"),
    ]
    # the same set again changes nothing
    again = ok(api.post("/api/saes/attach-set", items, format="json"))
    assert [a["status"] for a in again["attachments"]] == ["already_attached"] * 2
    assert Attachment.objects.count() == 2 and len(engine_client.attachments()) == 2
    # one more pair next to the existing ones
    more = ok(
        api.post(
            "/api/saes/attach-set",
            {"attachments": [{"sae_id": l1.id, "layer": 1}, {"sae_id": l1.id, "layer": 2}]},
            format="json",
        )
    )
    assert [a["status"] for a in more["attachments"]] == ["already_attached", "attached"]
    assert sorted(Attachment.objects.values_list("layer", flat=True)) == [1, 2, 3]
    listed = ok(api.get("/api/saes/attachments"))
    assert listed["count"] == 3
    assert listed["total_memory_usage_mb"] == pytest.approx(
        sum(e["memory_usage_mb"] for e in listed["entries"]), abs=0.01
    )
    assert ok(api.get("/api/saes/attachment"))["attachments_count"] == 3
    # detaching one layer keeps the others
    assert ok(api.post(f"/api/saes/{l1.id}/detach", {"layer": 2}, format="json"))["layers"] == [2]
    assert sorted(Attachment.objects.values_list("layer", flat=True)) == [1, 3]


@pytest.mark.django_db(transaction=True)
def test_unload_waits_for_running_requests(api, engine_client, tiny_llama, settings):
    """The row says 'unloading' and the engine refuses newcomers (engine_busy, which /v1
    answers as 503 model_busy) while the generation already running finishes in full,
    within GRACEFUL_UNLOAD_TIMEOUT."""
    settings.GRACEFUL_UNLOAD_TIMEOUT = 30.0
    _load(api, tiny_llama)
    with _slowed(engine_client):
        events = _generation_in_flight(engine_client, "running", max_tokens=40)
        job = ok(api.post(f"/api/models/{tiny_llama.id}/unload"), 202)["job"]  # on the pool
        deadline = time.monotonic() + 5
        while engine_client.status().draining != "unloading":
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert Model.objects.get(pk=tiny_llama.id).status == "unloading"
        assert engine_client.status().state == "ready"  # still serving the running request
        late = list(engine_client.generate(_job("late", 4)).events(10))
        assert [(e.type, e.code) for e in late] == [("error", "engine_busy")]
        assert ok(api.get("/api/health/detailed"))["readiness_checks"]["no_model_transition"] is False
        rest = list(events)
    assert rest[-1].type == "finish" and len(rest[-1].token_ids) == 40  # not cut short
    assert run_job(tasks.model_unload_task, job["id"]) == "succeeded"
    assert Model.objects.get(pk=tiny_llama.id).status == "ready"
    assert engine_client.status().state == "empty"


def test_unload_goes_ahead_when_requests_outlast_the_grace_period(api, engine_client, tiny_llama, settings):
    """Past GRACEFUL_UNLOAD_TIMEOUT the running generation is stopped (its client gets
    engine_busy: 503 model_busy / an SSE error frame on /v1) and the unload goes ahead."""
    settings.GRACEFUL_UNLOAD_TIMEOUT = 0.5
    _load(api, tiny_llama)
    with _slowed(engine_client):
        events = _generation_in_flight(engine_client, "long", max_tokens=400)  # ~20 s
        job = ok(api.post(f"/api/models/{tiny_llama.id}/unload"), 202)["job"]
        started = time.monotonic()
        assert tasks.model_unload_task(job["id"]) == "succeeded"
        took = time.monotonic() - started
        rest = list(events)
    assert 0.5 <= took < 10
    assert rest[-1].type == "error" and rest[-1].code == "engine_busy", rest[-1]
    assert len([e for e in rest if e.type == "token"]) < 200
    assert Model.objects.get(pk=tiny_llama.id).status == "ready"
    assert engine_client.status().state == "empty"


def _job(rid: str, max_tokens: int):
    from gpu_engine.api.protocol import GenerationJob, SamplingParams

    return GenerationJob(
        rid, prompt="once upon a time", sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    )


def _generation_in_flight(engine_client, rid: str, *, max_tokens: int):
    """A generation running in the engine (what a /v1 request is there), its first token
    read; the rest of its events to iterate."""
    events = engine_client.generate(_job(rid, max_tokens)).events(30)
    assert next(events).type == "token"
    return events


class _slowed:
    """Every forward pass of the loaded model takes at least 50 ms, so a generation's
    length is known (a hook on the first decoder block, removed on exit)."""

    def __init__(self, engine_client) -> None:
        self.module = engine_client.engine.backend.model.get_submodule("model.layers.0")

    def __enter__(self):
        self.handle = self.module.register_forward_hook(lambda *args: time.sleep(0.05))
        return self

    def __exit__(self, *exc):
        self.handle.remove()


def test_pools_are_sized_from_the_settings(settings):
    from core import jobs
    from core.runtime import runtime

    settings.MAX_DOWNLOAD_WORKERS, settings.MAX_LOAD_WORKERS = 3, 1
    dispatch = jobs.JobDispatch()
    with runtime().replaced(jobs=dispatch):
        try:
            assert dispatch.executor("downloads")._max_workers == 3
            assert dispatch.executor("loads")._max_workers == 1
            assert dispatch.executor("maintenance")._max_workers == 1
            with pytest.raises(ValueError):
                jobs.enqueue(tasks.model_load_task, 1, queue="nowhere")
        finally:
            dispatch.shutdown(wait=True)


def test_transition_selector_for_v1(tiny_llama):
    from registry import selectors

    assert selectors.model_transition(name="tiny-llama") is None
    Model.objects.filter(pk=tiny_llama.id).update(status="unloading")
    assert selectors.model_transition(name="tiny-llama") == "unloading"
    assert selectors.model_transition(name="missing") is None


@pytest.mark.django_db(transaction=True)  # the handler closes its thread's connections
def test_the_engines_memory_release_event_names_the_model_by_its_id(tiny_llama, published):
    """The engine knows its model by name; the web tier's event carries the registry's
    integer id like every other event (dashboards join on it)."""
    from gpu_engine.api.protocol import EngineEvent
    from orchestration import engine_events

    engine_events.handle(EngineEvent(name="memory:released", data={"bytes": 4096, "model_id": "tiny-llama"}))
    assert published[-1] == ("memory:released", {"bytes": 4096, "model_id": tiny_llama.id, "model_name": "tiny-llama"})


def _dead_workers_job(model, kind="model_load"):
    """The rows a Celery worker killed mid-load leaves: its job running, untouched since."""
    from datetime import timedelta

    from django.utils import timezone

    job = Job.objects.create(
        kind=kind, target=model.name, model=model, status="running", stage="starting", started_at=timezone.now()
    )
    Job.objects.filter(pk=job.pk).update(updated_at=timezone.now() - timedelta(seconds=120))
    return job


def test_a_load_whose_worker_died_is_ended_and_the_rows_follow_the_engine(
    api, engine_client, tiny_assets, tiny_llama, settings
):
    """Distributed: a worker killed during a load left its job 'running' and the model
    'loading' for good (readiness 503 on every web server, every later load and unload
    refused). Past JOB_STALE_AFTER_S without a heartbeat the job ends and the rows say
    what the engine holds."""
    from orchestration.services import load_job
    from registry import services

    settings.EMBEDDED = False
    gpt2 = services.model_register_local(local_path=str(tiny_assets.models["tiny-gpt2"].path), name="tiny-gpt2")
    _load(api, tiny_llama)
    # it died before the engine heard of it: the engine still holds tiny-llama
    stuck = _dead_workers_job(gpt2)
    Model.objects.filter(pk=gpt2.pk).update(status="loading")
    ready = ok(api.get("/api/health/ready"))
    assert ready["checks"]["no_model_transition"] is True
    stuck.refresh_from_db()
    assert stuck.status == "failed" and "no heartbeat" in stuck.error
    assert [(m.name, m.status) for m in Model.objects.order_by("name")] == [
        ("tiny-gpt2", "ready"),
        ("tiny-llama", "loaded"),
    ]

    # it died after the engine had loaded the model: the rows follow the engine
    engine_client.load_model(load_job(gpt2, device="cpu", dtype="float32"))
    stuck = _dead_workers_job(gpt2)
    Model.objects.filter(pk=gpt2.pk).update(status="loading")
    fresh = Job.objects.create(
        kind="model_unload", target="x", model=tiny_llama, status="running"
    )  # alive: touched just now
    queued = ok(api.post(f"/api/models/{tiny_llama.id}/load"), 202)  # not refused as busy
    stuck.refresh_from_db()
    fresh.refresh_from_db()
    assert (stuck.status, fresh.status) == ("failed", "running")
    assert Model.objects.get(pk=gpt2.pk).status == "loaded"
    assert Model.objects.get(pk=tiny_llama.id).status == "ready"
    assert queued["job"]["status"] == "queued"


@pytest.mark.django_db(transaction=True)  # the heartbeat writes through its own connection
def test_a_running_job_keeps_its_heartbeat(tiny_llama, settings, monkeypatch):
    import threading

    from orchestration import services

    settings.EMBEDDED = False
    monkeypatch.setattr(services, "JOB_HEARTBEAT_S", 0.05)
    monkeypatch.setattr(services, "JOB_STALE_AFTER_S", 0.5)
    job = Job.objects.create(kind="model_load", target=tiny_llama.name, model=tiny_llama)
    running = threading.Event()
    release = threading.Event()

    def operation(*, model, job):
        running.set()
        release.wait(10)

    worker = threading.Thread(target=tasks._run_model_job, args=(job.id, operation, "t"))
    worker.start()
    assert running.wait(5)
    time.sleep(1.0)  # twice the stale age: only the heartbeat keeps it alive
    assert services.model_jobs_reap() == 0
    assert Job.objects.get(pk=job.id).status == "running"
    release.set()
    worker.join(10)
