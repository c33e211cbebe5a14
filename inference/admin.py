from django.contrib import admin

from inference.models import KeyLimit, KeyUsage, StoredResponse
from inference.quotas import read_rows


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


@admin.register(KeyLimit)
class KeyLimitAdmin(admin.ModelAdmin):
    """Staff overrides of KEY_LIMITS (docs/security.md, "Quotas and usage"): a field set
    here replaces the setting's for that label; every web process reads them within
    ``inference.quotas.ROWS_REFRESH_S``, this one at once."""

    list_display = ("label", "rpm", "tpm", "concurrent", "updated_at")
    search_fields = ("label",)

    def save_model(self, request, obj, form, change) -> None:  # noqa: ANN001
        super().save_model(request, obj, form, change)
        read_rows()

    def delete_model(self, request, obj) -> None:  # noqa: ANN001
        super().delete_model(request, obj)
        read_rows()

    def delete_queryset(self, request, queryset) -> None:  # noqa: ANN001
        super().delete_queryset(request, queryset)
        read_rows()
