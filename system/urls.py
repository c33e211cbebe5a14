"""Everything under /api owned by the site itself: health, schema and docs. Unknown /api
paths get the envelope's 404 from ``core.api.ApiFallbackMiddleware``, so apps can
add their own /api routes in any order."""

from django.urls import path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

from system import health

urlpatterns = [
    path("health", health.LivenessView.as_view(), name="health"),
    path("health/ready", health.ReadinessView.as_view(), name="health-ready"),
    path("health/detailed", health.DetailedHealthView.as_view(), name="health-detailed"),
    path("health/inference", health.InferenceHealthView.as_view(), name="health-inference"),
    path("health/gpus", health.GpusView.as_view(), name="health-gpus"),
    path("health/metrics", health.MetricsView.as_view(), name="health-metrics"),
    path("health/metrics/prometheus", health.PrometheusView.as_view(), name="health-prometheus"),
    path("health/circuits", health.CircuitsView.as_view(), name="health-circuits"),
    path("health/circuits/<str:name>/reset", health.CircuitResetView.as_view(), name="health-circuit-reset"),
    path("health/version", health.VersionView.as_view(), name="health-version"),
    path("schema", SpectacularAPIView.as_view(), name="api-schema"),
    path("docs", SpectacularSwaggerView.as_view(url_name="api-schema"), name="api-docs"),
]
