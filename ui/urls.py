"""The pages (mounted at the site root) and their support routes."""

from django.urls import path, re_path

from ui import views

SAE_ID = r"(?P<sae_id>sae_[A-Za-z0-9_.-]{1,36})"

urlpatterns = [
    path("", views.page("dashboard", "Dashboard"), name="ui-dashboard"),
    path("models/", views.page("models", "Models"), name="ui-models"),
    path("saes/", views.page("saes", "SAEs", max_tokens=views.dashboard_max_tokens), name="ui-saes"),
    path("steering/", views.page("steering", "Steering"), name="ui-steering"),
    path("profiles/", views.page("profiles", "Profiles"), name="ui-profiles"),
    path("clusters/", views.page("clusters", "Clusters"), name="ui-clusters"),
    path("circuits/", views.page("circuits", "Circuits"), name="ui-circuits"),
    path("playground/", views.page("playground", "Playground"), name="ui-playground"),
    path("monitoring/", views.page("monitoring", "Monitoring"), name="ui-monitoring"),
    path("captures/", views.page("captures", "Captures"), name="ui-captures"),
    path("batches/", views.page("batches", "Batches"), name="ui-batches"),
    path("features/", views.page("features", "Features"), name="ui-features"),
    re_path(
        rf"^features/{SAE_ID}/(?P<index>[0-9]{{1,9}})/$",
        views.page("feature", "Feature", nav_key="features"),
        name="ui-feature",
    ),
    path(
        "dashboards/",
        views.page("dashboards", "Dashboards", max_tokens=views.dashboard_max_tokens),
        name="ui-dashboards",
    ),
    path(
        "experiments/",
        views.page("experiments", "Experiments", max_points=views.experiment_max_points),
        name="ui-experiments",
    ),
    re_path(rf"^ui/saes/{SAE_ID}/labels$", views.feature_labels, name="ui-feature-labels"),
    re_path(r"^static/(?P<path>.+)$", views.static, name="ui-static"),
]
