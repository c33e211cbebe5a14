"""The admin's "Access" page (/admin/access/, staff only): the configured keys by label and
kind (never a secret), what each kind may do, and the settings of the trust boundary
(docs/security.md). Read-only: keys are configuration (MILLM_API_KEYS,
MILLM_ADMIN_API_KEYS), changed where the operator sets the environment."""

from __future__ import annotations

from django.conf import settings
from django.contrib import admin
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse

from core.auth import parse_key
from system.health import access_summary


def access_view(request: HttpRequest) -> HttpResponse:
    keys = [
        {"label": label, "kind": kind, "owner": f"key:{label}"}
        for kind, entries in (("admin", settings.MILLM_ADMIN_API_KEYS), ("inference", settings.MILLM_API_KEYS))
        for label in (parse_key(entry).label for entry in entries)
    ]
    context = {
        **admin.site.each_context(request),
        "title": "Access",
        "keys": keys,
        "summary": access_summary(),
        "settings_rows": [
            ("ALLOWED_HOSTS", ", ".join(settings.ALLOWED_HOSTS)),
            ("ROOT_PATH", settings.MILLM_ROOT_PATH or "(empty)"),
            ("TRUSTED_PROXIES", ", ".join(settings.MILLM_TRUSTED_PROXIES) or "(none)"),
            ("MAX_REQUEST_BODY_BYTES", str(settings.MAX_REQUEST_BODY_BYTES)),
            ("ALLOW_REMOTE_CODE", str(getattr(settings, "ALLOW_REMOTE_CODE", False))),
        ],
    }
    return TemplateResponse(request, "admin/system/access.html", context)
