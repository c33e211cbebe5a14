"""The explainer with the server's own /v1 as its endpoint (EXPLAINER_BASE_URL pointing at
the live server, EXPLAINER_MODEL the resident tiny-llama): the stored explanation is the
answer the same chat request gets from /v1 directly (its first line, whitespace collapsed),
with its provenance. (The tiny model's answer is no English; the fake explainer of
tests/features/test_explanations.py checks the prompt's content and the scoring.)"""

from __future__ import annotations

from django.utils import timezone
from rest_framework.test import APIClient

from features import explainer
from features.models import DashboardRun, FeatureDashboard
from registry.labels import labels_for
from registry.models import SAE, FeatureExplanation


def test_the_servers_own_v1_explains_a_feature(llama, openai_client, settings):
    sae = SAE.objects.get(name="tiny-llama-L1-relu")
    run = DashboardRun.objects.create(
        sae=sae, layer=1, token_budget=100, status="completed", complete=True, finished_at=timezone.now()
    )
    top = [
        {"context": 1, "tokens": [" the", " sea", " is"], "activations": [0.0, 2.0, 0.1], "max_position": 1,
         "max_activation": 2.0},
        {"context": 2, "tokens": [" blue", " ocean"], "activations": [0.3, 1.5], "max_position": 1,
         "max_activation": 1.5},
    ]  # fmt: skip
    FeatureDashboard.objects.create(run=run, sae=sae, index=4, count=2, max=2.0, top_contexts=top)
    settings.EXPLAINER_BASE_URL, settings.EXPLAINER_MODEL = llama.base_url, "tiny-llama"
    settings.EXPLAINER_TIMEOUT_S = 60

    response = APIClient().post(f"/api/saes/{sae.id}/explanations/generate", {"features": [4]}, format="json")
    data = response.json()["data"]
    assert response.status_code == 200, response.content
    assert data["model"] == "tiny-llama"

    # the same request, sent by the test: its first non-empty line is the explanation
    direct = openai_client.chat.completions.create(
        model="tiny-llama",
        messages=[
            {"role": "system", "content": explainer.SYSTEM},
            {"role": "user", "content": explainer.explain_prompt(top)},
        ],
        temperature=0,
        max_tokens=60,
    )
    text = direct.choices[0].message.content or ""
    line = next((ln for ln in text.splitlines() if ln.strip()), "")
    expected = " ".join(line.split()).strip(" \"'`")[:200].rstrip()
    assert expected  # positive control: the model answered something
    (result,) = data["results"]
    assert result["status"] == "stored", result
    stored = FeatureExplanation.objects.get(sae=sae, index=4)
    assert stored.description == result["explanation"]["description"] == expected
    assert stored.source == "explainer" and stored.explainer_model == "tiny-llama"
    assert stored.provenance["base_url"] == llama.base_url and stored.provenance["contexts"] == [1, 2]
    assert stored.provenance["run_id"] == run.id
    assert labels_for(sae.id, [4]) == {4: stored.description}
