from django.urls import path

from leases import apis

urlpatterns = [
    path("models/<int:model_id>/lease", apis.ModelLeaseApi.as_view(), name="model-lease"),
    path("models/<int:model_id>/lease/renew", apis.ModelLeaseRenewApi.as_view(), name="model-lease-renew"),
]
