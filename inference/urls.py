from django.urls import path, re_path

from inference import views

app_name = "v1"

urlpatterns = [
    path("models", views.models, name="models"),
    path("models/<path:model_id>", views.model_detail, name="model"),
    path("chat/completions", views.chat_completions, name="chat-completions"),
    path("completions", views.completions, name="completions"),
    path("embeddings", views.embeddings, name="embeddings"),
    path("probes/score", views.probe_score, name="probes-score"),
    re_path(r"^(?P<rest>.*)$", views.not_found, name="not-found"),
]
