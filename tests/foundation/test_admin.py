"""Admin pages: staff see the registry, anonymous users are sent to the login page, and
actions go through the same services (refusals included)."""

from __future__ import annotations

import pytest

from registry import job_lifecycle, services
from registry.models import Job, Model

pytestmark = pytest.mark.django_db

PAGES = [
    "/admin/",
    "/admin/registry/model/",
    "/admin/registry/sae/",
    "/admin/registry/job/",
    "/admin/registry/model/?status__exact=ready&locked__exact=0",
    "/admin/registry/sae/?q=tiny",
]


@pytest.fixture
def registered(tiny_assets):
    models = [services.model_register_local(local_path=str(a.path), name=a.name) for a in tiny_assets.models.values()]
    saes = [services.sae_register_local(local_path=str(a.path), name=a.name) for a in tiny_assets.saes.values()]
    job = job_lifecycle.job_create(kind=Job.Kind.MODEL_LOAD, target="tiny-llama", model=models[0])
    return models, saes, job


@pytest.mark.parametrize("url", PAGES)
def test_anonymous_is_redirected_to_login(client, url):
    response = client.get(url)
    assert response.status_code == 302
    assert response["Location"].startswith("/admin/login/")


def test_staff_sees_models_saes_and_jobs(staff_client, registered):
    models, saes, job = registered
    for url in PAGES:
        assert staff_client.get(url).status_code == 200, url
    listing = staff_client.get("/admin/registry/model/").content.decode()
    for model in models:
        assert model.name in listing
    sae_listing = staff_client.get("/admin/registry/sae/").content.decode()
    for sae in saes:
        assert sae.id in sae_listing
    detail = staff_client.get(f"/admin/registry/model/{models[0].pk}/change/")
    assert detail.status_code == 200
    assert models[0].architecture in detail.content.decode()
    assert staff_client.get(f"/admin/registry/job/{job.pk}/change/").status_code == 200


def test_status_fields_are_read_only(staff_client, registered):
    model = registered[0][0]
    page = staff_client.get(f"/admin/registry/model/{model.pk}/change/").content.decode()
    assert 'name="status"' not in page and 'name="locked"' not in page
    assert 'name="name"' in page


def test_lock_action_and_refused_delete(staff_client, registered):
    model = registered[0][0]
    response = staff_client.post(
        "/admin/registry/model/", {"action": "lock_models", "_selected_action": [model.pk]}, follow=True
    )
    assert response.status_code == 200
    assert Model.objects.get(pk=model.pk).locked
    response = staff_client.post(
        "/admin/registry/model/", {"action": "delete_models", "_selected_action": [model.pk]}, follow=True
    )
    assert "MODEL_LOCKED" in response.content.decode()
    assert Model.objects.filter(pk=model.pk).exists()
    staff_client.post("/admin/registry/model/", {"action": "unlock_models", "_selected_action": [model.pk]})
    staff_client.post("/admin/registry/model/", {"action": "delete_models", "_selected_action": [model.pk]})
    assert not Model.objects.filter(pk=model.pk).exists()


def test_cancel_job_action(staff_client, registered):
    job = registered[2]
    staff_client.post("/admin/registry/job/", {"action": "cancel_jobs", "_selected_action": [job.pk]})
    assert Job.objects.get(pk=job.pk).status == "cancelled"


def test_root_is_the_dashboard_and_links_to_the_admin(client):
    response = client.get("/")
    assert response.status_code == 200
    page = response.content.decode()
    assert "<h1>Dashboard</h1>" in page
    assert 'href="/admin/"' in page
