from django.urls import path

from batches import views

app_name = "batches"

# included under /v1/ before inference's routes (whose last one answers unknown paths)
urlpatterns = [
    path("files", views.files, name="files"),
    path("files/<str:file_id>", views.file_detail, name="file"),
    path("files/<str:file_id>/content", views.file_content, name="file-content"),
    path("batches", views.batches, name="batches"),
    path("batches/<str:batch_id>", views.batch_detail, name="batch"),
    path("batches/<str:batch_id>/cancel", views.batch_cancel, name="batch-cancel"),
]
