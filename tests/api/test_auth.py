"""Access control: with MILLM_API_KEYS set, /api and /v1 need a bearer key (401 in each
surface's own shape), liveness and readiness stay open, the WebSocket needs the key too,
the admin keeps Django's login; without keys the server binds to localhost."""

from __future__ import annotations

import json

import pytest
from asgiref.sync import async_to_sync
from channels.testing import WebsocketCommunicator

from tests.api.conftest import ok, refused

pytestmark = pytest.mark.django_db

KEY = "millm-test-key-1"


@pytest.fixture
def keys(settings):
    settings.MILLM_API_KEYS = (KEY, "millm-test-key-2")
    return settings.MILLM_API_KEYS


def test_api_needs_a_key(api, keys):
    response = api.get("/api/models")
    error = refused(response, 401, "UNAUTHORIZED")
    assert "Bearer" in error["message"] and response["WWW-Authenticate"].startswith("Bearer")
    refused(api.get("/api/models", HTTP_AUTHORIZATION="Bearer wrong"), 401, "UNAUTHORIZED")
    refused(api.get("/api/models", HTTP_AUTHORIZATION=f"Basic {KEY}"), 401, "UNAUTHORIZED")
    refused(api.post("/api/models/preview", {}, format="json"), 401, "UNAUTHORIZED")
    refused(api.get("/api/schema"), 401, "UNAUTHORIZED")
    refused(api.get("/api/no/such/route"), 401, "UNAUTHORIZED")
    ok(api.get("/api/models", HTTP_AUTHORIZATION=f"Bearer {KEY}"))
    ok(api.get("/api/models", HTTP_AUTHORIZATION="Bearer millm-test-key-2"))


def test_liveness_and_readiness_stay_open(api, keys, engine_client):
    ok(api.get("/api/health"))
    ok(api.get("/api/health/ready"))
    refused(api.get("/api/health/detailed"), 401, "UNAUTHORIZED")
    refused(api.get("/api/health/metrics/prometheus"), 401, "UNAUTHORIZED")


def test_v1_refuses_in_openai_shape(api, keys):
    response = api.get("/v1/models")
    assert response.status_code == 401
    body = json.loads(response.content)
    assert set(body) == {"error"}
    assert body["error"]["type"] == "authentication_error"
    assert body["error"]["code"] == "invalid_api_key"
    response = api.post("/v1/chat/completions", {"model": "x", "messages": []}, format="json",
                        HTTP_AUTHORIZATION="Bearer nope")
    assert response.status_code == 401
    assert json.loads(response.content)["error"]["code"] == "invalid_api_key"
    assert api.get("/v1/models", HTTP_AUTHORIZATION=f"Bearer {KEY}").status_code == 200


def test_no_keys_no_check(api):
    ok(api.get("/api/models"))
    assert api.get("/v1/models").status_code == 200


def test_admin_keeps_djangos_login(api, keys, django_user_model):
    response = api.get("/admin/")
    assert response.status_code == 302 and "/admin/login/" in response["Location"]
    django_user_model.objects.create_superuser("root", "", "pw-for-the-test")
    api.login(username="root", password="pw-for-the-test")
    assert api.get("/admin/registry/model/").status_code == 200


def _ws(path: str, headers: list[tuple[bytes, bytes]] | None = None):
    from millm_site.asgi import application

    return WebsocketCommunicator(application, path, headers=headers or [])


def test_websocket_needs_the_key(keys):
    async def attempt(path, headers=None):
        communicator = _ws(path, headers)
        connected, code = await communicator.connect(timeout=5)
        await communicator.disconnect()
        return connected, code

    assert async_to_sync(attempt)("/ws/events") == (False, 4401)
    assert async_to_sync(attempt)("/ws/events?api_key=wrong") == (False, 4401)
    assert async_to_sync(attempt)("/ws/events", [(b"authorization", b"Bearer wrong")]) == \
        (False, 4401)
    assert async_to_sync(attempt)("/ws/events", [(b"authorization",
                                                  f"Bearer {KEY}".encode())])[0] is True
    assert async_to_sync(attempt)(f"/ws/events?api_key={KEY}")[0] is True


def test_a_websocket_path_without_a_route_is_refused():
    async def attempt(path):
        communicator = _ws(path)
        connected, code = await communicator.connect(timeout=5)
        await communicator.disconnect()
        return connected, code

    assert async_to_sync(attempt)("/ws/nope") == (False, 4404)
    assert async_to_sync(attempt)("/ws/events/extra") == (False, 4404)


def test_websocket_relays_events_without_keys(settings):
    from core import events

    settings.METRICS_PUSH_INTERVAL_S = 0  # only the event sent here (tests/v1 has the push)

    async def scenario():
        communicator = _ws("/ws/events")
        connected, _ = await communicator.connect(timeout=5)
        assert connected
        from channels.layers import get_channel_layer

        await get_channel_layer().group_send(events.GROUP, {
            "type": "millm.event", "event": "sae:attached", "data": {"sae_id": "sae_x"}})
        message = await communicator.receive_json_from(timeout=5)
        await communicator.send_to(text_data="ignored, not even JSON")
        await communicator.disconnect()
        return message

    assert async_to_sync(scenario)() == {"event": "sae:attached", "data": {"sae_id": "sae_x"}}


def test_bind_host(settings):
    from millm_site.management.commands.serve import bind_host

    settings.MILLM_API_KEYS = ()
    settings.MILLM_HOST_EXPLICIT = False
    settings.MILLM_HOST = "0.0.0.0"
    host, note = bind_host()
    assert host == "127.0.0.1" and "authentication is off" in note
    settings.MILLM_HOST_EXPLICIT = True
    host, note = bind_host()
    assert host == "0.0.0.0" and note.startswith("WARNING")
    settings.MILLM_HOST_EXPLICIT = False
    settings.MILLM_API_KEYS = (KEY,)
    host, note = bind_host()
    assert host == "0.0.0.0" and "API keys required" in note
    assert bind_host("10.1.2.3")[0] == "10.1.2.3"


def test_keys_come_from_the_environment(run_manage, tmp_path):
    code = ("from django.conf import settings; "
            "print(len(settings.MILLM_API_KEYS), settings.MILLM_HOST_EXPLICIT)")
    result = run_manage("shell", "-v", "0", "-c", code,
                        env={"MILLM_DATA_DIR": str(tmp_path), "MILLM_API_KEYS": "a, b ,"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "2 False"
    result = run_manage("check_config", env={"MILLM_DATA_DIR": str(tmp_path),
                                             "MILLM_API_KEYS": "supersecret"})
    assert "MILLM_API_KEYS=(set)" in result.stdout and "supersecret" not in result.stdout
