"""Fixtures for the /v1 tests: daphne on a loopback port serving the real ASGI app, a
fresh engine and admission controller for the session, the tiny models and SAEs
registered (committed, so the server's threads see them), and the official client."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

import pytest

from tests.fixtures.assets import asset_cache_dir
from tests.v1.tools_model import NAME as TOOLS_NAME
from tests.v1.live_server import live_server

V1_DIR = __file__.rsplit("/", 1)[0]
# the API keys of the ``keyed`` fixture: two inference keys and an admin key
KEYS = {"alice": "sk-alice-0123456789", "bob": "sk-bob-0123456789", "root": "sk-root-0123456789"}


def pytest_collection_modifyitems(items):
    # The server's threads must see what a test writes, so no test transaction wraps it;
    # pytest-django truncates the tables after each test instead.
    for item in items:
        if str(item.path).startswith(V1_DIR):
            item.add_marker(pytest.mark.django_db(transaction=True))


@dataclass
class V1Server:
    url: str
    client: Any  # the EmbeddedEngineClient the server uses

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    @property
    def engine(self) -> Any:
        return self.client.engine

    def wait_idle(self, timeout_s: float = 10.0) -> None:
        """Until no generation runs and every /v1 slot is free."""
        from core.runtime import runtime

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            status = self.engine.status()
            stats = runtime().admission.stats()
            if status.in_flight == 0 and stats.in_flight == 0 and stats.waiting == 0:
                return
            time.sleep(0.02)
        raise AssertionError(
            f"not idle after {timeout_s}s: engine {self.engine.status()}, admission {runtime().admission.stats()}"
        )


def _register_assets() -> None:
    from registry.models import Model
    from registry.services import demo_assets_install

    if not Model.objects.filter(name="tiny-llama").exists():
        demo_assets_install(root=asset_cache_dir(), include_demo=False)


@pytest.fixture(scope="session")
def v1_server(django_db_setup, django_db_blocker, tiny_assets) -> Any:
    from django.conf import settings
    from django.db import connections

    from core.engine_client import EmbeddedEngineClient
    from core.runtime import runtime
    from inference.admission import AdmissionController

    # float32 on CPU whatever the machine: references are computed in float32
    saved = settings.MILLM_ENGINE_DEVICE, settings.MILLM_ENGINE_DTYPE
    settings.MILLM_ENGINE_DEVICE, settings.MILLM_ENGINE_DTYPE = "cpu", "float32"
    client = EmbeddedEngineClient()
    with runtime().replaced(engine=client, admission=AdmissionController.from_settings()):
        with django_db_blocker.unblock():
            _register_assets()
        server = live_server()
        yield V1Server(server.url, client)
        server.stop()
    client.shutdown()
    settings.MILLM_ENGINE_DEVICE, settings.MILLM_ENGINE_DTYPE = saved
    connections.close_all()


@pytest.fixture(autouse=True)
def _v1_db(v1_server, transactional_db):
    """The registry rows every test expects (the previous test's were truncated)."""
    _register_assets()


def model_resident(server: V1Server, name: str) -> None:
    """Make ``name`` the resident model with no SAE attached (through the registry, as
    the management API would)."""
    from orchestration.services import model_load, sae_detach
    from registry.models import SAE, Model
    from registry.services import model_set_status

    row = Model.objects.get(name=name)
    if server.engine.status().model_id != name:
        model_load(model=row)
    elif row.status != Model.Status.LOADED:
        # the engine kept it from an earlier test; this test's fresh row says so too
        model_set_status(model=row, status=Model.Status.LOADED)
    for sae in SAE.objects.filter(status=SAE.Status.ATTACHED):
        sae_detach(sae=sae)
    server.engine.detach(None)


def attach(name: str, layer: int) -> Any:
    from orchestration.services import sae_attach
    from registry.models import SAE

    sae = SAE.objects.get(name=name)
    sae_attach(sae=sae, layer=layer)
    return sae


@pytest.fixture
def llama(v1_server):
    """tiny-llama resident, nothing attached, every slot free."""
    model_resident(v1_server, "tiny-llama")
    v1_server.wait_idle()
    yield v1_server
    v1_server.wait_idle()


@pytest.fixture
def tools_llm(v1_server, tools_model_dir):
    """The tool-calling model (``tests.v1.tools_model``) resident, every slot free."""
    from registry.models import Model
    from registry.services import model_register_local

    if not Model.objects.filter(name=TOOLS_NAME).exists():
        model_register_local(local_path=str(tools_model_dir), name=TOOLS_NAME)
    model_resident(v1_server, TOOLS_NAME)
    v1_server.wait_idle()
    yield v1_server
    v1_server.wait_idle()


@pytest.fixture
def keyed(v1_server, settings):
    """Keys on: alice and bob hold inference keys, root an admin key; a client each."""
    from openai import OpenAI

    settings.MILLM_API_KEYS = [f"alice:{KEYS['alice']}", f"bob:{KEYS['bob']}"]
    settings.MILLM_ADMIN_API_KEYS = [f"root:{KEYS['root']}"]
    clients = {
        name: OpenAI(base_url=v1_server.base_url, api_key=key, max_retries=0, timeout=60) for name, key in KEYS.items()
    }
    yield clients
    for client in clients.values():
        client.close()


@pytest.fixture
def openai_client(v1_server):
    from openai import OpenAI

    with OpenAI(base_url=v1_server.base_url, api_key="not-needed", max_retries=0, timeout=60) as client:
        yield client


@pytest.fixture
def admission(v1_server):
    """Swap in a controller with other limits for one test: ``admission(slots, pending)``."""
    from contextlib import ExitStack

    from core.runtime import runtime
    from inference.admission import AdmissionController

    with ExitStack() as stack:

        def make(slots: int = 1, pending: int = 0, **kwargs: Any) -> AdmissionController:
            controller = AdmissionController(slots=slots, max_pending=pending, **kwargs)
            stack.enter_context(runtime().replaced(admission=controller))
            return controller

        yield make


def in_thread(fn, *args, **kwargs) -> threading.Thread:
    thread = threading.Thread(target=fn, args=args, kwargs=kwargs, daemon=True)
    thread.start()
    return thread
