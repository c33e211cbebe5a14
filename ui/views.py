"""The browser UI: server-rendered page shells whose ES modules (static/ui/js) talk to
/api, /v1 and /ws/events from the browser. The pages hold no data of their own, so they
stay open like the APIs; with MILLM_API_KEYS set, the data needs the key, which the page
asks for once and keeps in sessionStorage (see docs/ui.md).

Also here: the static files under daphne (``manage.py serve`` runs the bare ASGI app, which
serves no static files) and the feature labels an SAE folder may ship.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.contrib.staticfiles.views import serve
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.http import require_GET
from django.views.generic import TemplateView

from core.auth import bearer_token, key_is_valid, keys_enabled
from gpu_engine.api.protocol import MAX_STEERING_STRENGTH
from registry.labels import labels_for
from registry.models import SAE


NAV = [
    ("dashboard", "/", "Dashboard"),
    ("models", "/models/", "Models"),
    ("saes", "/saes/", "SAEs"),
    ("steering", "/steering/", "Steering"),
    ("profiles", "/profiles/", "Profiles"),
    ("clusters", "/clusters/", "Clusters"),
    ("circuits", "/circuits/", "Circuits"),
    ("playground", "/playground/", "Playground"),
    ("monitoring", "/monitoring/", "Monitoring"),
    ("captures", "/captures/", "Captures"),
    ("batches", "/batches/", "Batches"),
    ("features", "/features/", "Features"),
    ("dashboards", "/dashboards/", "Dashboards"),
    ("experiments", "/experiments/", "Experiments"),
]


class Page(TemplateView):
    """One page shell: the layout, its title, and what its module needs to know."""

    page: str = ""
    title: str = ""
    # the navigation entry it belongs under (the feature page is under Features)
    nav_key: str = ""

    def get_template_names(self) -> list[str]:
        return [f"ui/{self.page}.html"]

    def get_context_data(self, **kwargs: Any) -> dict[str, Any]:
        context = super().get_context_data(**kwargs)
        context.update(
            {
                "page": self.page,
                "nav_key": self.nav_key or self.page,
                "title": self.title,
                "nav": NAV,
                "ui_config": {
                    "page": self.page,
                    "api_keys_required": keys_enabled(),
                    "max_strength": MAX_STEERING_STRENGTH,
                    **self.page_config(),
                    # what the URL names (the feature page's SAE and index), as matched
                    **self.kwargs,
                },
            }
        )
        return context

    def page_config(self) -> dict[str, Any]:
        return {}


def page(name: str, title: str, *, nav_key: str = "", **config: Any):
    """A page view; a config value that is callable is read per request (a setting)."""
    return type(
        f"{name.title()}Page",
        (Page,),
        {
            "page": name,
            "title": title,
            "nav_key": nav_key,
            "page_config": lambda self: {k: v() if callable(v) else v for k, v in config.items()},
        },
    ).as_view()


def dashboard_max_tokens() -> int:
    return int(settings.DASHBOARD_MAX_TOKENS)


def experiment_max_points() -> int:
    return int(settings.EXPERIMENT_MAX_POINTS)


def static(request: HttpRequest, path: str) -> HttpResponse:
    """Static files through the finders (static/, the apps' and packages' own: the admin,
    Swagger UI's sidecar). daphne has no static handler and the UI must work from a plain
    ``manage.py serve`` with no reverse proxy in front; a deployment that has one can
    serve ``collectstatic``'s STATIC_ROOT there instead."""
    response = serve(request, path, insecure=True)
    response["Cache-Control"] = "no-cache"  # revalidate (Last-Modified): code changes show
    return response


def _authorized(request: HttpRequest) -> bool:
    if not keys_enabled():
        return True
    return key_is_valid(bearer_token(request.headers.get("Authorization")))


@require_GET
def feature_labels(request: HttpRequest, sae_id: str) -> JsonResponse:
    """``{sae_id, labels: {"<index>": label}}``: each labelled feature's label, its best
    explanation (``registry.labels``; an SAE folder's feature_labels.json is imported as
    explanations, the demo SAE ships one); ``labels: {}`` when there is none. The steering
    page needs them to find a feature by name."""
    if not _authorized(request):
        response = JsonResponse({"error": "Missing or invalid API key"}, status=401)
        response["WWW-Authenticate"] = 'Bearer realm="miLLM"'
        return response
    sae = SAE.objects.filter(pk=sae_id).first()
    if sae is None:
        return JsonResponse({"error": f"No SAE {sae_id}"}, status=404)
    labels = labels_for(sae.id)
    return JsonResponse({"sae_id": sae.id, "labels": {str(i): label for i, label in sorted(labels.items())}})
