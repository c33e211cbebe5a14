"""Lease admin: read-only rows (the id is never stored, so there is nothing to edit), and
an action that ends a live lease without its id."""

from __future__ import annotations

from django.contrib import admin, messages

from leases import services
from leases.models import Lease


@admin.register(Lease)
class LeaseAdmin(admin.ModelAdmin):
    list_display = ("model", "holder", "acquired_at", "expires_at", "ended_at", "end_reason")
    list_filter = ("end_reason",)
    search_fields = ("holder", "reason", "model__name")
    readonly_fields = (
        "model",
        "holder",
        "reason",
        "ttl_seconds",
        "acquired_at",
        "renewed_at",
        "expires_at",
        "ended_at",
        "end_reason",
    )
    exclude = ("id_hash",)
    actions = ("revoke",)

    def has_add_permission(self, request) -> bool:
        return False  # a lease is granted through the API, which returns its id once

    def get_queryset(self, request):
        services.lease_expire_due()
        return super().get_queryset(request).select_related("model")

    @admin.action(description="End selected live leases (revoked)")
    def revoke(self, request, queryset):
        done = 0
        for lease in queryset.filter(ended_at__isnull=True):
            services.lease_revoke(lease=lease)
            done += 1
        self.message_user(request, f"Ended {done} lease(s).", level=messages.SUCCESS)
