"""Monitoring admin: the configuration and the recorded history (read-only rows)."""

from __future__ import annotations

from django.contrib import admin

from core.errors import MillmError
from core.runtime import runtime
from monitoring.models import (
    ActivationRecord,
    MonitoringConfig,
    Probe,
    ProbeVerdict,
    SensingArm,
)
from monitoring.probes import probe_arm


@admin.register(MonitoringConfig)
class MonitoringConfigAdmin(admin.ModelAdmin):
    list_display = ("__str__", "sae_id", "layer", "history_size", "top_k", "positions", "updated_at")
    readonly_fields = (
        "sae_id",
        "layer",
        "features",
        "history_size",
        "top_k",
        "positions",
        "statistics_since",
        "enabled",
        "updated_at",
    )

    def has_add_permission(self, request) -> bool:
        return False


@admin.register(ActivationRecord)
class ActivationRecordAdmin(admin.ModelAdmin):
    list_display = ("request_id", "token_position", "sae_id", "layer", "owner", "timestamp")
    list_filter = ("owner",)
    search_fields = ("request_id",)
    readonly_fields = (
        "timestamp",
        "request_id",
        "sae_id",
        "layer",
        "token_position",
        "completion_token_index",
        "activations",
        "top_k",
        "owner",
    )

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False


@admin.register(Probe)
class ProbeAdmin(admin.ModelAdmin):
    """Probes are created through /api/probes (parsed and checked there); the admin shows
    them and arms or disarms the validated ones through the same service."""

    list_display = ("name", "id", "owner", "basis", "sae_id", "layer", "threshold", "positions", "armed")
    list_filter = ("owner",)
    search_fields = ("name", "id")
    readonly_fields = (
        "id",
        "name",
        "owner",
        "basis",
        "sae_id",
        "layer",
        "features",
        "weights",
        "bias",
        "threshold",
        "norm_mean",
        "norm_std",
        "positions",
        "validation",
        "armed",
        "created_at",
        "updated_at",
    )
    actions = ["arm", "disarm"]

    def has_add_permission(self, request) -> bool:
        return False

    def _set(self, request, queryset, armed: bool) -> None:
        status = runtime().engine.status()
        for row in queryset:
            try:
                probe_arm(ref=row.id, armed=armed, status=status)
            except MillmError as exc:
                self.message_user(request, f"{row.name}: {exc.message}", level="error")

    @admin.action(description="Arm the selected probes")
    def arm(self, request, queryset) -> None:
        self._set(request, queryset, True)

    @admin.action(description="Disarm the selected probes")
    def disarm(self, request, queryset) -> None:
        self._set(request, queryset, False)


@admin.register(ProbeVerdict)
class ProbeVerdictAdmin(admin.ModelAdmin):
    list_display = ("request_id", "name", "scored", "score", "verdict", "owner", "timestamp")
    search_fields = ("request_id", "name")

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False


admin.site.register(SensingArm)
