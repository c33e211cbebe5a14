"""/api/health: liveness, readiness (and its rule), detailed, inference, gpus, metrics
(JSON and Prometheus), circuits, version."""

from __future__ import annotations

import re

import pytest

from orchestration import services as orchestration_services
from registry.models import Model
from tests.api.conftest import ok, refused

pytestmark = pytest.mark.django_db


def test_liveness(api):
    data = ok(api.get("/api/health"))
    assert data["status"] == "healthy" and data["version"] == "0.1.0"
    assert data["uptime_seconds"] >= 0 and data["timestamp"].endswith("Z")


def test_ready_without_a_model(api, engine_client):
    data = ok(api.get("/api/health/ready"))
    assert data["ready"] is True and data["model_loaded"] is False
    assert data["checks"] == {"database": True, "engine": True, "no_model_transition": True}


def test_not_ready_until_the_auto_load_model_is_resident(api, engine_client, settings, tiny_llama):

    settings.AUTO_LOAD_MODEL = "tiny-llama"
    response = api.get("/api/health/ready")
    error = refused(response, 503, "NOT_READY")
    assert response["Retry-After"] == str(settings.RETRY_AFTER_READINESS_S)
    assert error["details"]["checks"]["auto_load_model"] is False
    assert "auto_load_model" in error["message"]
    orchestration_services.model_load(model=tiny_llama)
    assert ok(api.get("/api/health/ready"))["checks"]["auto_load_model"] is True


def test_not_ready_while_a_model_is_being_swapped(api, engine_client, tiny_llama):
    Model.objects.filter(pk=tiny_llama.id).update(status="loading")
    response = api.get("/api/health/ready")
    error = refused(response, 503, "NOT_READY")
    assert error["details"]["transition"] == {"model": "tiny-llama", "status": "loading"}
    assert response["Retry-After"] == "5"


def test_not_ready_when_the_engine_is_away(api):
    from core.errors import EngineUnavailable
    from core.runtime import runtime

    class Away:
        def status(self):
            raise EngineUnavailable("no engine")

    with runtime().replaced(engine=Away()):
        error = refused(api.get("/api/health/ready"), 503, "NOT_READY")
        detailed = ok(api.get("/api/health/detailed"))
    assert error["details"]["checks"]["engine"] is False
    assert detailed["status"] == "unhealthy"
    assert {c["name"]: c["status"] for c in detailed["components"]}["engine"] == "unhealthy"


def test_detailed(api, engine_client, tiny_llama, llama_saes):

    orchestration_services.model_load(model=tiny_llama)
    orchestration_services.sae_attach(sae=llama_saes["tiny-llama-L1-relu"], layer=1)
    data = ok(api.get("/api/health/detailed"))
    names = {c["name"] for c in data["components"]}
    assert {"database", "engine", "channel_layer", "huggingface_circuit"} <= names
    assert data["model_loaded"] is True and data["model_name"] == "tiny-llama"
    assert data["model_id"] == tiny_llama.id and data["device"] == "cpu"
    assert data["sae_attached"] is True
    assert data["attachments"][0]["layer_module_path"] == "model.layers.1"
    inference = data["inference"]
    for key in ("pending", "in_flight", "waiting", "estimated_wait_seconds", "slots", "max_pending", "backend"):
        assert key in inference, key
    assert inference["in_flight"] == 0 and inference["waiting"] == 0
    assert data["lease"] is None  # no lease held (tests/documents/test_leases.py fills it)
    assert data["circuit_breakers"][0]["name"] == "huggingface"


def test_inference(api, engine_client, settings):
    data = ok(api.get("/api/health/inference"))
    # nothing loaded: no active backend, capabilities only once one reports them
    assert data["backend"] is None and data["mode"] == "serial"
    assert data["default_backend"] == "transformers"
    assert "per_request_steering" not in data["capabilities"]
    assert {b["name"]: b["available"] for b in data["backends"]}["transformers"] is True
    # MAX_CONCURRENT_REQUESTS unset: the slots follow the backend, and with nothing (or a
    # transformers model) loaded that is today's single slot
    assert settings.MAX_CONCURRENT_REQUESTS == 0
    assert data["max_concurrent_requests"] == 1
    assert data["slots"] == {
        "slots": 1,
        "source": "default",
        "backend": "none",
        "follows_backend": True,
        "max_concurrent_requests": 0,
    }


@pytest.mark.parametrize("pack, kernels", [(True, "onednn_packed"), (False, "default")])
def test_inference_reports_the_kernels_the_pack_setting_chose(api, engine_client, tiny_llama, settings, pack, kernels):

    assert ok(api.get("/api/health/inference"))["kernels"] is None  # nothing loaded yet
    settings.MILLM_ENGINE_PACK_WEIGHTS = pack
    orchestration_services.model_load(model=tiny_llama)
    data = ok(api.get("/api/health/inference"))
    assert data["kernels"] == kernels
    # the loaded backend names itself and reports what it can do
    assert data["backend"] == "transformers"
    assert data["capabilities"]["per_request_steering"] is True


def test_a_transformers_model_keeps_one_slot_unless_the_operator_sets_them(api, engine_client, tiny_llama, settings):
    settings.VLLM_MAX_NUM_SEQS = 8  # vLLM's batch does not size a transformers model's slots
    orchestration_services.model_load(model=tiny_llama)
    data = ok(api.get("/api/health/inference"))
    assert data["backend"] == "transformers"
    assert data["max_concurrent_requests"] == 1
    assert (data["slots"]["source"], data["slots"]["backend"]) == ("default", "transformers")
    assert ok(api.get("/api/health/detailed"))["inference"]["slots"] == 1
    settings.MAX_CONCURRENT_REQUESTS = 3  # set: the operator's value
    data = ok(api.get("/api/health/inference"))
    assert (data["max_concurrent_requests"], data["slots"]["source"]) == (3, "MAX_CONCURRENT_REQUESTS")
    inference = ok(api.get("/api/health/detailed"))["inference"]
    assert (inference["slots"], inference["slots_source"]) == (3, "MAX_CONCURRENT_REQUESTS")


def test_inference_reports_the_auto_kernels_by_their_probe(api, engine_client, tiny_llama, settings):
    settings.MILLM_ENGINE_PACK_WEIGHTS = None  # auto: the one-row probe decides at load
    orchestration_services.model_load(model=tiny_llama)
    data = ok(api.get("/api/health/inference"))
    probe = data["capabilities"]["kernel_probe"]
    assert data["kernels"] == ("onednn_packed" if probe["packed_ms"] <= probe["default_ms"] else "default")


@pytest.mark.parametrize("lean", [True, False])
def test_inference_reports_the_lean_decode_setting(api, engine_client, tiny_llama, settings, lean):
    settings.MILLM_ENGINE_LEAN_DECODE = lean
    orchestration_services.model_load(model=tiny_llama)
    caps = ok(api.get("/api/health/inference"))["capabilities"]
    assert caps["lean_decode"] is lean
    assert caps["lean_decode_reason"] == (None if lean else "turned off (lean_decode)")


@pytest.mark.parametrize("fused", [None, False])
def test_inference_reports_the_fused_kernels_setting(api, engine_client, tiny_llama, settings, fused):
    """MILLM_ENGINE_FUSED_KERNELS reaches the load: auto builds the C kernels (the CI machine
    has a compiler), false keeps the lean step's PyTorch calls."""
    settings.MILLM_ENGINE_FUSED_KERNELS = fused
    orchestration_services.model_load(model=tiny_llama)
    caps = ok(api.get("/api/health/inference"))["capabilities"]
    assert caps["fused_cpu_kernels"] is (fused is None)
    assert caps["fused_cpu_kernels_reason"] == (None if fused is None else "off (fused_cpu_kernels)")


@pytest.mark.parametrize(
    "compile_setting, kv, compiled, kv_in_force",
    [
        (None, "dynamic", False, "dynamic"),  # auto: not on the CPU
        (None, "static", False, "static"),
        (True, "dynamic", True, "static"),  # a compiled model decodes with the static cache
    ],
)
def test_inference_reports_compile_and_kv_cache_as_the_settings_chose(
    api, engine_client, tiny_llama, settings, compile_setting, kv, compiled, kv_in_force
):
    settings.TORCH_COMPILE, settings.KV_CACHE_MODE = compile_setting, kv
    orchestration_services.model_load(model=tiny_llama)
    caps = ok(api.get("/api/health/inference"))["capabilities"]
    assert (caps["torch_compile"], caps["kv_cache_mode"]) == (compiled, kv_in_force)
    text = api.get("/api/health/metrics/prometheus", HTTP_ACCEPT="text/plain").content.decode()
    if compiled:  # nothing generated yet: nothing compiled (the first decode step compiles)
        assert caps["torch_compile_status"] == {"mode": settings.TORCH_COMPILE_MODE, "compiles": 0, "cache_resets": 0}
        assert "millm_torch_compile_graphs_total 0.0" in text
    else:
        assert caps["torch_compile_status"] is None and "millm_torch_compile_graphs" not in text


def test_gpus_without_a_gpu(api):
    data = ok(api.get("/api/health/gpus"))
    import torch

    if torch.cuda.is_available():  # pragma: no cover - GPU hosts
        assert data["cards"] and all(c["memory_total_mb"] > 0 for c in data["cards"])
    else:
        assert data["cards"] == [] and data["total"] == 0
        assert "CUDA" in data["reason"]


def test_gpus_in_distributed_mode(api, settings):
    settings.EMBEDDED = False
    data = ok(api.get("/api/health/gpus"))
    assert data["cards"] == [] and "run_engine" in data["reason"]


def _metrics(api) -> dict:
    return ok(api.get("/api/health/metrics"))


def _grown(before: dict, after: dict) -> dict:
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


def test_metrics_json_and_prometheus(api, engine_client, tiny_llama, llama_saes):
    orchestration_services.model_load(model=tiny_llama)
    sae = llama_saes["tiny-llama-L1-relu"]
    orchestration_services.sae_attach(sae=sae, layer=1)  # which locks the model
    before = _metrics(api)
    refused(api.post(f"/api/models/{tiny_llama.id}/unload"), 409, "MODEL_LOCKED")
    refused(api.get("/api/models/999999"), 404, "MODEL_NOT_FOUND")  # wrong, not refused

    data = _metrics(api)
    assert _grown(before["refusals"], data["refusals"]) == {"model_locked": 1}
    assert data["requests"]["by_code"]["404"] >= 1
    assert data["requests"]["total"] == before["requests"]["total"] + 3  # + the first read
    assert data["steering_apply_count"] == [{"sae_id": sae.id, "layer": 1, "steering_apply_count": 0}]
    assert data["model_loaded"] is True and "waiting" in data["queue"]

    response = api.get("/api/health/metrics/prometheus", HTTP_ACCEPT="text/plain")
    assert response.status_code == 200 and response["Content-Type"].startswith("text/plain")
    text = response.content.decode()
    assert re.search(
        r'millm_http_requests_total\{code="404",method="GET",'
        r'route="api/models/<int:model_id>",surface="api"\} \d',
        text,
    )
    assert re.search(r"millm_queue_depth \d", text)
    assert re.search(r'millm_refusals_total\{reason="model_locked"\} \d', text)
    assert f'millm_steering_apply_count{{layer="1",sae_id="{sae.id}"}} 0.0' in text
    assert "millm_model_loaded 1.0" in text
    assert re.search(r"millm_admission_refused_total \d", text)
    assert 'millm_circuit_open{name="huggingface"} 0.0' in text


def test_refusals_count_each_refused_answer_once(api, engine_client, settings, monkeypatch, tiny_llama):
    from core.errors import ModelBusy
    from registry import selectors

    before = _metrics(api)["refusals"]
    settings.AUTO_LOAD_MODEL = "tiny-llama"
    refused(api.get("/api/health/ready"), 503, "NOT_READY")  # an answer, not a refusal
    settings.MILLM_API_KEYS = ("metrics-test-key",)
    assert api.get("/api/models").status_code == 401
    assert api.get("/v1/models").status_code == 401
    settings.MILLM_API_KEYS = ()

    def busy():
        raise ModelBusy("busy", retry_after=3)

    monkeypatch.setattr(selectors, "model_list", busy)
    refused(api.get("/api/models"), 503, "MODEL_BUSY")
    refused(api.post("/api/saes/attach-set", {"attachments": []}, format="json"), 422, "VALIDATION_ERROR")
    assert _grown(before, _metrics(api)["refusals"]) == {"unauthorized": 2, "model_busy": 1}


def test_version(api):
    data = ok(api.get("/api/health/version"))
    assert data["app"] == "miLLM" and data["version"] == "0.1.0"


def test_circuits(api, hub):
    data = ok(api.get("/api/health/circuits"))
    assert data["total"] == 1
    circuit = data["circuits"][0]
    assert circuit == {
        "name": "huggingface",
        "state": "closed",
        "is_open": False,
        "failure_count": 0,
        "fail_max": circuit["fail_max"],
        "reset_timeout_seconds": circuit["reset_timeout_seconds"],
        "opened_at": None,
        "retry_after_seconds": None,
    }
