"""Routes of the registry under /api: models, SAEs (lifecycle and attachments) and jobs.

SAE ids always start with ``sae_``, so ``/api/saes/steering…`` (the steering app's routes)
never reads as an SAE id whatever order the routes are included in.
"""

from django.urls import path, re_path

from registry import apis, vector_apis

SAE_ID = r"(?P<sae_id>sae_[A-Za-z0-9_.-]{1,36})"

urlpatterns = [
    path("models", apis.ModelListCreateApi.as_view(), name="models"),
    path("models/preview", apis.ModelPreviewApi.as_view(), name="model-preview"),
    path("models/<int:model_id>", apis.ModelDetailApi.as_view(), name="model-detail"),
    path("models/<int:model_id>/lock", apis.ModelLockApi.as_view(), name="model-lock"),
    path("models/<int:model_id>/unlock", apis.ModelUnlockApi.as_view(), name="model-unlock"),
    path("models/<int:model_id>/cancel", apis.ModelCancelApi.as_view(), name="model-cancel"),
    path("saes", apis.SAEListApi.as_view(), name="saes"),
    path("saes/download", apis.SAEDownloadApi.as_view(), name="sae-download"),
    path("saes/preview", apis.SAEPreviewApi.as_view(), name="sae-preview"),
    path("saes/attachments", apis.AttachmentListApi.as_view(), name="sae-attachments"),
    re_path(rf"^saes/{SAE_ID}$", apis.SAEDetailApi.as_view(), name="sae-detail"),
    re_path(rf"^saes/{SAE_ID}/cancel$", apis.SAECancelApi.as_view(), name="sae-cancel"),
    path("vectors", vector_apis.VectorListCreateApi.as_view(), name="vectors"),
    re_path(
        rf"^vectors/{SAE_ID.replace('sae_id', 'vector_id')}$",
        vector_apis.VectorDetailApi.as_view(),
        name="vector-detail",
    ),
    path("jobs", apis.JobListApi.as_view(), name="jobs"),
    path("jobs/<int:job_id>", apis.JobDetailApi.as_view(), name="job-detail"),
    path("jobs/<int:job_id>/cancel", apis.JobCancelApi.as_view(), name="job-cancel"),
]
