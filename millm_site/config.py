"""Every environment variable miLLM reads, parsed and validated once at start-up.

The table (``millm_site.config_variables``) is the single source of truth: settings
modules, the engine bridge, ``manage.py check_config`` and docs/configuration.md all follow
it. A bad value stops the
process with one line naming the variable and the rule it broke (``ConfigError``).

Parsing goes through django-environ (``.env`` support, booleans, lists, database URLs);
the rules on top of it (ranges, choices, combinations) are ours.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import environ

from millm_site.config_variables import (  # noqa: F401 - re-exported: the declarations
    BASE_DIR,
    LOOPBACK_HOSTS,
    VARIABLES,
    Var,
    _keys_set,
)

UNSET = object()


class ConfigError(Exception):
    """A variable that cannot be used; ``str()`` is the one line shown to the operator."""

    def __init__(self, name: str, rule: str, value: Any = UNSET):
        self.name = name
        self.rule = rule
        shown = "" if value is UNSET else f" (got {value!r})"
        super().__init__(f"{name}: {rule}{shown}")


VARIABLES_BY_NAME = {v.name: v for v in VARIABLES}
UNQUANTIZED_KV = {"f32", "f16", "bf16"}
POSTGRES_SCHEMES = {
    "postgres",
    "postgresql",
    "postgresql+asyncpg",
    "postgresql+psycopg",
    "postgresql+psycopg2",
    "pgsql",
}
_TRUE = {"1", "true", "yes", "on", "y", "t"}
_FALSE = {"0", "false", "no", "off", "n", "f"}


class Config(Mapping[str, Any]):
    """Read-only view of the parsed values; attribute and item access."""

    def __init__(self, values: dict[str, Any]):
        self._values = dict(values)

    def __getattr__(self, name: str) -> Any:
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(name) from None

    def __getitem__(self, name: str) -> Any:
        return self._values[name]

    def __iter__(self):
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    @property
    def embedded(self) -> bool:
        return not self._values["REDIS_URL"]

    def database(self) -> dict[str, Any]:
        """The Django DATABASES['default'] entry."""
        url = self._values["DATABASE_URL"]
        if not url:
            path = Path(self._values["MILLM_DATA_DIR"]) / "millm.sqlite3"
            # IMMEDIATE: a transaction that reads then writes (a batch runner claiming its
            # lines) takes the write lock first and waits for it; in SQLite's default
            # deferred mode its lock upgrade fails at once with "database is locked"
            # whenever another connection writes in between, which killed runners
            return {
                "ENGINE": "django.db.backends.sqlite3",
                "NAME": str(path),
                "OPTIONS": {"timeout": 20, "transaction_mode": "IMMEDIATE"},
            }
        scheme, rest = url.split("://", 1)
        parsed = environ.Env.db_url_config(f"postgresql://{rest}")
        parsed["ENGINE"] = "django.db.backends.postgresql"
        parsed["CONN_MAX_AGE"] = 60
        parsed["CONN_HEALTH_CHECKS"] = True
        return parsed


def _parse(var: Var, raw: str) -> Any:
    text = raw.strip()
    if var.kind == "str":
        return text
    if var.kind == "int":
        try:
            return int(text)
        except ValueError:
            raise ConfigError(var.name, "must be an integer", raw) from None
    if var.kind == "float":
        try:
            value = float(text)
        except ValueError:
            raise ConfigError(var.name, "must be a number", raw) from None
        if value != value or value in (float("inf"), float("-inf")):
            raise ConfigError(var.name, "must be a finite number", raw)
        return value
    if var.kind in ("bool", "tristate"):
        low = text.lower()
        if var.kind == "tristate" and low in ("", "auto"):
            return None
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
        allowed = "true/false" + ("/auto" if var.kind == "tristate" else "")
        raise ConfigError(var.name, f"must be {allowed}", raw)
    if var.kind == "list":
        return [item.strip() for item in text.split(",") if item.strip()]
    raise AssertionError(var.kind)


def _check_range(var: Var, value: Any) -> None:
    if var.choices is not None and value not in var.choices:
        raise ConfigError(var.name, f"must be one of {', '.join(var.choices)}", value)
    if var.minimum is not None and value < var.minimum:
        raise ConfigError(var.name, f"must be >= {var.minimum:g}", value)
    if var.maximum is not None and value > var.maximum:
        raise ConfigError(var.name, f"must be <= {var.maximum:g}", value)


def _check_combinations(v: dict[str, Any]) -> None:
    if v["LEASE_DEFAULT_TTL_SECONDS"] > v["LEASE_MAX_TTL_SECONDS"]:
        raise ConfigError(
            "LEASE_DEFAULT_TTL_SECONDS",
            f"must not exceed LEASE_MAX_TTL_SECONDS ({v['LEASE_MAX_TTL_SECONDS']})",
            v["LEASE_DEFAULT_TTL_SECONDS"],
        )
    if v["RETRY_AFTER_QUEUE_DEFAULT_S"] > v["RETRY_AFTER_MAX_S"]:
        raise ConfigError(
            "RETRY_AFTER_QUEUE_DEFAULT_S",
            f"must not exceed RETRY_AFTER_MAX_S ({v['RETRY_AFTER_MAX_S']})",
            v["RETRY_AFTER_QUEUE_DEFAULT_S"],
        )
    if not v["GGUF_FLASH_ATTENTION"] and v["GGUF_KV_CACHE_TYPE"] not in UNQUANTIZED_KV:
        raise ConfigError(
            "GGUF_FLASH_ATTENTION",
            f"must be true when GGUF_KV_CACHE_TYPE is quantized "
            f"({v['GGUF_KV_CACHE_TYPE']}); use f16 to turn flash attention off",
            False,
        )
    if v["SPECULATIVE_MODEL"] and v["ENABLE_CONTINUOUS_BATCHING"]:
        raise ConfigError(
            "SPECULATIVE_MODEL",
            "speculative decoding runs on the serial path; set ENABLE_CONTINUOUS_BATCHING=false to use it",
            v["SPECULATIVE_MODEL"],
        )
    if v["SPECULATIVE_MODEL"] and (v["TORCH_COMPILE"] or v["KV_CACHE_MODE"] == "static"):
        raise ConfigError(
            "SPECULATIVE_MODEL",
            "speculative decoding runs eagerly on the dynamic KV cache (it cuts the "
            "cache back after each verification); set TORCH_COMPILE=false and "
            "KV_CACHE_MODE=dynamic to use it",
            v["SPECULATIVE_MODEL"],
        )
    if v["SPECULATIVE_MODEL"].startswith("self:") and not re.fullmatch(
        r"self:layers=[1-9][0-9]*", v["SPECULATIVE_MODEL"]
    ):
        raise ConfigError("SPECULATIVE_MODEL", "a self-draft is self:layers=N (N >= 1)", v["SPECULATIVE_MODEL"])
    if (
        v["VLLM_DISTRIBUTED_EXECUTOR"] == "uni"
        and v["VLLM_TENSOR_PARALLEL_SIZE"] * v["VLLM_PIPELINE_PARALLEL_SIZE"] > 1
    ):
        raise ConfigError(
            "VLLM_DISTRIBUTED_EXECUTOR", "uni runs one worker; tensor or pipeline parallelism needs mp or ray", "uni"
        )
    for item in v["GGUF_TENSOR_SPLIT"]:
        try:
            share = float(item)
        except ValueError:
            raise ConfigError(
                "GGUF_TENSOR_SPLIT", "must be comma-separated numbers", ",".join(v["GGUF_TENSOR_SPLIT"])
            ) from None
        if not share > 0:
            raise ConfigError("GGUF_TENSOR_SPLIT", "every proportion must be > 0", ",".join(v["GGUF_TENSOR_SPLIT"]))
    for item in v["AUTO_ATTACH_SAES"]:
        name, _, layer = item.partition("@")
        if not name or (layer and not layer.isdigit()):
            raise ConfigError("AUTO_ATTACH_SAES", "entries must be <sae name or id>[@<layer>]", item)
    for item in v["ANALYZERS_EXTRA"]:
        module, _, func = item.partition(":")
        if not func or not all(p.isidentifier() for p in module.split(".")) or not func.isidentifier():
            raise ConfigError("ANALYZERS_EXTRA", "entries must be package.module:function", item)
    if v["AUTO_ATTACH_SAES"] and not v["AUTO_LOAD_MODEL"]:
        raise ConfigError(
            "AUTO_ATTACH_SAES",
            "needs AUTO_LOAD_MODEL (SAEs attach to the model loaded at start-up)",
            ",".join(v["AUTO_ATTACH_SAES"]),
        )
    device = v["MILLM_ENGINE_DEVICE"]
    if device not in ("auto", "cpu", "cuda") and not (device.startswith("cuda:") and device[5:].isdigit()):
        raise ConfigError("MILLM_ENGINE_DEVICE", "must be auto, cpu, cuda or cuda:N", device)
    if 0 < v["ENGINE_MAX_IN_FLIGHT"] < v["MAX_CONCURRENT_REQUESTS"]:
        raise ConfigError(
            "ENGINE_MAX_IN_FLIGHT",
            f"must be 0 or at least MAX_CONCURRENT_REQUESTS "
            f"({v['MAX_CONCURRENT_REQUESTS']}): admitted requests would wait "
            "in the engine's stream",
            v["ENGINE_MAX_IN_FLIGHT"],
        )
    if v["ENGINE_DEAD_AFTER_S"] < 2 * v["ENGINE_HEARTBEAT_S"]:
        raise ConfigError(
            "ENGINE_DEAD_AFTER_S",
            f"must be at least twice ENGINE_HEARTBEAT_S ({v['ENGINE_HEARTBEAT_S']:g})",
            v["ENGINE_DEAD_AFTER_S"],
        )
    if not all(c.isalnum() or c in "_-." for c in v["ENGINE_STREAM_PREFIX"]) or not v["ENGINE_STREAM_PREFIX"]:
        raise ConfigError("ENGINE_STREAM_PREFIX", "must be non-empty letters, digits, _ - .", v["ENGINE_STREAM_PREFIX"])
    _check_engines(v)
    url = v["DATABASE_URL"]
    if url:
        scheme = url.split("://", 1)[0].lower() if "://" in url else ""
        if scheme not in POSTGRES_SCHEMES:
            raise ConfigError(
                "DATABASE_URL",
                "must be a PostgreSQL URL (postgresql://user:pass@host:5432/db) or unset for SQLite",
                _redact(url),
            )
        if not urlparse(url).path.strip("/"):
            raise ConfigError("DATABASE_URL", "must name a database", _redact(url))
    root = v["ROOT_PATH"]
    if root and (not root.startswith("/") or root.endswith("/") or "//" in root):
        raise ConfigError("ROOT_PATH", "must be empty or a path like /millm (leading /, no trailing /)", root)
    import ipaddress

    for item in v["TRUSTED_PROXIES"]:
        try:
            ipaddress.ip_network(item, strict=False)
        except ValueError:
            raise ConfigError("TRUSTED_PROXIES", "entries must be IP addresses or CIDR networks", item) from None
    redis_url = v["REDIS_URL"]
    if redis_url and urlparse(redis_url).scheme not in ("redis", "rediss", "unix"):
        raise ConfigError("REDIS_URL", "must be a redis://, rediss:// or unix:// URL", _redact(redis_url))
    origins = v["CORS_ORIGINS"]
    if "*" in origins and not _keys_set(v):
        raise ConfigError(
            "CORS_ORIGINS",
            "* needs MILLM_API_KEYS or MILLM_ADMIN_API_KEYS: "
            "without keys any web page the operator opens could drive the "
            "server; name the origins, or set keys",
            "*",
        )
    for origin in origins:
        if origin != "*" and urlparse(origin).scheme not in ("http", "https"):
            raise ConfigError("CORS_ORIGINS", "each origin must be * or an http(s) URL", origin)
    from inference.quota_limits import KeyLimitsError, parse_key_limits

    try:
        parse_key_limits(v["KEY_LIMITS"])
    except KeyLimitsError as exc:
        raise ConfigError("KEY_LIMITS", str(exc)) from None
    if not v["DEBUG"] and v["DATABASE_URL"] and not v["SECRET_KEY"]:
        raise ConfigError("SECRET_KEY", "is required when DEBUG is off and DATABASE_URL is set")
    if v["SECRET_KEY"] and len(v["SECRET_KEY"]) < 32 and not v["DEBUG"]:
        raise ConfigError("SECRET_KEY", "must be at least 32 characters when DEBUG is off")


def _check_engines(v: dict[str, Any]) -> None:
    """ENGINE_NAME is a valid name; ENGINE_MODELS parses, and names engines other than the
    default one only where engines run apart (REDIS_URL)."""
    from core.engines import DEFAULT_ENGINE, parse_engine_models, valid_engine_name

    if not valid_engine_name(v["ENGINE_NAME"]):
        raise ConfigError("ENGINE_NAME", "must be 1-40 letters, digits, _ or -", v["ENGINE_NAME"])
    try:
        routes = parse_engine_models(v["ENGINE_MODELS"])
    except ValueError as exc:
        raise ConfigError("ENGINE_MODELS", str(exc), v["ENGINE_MODELS"]) from None
    if not v["REDIS_URL"] and [r.name for r in routes] != [DEFAULT_ENGINE]:
        raise ConfigError(
            "ENGINE_MODELS",
            "names engines other than `default`, which needs REDIS_URL (embedded mode runs one engine)",
            v["ENGINE_MODELS"],
        )


def _check_tracing(v: dict[str, Any]) -> None:
    """OTEL_ENABLED needs the OpenTelemetry SDK and its OTLP exporter installed
    (requirements/otel.txt): said at start-up, not at the first request."""
    if not v["OTEL_ENABLED"]:
        return
    try:
        import opentelemetry.exporter.otlp.proto.http.trace_exporter  # noqa: F401
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError as exc:
        raise ConfigError(
            "OTEL_ENABLED",
            f"needs the OpenTelemetry packages (pip install -r requirements/otel.txt): {exc}",
            True,
        ) from None


def _redact(url: str) -> str:
    parsed = urlparse(url)
    if parsed.password:
        return url.replace(f":{parsed.password}@", ":***@")
    return url


def load_config(environ_map: Mapping[str, str] | None = None) -> Config:
    """Parse and validate every variable; raise ConfigError on the first bad one."""
    source = os.environ if environ_map is None else environ_map
    values: dict[str, Any] = {}
    derived: list[Var] = []
    for var in VARIABLES:
        raw = source.get(var.name)
        if raw is None or (raw.strip() == "" and var.kind not in ("str", "list", "tristate")):
            if var.derive is not None:
                derived.append(var)
                continue
            values[var.name] = var.default
            continue
        if raw.strip() == "" and var.derive is not None:
            derived.append(var)
            continue
        value = _parse(var, raw)
        _check_range(var, value)
        if var.unbuilt and value != var.default and value not in var.unbuilt_ok:
            raise ConfigError(
                var.name,
                f"is accepted from the original's reference but {var.unbuilt} is not built yet; leave it unset",
                raw,
            )
        values[var.name] = value
    for var in derived:
        values[var.name] = var.derive(values)
    _check_combinations(values)
    _check_tracing(values)
    return Config(values)


def read_dotenv(path: Path | None = None) -> None:
    """Load ``.env`` (without overriding the real environment), as django-environ does."""
    path = path or Path(os.environ.get("MILLM_ENV_FILE", BASE_DIR / ".env"))
    if path.is_file():
        environ.Env.read_env(str(path), overwrite=False)


_CONFIG: Config | None = None


def get_config() -> Config:
    """The process-wide configuration; exits with one line on a bad value."""
    global _CONFIG
    if _CONFIG is None:
        read_dotenv()
        try:
            _CONFIG = load_config()
        except ConfigError as exc:
            sys.stderr.write(f"miLLM configuration error: {exc}\n")
            sys.stderr.flush()
            raise SystemExit(2) from None
    return _CONFIG
