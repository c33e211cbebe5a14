"""Routes of engine orchestration under /api: load and unload, attach, detach, the
attachment status and the compatibility dry run."""

from django.urls import path, re_path

from orchestration import apis
from registry.urls import SAE_ID

urlpatterns = [
    path("models/<int:model_id>/load", apis.ModelLoadApi.as_view(), name="model-load"),
    path("models/<int:model_id>/unload", apis.ModelUnloadApi.as_view(), name="model-unload"),
    path("engines", apis.EngineListApi.as_view(), name="engine-list"),
    path("saes/attachment", apis.AttachmentStatusApi.as_view(), name="sae-attachment"),
    path("saes/attach-set", apis.AttachSetApi.as_view(), name="sae-attach-set"),
    re_path(rf"^saes/{SAE_ID}/compatibility$", apis.SAECompatibilityApi.as_view(), name="sae-compatibility"),
    re_path(rf"^saes/{SAE_ID}/attach$", apis.SAEAttachApi.as_view(), name="sae-attach"),
    re_path(rf"^saes/{SAE_ID}/detach$", apis.SAEDetachApi.as_view(), name="sae-detach"),
    path("vectors/compute", apis.VectorComputeApi.as_view(), name="vector-compute"),
    path("circuits/<str:circuit_id>/activate", apis.CircuitActivateApi.as_view(), name="circuit-activate"),
]
