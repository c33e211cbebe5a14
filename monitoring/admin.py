"""Monitoring admin: the configuration and the recorded history (read-only rows)."""

from __future__ import annotations

from django.contrib import admin

from monitoring.models import ActivationRecord, MonitoringConfig


@admin.register(MonitoringConfig)
class MonitoringConfigAdmin(admin.ModelAdmin):
    list_display = ("__str__", "sae_id", "layer", "history_size", "top_k", "positions",
                    "updated_at")
    readonly_fields = ("sae_id", "layer", "features", "history_size", "top_k", "positions",
                       "statistics_since", "enabled", "updated_at")

    def has_add_permission(self, request) -> bool:
        return False


@admin.register(ActivationRecord)
class ActivationRecordAdmin(admin.ModelAdmin):
    list_display = ("request_id", "token_position", "sae_id", "layer", "timestamp")
    search_fields = ("request_id",)
    readonly_fields = ("timestamp", "request_id", "sae_id", "layer", "token_position",
                       "completion_token_index", "activations", "top_k")

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False
