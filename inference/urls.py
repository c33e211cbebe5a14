from django.urls import path, re_path

from inference import capabilities, responses_answer, responses_views, views

app_name = "v1"

urlpatterns = [
    path("models", views.models, name="models"),
    path("models/<path:model_id>", views.model_detail, name="model"),
    path("capabilities", capabilities.capabilities, name="capabilities"),
    path("chat/completions", views.chat_completions, name="chat-completions"),
    path("completions", views.completions, name="completions"),
    path("embeddings", views.embeddings, name="embeddings"),
    path("probes/score", views.probe_score, name="probes-score"),
    path("responses", responses_answer.responses_create, name="responses"),
    # a stored response (Responses API; POST /v1/responses is the answer itself)
    path("responses/<str:response_id>", responses_views.response_detail, name="response"),
    path("responses/<str:response_id>/cancel", responses_views.response_cancel, name="response-cancel"),
    path("responses/<str:response_id>/input_items", responses_views.response_input_items, name="response-input-items"),
    re_path(r"^(?P<rest>.*)$", views.not_found, name="not-found"),
]
