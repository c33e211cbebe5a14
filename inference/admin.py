from django.contrib import admin

from inference.models import KeyUsage, StoredResponse


@admin.register(StoredResponse)
class StoredResponseAdmin(admin.ModelAdmin):
    list_display = ("id", "owner", "status", "model", "background", "previous_response_id", "bytes", "created_at")
    list_filter = ("status", "background")
    readonly_fields = [f.name for f in StoredResponse._meta.fields]

    def has_add_permission(self, request) -> bool:  # noqa: ANN001
        return False

    def has_change_permission(self, request, obj=None) -> bool:  # noqa: ANN001
        return False


@admin.register(KeyUsage)
class KeyUsageAdmin(admin.ModelAdmin):
    """Read-only: rows are what /v1 recorded (``inference.usage``)."""

    list_display = ("owner", "day", "requests", "prompt_tokens", "completion_tokens", "steered_requests", "updated_at")
    list_filter = ("day",)
    search_fields = ("owner",)
    date_hierarchy = "day"
    readonly_fields = [f.name for f in KeyUsage._meta.fields]

    def has_add_permission(self, request) -> bool:  # noqa: ANN001
        return False

    def has_change_permission(self, request, obj=None) -> bool:  # noqa: ANN001
        return False

    def has_delete_permission(self, request, obj=None) -> bool:  # noqa: ANN001
        return False
