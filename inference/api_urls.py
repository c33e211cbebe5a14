"""inference's /api routes: scoring inputs with probes runs through the engine as a /v1
request does, which only this layer (above monitoring) may reach; usage per key is what
/v1 recorded (``inference.usage``)."""

from django.urls import path

from inference import probe_apis, usage_apis

urlpatterns = [
    path("probes/score", probe_apis.probe_score_api, name="probes-score"),
    path("usage", usage_apis.UsageApi.as_view(), name="usage"),
]
