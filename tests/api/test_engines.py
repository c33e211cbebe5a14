"""Several engines, one front (docs/deploy.md, "Several models, several engines"): what
ENGINE_NAME and ENGINE_MODELS accept at start-up, which engine a model is routed to, and
``GET /api/engines`` (admin keys only) in one process. The two-engine run across real
processes is tests/distributed/test_engines.py."""

from __future__ import annotations

import pytest

from core.engines import engine_for_model, engine_prefix, parse_engine_models
from millm_site.config import ConfigError, load_config
from tests.api.conftest import ok, refused

ADMIN = "Bearer adm-secret-1"
ALICE = "Bearer inf-secret-a"


@pytest.mark.parametrize(
    "env, match",
    [
        ({"ENGINE_NAME": "gpu 1"}, "ENGINE_NAME"),
        ({"ENGINE_NAME": ""}, "ENGINE_NAME"),
        ({"ENGINE_NAME": "a" * 41}, "ENGINE_NAME"),
        ({"REDIS_URL": "redis://127.0.0.1:6379/0", "ENGINE_MODELS": "gpu1"}, "ENGINE_MODELS"),
        ({"REDIS_URL": "redis://127.0.0.1:6379/0", "ENGINE_MODELS": "gpu1:"}, "lists no model"),
        ({"REDIS_URL": "redis://127.0.0.1:6379/0", "ENGINE_MODELS": "gpu1:a;gpu1:b"}, "listed twice"),
        ({"REDIS_URL": "redis://127.0.0.1:6379/0", "ENGINE_MODELS": "gp/u:a"}, "engine name"),
        # embedded mode runs one engine: another one has nowhere to run
        ({"ENGINE_MODELS": "gpu1:a;default:*"}, "needs REDIS_URL"),
    ],
)
def test_bad_engine_settings_stop_start_up(env, match):
    with pytest.raises(ConfigError, match=match):
        load_config(env)


def test_engine_settings_accepted():
    config = load_config({"REDIS_URL": "redis://127.0.0.1:6379/0", "ENGINE_MODELS": "gpu1:model-b;default:*"})
    assert config.ENGINE_MODELS == "gpu1:model-b;default:*"
    assert load_config({"ENGINE_MODELS": "default:*"}).ENGINE_NAME == "default"


def test_a_model_goes_to_the_first_engine_naming_it_else_the_first_pattern():
    routes = "big:llama-*;small:llama-tiny,gpt2;default:*"
    parsed = parse_engine_models(routes)
    assert [r.name for r in parsed] == ["big", "small", "default"]
    with pytest.MonkeyPatch.context() as mp:
        from django.conf import settings

        mp.setattr(settings, "ENGINE_MODELS", routes, raising=False)
        assert engine_for_model("llama-tiny") == "small"  # named exactly beats big's pattern
        assert engine_for_model("llama-7b") == "big"
        assert engine_for_model("gpt2") == "small"
        assert engine_for_model("other") == "default"
        mp.setattr(settings, "ENGINE_MODELS", "big:llama-*;small:gpt2", raising=False)
        assert engine_for_model("other") is None  # no engine may hold it
    assert engine_prefix("default", "millm") == "millm"
    assert engine_prefix("gpu1", "millm") == "millm.gpu1"


@pytest.mark.django_db
def test_engines_route_is_for_admin_keys(api, settings, engine_client, tiny_llama):
    settings.MILLM_ADMIN_API_KEYS = ("root:adm-secret-1",)
    settings.MILLM_API_KEYS = ("alice:inf-secret-a",)
    assert api.get("/api/engines").status_code == 401
    assert api.get("/api/engines", HTTP_AUTHORIZATION="Bearer not-a-key").status_code == 401
    refused(api.get("/api/engines", HTTP_AUTHORIZATION=ALICE), 403, "FORBIDDEN")
    # the one embedded engine, holding nothing yet
    (entry,) = ok(api.get("/api/engines", HTTP_AUTHORIZATION=ADMIN))["engines"]
    assert entry["name"] == "default"
    assert entry["models_allowed"] == ["*"]
    assert entry["model"] is None and entry["recorded"] == []
    from orchestration import services

    services.model_load(model=tiny_llama)
    (entry,) = ok(api.get("/api/engines", HTTP_AUTHORIZATION=ADMIN))["engines"]
    assert (entry["alive"], entry["state"], entry["model"]) == (True, "ready", "tiny-llama")
    assert entry["recorded"] == ["tiny-llama"]
    # the registry says which engine holds it
    model = ok(api.get(f"/api/models/{tiny_llama.id}", HTTP_AUTHORIZATION=ADMIN))
    assert model["engine"] == "default"
    services.model_unload(model=tiny_llama)
    model = ok(api.get(f"/api/models/{tiny_llama.id}", HTTP_AUTHORIZATION=ADMIN))
    assert model["engine"] is None


@pytest.mark.parametrize(
    "routes, name, match",
    [
        ("", "gpu1", "not one ENGINE_MODELS routes to \\(default\\)"),
        ("gpu1:a;default:*", "gpu2", "not one ENGINE_MODELS routes to \\(gpu1, default\\)"),
        ("gpu1:a;default:*", "bad name", "must be 1-40 letters"),
    ],
)
def test_run_engine_refuses_a_name_nothing_routes_to(settings, routes, name, match):
    from django.core.management import CommandError, call_command

    settings.EMBEDDED = False  # the check comes before any connection to Redis
    settings.ENGINE_MODELS = routes
    with pytest.raises(CommandError, match=match):
        call_command("run_engine", "--name", name)


class _TwoEngines:
    """The runtime's EngineSet with a second engine, ``gpu1``: its own in-process engine,
    swapped in at the client boundary (the two-process run is tests/distributed)."""

    def __init__(self, gpu1) -> None:
        self.gpu1 = gpu1

    def names(self) -> list[str]:
        return ["gpu1", "default"]

    def client(self, name: str):
        from core.engines import DEFAULT_ENGINE, using_engine
        from core.runtime import runtime

        if name == "gpu1":
            return self.gpu1
        assert name == DEFAULT_ENGINE, name
        with using_engine(DEFAULT_ENGINE):
            return runtime().engine

    def shutdown(self) -> None:
        pass


class _Dying:
    """gpu1's client as the front sees it when its engine core died (``failure``) or the
    engine is gone (status refused)."""

    def __init__(self, client, *, failure: str | None = None, gone: bool = False) -> None:
        self.client, self.failure, self.gone = client, failure, gone
        self.status_blocks = client.status_blocks

    def status(self):
        import msgspec

        from gpu_engine.api.errors import EngineShutdown

        if self.gone:
            raise EngineShutdown("engine gpu1 is gone")
        return msgspec.structs.replace(self.client.status(), failure=self.failure)

    def __getattr__(self, name):
        return getattr(self.client, name)


@pytest.fixture
def two_engines(settings, engine_client, tiny_assets):
    """default holds tiny-llama, gpu1 holds tiny-gpt2, both loaded through the load service."""
    import json

    from core.engine_client import EmbeddedEngineClient
    from core.runtime import runtime
    from orchestration import services
    from registry import services as registry

    settings.ENGINE_MODELS = "gpu1:tiny-gpt2;default:*"
    gpu1 = EmbeddedEngineClient()
    engines = _TwoEngines(gpu1)
    llama = registry.model_register_local(local_path=str(tiny_assets.models["tiny-llama"].path), name="tiny-llama")
    gpt2 = registry.model_register_local(local_path=str(tiny_assets.models["tiny-gpt2"].path), name="tiny-gpt2")
    with runtime().replaced(engines=engines):
        services.model_load(model=llama)
        services.model_load(model=gpt2)
        layers = {
            name: json.loads((tiny_assets.models[name].path / "config.json").read_text())
            for name in ("tiny-llama", "tiny-gpt2")
        }
        yield engines, llama, gpt2, layers
    gpu1.shutdown()


@pytest.mark.django_db
def test_health_and_models_describe_every_engine(api, two_engines):
    engines, llama, gpt2, configs = two_engines
    ready = ok(api.get("/api/health/ready"))
    assert ready["failed_engines"] == []
    by_name = {e["name"]: e for e in ready["engines"]}
    assert {n: (e["alive"], e["model_name"]) for n, e in by_name.items()} == {
        "gpu1": (True, "tiny-gpt2"),
        "default": (True, "tiny-llama"),
    }
    assert ready["model_name"] == "tiny-llama"  # the top level stays the default engine's

    detailed = ok(api.get("/api/health/detailed"))
    engine_parts = {c["engine"]: c for c in detailed["components"] if c["name"].startswith("engine")}
    assert engine_parts["default"]["name"] == "engine"
    assert engine_parts["gpu1"]["name"] == "engine:gpu1"
    assert engine_parts["gpu1"]["status"] == "healthy"
    assert "tiny-gpt2" in engine_parts["gpu1"]["message"]

    inference = ok(api.get("/api/health/inference"))
    assert inference["model_name"] == "tiny-llama"
    rows = {e["name"]: e for e in inference["engines"]}
    assert rows["gpu1"]["model_name"] == "tiny-gpt2" and rows["default"]["model_name"] == "tiny-llama"
    assert rows["gpu1"]["engine_failure"] is None
    # each engine's own weights: gpt2's parameters are not llama's
    assert rows["gpu1"]["weights"]["bytes"] > 0 and rows["default"]["weights"]["bytes"] > 0
    assert rows["gpu1"]["weights"]["bytes"] != rows["default"]["weights"]["bytes"]
    assert rows["default"]["weights"] == inference["weights"]

    models = ok(api.get("/api/models"))
    assert models["loaded_model_id"] == llama.id
    assert models["loaded_models"] == {"default": llama.id, "gpu1": gpt2.id}

    # /v1/capabilities: each model from the engine that holds it, as its checkpoint says
    caps = {e["id"]: e for e in api.get("/v1/capabilities").json()["data"]}
    assert (caps["tiny-gpt2"]["engine"], caps["tiny-gpt2"]["resident"]) == ("gpu1", True)
    assert (caps["tiny-llama"]["engine"], caps["tiny-llama"]["resident"]) == ("default", True)
    assert caps["tiny-gpt2"]["num_layers"] == configs["tiny-gpt2"]["n_layer"]
    assert caps["tiny-gpt2"]["hidden_size"] == configs["tiny-gpt2"]["n_embd"]
    assert caps["tiny-llama"]["num_layers"] == configs["tiny-llama"]["num_hidden_layers"]


@pytest.mark.django_db
@pytest.mark.parametrize("dying", [{"failure": "engine core exited (pid 7, code -9)"}, {"gone": True}])
def test_readiness_fails_naming_the_engine_that_failed(api, two_engines, dying):
    engines, llama, gpt2, _ = two_engines
    engines.gpu1 = _Dying(engines.gpu1, **dying)
    error = refused(api.get("/api/health/ready"), 503, "NOT_READY")
    assert "gpu1" in error["message"]
    assert error["details"]["failed_engines"] == ["gpu1"]
    assert error["details"]["checks"]["engine"] is False
    gpu1 = next(e for e in error["details"]["engines"] if e["name"] == "gpu1")
    assert gpu1["ready"] is False
    if "failure" in dying:
        assert gpu1["engine_failure"] == dying["failure"]
        assert dying["failure"] in error["message"]
    detailed = ok(api.get("/api/health/detailed"))
    part = next(c for c in detailed["components"] if c.get("engine") == "gpu1")
    assert part["status"] == "unhealthy"
    assert detailed["status"] == "unhealthy"
    # the default engine is still whole: its component and /v1/capabilities entry say so
    assert next(c for c in detailed["components"] if c.get("engine") == "default")["status"] == "healthy"
    caps = {e["id"]: e for e in api.get("/v1/capabilities").json()["data"]}
    assert caps["tiny-llama"]["resident"] is True
    if "gone" in dying:
        # gpu1 does not answer: its model is listed, not resident, its backend unknown
        assert (caps["tiny-gpt2"]["resident"], caps["tiny-gpt2"]["backend_available"]) == (False, False)


@pytest.mark.django_db
def test_auto_load_model_is_judged_on_its_own_engine(api, settings, two_engines):
    # AUTO_LOAD_MODEL routed to gpu1 is resident there: ready, the setting applied
    settings.AUTO_LOAD_MODEL = "tiny-gpt2"
    ready = ok(api.get("/api/health/ready"))
    assert ready["checks"]["auto_load_model"] is True
    assert ready["auto_load_model"]["applied"] is True
    assert ready["auto_load_model"]["resident"] == "tiny-gpt2"
