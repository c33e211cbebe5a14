"""inference's one /api route: scoring inputs with probes runs through the engine as a
/v1 request does, which only this layer (above monitoring) may reach."""

from django.urls import path

from inference import probe_apis

urlpatterns = [
    path("probes/score", probe_apis.probe_score_api, name="probes-score"),
]
