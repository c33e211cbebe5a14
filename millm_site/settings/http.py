"""HTTP surface: CORS, DRF (the /api envelope and its schema), Channels, access control."""

import os

from corsheaders.defaults import default_headers

from inference.quota_limits import parse_key_limits

from .core import CONFIG, EMBEDDED

if "*" in CONFIG.CORS_ORIGINS:  # only with keys (millm_site.config refuses it without)
    CORS_ALLOW_ALL_ORIGINS = True
else:
    CORS_ALLOWED_ORIGINS = CONFIG.CORS_ORIGINS
# what a browser client may send and read: every X-miLLM-* request header the server reads
# and every response header it sets (tests/v1/test_cors.py keeps the lists whole)
CORS_ALLOW_HEADERS = (*default_headers, "x-millm-lease", "x-millm-load-policy", "x-millm-strict")
CORS_EXPOSE_HEADERS = [
    "Retry-After",
    "X-miLLM-Backend",
    "X-miLLM-Steering",
    "X-miLLM-Seed",
    "X-miLLM-Ignored-Fields",
    "X-miLLM-Batch",
    "X-miLLM-Probe-Verdicts",
    "X-miLLM-Scoring",
]

REST_FRAMEWORK = {
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
    # JSON bodies are held to their serializer's fields and types (core.api.validated)
    "DEFAULT_PARSER_CLASSES": ["core.api.JSONBodyParser"],
    # Access control is one middleware for /api and /v1 (core.auth), so DRF itself
    # authenticates nobody and never asks for a CSRF token.
    "DEFAULT_AUTHENTICATION_CLASSES": [],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.AllowAny"],
    "UNAUTHENTICATED_USER": None,
    "EXCEPTION_HANDLER": "core.api.exception_handler",
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
}

SPECTACULAR_SETTINGS = {
    "TITLE": "miLLM API",
    "DESCRIPTION": (
        "Management API (/api): every response is the envelope "
        "{success, data, error: {code, message, details}}; every 503 carries Retry-After. "
        "With MILLM_API_KEYS or MILLM_ADMIN_API_KEYS set, send Authorization: Bearer "
        "<key>; changes of shared state need an admin key."
    ),
    "VERSION": "1",
    "SERVE_INCLUDE_SCHEMA": False,
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    "COMPONENT_SPLIT_REQUEST": True,
    "SCHEMA_PATH_PREFIX": r"/(api|v1)",
    "OAS_VERSION": "3.1.0",
    "POSTPROCESSING_HOOKS": [
        "drf_spectacular.hooks.postprocess_schema_enums",
        "millm_site.schema.add_bearer_auth",
        "millm_site.schema.add_v1_paths",
    ],
}

if EMBEDDED:
    CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}
else:
    CHANNEL_LAYERS = {
        "default": {
            "BACKEND": "channels_redis.core.RedisChannelLayer",
            "CONFIG": {"hosts": [CONFIG.REDIS_URL]},
        }
    }

METRICS_PUSH_INTERVAL_S = CONFIG.METRICS_PUSH_INTERVAL_S
METRICS_FLUSH_INTERVAL_S = CONFIG.METRICS_FLUSH_INTERVAL_S
OTEL_ENABLED = CONFIG.OTEL_ENABLED
OTEL_EXPORTER_OTLP_ENDPOINT = CONFIG.OTEL_EXPORTER_OTLP_ENDPOINT
OTEL_SERVICE_NAME = CONFIG.OTEL_SERVICE_NAME

MILLM_HOST = CONFIG.HOST
MILLM_PORT = CONFIG.PORT
MILLM_API_KEYS = tuple(CONFIG.MILLM_API_KEYS)
MILLM_ADMIN_API_KEYS = tuple(CONFIG.MILLM_ADMIN_API_KEYS)
# per-key quotas of /v1, parsed (inference.quotas; checked at start-up by millm_site.config)
KEY_LIMITS = parse_key_limits(CONFIG.KEY_LIMITS)
# one limit for a request body (millm_site.boundary refuses larger ones before reading them)
MAX_REQUEST_BODY_BYTES = CONFIG.MAX_REQUEST_BODY_BYTES
DATA_UPLOAD_MAX_MEMORY_SIZE = CONFIG.MAX_REQUEST_BODY_BYTES
# the ASGI root_path, from here only (millm_site.asgi ignores Daphne-Root-Path)
MILLM_ROOT_PATH = CONFIG.ROOT_PATH
# peers whose X-Forwarded-For / X-Forwarded-Proto are believed (millm_site.asgi)
MILLM_TRUSTED_PROXIES = tuple(CONFIG.TRUSTED_PROXIES)
# a /v1 chat request's own chat_template (inference.policy.template_kwargs)
MILLM_ALLOW_REQUEST_CHAT_TEMPLATE = CONFIG.MILLM_ALLOW_REQUEST_CHAT_TEMPLATE
# Whether HOST was given (environment or .env) rather than defaulted: without API keys a
# defaulted HOST binds to 127.0.0.1 only (millm_site.management.commands.serve).
MILLM_HOST_EXPLICIT = bool(os.environ.get("HOST", "").strip())
