"""The declarations of every environment variable miLLM reads: its topic, kind, default
(or the default derived from other values), help, and the rules of its value. The single
source of truth that ``millm_site.config`` parses and checks, ``manage.py check_config``
prints and docs/configuration.md follows."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpu_engine.api.host import backend_names

_BACKENDS = backend_names()

BASE_DIR = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Var:
    name: str
    topic: str
    kind: str  # str | int | float | bool | list | tristate
    default: Any
    help: str
    choices: tuple[str, ...] | None = None
    minimum: float | None = None
    maximum: float | None = None
    secret: bool = False
    # A default computed from other values (e.g. paths under the data directory).
    derive: Callable[[dict[str, Any]], Any] | None = field(default=None, compare=False)
    # A variable of the original's reference that nothing here reads yet: why, and the
    # values that ask for what already happens (its default included). Any other value
    # stops start-up instead of being accepted and ignored.
    unbuilt: str | None = None
    unbuilt_ok: tuple[Any, ...] = ()


def _keys_set(values: dict[str, Any]) -> bool:
    return bool(values.get("MILLM_API_KEYS") or values.get("MILLM_ADMIN_API_KEYS"))


LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1", "[::1]")


def _default_allowed_hosts(values: dict[str, Any]) -> list[str]:
    if _keys_set(values):
        return ["*"]
    host = str(values.get("HOST") or "").strip()
    extra = [host] if host and host not in ("0.0.0.0", "::") else []
    return [*LOOPBACK_HOSTS, *extra]


def _default_origins(values: dict[str, Any]) -> list[str]:
    return ["*"] if _keys_set(values) else []


def _under_data(sub: str) -> Callable[[dict[str, Any]], Any]:
    return lambda values: str(Path(values["MILLM_DATA_DIR"]) / sub)


VARIABLES: tuple[Var, ...] = (
    # --- Core -----------------------------------------------------------------------
    Var(
        "MILLM_DATA_DIR",
        "Core",
        "str",
        str(BASE_DIR / "data"),
        "Directory for the embedded SQLite database, the generated SECRET_KEY, demo assets "
        "and (by default) the model and SAE caches. Set it to /app in a container image to "
        "get the original /app/model_cache and /app/sae_cache paths.",
    ),
    Var(
        "DATABASE_URL",
        "Core",
        "str",
        "",
        "Unset: an SQLite file in MILLM_DATA_DIR (embedded). Set: a PostgreSQL DSN "
        "(postgresql://user:pass@host:5432/db; the original's postgresql+asyncpg:// form is "
        "accepted and served through psycopg 3).",
        secret=True,
    ),
    Var(
        "MODEL_CACHE_DIR",
        "Core",
        "str",
        None,
        "Where downloaded model weights live (default MILLM_DATA_DIR/model_cache).",
        derive=_under_data("model_cache"),
    ),
    Var(
        "SAE_CACHE_DIR",
        "Core",
        "str",
        None,
        "Where downloaded SAEs live (default MILLM_DATA_DIR/sae_cache).",
        derive=_under_data("sae_cache"),
    ),
    Var(
        "HF_TOKEN",
        "Core",
        "str",
        "",
        "Server-wide Hugging Face token for gated repos; a "
        "per-request token in an API call takes precedence and is never persisted.",
        secret=True,
    ),
    Var(
        "HF_ENDPOINT",
        "Core",
        "str",
        "",
        "Hugging Face hub endpoint (mirror or stand-in hub); empty means huggingface_hub's default.",
    ),
    Var(
        "HOST",
        "Core",
        "str",
        "0.0.0.0",
        "Bind address of the HTTP server. When HOST is "
        "not set and MILLM_API_KEYS is empty, the server binds to 127.0.0.1 instead and says "
        "so at start-up: an unauthenticated server is not exposed by default.",
    ),
    Var("PORT", "Core", "int", 8000, "Bind port of the HTTP server.", minimum=1, maximum=65535),
    Var("DEBUG", "Core", "bool", False, "Django debug behaviour; never use in production."),
    Var(
        "SECRET_KEY",
        "Core",
        "str",
        "",
        "Django secret key. Required when DEBUG is off and "
        "DATABASE_URL is set (a deployment); the embedded default generates one and keeps "
        "it in MILLM_DATA_DIR/secret_key.",
        secret=True,
    ),
    Var(
        "ALLOWED_HOSTS",
        "Core",
        "list",
        None,
        "Host names the HTTP server answers for "
        "(Host header). Default: with API keys, any (*); without keys, only the loopback names "
        "(localhost, 127.0.0.1, ::1) and HOST when it names one address, so a web page that "
        "rebinds its own DNS name to this machine gets 400, not the API.",
        derive=lambda v: _default_allowed_hosts(v),
    ),
    Var(
        "REDIS_URL",
        "Core",
        "str",
        "",
        "Unset: embedded mode (engine in the web process, "
        "in-memory channel layer, tasks in-process). Set: distributed mode over Redis "
        "(redis://host:6379/0).",
        secret=True,
    ),
    Var(
        "AUTO_LOAD_MODEL",
        "Core",
        "str",
        "",
        "Model id or name to load at start-up. It wins over another model a restart "
        "restored (that one is swapped out, its attachments and steering with it) unless "
        "that model is locked or leased: then it stays, AUTO_LOAD_MODEL and AUTO_ATTACH_SAES "
        "are not applied (logged as auto_load_skipped), and /api/health/ready's "
        "auto_load_model says which model holds the engine and why.",
    ),
    Var(
        "AUTO_ATTACH_SAES",
        "Core",
        "list",
        [],
        "SAEs to attach once AUTO_LOAD_MODEL is resident: comma-separated <sae name or id>"
        "[@<layer>] (the layer defaults to the one the SAE was trained on).",
    ),
    # --- Access & hub ---------------------------------------------------------------
    Var(
        "MILLM_API_KEYS",
        "Access & hub",
        "list",
        [],
        "Comma-separated inference keys (each 'secret' or 'label:secret'; the label names "
        "the key in logs and owns what it makes). Set: /v1, /api (except liveness and "
        "readiness) and /ws/events require Authorization: Bearer <key>; an inference key may "
        "use /v1, read /api and manage its own objects (see MILLM_ADMIN_API_KEYS). Unset "
        "with no admin keys either: no authentication, and with HOST unset the server binds "
        "to 127.0.0.1 only.",
        secret=True,
    ),
    Var(
        "MILLM_ADMIN_API_KEYS",
        "Access & hub",
        "list",
        [],
        "Comma-separated admin keys (each 'secret' or 'label:secret'). An admin key may do "
        "everything: registry changes, downloads, load and unload, attach and detach, live "
        "steering, documents, and it sees every key's files, batches, captures and probes. "
        "MILLM_API_KEYS are inference keys: /v1, read-only /api, and their own objects. With "
        "either set, /api and /v1 require a key; with inference keys only, admin actions "
        "are refused (403) over HTTP and stay with manage.py and the Django admin.",
        secret=True,
    ),
    Var(
        "KEY_LIMITS",
        "Access & hub",
        "str",
        "",
        'Per-key quotas of /v1 as JSON: {"*": {"rpm": 60, "tpm": 100000, "concurrent": 4}, '
        '"alice": {"rpm": 600}} (requests per minute, prompt + completion tokens per minute, '
        'requests at once; by key label, "*" for every inference key; a key\'s entry overrides '
        '"*" field by field, null lifts a limit). Admin keys are limited only by an entry naming '
        "them. Over a limit: 429 rate_limit_exceeded (/v1) or RATE_LIMIT_EXCEEDED (/api) with "
        "Retry-After. Empty, or keys off: no limits. Windows are shared through Redis when "
        "REDIS_URL is set.",
    ),
    Var(
        "ROOT_PATH",
        "Access & hub",
        "str",
        "",
        "The URL prefix under which a reverse proxy serves miLLM (e.g. /millm), the ASGI "
        "root_path. Taken from here only: a client's Daphne-Root-Path header is ignored.",
    ),
    Var(
        "TRUSTED_PROXIES",
        "Access & hub",
        "list",
        [],
        "Addresses or networks (CIDR) of reverse proxies whose X-Forwarded-For and "
        "X-Forwarded-Proto headers are believed. From any other peer these headers are "
        "ignored (the client address and scheme are the connection's).",
    ),
    Var(
        "MILLM_ALLOW_REQUEST_CHAT_TEMPLATE",
        "Access & hub",
        "bool",
        False,
        "Let a /v1 chat request bring its own Jinja chat template "
        "(chat_template_kwargs.chat_template). Off: such a request is refused (400 "
        "invalid_parameter) and the model's own template is used; a template runs on the "
        "server, sandboxed but as long as it likes, so allow it only for trusted clients.",
    ),
    Var(
        "ALLOW_REMOTE_CODE",
        "Access & hub",
        "bool",
        False,
        "Let an admin register and load a model with trust_remote_code (the repository's "
        "own Python, imported by transformers or vLLM in the engine). Off: "
        "trust_remote_code=true is refused (400 REMOTE_CODE_NOT_ALLOWED), no .py file is "
        "downloaded, and a row registered with it earlier is refused at load.",
    ),
    Var(
        "LOCAL_MODEL_ROOTS",
        "Access & hub",
        "list",
        [],
        "Comma-separated directories under which source=local models and SAEs may be "
        "registered (paths resolved, symlinks and '..' followed, before the check); "
        "empty: MODEL_CACHE_DIR, SAE_CACHE_DIR and MILLM_DATA_DIR. A path outside them is "
        "refused with one answer whether it exists or not.",
    ),
    Var(
        "HF_CIRCUIT_FAIL_MAX",
        "Access & hub",
        "int",
        5,
        "Consecutive hub failures (connection errors, timeouts, 5xx) that open the hub circuit breaker.",
        minimum=1,
    ),
    Var(
        "HF_CIRCUIT_RESET_TIMEOUT_S",
        "Access & hub",
        "int",
        60,
        "Seconds an open hub breaker refuses calls (503 HUB_UNAVAILABLE, Retry-After = the "
        "time left) before it lets one trial call through.",
        minimum=1,
    ),
    Var(
        "HF_REQUEST_TIMEOUT_S",
        "Access & hub",
        "float",
        10.0,
        "Timeout of one hub metadata call (repository info, file metadata).",
        minimum=0.1,
    ),
    Var(
        "HF_RETRY_ATTEMPTS",
        "Access & hub",
        "int",
        3,
        "Attempts for a hub call that failed with a transient error (connection reset, "
        "timeout, 502/503/504) before it counts as one breaker failure.",
        minimum=1,
        maximum=10,
    ),
    # --- HTTP & logging -------------------------------------------------------------
    Var(
        "CORS_ORIGINS",
        "HTTP & logging",
        "list",
        None,
        "Comma-separated browser origins allowed to call /api and /v1 and open /ws/events, "
        "or * for any. Default: * with API keys (a page still needs a key); none without "
        "keys (only the server's own pages). * without keys is refused at start-up: any web "
        "page could drive the server.",
        derive=lambda v: _default_origins(v),
    ),
    Var(
        "MAX_REQUEST_BODY_BYTES",
        "HTTP & logging",
        "int",
        2621440,
        "Largest request body for /api and /v1 other than file uploads (uploads: "
        "BATCH_MAX_FILE_BYTES). A larger one is refused with 413 from its Content-Length "
        "before it is read, or as soon as its bytes pass the limit.",
        minimum=1024,
    ),
    Var(
        "LOG_LEVEL",
        "HTTP & logging",
        "str",
        "INFO",
        "Log threshold of every process.",
        choices=("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"),
    ),
    Var(
        "LOG_FORMAT",
        "HTTP & logging",
        "str",
        "console",
        "console for humans, json (one object per line) for log pipelines.",
        choices=("console", "json"),
    ),
    Var(
        "METRICS_PUSH_INTERVAL_S",
        "HTTP & logging",
        "float",
        2.0,
        "Seconds between the system:metrics events each web process sends its /ws/events "
        "clients while at least one is connected (the dashboard's figures); 0 turns the "
        "push off and the dashboard polls GET /api/health/metrics instead.",
        minimum=0,
    ),
    Var(
        "METRICS_FLUSH_INTERVAL_S",
        "HTTP & logging",
        "float",
        1.0,
        "Distributed mode (REDIS_URL set): seconds between the sends of what each process's "
        "counters grew to the stack's sums in Redis, which /api/health/metrics, the Prometheus "
        "scrape and system:metrics read (a process reading them sends its own first, and one "
        "that exits sends the rest). Embedded mode keeps its counters in the process.",
        minimum=0.05,
    ),
    Var(
        "OTEL_ENABLED",
        "HTTP & logging",
        "bool",
        False,
        "Send OpenTelemetry traces: a span for each /v1 generation request (to its response "
        "headers) and one for each of its engine jobs (from arrival at the engine to the last "
        "event), one trace, both carrying the request id and the steering hash. Needs "
        "requirements/otel.txt installed (start-up says so otherwise).",
    ),
    Var(
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "HTTP & logging",
        "str",
        "",
        "Where the spans go with OTEL_ENABLED (OTLP over HTTP, e.g. http://collector:4318); "
        "empty: the exporter's own default, http://localhost:4318.",
    ),
    Var(
        "OTEL_SERVICE_NAME",
        "HTTP & logging",
        "str",
        "millm",
        "The service.name of the spans with OTEL_ENABLED (give web and engine hosts their own "
        "if you want them told apart; the span names say which side anyway).",
    ),
    # --- Concurrency & timeouts -----------------------------------------------------
    Var(
        "MAX_CONCURRENT_REQUESTS",
        "Concurrency & timeouts",
        "int",
        0,
        "Generation slots of /v1. Every request carries its own steering and monitoring, "
        "so any value is correct. Serial backend: admitted requests run one at a time in "
        "arrival order. Continuous batching: the batch's rows, up to this many requests "
        "share every forward pass (a request with n choices brings n rows; extra rows wait "
        "in the engine). 0 (the default) follows the loaded model's backend: a model on "
        "vLLM gets VLLM_MAX_NUM_SEQS slots (its own batch's rows), any other backend 1. A "
        "value of 1 or more caps the slots on every backend; on vLLM they are never more "
        "than VLLM_MAX_NUM_SEQS (a slot beyond its batch would only wait inside vLLM). "
        "GET /api/health/inference reports the slots in force and where they come from.",
        minimum=0,
    ),
    Var(
        "MAX_PENDING_REQUESTS",
        "Concurrency & timeouts",
        "int",
        10,
        "Queue depth beyond the concurrent slots; overflow is refused with 503 queue_full.",
        minimum=0,
    ),
    Var(
        "MAX_DOWNLOAD_WORKERS",
        "Concurrency & timeouts",
        "int",
        2,
        "Parallel model/SAE downloads: the embedded pool, and the Celery concurrency `manage.py worker "
        "-Q downloads,…` gives the deployed download worker (compose, k8s, systemd).",
        minimum=1,
    ),
    Var(
        "MAX_LOAD_WORKERS",
        "Concurrency & timeouts",
        "int",
        1,
        "Parallel model loads (keep at 1): the embedded pool, and the Celery concurrency "
        "`manage.py worker -Q loads` gives the deployed loader.",
        minimum=1,
    ),
    Var(
        "GRACEFUL_UNLOAD_TIMEOUT",
        "Concurrency & timeouts",
        "float",
        30.0,
        "Seconds an unload waits for running requests before moving any weight; requests "
        "arriving meanwhile get 503 model_busy.",
        minimum=0,
    ),
    Var(
        "DOWNLOAD_TIMEOUT",
        "Concurrency & timeouts",
        "float",
        3600.0,
        "Maximum seconds for a single download.",
        minimum=1,
    ),
    # --- Model lease and backpressure -----------------------------------------------
    Var(
        "LEASE_DEFAULT_TTL_SECONDS",
        "Lease & backpressure",
        "int",
        7200,
        "TTL of a lease taken without ttl_seconds; must not exceed the maximum.",
        minimum=1,
    ),
    Var(
        "LEASE_MAX_TTL_SECONDS",
        "Lease & backpressure",
        "int",
        7200,
        "Largest ttl_seconds accepted; larger values are refused with 400, never clamped.",
        minimum=1,
    ),
    Var(
        "LEASE_HOLDER_MAX_CHARS",
        "Lease & backpressure",
        "int",
        128,
        "Longest holder label, after stripping.",
        minimum=1,
    ),
    Var("LEASE_REASON_MAX_CHARS", "Lease & backpressure", "int", 512, "Longest reason, after stripping.", minimum=1),
    Var(
        "LEASE_ENDED_MEMORY",
        "Lease & backpressure",
        "int",
        64,
        "Ended leases remembered so renew/release of a seen id answers 409 LEASE_EXPIRED.",
        minimum=0,
    ),
    Var(
        "QUEUE_DURATION_WINDOW",
        "Lease & backpressure",
        "int",
        50,
        "Recent slot-holding durations kept for estimated_wait_seconds.",
        minimum=1,
    ),
    Var(
        "RETRY_AFTER_QUEUE_DEFAULT_S",
        "Lease & backpressure",
        "int",
        5,
        "Retry-After of QUEUE_FULL with no estimate.",
        minimum=1,
    ),
    Var("RETRY_AFTER_MAX_S", "Lease & backpressure", "int", 60, "Ceiling on the QUEUE_FULL estimate.", minimum=1),
    Var(
        "RETRY_AFTER_LOAD_S",
        "Lease & backpressure",
        "int",
        15,
        "Retry-After of MODEL_BUSY / MODEL_LOADING while a load runs.",
        minimum=1,
    ),
    Var(
        "RETRY_AFTER_UNLOAD_S",
        "Lease & backpressure",
        "int",
        5,
        "Retry-After of MODEL_BUSY while an unload runs.",
        minimum=1,
    ),
    Var("RETRY_AFTER_NOT_LOADED_S", "Lease & backpressure", "int", 30, "Retry-After of MODEL_NOT_LOADED.", minimum=1),
    Var(
        "RETRY_AFTER_MEMORY_S",
        "Lease & backpressure",
        "int",
        30,
        "Retry-After of INSUFFICIENT_MEMORY on /v1.",
        minimum=1,
    ),
    Var(
        "RETRY_AFTER_READINESS_S",
        "Lease & backpressure",
        "int",
        5,
        "Retry-After of the readiness probe's 503.",
        minimum=1,
    ),
    Var(
        "RETRY_AFTER_FALLBACK_S",
        "Lease & backpressure",
        "int",
        10,
        "Any other 503 that reached the response without Retry-After (logged as retry_after_defaulted).",
        minimum=1,
    ),
    # --- Performance ----------------------------------------------------------------
    Var(
        "TORCH_COMPILE",
        "Performance",
        "tristate",
        None,
        "torch.compile of the transformers backend's one-token decode step, serial and "
        "batched: true, false, or unset/auto = compile on CUDA, not on the CPU (where it "
        "did not pay: docs/performance.md). A compiled model decodes with the static KV "
        "cache whatever KV_CACHE_MODE says. Read when a model loads.",
    ),
    Var(
        "TORCH_COMPILE_MODE",
        "Performance",
        "str",
        "reduce-overhead",
        "torch.compile mode of a compiled model (reduce-overhead adds CUDA graphs on CUDA; "
        "on the CPU the three differ little).",
        choices=("default", "reduce-overhead", "max-autotune"),
    ),
    Var(
        "KV_CACHE_MODE",
        "Performance",
        "str",
        "dynamic",
        "The transformers backend's KV cache. dynamic: grows with the sequence. static: "
        "preallocated, shapes fixed as sequences grow (a StaticCache on the serial path, "
        "the batch's slab stepped over its whole capacity), the cache compiled decoding "
        "uses. Same tokens either way. Read when a model loads.",
        choices=("dynamic", "static"),
    ),
    Var(
        "PREFIX_CACHE_MAX_MB",
        "Performance",
        "int",
        256,
        "Prefix cache of the transformers and llama.cpp backends: MiB of finished requests' "
        "KV kept (least recently used evicted first) so that a prompt starting with a stored "
        "one (the next turn of a chat) prefills only its new tokens; 0 = off. Keyed by "
        "prompt_cache_key and by the steering that touches prompt rows (docs/engine.md, "
        '"Prefix cache"). On a GPU the KV stays in GPU memory. Read when a model loads.',
        minimum=0,
    ),
    Var(
        "SPECULATIVE_MODEL",
        "Performance",
        "str",
        "",
        "Draft for speculative decoding of the transformers backend's serial path (unset = "
        "off): self:layers=N (the loaded model's first N blocks and its head, no second "
        "model), a checkpoint directory, or a registered model's name or hub repository id "
        "(its files), with the same vocabulary. Anything else stops the start-up (and "
        "refuses a load before the resident model is unloaded). Greedy requests only; needs "
        "ENABLE_CONTINUOUS_BATCHING=false.",
    ),
    Var(
        "SPECULATIVE_NUM_TOKENS", "Performance", "int", 5, "Tokens the draft proposes per step.", minimum=1, maximum=64
    ),
    Var(
        "MILLM_BACKEND",
        "Performance",
        "str",
        "transformers",
        "The engine backend a model loads on when its record names none (a model's own "
        "`backend` field, set in the admin, /api/models or `load_model --backend`, wins). "
        "/api/health/inference lists the backends and whether each is installed.",
        choices=_BACKENDS,
    ),
    Var(
        "MILLM_ENGINE_DEVICE",
        "Performance",
        "str",
        "auto",
        "Where the engine puts the model: cpu, cuda, cuda:N or auto (cuda when present).",
    ),
    Var(
        "MILLM_ENGINE_DTYPE",
        "Performance",
        "str",
        "auto",
        "Model dtype: float32, bfloat16, float16, or auto (bfloat16 on CUDA, float32 on CPU).",
        choices=("auto", "float32", "bfloat16", "float16"),
    ),
    Var(
        "MILLM_ENGINE_PACK_WEIGHTS",
        "Performance",
        "tristate",
        None,
        "On CPU in float32, repack every linear layer's weight into oneDNN's blocked layout "
        "when a model loads: true, false, or unset/auto = pack when one-row products through "
        "the model's own linears, timed at load, are no slower packed (it depends on the CPU), "
        "and in any case once the engine batches (several rows a step, where packing wins). "
        "A tied output embedding costs one extra copy of itself.",
    ),
    Var(
        "MILLM_ENGINE_FUSED_KERNELS",
        "Performance",
        "tristate",
        None,
        "On CPU in float32, the lean decode step (MILLM_ENGINE_LEAN_DECODE) runs its small "
        "operations between the products — norms with their residual adds, rotary, the cache "
        "write and attention, SiLU — as three C functions built with the machine's C compiler "
        "on first use (backends/transformers/cpu_fused.c): unset/auto = where they build, "
        "true = refuse a load where they cannot, false = PyTorch's calls. Read when a model loads.",
    ),
    Var(
        "MILLM_ENGINE_LEAN_DECODE",
        "Performance",
        "bool",
        True,
        "The transformers backend (serial and continuously batched) decodes Llama-family "
        "models one token a step "
        "without model.forward (the modules' own weights and hooks, KV in preallocated "
        "buffers: backends/transformers/lean.py); false always runs model.forward. "
        "Read when a model loads.",
    ),
    # --- Distributed engine ---------------------------------------------------------
    Var(
        "ENGINE_STREAM_PREFIX",
        "Distributed engine",
        "str",
        "millm",
        "Prefix of every Redis key and stream the web tier and run_engine share (command "
        "and request streams, heartbeat, per-request streams). One prefix is one engine; "
        "give each engine of a multi-engine deployment its own.",
    ),
    Var(
        "ENGINE_NAME",
        "Distributed engine",
        "str",
        "default",
        "run_engine's name (also `run_engine --name`): the engine `default` uses "
        "ENGINE_STREAM_PREFIX, any other name `<ENGINE_STREAM_PREFIX>.<name>`, so each name is "
        "one engine; it restores only the models the registry records on it. Letters, digits, _ -.",
    ),
    Var(
        "ENGINE_MODELS",
        "Distributed engine",
        "str",
        "",
        "Which engine (ENGINE_NAME) may hold which models, for the web tier and workers that "
        "route by model name: `gpu1:model-b;default:*` (engine:name-or-pattern,...; a model "
        "goes to the first engine naming it exactly, else the first pattern that matches). "
        "Empty: one engine, `default`, holding any model. More than the default engine needs "
        "REDIS_URL.",
    ),
    Var(
        "ENGINE_HEARTBEAT_S",
        "Distributed engine",
        "float",
        1.0,
        "How often run_engine rewrites its heartbeat (its status: model, attachments, "
        "requests in flight) and renews its claim on the work it holds.",
        minimum=0.05,
    ),
    Var(
        "ENGINE_DEAD_AFTER_S",
        "Distributed engine",
        "float",
        5.0,
        "Seconds without a heartbeat after which the engine counts as dead: waiting clients "
        "get an error (SSE error frame or 503 with Retry-After), new requests get "
        "model_not_loaded, and the work it held can be reclaimed by the next engine. At "
        "least twice ENGINE_HEARTBEAT_S.",
        minimum=0.5,
    ),
    Var(
        "ENGINE_MAX_DELIVERIES",
        "Distributed engine",
        "int",
        3,
        "Deliveries of one job or command after which it goes to the dead-letter stream "
        "(its client gets an error) instead of to another engine.",
        minimum=1,
        maximum=100,
    ),
    Var(
        "ENGINE_MAX_IN_FLIGHT",
        "Distributed engine",
        "int",
        0,
        "Jobs run_engine takes from the request stream at once, a safety net behind /v1's "
        "admission (which decides the queue); 0 = the most slots a model can get "
        "(MAX_CONCURRENT_REQUESTS; unset, the larger of 1 and VLLM_MAX_NUM_SEQS) + "
        "MAX_PENDING_REQUESTS + BATCH_ENGINE_ROWS, so no admitted job waits in the stream "
        "behind batch lines. Otherwise at least "
        "MAX_CONCURRENT_REQUESTS.",
        minimum=0,
    ),
    Var(
        "ENGINE_COMMAND_TIMEOUT_S",
        "Distributed engine",
        "float",
        900.0,
        "Longest a web process or worker waits for run_engine to answer a command (a model "
        "load) or a request, beyond the drain wait; a dead engine ends the wait sooner.",
        minimum=1,
    ),
    Var(
        "ENGINE_RESULT_TTL_S",
        "Distributed engine",
        "int",
        600,
        "Seconds a request's event stream and started marker stay in Redis after the last write.",
        minimum=10,
    ),
    Var(
        "ENGINE_SHUTDOWN_GRACE_S",
        "Distributed engine",
        "float",
        30.0,
        "On SIGTERM, seconds run_engine lets running requests finish before it stops them "
        "(their clients get engine_unavailable).",
        minimum=0,
    ),
    # --- Continuous batching --------------------------------------------------------
    Var(
        "ENABLE_CONTINUOUS_BATCHING",
        "Continuous batching",
        "bool",
        False,
        "Run generations through the engine's continuous-batching scheduler: requests join "
        "and leave the running batch between decode steps and share forward passes, each "
        "keeping its own sampling, seed, stops, steering and exact monitoring (no serial "
        "fallback). Off: one generation at a time.",
    ),
    Var(
        "CBM_MAX_QUEUE_SIZE",
        "Continuous batching",
        "int",
        256,
        "With batching: sequences the engine holds beyond its free rows, waiting for one; "
        "more are refused at once (503 model_busy). A safety net behind /v1's admission: "
        "never less than the jobs run_engine takes beyond the fewest slots a model can get "
        "(ENGINE_MAX_IN_FLIGHT - MAX_CONCURRENT_REQUESTS, or fewer on vLLM; with it unset, "
        "ENGINE_MAX_IN_FLIGHT - 1), so admitted work is never refused.",
        minimum=1,
    ),
    Var(
        "CBM_DEFAULT_TEMPERATURE",
        "Continuous batching",
        "float",
        0.7,
        "On an engine that batches, the temperature of a /v1 request that sends none "
        "(1 on a serial engine); a request's own value always wins.",
        minimum=0,
        maximum=2,
    ),
    Var(
        "CBM_DEFAULT_TOP_P",
        "Continuous batching",
        "float",
        0.95,
        "On an engine that batches, the top-p of a /v1 request that sends none (1 on a serial engine).",
        minimum=0,
        maximum=1,
    ),
    Var(
        "CBM_DEFAULT_MAX_TOKENS",
        "Continuous batching",
        "int",
        512,
        "On an engine that batches, the token budget of a /v1 request that sends no "
        "max_tokens: a ceiling a long prompt shrinks, never a refusal.",
        minimum=1,
    ),
    Var(
        "CBM_GATHER_MS",
        "Continuous batching",
        "int",
        50,
        "With batching: when /v1 generation requests reach an idle batch while others that "
        "came in with them are still being prepared (parsed, resolved, planned), the first "
        "prefill waits for those, at most this many milliseconds, so a burst starts as one "
        "batch instead of the late arrivals waiting behind the early ones' prefill. A lone "
        "request never waits; 0 turns the wait off. Embedded mode (the web tier and the "
        "engine in one process).",
        minimum=0,
        maximum=10000,
    ),
    Var(
        "CBM_FORCE_SERIAL_MONITORING",
        "Continuous batching",
        "bool",
        False,
        "With batching: a request that monitors SAE features runs alone (the batch drains "
        "first, others wait for it). Attribution is exact in the batch either way; this "
        "only trades throughput for isolation.",
    ),
    # --- Batch API --------------------------------------------------------------------
    Var(
        "BATCH_ENGINE_ROWS",
        "Batch API",
        "int",
        4,
        "Batch API lines one batch runner keeps at the engine at once. With continuous "
        "batching these are extra rows beyond the interactive slots that only batch lines "
        "use, so interactive requests keep their own rows (and their time to first token); "
        "batch lines start only when no interactive request waits. Serial backend: batch "
        "lines queue behind every interactive request.",
        minimum=1,
        maximum=256,
    ),
    Var(
        "BATCH_MAX_FILE_LINES",
        "Batch API",
        "int",
        50000,
        "Most requests (lines) one batch input file may hold; more is refused at upload with 400.",
        minimum=1,
    ),
    Var(
        "BATCH_MAX_FILE_BYTES",
        "Batch API",
        "int",
        200 * 1024 * 1024,
        "Largest batch input file accepted by POST /v1/files, in bytes (200 MiB).",
        minimum=1,
    ),
    Var(
        "BATCH_MAX_LINE_BYTES",
        "Batch API",
        "int",
        1024 * 1024,
        "Largest single line of a batch input file, in bytes (1 MiB).",
        minimum=1,
    ),
    Var(
        "BATCH_RUNNER_STALE_S",
        "Batch API",
        "float",
        30.0,
        "Seconds without a heartbeat after which a batch's runner (a Celery worker, or the "
        "embedded process) counts as gone: the next start-up or worker takes the batch over "
        "and re-runs the lines that were running but not answered. A feature dashboard run's "
        "runner counts as gone after the same time (the run resumes from its last checkpoint).",
        minimum=1,
    ),
    Var(
        "BATCH_SWEEP_INTERVAL_S",
        "Batch API",
        "float",
        30.0,
        "Seconds between two sweeps of the batch sweeper (a thread of the embedded server "
        "and of every Celery worker of the batches queue): a batch whose runner's heartbeat "
        "is stale is queued for a new runner, one left finalizing is finalized again, and "
        "one past its completion window with no live runner ends expired. The dashboards "
        "sweeper (the embedded server, every worker of the dashboards queue) runs as often: a "
        "dashboard run whose runner is stale is queued for a new runner, a cancel no runner "
        "saw ends cancelled.",
        minimum=1,
    ),
    Var(
        "BATCH_MAX_RESUMES",
        "Batch API",
        "int",
        5,
        "Times the sweeper queues a new runner for a batch whose runner died; the next "
        "time it ends failed (error batch_runner_failed), its answered lines kept in the "
        "output and error files. A feature-dashboard run is taken over at most this many "
        "times from a runner that died; the next take-over ends it failed "
        "(DASHBOARD_RUNNER_FAILED), nothing stored.",
        minimum=0,
    ),
    Var(
        "FILES_MAX_BYTES_PER_OWNER",
        "Batch API",
        "int",
        2 * 1024 * 1024 * 1024,
        "Most bytes of files (batch inputs and outputs) one API key, or the anonymous owner "
        "when keys are off, may hold in /v1/files (2 GiB). An upload that would pass it is "
        "refused with 413 files_quota_exceeded and nothing is stored; 0: no limit. Batch "
        "outputs count but are never refused.",
        minimum=0,
    ),
    Var(
        "FILES_MAX_BYTES_TOTAL",
        "Batch API",
        "int",
        20 * 1024 * 1024 * 1024,
        "Most bytes of files all owners together may hold in /v1/files (20 GiB). An upload "
        "that would pass it is refused with 507 insufficient_storage and nothing is stored; "
        "0: no limit.",
        minimum=0,
    ),
    # --- Responses API ----------------------------------------------------------------
    Var(
        "RESPONSES_RETENTION_DAYS",
        "Responses API",
        "int",
        30,
        "Days a stored response of POST /v1/responses (store=true, the default) is kept, "
        "as OpenAI's 30: the batch sweeper deletes older ones, after which GET and "
        "previous_response_id to them answer 404. 0 keeps them until deleted.",
        minimum=0,
    ),
    Var(
        "AUDIT_RETENTION_DAYS",
        "Responses API",
        "int",
        90,
        "Days an audit log entry (GET /api/audit, the admin's Audit log) is kept: the "
        "batch sweeper deletes older ones with the stored responses past their retention. "
        "0 keeps them forever.",
        minimum=0,
    ),
    Var(
        "RESPONSES_MAX_STORED_BYTES",
        "Responses API",
        "int",
        16 * 1024 * 1024,
        "Largest stored response (its Response object and its request's input items, as "
        "JSON) in bytes (16 MiB): a larger one is refused with 400 response_too_large and "
        "nothing is stored; 0: no limit.",
        minimum=0,
    ),
    Var(
        "RESPONSES_BACKGROUND_WORKERS",
        "Responses API",
        "int",
        2,
        "Embedded mode: background responses (POST /v1/responses with background=true) "
        "run at once in this process, each a thread of the responses pool; more wait "
        "queued. Distributed mode: the concurrency of the Celery workers of the "
        "responses queue decides.",
        minimum=1,
        maximum=64,
    ),
    # --- Feature dashboards and explanations -----------------------------------------
    Var(
        "DASHBOARD_DIR",
        "Feature dashboards",
        "str",
        None,
        "Where a running feature-dashboard job keeps its working files (each context's "
        "activations, the checkpoint it resumes from after a restart); removed when the "
        "run ends (default MILLM_DATA_DIR/dashboards). In distributed mode a path the "
        "workers of the dashboards queue share.",
        derive=_under_data("dashboards"),
    ),
    Var(
        "DASHBOARD_MAX_TOKENS",
        "Feature dashboards",
        "int",
        2_000_000,
        "Largest token_budget one dashboard run may ask for (POST /api/saes/{id}/dashboards, "
        "manage.py dashboards); a larger one is refused with 422 naming token_budget.",
        minimum=1,
    ),
    Var(
        "DASHBOARD_ENGINE_ROWS",
        "Feature dashboards",
        "int",
        16,
        "Corpus contexts a dashboard run keeps at the engine at once (they are batched "
        "together as concurrent requests are).",
        minimum=1,
        maximum=256,
    ),
    Var(
        "DASHBOARD_WORKERS",
        "Feature dashboards",
        "int",
        1,
        "Embedded mode: dashboard runs at once in this process (the dashboards pool); more "
        "wait queued. Distributed mode: the concurrency of the Celery workers of the "
        "dashboards queue decides.",
        minimum=1,
        maximum=16,
    ),
    # --- Steering experiments ---------------------------------------------------------
    Var(
        "EXPERIMENT_MAX_POINTS",
        "Steering experiments",
        "int",
        256,
        "Largest grid one sweep may ask for (POST /api/experiments/sweep, manage.py sweep): "
        "prompts × (1 + variants × strengths) points, each prompt's unsteered default "
        "included; a calibration's prompts × (max_iterations + 2) teacher-forced passes "
        "count the same way. A larger one is refused with 422 naming the field before "
        "anything runs.",
        minimum=1,
        maximum=100_000,
    ),
    Var(
        "EXPERIMENT_ENGINE_ROWS",
        "Steering experiments",
        "int",
        16,
        "Engine jobs (generations and teacher-forced passes) an experiment keeps at the "
        "engine at once; they are batched together as concurrent requests are.",
        minimum=1,
        maximum=256,
    ),
    Var(
        "EXPERIMENT_WORKERS",
        "Steering experiments",
        "int",
        1,
        "Embedded mode: experiments run at once in this process (the experiments pool); "
        "more wait queued. Distributed mode: the concurrency of the Celery workers of the "
        "experiments queue decides.",
        minimum=1,
        maximum=16,
    ),
    Var(
        "EXPLAINER_BASE_URL",
        "Feature dashboards",
        "str",
        "",
        "An OpenAI-compatible endpoint (its /v1 base URL, e.g. http://127.0.0.1:8000/v1 for "
        "this server's own) that writes explanations of features from their top contexts "
        "(POST /api/saes/{id}/explanations/generate). Empty: automatic explanations are "
        "refused with 409 EXPLAINER_NOT_CONFIGURED; the generation runs in the request.",
    ),
    Var(
        "EXPLAINER_MODEL",
        "Feature dashboards",
        "str",
        "",
        "The model name sent to EXPLAINER_BASE_URL (empty: the first of its /v1/models).",
    ),
    Var(
        "EXPLAINER_API_KEY",
        "Feature dashboards",
        "str",
        "",
        "Bearer key sent to EXPLAINER_BASE_URL (empty: none).",
        secret=True,
    ),
    Var(
        "EXPLAINER_TIMEOUT_S",
        "Feature dashboards",
        "float",
        120.0,
        "Seconds one call to the explainer may take: past it, that feature's explanation fails "
        "(reported in the answer, nothing stored for it).",
        minimum=1,
    ),
    # --- Capture --------------------------------------------------------------------
    Var(
        "CAPTURE_DIR",
        "Capture",
        "str",
        None,
        "Where captured hidden states larger than "
        "CAPTURE_INLINE_MAX_BYTES are stored (default MILLM_DATA_DIR/captures). In "
        "distributed mode the engine writes there and the web tier serves from there: a "
        "path both see.",
        derive=_under_data("captures"),
    ),
    Var(
        "CAPTURE_MAX_BYTES",
        "Capture",
        "int",
        256 * 1024 * 1024,
        "Largest capture a request may ask for, in bytes, estimated before generation "
        "from every row it may take (rows x layers x hidden size x dtype size); larger is "
        "refused with 400 capture_too_large naming the estimate.",
        minimum=1,
    ),
    Var(
        "CAPTURE_INLINE_MAX_BYTES",
        "Capture",
        "int",
        1024 * 1024,
        "A capture artifact of at most this many bytes comes back inline (base64 in "
        "millm.capture); a larger one is stored under CAPTURE_DIR and fetched by id from "
        "/api/captures.",
        minimum=0,
    ),
    Var(
        "CAPTURE_RETENTION_S",
        "Capture",
        "int",
        86400,
        "Seconds a stored capture is kept: an expired one is no longer listed or served, "
        "and the server deletes it (and files no capture row names) every "
        "CAPTURE_PRUNE_INTERVAL_S, as manage.py prune_captures does at once. 0 keeps them "
        "until deleted.",
        minimum=0,
    ),
    Var(
        "CAPTURE_PRUNE_INTERVAL_S",
        "Capture",
        "float",
        300.0,
        "Seconds between two prunes of expired captures by the capture pruner, a thread "
        "of every web process (embedded and distributed alike): nobody has to run "
        "manage.py prune_captures.",
        minimum=1,
    ),
    Var(
        "CAPTURE_DIR_MAX_BYTES",
        "Capture",
        "int",
        10 * 1024 * 1024 * 1024,
        "Most bytes all stored captures together may hold under CAPTURE_DIR (10 GiB). A "
        "request whose capture could be stored and would pass it (its estimate, as for "
        "CAPTURE_MAX_BYTES, above the room left) is refused before generation with 507 "
        "capture_store_full naming this setting; 0: no quota.",
        minimum=0,
    ),
    Var(
        "ANALYZERS_EXTRA",
        "Capture",
        "list",
        [],
        "A deployment's own analyzers: comma-separated package.module:function entries, "
        "each called at start-up with the analyzer registry to register analyzers. An entry "
        "that does not import or register stops start-up with one line.",
    ),
    Var(
        "ANALYZER_PROBE_DIR",
        "Capture",
        "str",
        None,
        "Where the probe files that "
        "analyzers read (H-Node .npz, science probe .json/.npz) live (default "
        "MILLM_DATA_DIR/probes). Requests name a file inside it, never a path.",
        derive=_under_data("probes"),
    ),
    Var(
        "ANALYSIS_TIMEOUT_S",
        "Capture",
        "float",
        120.0,
        "The longest a request waits for its analyses (an analyze field on /v1, "
        "/api/captures/{id}/analyze). In distributed mode they run on the Celery analysis "
        "queue: with no worker consuming it in time, a /v1 analysis entry is the error "
        "analysis_unavailable and /api/captures/{id}/analyze is 503 ANALYSIS_UNAVAILABLE.",
        minimum=1,
    ),
    # --- Structured output ----------------------------------------------------------
    Var(
        "STRUCTURED_MAX_PATTERN_LENGTH",
        "Structured output",
        "int",
        1000,
        "Longest regex a response_format or tool schema may hold (each pattern and "
        "patternProperties key), in characters; longer is 400 schema_too_complex naming "
        "the field.",
        minimum=1,
    ),
    Var(
        "STRUCTURED_MAX_REPEAT",
        "Structured output",
        "int",
        1000,
        "Largest repetition bound in a schema's regex: each {n}, {n,} or {n,m} (its larger "
        "number) times the bounds of the groups around it; larger is 400 "
        "schema_too_complex naming the field (xgrammar's build time grows with it: "
        "a{2000} 0.6 s, a{20000} ~25 s). Also the most a pattern's repetitions together "
        "may add to its length (a{999} twenty times adds 19,960).",
        minimum=1,
    ),
    Var(
        "STRUCTURED_MAX_SCHEMA_REPEAT",
        "Structured output",
        "int",
        4000,
        "The most every pattern of one schema together may add by repetition (the sum of "
        "what STRUCTURED_MAX_REPEAT bounds per pattern); more is 400 schema_too_complex "
        "naming the pattern that passed it.",
        minimum=1,
    ),
    Var(
        "STRUCTURED_COMPILE_TIMEOUT_S",
        "Structured output",
        "float",
        10.0,
        "The longest a request's grammar may take to build (a child process of the engine, "
        "off its generation thread; killed at the deadline); over it the request is 400 "
        "schema_too_complex and other requests never waited for it.",
        minimum=0.1,
    ),
    # --- Transformers models --------------------------------------------------------
    Var(
        "TRANSFORMERS_MIN_CONTEXT",
        "Transformers models",
        "int",
        4096,
        "Context whose KV cache every card a model uses must have room for (or the model's "
        "own maximum if shorter); a floor for loading, not a request limit.",
        minimum=1,
    ),
    Var(
        "TRANSFORMERS_CUDA_CONTEXT_MB",
        "Transformers models",
        "int",
        500,
        "Memory each card keeps for its CUDA context, in MB: a transformers load or SAE "
        "attach must fit in what the card reports free minus this.",
        minimum=0,
    ),
    Var(
        "TRANSFORMERS_IDLE_CACHE_RELEASE_S",
        "Transformers models",
        "float",
        5.0,
        "Idle seconds (nothing running, nothing queued) before the engine releases the "
        "memory a transformers model keeps between requests: the batched KV cache, "
        "PyTorch's cached CUDA memory, glibc's free heap on the CPU. Never during a "
        "request; a request that arrives first cancels it. 0 at once, negative never.",
    ),
    # --- GGUF models ----------------------------------------------------------------
    Var(
        "GGUF_CONTEXT_LENGTH",
        "GGUF models",
        "int",
        32768,
        "Ceiling on the loaded context window; 0 = what the file declares.",
        minimum=0,
    ),
    Var(
        "GGUF_TENSOR_SPLIT",
        "GGUF models",
        "list",
        [],
        "Per-card proportions for a multi-GPU GGUF load (empty = by free memory).",
    ),
    Var(
        "GGUF_KV_CACHE_TYPE",
        "GGUF models",
        "str",
        "q8_0",
        "KV-cache precision. A "
        "quantized cache (the default q8_0) is near-lossless for generation but not for "
        "reading the model: captured hidden states, SAE activations (monitoring, "
        "return_sae_activations) and logprobs then differ from a float32 reference "
        "(measured on the tiny test Llama: hidden states by up to 0.06, an SAE activation by "
        "4 %, logprobs by 0.01). For exact reads set f32 (or f16) with "
        "GGUF_FLASH_ATTENTION=false; the fidelity tests run that way.",
        choices=("f32", "f16", "bf16", "q8_0", "q5_1", "q5_0", "q4_1", "q4_0", "iq4_nl"),
    ),
    Var("GGUF_FLASH_ATTENTION", "GGUF models", "bool", True, "Flash attention; required by a quantized KV cache."),
    Var(
        "GGUF_ENABLE_EMBEDDINGS",
        "GGUF models",
        "bool",
        True,
        "Load GGUF models with embedding output so /v1/embeddings works.",
    ),
    Var(
        "GGUF_STEERING_MODE",
        "GGUF models",
        "str",
        "auto",
        "How requests with different steering share a GGUF model: auto (per-row writes in "
        "the eval callback where the load's self-check shows they hold, else control "
        "vectors swapped between requests) or control_vector_swap (the fallback, forced).",
        choices=("auto", "control_vector_swap"),
    ),
    # --- vLLM models ----------------------------------------------------------------
    Var(
        "VLLM_TENSOR_PARALLEL_SIZE",
        "vLLM models",
        "int",
        1,
        "GPUs each pipeline stage of a model on the vllm backend is split over (tensor "
        "parallelism; every rank holds the full hidden state after its all-reduce, so "
        "steering and monitoring are unchanged).",
        minimum=1,
        maximum=64,
    ),
    Var(
        "VLLM_PIPELINE_PARALLEL_SIZE",
        "vLLM models",
        "int",
        1,
        "Pipeline stages (groups of layers) a model on the vllm backend is split over; "
        "with more than one node, stages run on other nodes through Ray.",
        minimum=1,
        maximum=64,
    ),
    Var(
        "VLLM_DISTRIBUTED_EXECUTOR",
        "vLLM models",
        "str",
        "mp",
        "How vLLM runs its workers: mp (processes on this host), ray (a Ray cluster, "
        "for more than one node), uni (engine core and the one worker inside the engine "
        "process: one device only, the cheapest start).",
        choices=("mp", "ray", "uni"),
    ),
    Var(
        "VLLM_GPU_MEMORY_UTILIZATION",
        "vLLM models",
        "float",
        0.9,
        "Share of each GPU's memory vLLM may take for weights, activations and its paged "
        "KV cache (ignored on CPU, where VLLM_CPU_KVCACHE_SPACE in GiB sizes the cache).",
        minimum=0.05,
        maximum=1.0,
    ),
    Var(
        "VLLM_MAX_MODEL_LEN",
        "vLLM models",
        "int",
        0,
        "Context window vLLM serves, at most the model's own (a larger value serves the "
        "model's own); 0 = the model's own.",
        minimum=0,
    ),
    Var(
        "VLLM_MAX_NUM_SEQS",
        "vLLM models",
        "int",
        16,
        "Requests vLLM runs in one batch at most (its continuous batch's rows). With "
        "MAX_CONCURRENT_REQUESTS unset (0) a model on vLLM gets this many /v1 slots; "
        "MAX_CONCURRENT_REQUESTS set caps them (the smaller of the two wins).",
        minimum=1,
        maximum=4096,
    ),
    Var(
        "VLLM_ENFORCE_EAGER",
        "vLLM models",
        "bool",
        True,
        "Run vLLM eagerly (no CUDA graphs, no torch.compile). With false vLLM compiles the "
        "model at load (about a minute on two CPU cores) and, on CUDA, captures piecewise "
        "CUDA graphs; steering, monitoring and capture run in both (the compiled graph "
        "calls the taps miLLM's loader puts on every layer).",
    ),
)
