from django.contrib import admin

from features.models import DashboardRun, FeatureDashboard


@admin.register(DashboardRun)
class DashboardRunAdmin(admin.ModelAdmin):
    list_display = ("id", "sae", "layer", "owner", "corpus", "status", "complete", "tokens_done", "created_at")
    list_filter = ("status", "complete", "corpus")
    readonly_fields = [f.name for f in DashboardRun._meta.fields]


@admin.register(FeatureDashboard)
class FeatureDashboardAdmin(admin.ModelAdmin):
    list_display = ("sae", "index", "run", "density", "mean", "max")
    list_filter = ("sae",)
    search_fields = ("index",)
    readonly_fields = [f.name for f in FeatureDashboard._meta.fields]
