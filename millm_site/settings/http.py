"""HTTP surface: CORS, DRF, Channels."""

from .core import CONFIG, EMBEDDED

if CONFIG.CORS_ORIGINS == ["*"]:
    CORS_ALLOW_ALL_ORIGINS = True
else:
    CORS_ALLOWED_ORIGINS = CONFIG.CORS_ORIGINS
CORS_EXPOSE_HEADERS = ["Retry-After", "X-miLLM-Backend", "X-miLLM-Steering"]

REST_FRAMEWORK = {
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
    "DEFAULT_PARSER_CLASSES": ["rest_framework.parsers.JSONParser"],
    "UNAUTHENTICATED_USER": None,
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

MILLM_HOST = CONFIG.HOST
MILLM_PORT = CONFIG.PORT
