"""Routes of the steering app under /api. ``saes/steering…`` never reads as an SAE id: the
registry's SAE routes only match ids that start with ``sae_``."""

from django.urls import path

from steering import apis, document_apis

urlpatterns = [
    path("saes/steering", apis.SteeringApi.as_view(), name="steering"),
    path("saes/steering/batch", apis.SteeringBatchApi.as_view(), name="steering-batch"),
    path("saes/steering/enable", apis.SteeringEnableApi.as_view(), name="steering-enable"),
    path("saes/steering/disable", apis.SteeringDisableApi.as_view(), name="steering-disable"),
    path("saes/steering/<int:feature_idx>", apis.SteeringFeatureApi.as_view(), name="steering-feature"),
    path("profiles", apis.ProfileListApi.as_view(), name="profiles"),
    path("profiles/save-current", apis.ProfileSaveCurrentApi.as_view(), name="profile-save-current"),
    path("profiles/active", apis.ProfileActiveApi.as_view(), name="profile-active"),
    path("profiles/import", apis.ProfileImportApi.as_view(), name="profile-import"),
    path("profiles/<str:profile_id>", apis.ProfileDetailApi.as_view(), name="profile-detail"),
    path("profiles/<str:profile_id>/activate", apis.ProfileActivateApi.as_view(), name="profile-activate"),
    path("profiles/<str:profile_id>/deactivate", apis.ProfileDeactivateApi.as_view(), name="profile-deactivate"),
    path("profiles/<str:profile_id>/export", apis.ProfileExportApi.as_view(), name="profile-export"),
    path("clusters", document_apis.ClusterListApi.as_view(), name="clusters"),
    path("clusters/import", document_apis.ClusterImportApi.as_view(), name="cluster-import"),
    path("clusters/active", document_apis.ClusterActiveApi.as_view(), name="cluster-active"),
    path(
        "clusters/active/intensity", document_apis.ClusterActiveIntensityApi.as_view(), name="cluster-active-intensity"
    ),
    path("clusters/<str:cluster_id>", document_apis.ClusterDetailApi.as_view(), name="cluster-detail"),
    path("clusters/<str:cluster_id>/activate", document_apis.ClusterActivateApi.as_view(), name="cluster-activate"),
    path(
        "clusters/<str:cluster_id>/deactivate", document_apis.ClusterDeactivateApi.as_view(), name="cluster-deactivate"
    ),
    path("clusters/<str:cluster_id>/intensity", document_apis.ClusterIntensityApi.as_view(), name="cluster-intensity"),
    path("clusters/<str:cluster_id>/export", document_apis.ClusterExportApi.as_view(), name="cluster-export"),
    path("circuits", document_apis.CircuitListApi.as_view(), name="circuits"),
    path("circuits/import", document_apis.CircuitImportApi.as_view(), name="circuit-import"),
    path("circuits/active", document_apis.CircuitActiveApi.as_view(), name="circuit-active"),
    path(
        "circuits/active/intensity", document_apis.CircuitActiveIntensityApi.as_view(), name="circuit-active-intensity"
    ),
    path("circuits/claims", document_apis.CircuitClaimsApi.as_view(), name="circuit-claims"),
    path("circuits/<str:circuit_id>", document_apis.CircuitDetailApi.as_view(), name="circuit-detail"),
    path(
        "circuits/<str:circuit_id>/deactivate", document_apis.CircuitDeactivateApi.as_view(), name="circuit-deactivate"
    ),
    path("circuits/<str:circuit_id>/intensity", document_apis.CircuitIntensityApi.as_view(), name="circuit-intensity"),
    path("circuits/<str:circuit_id>/export", document_apis.CircuitExportApi.as_view(), name="circuit-export"),
]
