"""/api/audit (admin keys only)."""

from django.urls import path

from audit import apis

urlpatterns = [
    path("audit", apis.AuditListApi.as_view(), name="audit-list"),
]
