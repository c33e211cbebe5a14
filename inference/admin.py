import threading

from django.contrib import admin
from django.db import transaction

from audit.services import record
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

    # each change is in the audit log (docs/security.md, "Audit log"), the admin user as actor

    def save_model(self, request, obj, form, change) -> None:  # noqa: ANN001
        super().save_model(request, obj, form, change)
        _recorded("key_limit.update" if change else "key_limit.create", obj)
        _read_rows_after_commit()

    def delete_model(self, request, obj) -> None:  # noqa: ANN001
        pk = obj.pk
        super().delete_model(request, obj)
        _recorded("key_limit.delete", obj, pk)
        _read_rows_after_commit()

    def delete_queryset(self, request, queryset) -> None:  # noqa: ANN001
        rows = [(row, row.pk) for row in queryset]
        super().delete_queryset(request, queryset)
        for row, pk in rows:
            _recorded("key_limit.delete", row, pk)
        _read_rows_after_commit()


def _read_rows_after_commit() -> None:
    """This process reads the rows again once the admin's transaction committed, on a
    thread of its own: ``read_rows`` closes its thread's connection, which inside the
    admin's atomic block broke the save (500, nothing saved)."""
    transaction.on_commit(
        lambda: threading.Thread(target=read_rows, name="millm-key-limits-saved", daemon=True).start()
    )


def _recorded(action: str, row: KeyLimit, pk: object = None) -> None:
    fields = {name: getattr(row, name) for name in ("rpm", "tpm", "concurrent")}
    record(action, target=("key_limit", pk if pk is not None else row.pk, row.label), params=fields)
