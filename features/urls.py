"""Routes of feature dashboards, search and explanations under /api (docs/api.md, "Feature
dashboards"). SAE ids match registry's ``SAE_ID`` (they start with ``sae_``), so
``/api/saes/steering…`` and the other fixed ``saes/…`` routes never read as one."""

from django.urls import re_path

from core.run_apis import run_paths
from features import apis, explanation_apis
from registry.urls import SAE_ID

RUN_ID = r"(?P<run_id>[A-Za-z0-9_.-]{1,64})"
# any integer, negative included: one outside the SAE is refused as INVALID_FEATURE_INDEX
INDEX = r"(?P<index>-?[0-9]{1,20})"

urlpatterns = [
    re_path(rf"^saes/{SAE_ID}/dashboards$", apis.DashboardListCreateApi.as_view(), name="sae-dashboards"),
    *run_paths("dashboards", RUN_ID, "dashboard", {"": apis.DashboardDetailApi, "cancel": apis.DashboardCancelApi}),
    re_path(rf"^saes/{SAE_ID}/features$", apis.FeatureSearchApi.as_view(), name="sae-features"),
    re_path(rf"^saes/{SAE_ID}/features/{INDEX}$", apis.FeatureDetailApi.as_view(), name="sae-feature"),
    # explanations (labels): features/explanation_apis.py
    re_path(rf"^saes/{SAE_ID}/explanations$", explanation_apis.ExplanationListApi.as_view(), name="sae-explanations"),
    re_path(
        rf"^saes/{SAE_ID}/explanations/import$",
        explanation_apis.ExplanationImportApi.as_view(),
        name="sae-explanations-import",
    ),
    re_path(
        rf"^saes/{SAE_ID}/explanations/export$",
        explanation_apis.ExplanationExportApi.as_view(),
        name="sae-explanations-export",
    ),
    re_path(
        rf"^saes/{SAE_ID}/explanations/generate$",
        explanation_apis.ExplanationGenerateApi.as_view(),
        name="sae-explanations-generate",
    ),
    re_path(
        rf"^saes/{SAE_ID}/explanations/(?P<explanation_id>[0-9]{{1,18}})$",
        explanation_apis.ExplanationDetailApi.as_view(),
        name="sae-explanation",
    ),
]
