from django.contrib import admin

from batches.models import Batch, File


@admin.register(Batch)
class BatchAdmin(admin.ModelAdmin):
    list_display = ("id", "status", "endpoint", "model", "total", "completed", "failed",
                    "created_at")
    list_filter = ("status", "endpoint")
    readonly_fields = [f.name for f in Batch._meta.fields]


@admin.register(File)
class FileAdmin(admin.ModelAdmin):
    list_display = ("id", "filename", "purpose", "bytes", "lines", "created_at")
    list_filter = ("purpose",)
    exclude = ("content",)
    readonly_fields = ("id", "filename", "purpose", "bytes", "lines", "created_at")
