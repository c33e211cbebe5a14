"""Routes of the steering experiments under /api (docs/api.md, "Experiments"). Run ids
start with ``exp_``, so ``/api/experiments/sweep`` and the other fixed routes never read as
one. W2's ``experiments/fidelity`` and W4's ``experiments/attribution`` go beside the
fixed routes here; ``saes/<SAE_ID>/fidelity`` too."""

from django.urls import re_path

from core.run_apis import run_paths
from experiments import apis, attribution_apis, fidelity_apis
from registry.urls import SAE_ID

RUN_ID = r"(?P<run_id>exp_[A-Za-z0-9]{1,36})"

urlpatterns = [
    re_path(r"^experiments$", apis.ExperimentListApi.as_view(), name="experiments"),
    re_path(r"^experiments/sweep$", apis.SweepStartApi.as_view(), name="experiments-sweep"),
    re_path(r"^experiments/calibrate$", apis.CalibrateStartApi.as_view(), name="experiments-calibrate"),
    re_path(r"^experiments/fidelity$", fidelity_apis.FidelityStartApi.as_view(), name="experiments-fidelity"),
    re_path(r"^experiments/attribution$", attribution_apis.AttributionApi.as_view(), name="experiments-attribution"),
    re_path(rf"^saes/{SAE_ID}/fidelity$", fidelity_apis.SaeFidelityApi.as_view(), name="sae-fidelity"),
    *run_paths(
        "experiments",
        RUN_ID,
        "experiment",
        {
            "": apis.ExperimentDetailApi,
            "points": apis.ExperimentPointsApi,
            "download": apis.ExperimentDownloadApi,
            "cancel": apis.ExperimentCancelApi,
        },
    ),
]
