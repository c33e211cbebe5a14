"""Logging for every process (web, engine, Celery, commands): LOG_LEVEL and LOG_FORMAT.

structlog renders both our structured events and the standard library's records, so
``LOG_FORMAT=json`` gives one JSON object per line whichever library logged.
"""

import structlog

from .core import CONFIG

_shared = [
    structlog.contextvars.merge_contextvars,
    structlog.stdlib.add_log_level,
    structlog.stdlib.add_logger_name,
    structlog.processors.TimeStamper(fmt="iso", utc=True),
]

if CONFIG.LOG_FORMAT == "json":
    _renderer = structlog.processors.JSONRenderer()
    _shared_extra = [structlog.processors.format_exc_info]
else:
    _renderer = structlog.dev.ConsoleRenderer(colors=False)
    _shared_extra = []

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {
        "millm": {
            "()": structlog.stdlib.ProcessorFormatter,
            "processors": [structlog.stdlib.ProcessorFormatter.remove_processors_meta, *_shared_extra, _renderer],
            "foreign_pre_chain": _shared,
        },
    },
    "handlers": {
        "stderr": {"class": "logging.StreamHandler", "formatter": "millm"},
    },
    "root": {"handlers": ["stderr"], "level": CONFIG.LOG_LEVEL},
    "loggers": {
        "django": {"level": CONFIG.LOG_LEVEL, "propagate": True},
        "daphne": {"level": CONFIG.LOG_LEVEL, "propagate": True},
        "celery": {"level": CONFIG.LOG_LEVEL, "propagate": True},
    },
}

structlog.configure(
    processors=[*_shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
    logger_factory=structlog.stdlib.LoggerFactory(),
    wrapper_class=structlog.stdlib.BoundLogger,
    cache_logger_on_first_use=True,
)
