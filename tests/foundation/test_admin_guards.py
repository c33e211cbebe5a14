"""Admin pages that must refuse rather than break or drift: the object's own delete page
for a row a service will not delete, and the edit and add forms of a model, which must
not say what the engine does not hold nor take what the API's registration refuses."""

from __future__ import annotations

import pytest
from django.contrib.admin.models import DELETION, LogEntry
from django.contrib.auth import get_user_model
from django.test import Client

from registry import services
from registry.models import SAE, Model

pytestmark = pytest.mark.django_db


@pytest.fixture
def staff_client():
    user = get_user_model().objects.create_superuser("root", "", "pw-for-tests")
    client = Client()
    client.force_login(user)
    return client


@pytest.fixture
def model(tiny_assets):
    asset = tiny_assets.models["tiny-llama"]
    return services.model_register_local(local_path=str(asset.path), name=asset.name)


@pytest.fixture
def sae(tiny_assets):
    asset = next(iter(tiny_assets.saes.values()))
    return services.sae_register_local(local_path=str(asset.path), name=asset.name)


def _messages(response) -> list[str]:
    return [str(m) for m in response.context["messages"]]


# --- the delete page -------------------------------------------------------------------

@pytest.mark.parametrize("state, code", [({"locked": True}, "MODEL_LOCKED"),
                                         ({"status": "loaded"}, "MODEL_LOADED"),
                                         ({"status": "loading"}, "MODEL_LOADED")])
def test_delete_page_refuses_a_locked_or_resident_model(staff_client, model, state, code):
    Model.objects.filter(pk=model.pk).update(**state)
    url = f"/admin/registry/model/{model.pk}/delete/"
    assert staff_client.get(url).status_code == 200  # the confirmation page
    response = staff_client.post(url, {"post": "yes"}, follow=True)
    assert response.status_code == 200
    # back on the model's own page, with the refusal the bulk action gives
    assert response.redirect_chain[-1][0] == f"/admin/registry/model/{model.pk}/change/"
    [message] = _messages(response)
    assert message.startswith("tiny-llama: Model 'tiny-llama' is ") and f"({code})" in message
    # the admin capitalises the first letter of a message
    assert message[0].upper() + message[1:] in response.content.decode().replace("&#x27;", "'")
    assert Model.objects.filter(pk=model.pk).exists()
    assert not LogEntry.objects.filter(action_flag=DELETION).exists()


def test_delete_page_refuses_an_attached_sae(staff_client, sae):
    SAE.objects.filter(pk=sae.pk).update(status=SAE.Status.ATTACHED)
    response = staff_client.post(f"/admin/registry/sae/{sae.pk}/delete/", {"post": "yes"},
                                 follow=True)
    assert response.status_code == 200
    [message] = _messages(response)
    assert "is attached; detach it first (SAE_ALREADY_ATTACHED)" in message
    assert SAE.objects.filter(pk=sae.pk).exists()


def test_delete_page_still_deletes_what_may_go(staff_client, model):
    response = staff_client.post(f"/admin/registry/model/{model.pk}/delete/", {"post": "yes"},
                                 follow=True)
    assert response.status_code == 200
    assert any("was deleted successfully" in m for m in _messages(response))
    assert not Model.objects.filter(pk=model.pk).exists()
    assert LogEntry.objects.filter(action_flag=DELETION).count() == 1
