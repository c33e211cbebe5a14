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
