"""A property-based run over every documented /api operation (schemathesis, generating
requests from the OpenAPI schema the server publishes at /api/schema): whatever it sends,
the server answers without a 5xx. Bounded: a few examples per operation, no deadline, no
example database on disk. The stand-in hub answers the hub calls and the embedded engine
answers the engine calls, so a 503 here would be a real fault (readiness is ready: no
AUTO_LOAD_MODEL, no model swap in progress)."""

from __future__ import annotations

import pytest
import schemathesis
from django.core.wsgi import get_wsgi_application
from hypothesis import HealthCheck
from hypothesis import settings as hypothesis_settings

APP = get_wsgi_application()
schema = schemathesis.openapi.from_wsgi("/api/schema", APP)


def test_the_schema_documents_the_api():
    paths = set(schema.raw_schema["paths"])
    for path in (
        "/api/models",
        "/api/models/{model_id}/load",
        "/api/saes/attach-set",
        "/api/saes/{sae_id}/compatibility",
        "/api/health/ready",
        "/api/health/circuits/{name}/reset",
        "/api/jobs/{job_id}",
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/embeddings",
        "/v1/models",
        "/v1/files",
        "/v1/files/{file_id}/content",
        "/v1/batches",
        "/v1/batches/{batch_id}/cancel",
        "/v1/probes/score",
    ):
        assert path in paths, path
    assert schema.raw_schema["components"]["securitySchemes"]["bearerAuth"]["scheme"] == "bearer"
    chat = schema.raw_schema["paths"]["/v1/chat/completions"]["post"]
    body = chat["requestBody"]["content"]["application/json"]["schema"]
    request = schema.raw_schema["components"]["schemas"][body["$ref"].rsplit("/", 1)[1]]
    assert {"messages", "steering", "return_sae_activations"} <= set(request["properties"])


def test_browsable_docs(api_client_docs):
    response = api_client_docs.get("/api/docs")
    assert response.status_code == 200 and b"swagger-ui" in response.content.lower()
    # served from the sidecar package, not a CDN: works with no network
    assert b"cdn.jsdelivr" not in response.content


@pytest.fixture
def api_client_docs():
    from django.test import Client

    return Client()


@pytest.fixture
def keep_test_connection():
    """Requests go through the WSGI handler, which closes database connections at their
    start and end; inside the test's transaction that would close it under the test. The
    Django test client disconnects the same two receivers."""
    from django.core import signals
    from django.db import close_old_connections

    signals.request_started.disconnect(close_old_connections)
    signals.request_finished.disconnect(close_old_connections)
    yield
    signals.request_started.connect(close_old_connections)
    signals.request_finished.connect(close_old_connections)


@pytest.mark.django_db
@schema.include(path_regex=r"^/api/").parametrize()
@hypothesis_settings(max_examples=6, deadline=None, database=None, suppress_health_check=list(HealthCheck))
def test_no_server_errors(case, hub, engine_client, keep_test_connection):
    response = case.call()
    assert response.status_code < 500, (
        f"{case.method} {case.formatted_path} -> {response.status_code}: {response.text[:500]}"
    )
