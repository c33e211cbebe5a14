"""Apps, middleware, templates, static files and the secret key."""

import secrets
from pathlib import Path

from millm_site.config import BASE_DIR, get_config

CONFIG = get_config()
DATA_DIR = Path(CONFIG.MILLM_DATA_DIR)
DATA_DIR.mkdir(parents=True, exist_ok=True)
EMBEDDED = CONFIG.embedded

DEBUG = CONFIG.DEBUG


def _secret_key() -> str:
    if CONFIG.SECRET_KEY:
        return CONFIG.SECRET_KEY
    # Embedded default: a real random key, generated once and kept beside the database so
    # sessions survive restarts. Deployments (DATABASE_URL set) must provide their own.
    path = DATA_DIR / "secret_key"
    if path.is_file():
        key = path.read_text().strip()
        if len(key) >= 32:
            return key
    key = secrets.token_urlsafe(50)
    path.write_text(key)
    path.chmod(0o600)
    return key


SECRET_KEY = _secret_key()
ALLOWED_HOSTS = CONFIG.ALLOWED_HOSTS

INSTALLED_APPS = [
    "daphne",
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "corsheaders",
    "rest_framework",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "channels",
    "millm_site",
    "audit",
    "registry",
    "steering",
    "inference",
    "batches",
    "monitoring",
    "leases",
    "orchestration",
    "features",
    "experiments",
    "ui",
    "system",
]

MIDDLEWARE = [
    # First, so it counts every answer (refusals of the middlewares below included) and
    # gives any 503 that lacks one a Retry-After.
    "core.metrics.MetricsMiddleware",
    # Unknown /api paths and exceptions outside DRF views still answer the envelope.
    "core.api.ApiFallbackMiddleware",
    "corsheaders.middleware.CorsMiddleware",
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "core.auth.ApiKeyMiddleware",
    # the caller (key label, admin user) that audit entries name while the view runs
    "audit.context.AuditActorMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

# /v1 is served by its own handler (millm_site/asgi.py) with only what it uses: metrics
# and the Retry-After guarantee, CORS for browser clients, and API keys.
V1_MIDDLEWARE = [
    "core.metrics.MetricsMiddleware",
    "corsheaders.middleware.CorsMiddleware",
    "core.auth.ApiKeyMiddleware",
    "audit.context.AuditActorMiddleware",
]

ROOT_URLCONF = "millm_site.urls"
WSGI_APPLICATION = None
ASGI_APPLICATION = "millm_site.asgi.application"
# Reconcile the registry (and, embedded, restore the recorded model) when the ASGI module
# is imported by a server; not an environment variable: only the test suite turns it off.
MILLM_APPLICATION_START = True
# Keep the process copies /v1 requests read (core.process_copy) fresh from a background
# thread while requests use them; not an environment variable: the test suite turns it
# off, whose non-transactional tests hold rows another connection cannot see.
MILLM_PROCESS_COPY_REFRESH = True

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATICFILES_DIRS = [BASE_DIR / "static"]
STATIC_ROOT = DATA_DIR / "staticfiles"

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
