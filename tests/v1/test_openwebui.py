"""The Open WebUI filter (integrations/openwebui/millm_steering.py), called as Open WebUI
calls a filter function — ``inlet(body, __user__)`` with the chat body it builds and the
user's valves — and its output sent to a real server's /v1."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tests.v1.conftest import attach
from tests.v1.helpers import request

FILTER = Path(__file__).resolve().parents[2] / "integrations" / "openwebui" / "millm_steering.py"


@pytest.fixture
def owui_filter():
    spec = importlib.util.spec_from_file_location("millm_steering", FILTER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.Filter


def _body() -> dict:
    # what Open WebUI hands a filter for a chat turn (the fields it sends on to /v1)
    return {
        "model": "tiny-llama",
        "stream": False,
        "temperature": 0,
        "max_tokens": 12,
        "messages": [{"role": "user", "content": "Tell me about the sea"}],
    }


def _chat(server, body):
    return request(server.base_url, "POST", "/chat/completions", body)


def test_the_dial_steers_through_v1_as_explicit_fields_do(llama, owui_filter):
    from steering.services import profile_create

    sae = attach("tiny-llama-L1-relu", 1)
    profile_create(name="sea", sae_id=sae.id, layer=1, steering={"3": 60.0}, model_name="tiny-llama")
    plain = _chat(llama, _body())
    assert plain.headers["x-millm-steering"] == "none"

    # the admin's valves: a profile at intensity 1.5
    flt = owui_filter()
    flt.valves = flt.Valves(profile="sea", intensity="1.5")
    body = flt.inlet(_body(), __user__={"id": "u1", "role": "user"})
    assert (body["profile"], body["steering_intensity"]) == ("sea", 1.5)
    steered = _chat(llama, body)
    assert steered.headers["x-millm-steering"].startswith("profile;name=sea;intensity=1.5;hash=")
    explicit = _chat(llama, {**_body(), "profile": "sea", "steering_intensity": 1.5})
    text = steered.json()["choices"][0]["message"]["content"]
    assert text == explicit.json()["choices"][0]["message"]["content"]
    assert text != plain.json()["choices"][0]["message"]["content"]  # positive control
    assert "x-millm-ignored-fields" not in steered.headers  # every field it adds is read

    # a user's own valves win over the admin's: inline features, or "off"
    mine = flt.inlet(_body(), __user__={"id": "u2", "valves": flt.UserValves(features="3:60, 40:-2")})
    assert mine["steering"] == {"features": [{"index": 3, "strength": 60.0}, {"index": 40, "strength": -2.0}]}
    inline = _chat(llama, mine)
    assert inline.status == 200 and inline.headers["x-millm-steering"].startswith("inline")
    off = _chat(llama, flt.inlet(_body(), __user__={"valves": flt.UserValves(intensity="off")}))
    assert off.headers["x-millm-steering"] == "none"
    assert off.json()["choices"][0]["message"]["content"] == plain.json()["choices"][0]["message"]["content"]


def test_an_explicit_client_field_wins_and_bad_features_are_refused(owui_filter):
    flt = owui_filter()
    flt.valves = flt.Valves(profile="sea")
    body = {**_body(), "profile": "other"}
    assert flt.inlet(body) == body
    flt.valves = flt.Valves(features="3")
    with pytest.raises(ValueError, match="index:strength"):
        flt.inlet(_body())
    assert flt.outlet({"x": 1}) == {"x": 1}


def test_the_filter_never_sends_what_the_server_refuses(llama, owui_filter):
    """Every combination of valves and model-menu pick gives a body /v1 accepts: at most
    one of profile / steering, and none beside a ``<model>@<profile>`` pick."""
    from steering.services import profile_create

    sae = attach("tiny-llama-L1-relu", 1)
    for name, feature in (("sea", "3"), ("calm", "40")):
        profile_create(name=name, sae_id=sae.id, layer=1, steering={feature: 60.0}, model_name="tiny-llama")
    flt = owui_filter()

    def sent(valves, user_valves=None, model="tiny-llama"):
        flt.valves = valves
        user = {"id": "u", "valves": user_valves} if user_valves is not None else None
        response = _chat(llama, flt.inlet({**_body(), "model": model}, __user__=user))
        assert response.status == 200, response.json()
        return response.headers["x-millm-steering"]

    # the admin's profile and features: the profile wins, as the valves say
    assert sent(flt.Valves(profile="sea", features="3:50")).startswith("profile;name=sea;intensity=1;")
    # a menu pick keeps its profile whatever the valves hold; the intensity still dials it
    assert sent(flt.Valves(features="3:50"), model="tiny-llama@sea").startswith("profile;name=sea;intensity=1;")
    assert sent(flt.Valves(profile="sea", intensity="0.5"), model="tiny-llama@calm").startswith(
        "profile;name=calm;intensity=0.5;"
    )
    assert (
        sent(flt.Valves(profile="sea"), flt.UserValves(features="3:50", intensity="off"), model="tiny-llama@calm")
        == "none"
    )
    # a user's profile and features: the profile wins, and replaces the admin's features
    assert sent(flt.Valves(features="3:50"), flt.UserValves(profile="calm", features="40:5")).startswith(
        "profile;name=calm;intensity=1;"
    )
    # the user's features replace the admin's profile
    assert sent(flt.Valves(profile="sea"), flt.UserValves(features="40:5")).startswith("inline")


@pytest.mark.parametrize(
    "valves",
    [
        {"intensity": "nan"},
        {"intensity": "inf"},
        {"intensity": "-0.5"},
        {"intensity": "3"},
        {"intensity": "loud"},
        {"features": "3:nan"},
        {"features": "3:-inf"},
        {"features": "-3:1"},
        {"features": "x:1"},
    ],
)
def test_bad_valves_are_refused_before_anything_is_sent(owui_filter, valves):
    # "nan" and "inf" read as floats, which no JSON body can carry: refused like "loud"
    flt = owui_filter()
    flt.valves = flt.Valves(**valves)
    with pytest.raises(ValueError, match="intensity|feature"):
        flt.inlet(_body())
    flt.valves = flt.Valves()
    with pytest.raises(ValueError, match="intensity|feature"):
        flt.inlet(_body(), __user__={"valves": flt.UserValves(**valves)})
