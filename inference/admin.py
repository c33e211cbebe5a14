from django.contrib import admin

from inference.models import StoredResponse


@admin.register(StoredResponse)
class StoredResponseAdmin(admin.ModelAdmin):
    list_display = ("id", "owner", "status", "model", "background", "previous_response_id", "bytes", "created_at")
    list_filter = ("status", "background")
    readonly_fields = [f.name for f in StoredResponse._meta.fields]

    def has_add_permission(self, request) -> bool:  # noqa: ANN001
        return False

    def has_change_permission(self, request, obj=None) -> bool:  # noqa: ANN001
        return False
