from django.contrib import admin

from experiments.models import ExperimentRun


@admin.register(ExperimentRun)
class ExperimentRunAdmin(admin.ModelAdmin):
    list_display = ("id", "kind", "owner", "status", "done", "total", "partial", "created_at")
    list_filter = ("kind", "status")
    search_fields = ("id", "owner", "sae_id")
    readonly_fields = [f.name for f in ExperimentRun._meta.fields]

    def has_add_permission(self, request) -> bool:  # noqa: ANN001
        return False
