"""The audit log in the Django admin: read-only (nothing is added, changed or deleted by
hand; the retention prunes it)."""

from __future__ import annotations

from django.contrib import admin

from audit.models import AuditEntry


@admin.register(AuditEntry)
class AuditEntryAdmin(admin.ModelAdmin):
    list_display = ("created_at", "actor", "actor_kind", "action", "target_kind", "target_id", "target_name", "result")
    list_filter = ("action", "actor_kind", "result", "target_kind")
    search_fields = ("actor", "action", "target_id", "target_name")
    date_hierarchy = "created_at"
    readonly_fields = tuple(f.name for f in AuditEntry._meta.fields)
    actions = None

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False
