from django.contrib import admin

from batches.models import Batch, File


@admin.register(Batch)
class BatchAdmin(admin.ModelAdmin):
    list_display = ("id", "owner", "status", "endpoint", "model", "total", "completed", "failed", "created_at")
    list_filter = ("status", "endpoint")
    readonly_fields = [f.name for f in Batch._meta.fields]


@admin.register(File)
class FileAdmin(admin.ModelAdmin):
    list_display = ("id", "owner", "filename", "purpose", "bytes", "lines", "created_at")
    list_filter = ("purpose",)
    readonly_fields = ("id", "owner", "filename", "purpose", "bytes", "lines", "complete", "created_at")
