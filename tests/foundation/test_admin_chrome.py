"""What every admin page carries: the UI's icon (so the browser does not ask for a
/favicon.ico that is not there), and model names spelled right in the index."""

from __future__ import annotations

import re

import pytest

from registry import services

pytestmark = pytest.mark.django_db

ICON = '<link rel="icon" href="/static/ui/favicon.svg" type="image/svg+xml">'


def test_every_kind_of_admin_page_links_the_icon(staff_client, client, tiny_assets):
    model = services.model_register_local(local_path=str(tiny_assets.models["tiny-llama"].path), name="tiny-llama")
    pages = [
        "/admin/",
        "/admin/registry/model/",
        f"/admin/registry/model/{model.pk}/change/",
        f"/admin/registry/model/{model.pk}/delete/",
        "/admin/registry/model/add/",
        "/admin/steering/profile/import/",
        "/admin/batches/batch/",
    ]
    for url in pages:
        response = staff_client.get(url)
        assert response.status_code == 200, url
        page = response.content.decode()
        assert page.count(ICON) == 1, url
        assert "<title>" in page and "miLLM admin</title>" in page, url  # the title kept
    login = client.get("/admin/login/").content.decode()
    assert ICON in login and "miLLM administration" in login
    # the icon it names is served
    icon = client.get("/static/ui/favicon.svg")
    assert icon.status_code == 200


def test_the_index_says_batches(staff_client):
    page = staff_client.get("/admin/").content.decode()
    names = re.findall(r'<a href="/admin/batches/[a-z]+/">([^<]+)</a>', page)
    assert names == ["Batches", "Files"]
    assert "Batchs" not in page
