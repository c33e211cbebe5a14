from django.contrib import admin
from django.urls import include, path

from system.access_admin import access_view

admin.site.site_header = "miLLM administration"
admin.site.site_title = "miLLM admin"

urlpatterns = [
    # the configured keys by label and kind, and the boundary's settings (staff only)
    path("admin/access/", admin.site.admin_view(access_view), name="admin-access"),
    path("admin/", admin.site.urls),
    # the Files and Batch API first: inference's last route answers every unknown /v1 path
    path("v1/", include("batches.urls")),
    path("v1/", include("inference.urls")),
    path("api/", include("system.urls")),
    path("api/", include("registry.urls")),
    # feature dashboards, search and explanations: saes/<SAE_ID>/dashboards|features|explanations
    path("api/", include("features.urls")),
    # steering experiments: experiments (sweep, calibrate, fidelity, attribution, <id>...)
    path("api/", include("experiments.urls")),
    path("api/", include("orchestration.urls")),
    path("api/", include("steering.urls")),
    # before monitoring's probes/<ref>: /api/probes/score runs on the engine
    path("api/", include("inference.api_urls")),
    path("api/", include("monitoring.urls")),
    path("api/", include("leases.urls")),
    path("api/", include("audit.urls")),
    # the browser UI: the dashboard at the root, the other pages and /static beside it
    path("", include("ui.urls")),
]
