"""The quick start as a new user runs it: an SQLite data directory, the demo assets, the
server started with the demo model loaded and its SAE attached (AUTO_LOAD_MODEL,
AUTO_ATTACH_SAES), then the README's steered chat completion."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request

import pytest

from tests.conftest import manage
from tests.fixtures.served import quickstart_serve


def _get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())
    except OSError:
        return 0, {}


@pytest.fixture(scope="module")
def quickstart_server(tiny_assets, tmp_path_factory):
    data = tmp_path_factory.mktemp("quickstart-data")
    with quickstart_serve(
        data, assets_root=tiny_assets.root, model="tiny-llama", sae="tiny-llama-L1-relu", tiny_only=True, timeout_s=120
    ) as served:
        yield served


def test_server_starts_with_the_demo_model_loaded_and_its_sae_attached(quickstart_server, tiny_assets):
    url, attachments = quickstart_server
    sae = tiny_assets.saes["tiny-llama-L1-relu"]
    assert [(a["layer"], a["layer_module_path"]) for a in attachments] == [(sae.layer, "model.layers.1")]
    status, models = _get(url + "/api/models")
    loaded = [m["name"] for m in models["data"]["models"] if m["status"] == "loaded"]
    assert loaded == ["tiny-llama"]


def test_readme_steered_chat_completion_works(quickstart_server):
    url, _ = quickstart_server

    def chat(steering: dict):
        body = {
            "model": "tiny-llama",
            "max_tokens": 8,
            "temperature": 0,
            "messages": [{"role": "user", "content": "Tell me about your weekend."}],
            "steering": steering,
            "return_sae_activations": {"top_k": 5, "positions": "last"},
        }
        request = urllib.request.Request(
            url + "/v1/chat/completions",
            data=json.dumps(body).encode(),
            method="POST",
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            return json.loads(response.read()), response.headers

    steered, headers = chat({"features": [{"index": 0, "strength": 60}]})
    assert headers["X-miLLM-Steering"].startswith("inline;")
    assert steered["choices"][0]["message"]["role"] == "assistant"
    assert steered["usage"]["completion_tokens"] > 0
    assert steered["millm"]
    plain, plain_headers = chat({"features": []})
    assert plain_headers["X-miLLM-Steering"] == "none"
    # positive control: the steer changed the greedy answer
    assert steered["choices"][0]["message"]["content"] != plain["choices"][0]["message"]["content"]


def test_auto_attach_names_must_exist(tmp_path):
    result = manage("check", env={"MILLM_DATA_DIR": str(tmp_path), "AUTO_ATTACH_SAES": "x@1"})
    assert result.returncode == 2
    assert "AUTO_ATTACH_SAES: needs AUTO_LOAD_MODEL" in result.stderr


def test_serve_refuses_a_speculative_model_that_names_nothing(tmp_path):
    """A hub repository id that is not registered stops the start-up with the setting's
    name, not every later load (issue 37)."""
    env = {"MILLM_DATA_DIR": str(tmp_path), "MILLM_ENGINE_DEVICE": "cpu"}
    assert manage("migrate", "--noinput", env=env, timeout=300).returncode == 0
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    draft = {"SPECULATIVE_MODEL": "millm-test/no-such-draft", "ENABLE_CONTINUOUS_BATCHING": "false"}
    result = manage("serve", "--port", str(port), env={**env, **draft}, timeout=120)
    assert result.returncode == 1
    assert "SPECULATIVE_MODEL: MODEL_NOT_FOUND: SPECULATIVE_MODEL='millm-test/no-such-draft'" in result.stderr
    assert "Traceback" not in result.stderr + result.stdout


def test_a_taken_port_is_refused_before_the_model_starts_loading(tiny_assets, tmp_path):
    env = {"MILLM_DATA_DIR": str(tmp_path), "MILLM_ENGINE_DEVICE": "cpu"}
    for args in (("migrate", "--noinput"), ("create_demo_assets", "--tiny-only", "--output", str(tiny_assets.root))):
        assert manage(*args, env=env, timeout=300).returncode == 0
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = manage("serve", "--port", str(port), env={**env, "AUTO_LOAD_MODEL": "tiny-llama"}, timeout=120)
    assert result.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    # the registry is as it was: the model was never started loading, so it is not failed
    status = manage(
        "shell",
        "-v",
        "0",
        "-c",
        "from registry.models import Model; print(Model.objects.get(name='tiny-llama').status)",
        env=env,
    )
    assert status.stdout.strip() == "ready", status.stderr
