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
    response = api.post(
        "/v1/chat/completions", {"model": "x", "messages": []}, format="json", HTTP_AUTHORIZATION="Bearer nope"
    )
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
    assert async_to_sync(attempt)("/ws/events", [(b"authorization", b"Bearer wrong")]) == (False, 4401)
    assert async_to_sync(attempt)("/ws/events", [(b"authorization", f"Bearer {KEY}".encode())])[0] is True
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

        await get_channel_layer().group_send(
            events.GROUP, {"type": "millm.event", "event": "sae:attached", "data": {"sae_id": "sae_x"}}
        )
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
    code = "from django.conf import settings; print(len(settings.MILLM_API_KEYS), settings.MILLM_HOST_EXPLICIT)"
    result = run_manage(
        "shell", "-v", "0", "-c", code, env={"MILLM_DATA_DIR": str(tmp_path), "MILLM_API_KEYS": "a, b ,"}
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "2 False"
    result = run_manage("check_config", env={"MILLM_DATA_DIR": str(tmp_path), "MILLM_API_KEYS": "supersecret"})
    assert "MILLM_API_KEYS=(set)" in result.stdout and "supersecret" not in result.stdout


def test_inference_and_admin_keys(api, settings):
    """An inference key reads and manages its own; a change of shared state needs an admin
    key (403 in each surface's shape); labels name owners, never the secret."""
    settings.MILLM_API_KEYS = ("alice:secret-a", "bare-secret")
    settings.MILLM_ADMIN_API_KEYS = ("root:secret-r",)
    ok(api.get("/api/models", HTTP_AUTHORIZATION="Bearer secret-a"))
    ok(api.get("/api/models", HTTP_AUTHORIZATION="Bearer bare-secret"))
    # the label is not a key
    refused(api.get("/api/models", HTTP_AUTHORIZATION="Bearer alice:secret-a"), 401, "UNAUTHORIZED")
    error = refused(
        api.post("/api/saes/steering/enable", {}, format="json", HTTP_AUTHORIZATION="Bearer secret-a"), 403, "FORBIDDEN"
    )
    assert "MILLM_ADMIN_API_KEYS" in error["message"] and "secret" not in error["message"]
    refused(api.delete("/api/models/1", HTTP_AUTHORIZATION="Bearer bare-secret"), 403, "FORBIDDEN")
    # what it may change of its own reaches the view (404: there is no such capture)
    response = api.delete("/api/captures/cap_nope", HTTP_AUTHORIZATION="Bearer secret-a")
    assert response.status_code == 404
    # the admin key passes the gate (the view's own answer, not 401/403)
    response = api.post("/api/saes/steering/enable", {}, format="json", HTTP_AUTHORIZATION="Bearer secret-r")
    assert response.status_code not in (401, 403)
    # /v1 takes both kinds
    assert api.get("/v1/models", HTTP_AUTHORIZATION="Bearer secret-a").status_code == 200
    assert api.get("/v1/models", HTTP_AUTHORIZATION="Bearer secret-r").status_code == 200


def test_admin_keys_alone_protect_everything(api, settings):
    settings.MILLM_API_KEYS = ()
    settings.MILLM_ADMIN_API_KEYS = ("root:secret-r",)
    refused(api.get("/api/models"), 401, "UNAUTHORIZED")
    assert api.get("/v1/models").status_code == 401
    ok(api.get("/api/models", HTTP_AUTHORIZATION="Bearer secret-r"))


def test_an_owners_events_reach_only_its_sockets(settings):
    """batch:progress and monitoring:activation of one key's work go to that key's sockets
    and admin sockets, never to another key's."""
    from channels.layers import get_channel_layer

    from core import events

    settings.METRICS_PUSH_INTERVAL_S = 0
    settings.MILLM_API_KEYS = ("alice:ka", "bob:kb")
    settings.MILLM_ADMIN_API_KEYS = ("root:kr",)

    async def scenario():
        sockets = {}
        for name, key in (("alice", "ka"), ("bob", "kb"), ("root", "kr")):
            sockets[name] = _ws(f"/ws/events?api_key={key}")
            connected, _ = await sockets[name].connect(timeout=5)
            assert connected
        layer = get_channel_layer()
        await layer.group_send(
            events.GROUP,
            {
                "type": "millm.event",
                "event": "batch:progress",
                "data": {"batch_id": "batch_a", events.OWNER_FIELD: "key:alice"},
            },
        )
        await layer.group_send(events.GROUP, {"type": "millm.event", "event": "sae:attached", "data": {"sae_id": "s"}})
        got = {}
        for name, socket in sockets.items():
            got[name] = [await socket.receive_json_from(timeout=5)]
            if await socket.receive_nothing(timeout=0.3) is False:
                got[name].append(await socket.receive_json_from(timeout=5))
            await socket.disconnect()
        return got

    got = async_to_sync(scenario)()
    mine = {"event": "batch:progress", "data": {"batch_id": "batch_a"}}
    shared = {"event": "sae:attached", "data": {"sae_id": "s"}}
    assert got["alice"] == [mine, shared] and got["root"] == [mine, shared]
    assert got["bob"] == [shared]


def test_a_foreign_page_cannot_open_the_socket(settings):
    settings.MILLM_API_KEYS = ()
    settings.MILLM_ADMIN_API_KEYS = ()
    settings.CORS_ALLOW_ALL_ORIGINS = False
    settings.CORS_ALLOWED_ORIGINS = ["http://webui.example"]

    async def attempt(origin: bytes):
        communicator = _ws("/ws/events", [(b"origin", origin), (b"host", b"127.0.0.1:8000")])
        connected, code = await communicator.connect(timeout=5)
        await communicator.disconnect()
        return connected, code

    assert async_to_sync(attempt)(b"http://evil.example") == (False, 4403)
    assert async_to_sync(attempt)(b"http://webui.example")[0] is True
    assert async_to_sync(attempt)(b"http://127.0.0.1:8000")[0] is True


def test_the_admin_names_the_keys_never_their_secrets(api, staff_client, settings):
    settings.MILLM_API_KEYS = ("alice:secret-a",)
    settings.MILLM_ADMIN_API_KEYS = ("root:secret-r",)
    page = staff_client.get("/admin/access/")
    assert page.status_code == 200
    text = page.content.decode()
    assert "alice" in text and "root" in text and "key:alice" in text
    assert "secret-a" not in text and "secret-r" not in text
    assert 'href="/admin/access/"' in staff_client.get("/admin/").content.decode()
    anonymous = api.get("/admin/access/")
    assert anonymous.status_code == 302 and "/admin/login/" in anonymous["Location"]
    # a key is no admin login, and a logged-in user who is not staff gets the login page
    keyed = api.get("/admin/access/", HTTP_AUTHORIZATION="Bearer secret-r")
    assert keyed.status_code == 302 and "/admin/login/" in keyed["Location"]
    from django.contrib.auth import get_user_model

    get_user_model().objects.create_user("visitor", "", "pw-for-tests")
    api.login(username="visitor", password="pw-for-tests")
    visitor = api.get("/admin/access/")
    assert visitor.status_code == 302 and "secret" not in visitor.content.decode()
