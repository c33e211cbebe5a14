"""Configuration: every documented variable, its default, and every start-up refusal."""

from __future__ import annotations

import json

import pytest

from millm_site.config import VARIABLES_BY_NAME, ConfigError, load_config
from tests.conftest import manage

# The configuration reference of the original (shared/seeds/001), name -> default, typed as
# the variable parses. Paths under /app become paths under MILLM_DATA_DIR (README).
SEED_DEFAULTS = {
    "HF_TOKEN": "",
    "HOST": "0.0.0.0",
    "PORT": 8000,
    "DEBUG": False,
    "REDIS_URL": "",
    "AUTO_LOAD_MODEL": "",
    "LOG_LEVEL": "INFO",
    "LOG_FORMAT": "console",
    "MAX_CONCURRENT_REQUESTS": 0,  # unset: the slots follow the loaded model's backend
    "MAX_PENDING_REQUESTS": 10,
    "MAX_DOWNLOAD_WORKERS": 2,
    "MAX_LOAD_WORKERS": 1,
    "GRACEFUL_UNLOAD_TIMEOUT": 30.0,
    "DOWNLOAD_TIMEOUT": 3600.0,
    "LEASE_DEFAULT_TTL_SECONDS": 7200,
    "LEASE_MAX_TTL_SECONDS": 7200,
    "LEASE_HOLDER_MAX_CHARS": 128,
    "LEASE_REASON_MAX_CHARS": 512,
    "LEASE_ENDED_MEMORY": 64,
    "QUEUE_DURATION_WINDOW": 50,
    "RETRY_AFTER_QUEUE_DEFAULT_S": 5,
    "RETRY_AFTER_MAX_S": 60,
    "RETRY_AFTER_LOAD_S": 15,
    "RETRY_AFTER_UNLOAD_S": 5,
    "RETRY_AFTER_NOT_LOADED_S": 30,
    "RETRY_AFTER_MEMORY_S": 30,
    "RETRY_AFTER_READINESS_S": 5,
    "RETRY_AFTER_FALLBACK_S": 10,
    "TORCH_COMPILE": None,
    "TORCH_COMPILE_MODE": "reduce-overhead",
    "KV_CACHE_MODE": "dynamic",
    "SPECULATIVE_MODEL": "",
    "SPECULATIVE_NUM_TOKENS": 5,
    "ENABLE_CONTINUOUS_BATCHING": False,
    "CBM_MAX_QUEUE_SIZE": 256,
    "CBM_DEFAULT_TEMPERATURE": 0.7,
    "CBM_DEFAULT_TOP_P": 0.95,
    "CBM_DEFAULT_MAX_TOKENS": 512,
    "CBM_GATHER_MS": 50,
    "CBM_FORCE_SERIAL_MONITORING": False,
    "TRANSFORMERS_MIN_CONTEXT": 4096,
    "TRANSFORMERS_CUDA_CONTEXT_MB": 500,
    "TRANSFORMERS_IDLE_CACHE_RELEASE_S": 5.0,
    "GGUF_CONTEXT_LENGTH": 32768,
    "GGUF_TENSOR_SPLIT": [],
    "GGUF_KV_CACHE_TYPE": "q8_0",
    "GGUF_FLASH_ATTENTION": True,
    "GGUF_ENABLE_EMBEDDINGS": True,
}


def test_every_seed_variable_exists_with_its_default():
    config = load_config({})
    for name, default in SEED_DEFAULTS.items():
        assert name in VARIABLES_BY_NAME, name
        assert config[name] == default, name
    assert config.MODEL_CACHE_DIR.endswith("/model_cache")
    assert config.SAE_CACHE_DIR.endswith("/sae_cache")


def test_the_seed_cors_default_holds_only_with_keys():
    """The original's CORS_ORIGINS=* stays the default of a server with keys; without keys
    any web page could drive it (docs/security.md), so none is granted and * is refused."""
    assert load_config({"MILLM_API_KEYS": "k"}).CORS_ORIGINS == ["*"]
    assert load_config({"MILLM_ADMIN_API_KEYS": "a:k"}).CORS_ORIGINS == ["*"]
    assert load_config({}).CORS_ORIGINS == []
    assert load_config({}).ALLOWED_HOSTS == ["localhost", "127.0.0.1", "::1", "[::1]"]
    assert load_config({"HOST": "192.0.2.4"}).ALLOWED_HOSTS[-1] == "192.0.2.4"
    with pytest.raises(ConfigError, match="CORS_ORIGINS.*MILLM_API_KEYS"):
        load_config({"CORS_ORIGINS": "*"})
    for bad in ({"ROOT_PATH": "x/"}, {"TRUSTED_PROXIES": "proxy.example"}):
        with pytest.raises(ConfigError):
            load_config(bad)


def test_cache_dirs_follow_the_data_directory():
    config = load_config({"MILLM_DATA_DIR": "/app"})
    assert config.MODEL_CACHE_DIR == "/app/model_cache"
    assert config.SAE_CACHE_DIR == "/app/sae_cache"
    explicit = load_config({"MILLM_DATA_DIR": "/app", "MODEL_CACHE_DIR": "/models"})
    assert explicit.MODEL_CACHE_DIR == "/models"


def test_values_are_parsed_by_type():
    config = load_config(
        {
            "PORT": "9000",
            "DEBUG": "yes",
            "GRACEFUL_UNLOAD_TIMEOUT": "2.5",
            "CORS_ORIGINS": "http://a.example, https://b.example",
            "TORCH_COMPILE": "false",
            "GGUF_TENSOR_SPLIT": "1,3",
        }
    )
    assert config.PORT == 9000 and config.DEBUG is True
    assert config.GRACEFUL_UNLOAD_TIMEOUT == 2.5
    assert config.CORS_ORIGINS == ["http://a.example", "https://b.example"]
    assert config.TORCH_COMPILE is False
    assert config.GGUF_TENSOR_SPLIT == ["1", "3"]


def test_database_url_unset_is_sqlite_in_the_data_dir_and_set_is_postgres():
    sqlite = load_config({"MILLM_DATA_DIR": "/srv/millm"}).database()
    assert sqlite["ENGINE"] == "django.db.backends.sqlite3"
    assert sqlite["NAME"] == "/srv/millm/millm.sqlite3"
    pg = load_config(
        {"DATABASE_URL": "postgresql+asyncpg://u:pw@db.internal:5433/millm", "SECRET_KEY": "x" * 40}
    ).database()
    assert pg["ENGINE"] == "django.db.backends.postgresql"
    assert (pg["HOST"], pg["PORT"], pg["NAME"], pg["USER"], pg["PASSWORD"]) == ("db.internal", 5433, "millm", "u", "pw")


def test_redis_url_selects_distributed_mode():
    assert load_config({}).embedded is True
    assert load_config({"REDIS_URL": "redis://127.0.0.1:6379/0"}).embedded is False


REFUSALS = [
    ({"MAX_PENDING_REQUESTS": "-1"}, "MAX_PENDING_REQUESTS", "must be >= 0"),
    ({"MAX_CONCURRENT_REQUESTS": "-1"}, "MAX_CONCURRENT_REQUESTS", "must be >= 0"),
    ({"PORT": "eighty"}, "PORT", "must be an integer"),
    ({"PORT": "70000"}, "PORT", "must be <= 65535"),
    ({"METRICS_PUSH_INTERVAL_S": "-1"}, "METRICS_PUSH_INTERVAL_S", "must be >= 0"),
    ({"GRACEFUL_UNLOAD_TIMEOUT": "nan"}, "GRACEFUL_UNLOAD_TIMEOUT", "finite"),
    ({"DEBUG": "maybe"}, "DEBUG", "must be true/false"),
    ({"LOG_FORMAT": "xml"}, "LOG_FORMAT", "must be one of console, json"),
    ({"LOG_LEVEL": "LOUD"}, "LOG_LEVEL", "must be one of"),
    (
        {"LEASE_DEFAULT_TTL_SECONDS": "9000"},
        "LEASE_DEFAULT_TTL_SECONDS",
        "must not exceed LEASE_MAX_TTL_SECONDS (7200)",
    ),
    ({"GGUF_FLASH_ATTENTION": "false"}, "GGUF_FLASH_ATTENTION", "quantized (q8_0)"),
    ({"GGUF_TENSOR_SPLIT": "1,zero"}, "GGUF_TENSOR_SPLIT", "comma-separated numbers"),
    ({"KV_CACHE_MODE": "paged"}, "KV_CACHE_MODE", "must be one of dynamic, static"),
    ({"TORCH_COMPILE": "sometimes"}, "TORCH_COMPILE", "true/false/auto"),
    ({"CBM_DEFAULT_TOP_P": "1.5"}, "CBM_DEFAULT_TOP_P", "must be <= 1"),
    ({"RETRY_AFTER_QUEUE_DEFAULT_S": "90"}, "RETRY_AFTER_QUEUE_DEFAULT_S", "must not exceed RETRY_AFTER_MAX_S"),
    (
        {"ENGINE_MAX_IN_FLIGHT": "2", "MAX_CONCURRENT_REQUESTS": "4"},
        "ENGINE_MAX_IN_FLIGHT",
        "at least MAX_CONCURRENT_REQUESTS (4)",
    ),
    ({"MILLM_ENGINE_DEVICE": "tpu"}, "MILLM_ENGINE_DEVICE", "auto, cpu, cuda or cuda:N"),
    (
        {"DATABASE_URL": "mysql://root@localhost/millm", "SECRET_KEY": "x" * 40},
        "DATABASE_URL",
        "must be a PostgreSQL URL",
    ),
    ({"REDIS_URL": "http://127.0.0.1:6379"}, "REDIS_URL", "redis://"),
    ({"CORS_ORIGINS": "example.com"}, "CORS_ORIGINS", "http(s) URL"),
    ({"DATABASE_URL": "postgresql://u@127.0.0.1:5432/millm"}, "SECRET_KEY", "required when DEBUG is off"),
    ({"SECRET_KEY": "short"}, "SECRET_KEY", "at least 32 characters"),
    ({"ANALYZERS_EXTRA": "my_analyzers.register"}, "ANALYZERS_EXTRA", "package.module:function"),
]


@pytest.mark.parametrize(
    ("env", "name", "rule"), REFUSALS, ids=[r[1] + ":" + next(iter(r[0].values()))[:12] for r in REFUSALS]
)
def test_bad_value_is_refused_naming_the_variable(env, name, rule):
    with pytest.raises(ConfigError) as info:
        load_config(env)
    assert info.value.name == name
    assert rule in str(info.value)
    assert str(info.value).startswith(f"{name}: ")


def test_quantized_kv_cache_is_fine_with_flash_attention_and_f16_without():
    load_config({"GGUF_KV_CACHE_TYPE": "q4_0", "GGUF_FLASH_ATTENTION": "true"})
    load_config({"GGUF_KV_CACHE_TYPE": "f16", "GGUF_FLASH_ATTENTION": "false"})


@pytest.mark.parametrize(
    ("env", "name"),
    [
        ({"MAX_PENDING_REQUESTS": "-1"}, "MAX_PENDING_REQUESTS"),
        ({"LEASE_DEFAULT_TTL_SECONDS": "9000"}, "LEASE_DEFAULT_TTL_SECONDS"),
        ({"GGUF_FLASH_ATTENTION": "false", "GGUF_KV_CACHE_TYPE": "q4_0"}, "GGUF_FLASH_ATTENTION"),
        ({"LOG_FORMAT": "xml"}, "LOG_FORMAT"),
        ({"DATABASE_URL": "postgresql://u@127.0.0.1:5432/millm"}, "SECRET_KEY"),
    ],
)
def test_process_refuses_to_start_with_one_line(tmp_path, env, name):
    result = manage("check", env={"MILLM_DATA_DIR": str(tmp_path), **env})
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"miLLM configuration error: {name}: ")
    assert "Traceback" not in result.stderr


def values(stdout: str) -> list[str]:
    """check_config's ``NAME=value`` lines without the ``# read in …`` note."""
    return [line.split("    #", 1)[0] for line in stdout.splitlines()]


def test_dotenv_file_is_read_and_validated(tmp_path):
    env_file = tmp_path / ".env"
    env_file.write_text("LOG_FORMAT=yaml\n")
    result = manage("check", env={"MILLM_DATA_DIR": str(tmp_path), "MILLM_ENV_FILE": str(env_file)})
    assert result.returncode == 2
    assert "LOG_FORMAT: must be one of console, json (got 'yaml')" in result.stderr
    env_file.write_text("MAX_PENDING_REQUESTS=33\n")
    result = manage("check_config", env={"MILLM_DATA_DIR": str(tmp_path), "MILLM_ENV_FILE": str(env_file)})
    assert result.returncode == 0, result.stderr
    assert "MAX_PENDING_REQUESTS=33" in values(result.stdout)


def test_real_environment_wins_over_dotenv(tmp_path):
    env_file = tmp_path / ".env"
    env_file.write_text("MAX_PENDING_REQUESTS=33\n")
    result = manage(
        "check_config",
        env={"MILLM_DATA_DIR": str(tmp_path), "MILLM_ENV_FILE": str(env_file), "MAX_PENDING_REQUESTS": "7"},
    )
    assert "MAX_PENDING_REQUESTS=7" in values(result.stdout)


def test_secrets_are_not_printed(tmp_path):
    result = manage("check_config", env={"MILLM_DATA_DIR": str(tmp_path), "HF_TOKEN": "hf_supersecret"})
    assert result.returncode == 0
    assert "hf_supersecret" not in result.stdout + result.stderr
    assert "HF_TOKEN=(set)" in result.stdout


def test_log_format_json_gives_one_json_object_per_line(tmp_path):
    result = manage("check_config", env={"MILLM_DATA_DIR": str(tmp_path), "LOG_FORMAT": "json", "LOG_LEVEL": "INFO"})
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in result.stderr.splitlines() if line.strip()]
    event = next(r for r in records if r["event"] == "config_ok")
    assert event["level"] == "info" and event["mode"] == "embedded"


def test_log_level_filters(tmp_path):
    result = manage("check_config", env={"MILLM_DATA_DIR": str(tmp_path), "LOG_FORMAT": "json", "LOG_LEVEL": "WARNING"})
    assert result.returncode == 0
    assert "config_ok" not in result.stderr


def test_cors_origins_reach_the_http_settings(tmp_path):
    code = (
        "import django; django.setup(); from django.conf import settings as s; "
        "print(getattr(s, 'CORS_ALLOW_ALL_ORIGINS', False), s.CORS_ALLOWED_ORIGINS)"
    )
    result = manage(
        "shell",
        "-v",
        "0",
        "-c",
        code,
        env={"MILLM_DATA_DIR": str(tmp_path), "CORS_ORIGINS": "http://localhost:3000,https://webui.example.com"},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == ("False ['http://localhost:3000', 'https://webui.example.com']")


def test_configuration_reference_documents_every_variable():
    from millm_site.config import BASE_DIR, VARIABLES

    text = (BASE_DIR / "docs" / "configuration.md").read_text()
    for var in VARIABLES:
        assert f"| `{var.name}` |" in text, var.name


# what is not the product (the declarations, the settings module that only re-exports
# names, test settings, tests, docs, benchmarks, pins, data)
NOT_PRODUCT = (
    "millm_site/config.py",
    "millm_site/config_variables.py",
    "millm_site/config_readers.py",
    "millm_site/settings/engine.py",
    "millm_site/test_settings.py",
)


def _product_words() -> dict[str, set[str]]:
    import re
    import subprocess

    from millm_site.config import BASE_DIR

    # tracked files and new ones not ignored: what a checkout holds while work is under way
    files = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=BASE_DIR,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    out = {}
    for f in files:
        top = f.split("/", 1)[0]
        if top in ("tests", "docs", "benchmarks", "requirements") or f in NOT_PRODUCT:
            continue
        if "/migrations/" in f or not (
            f.endswith((".py", ".html", ".js", ".sh")) or f.startswith(("scripts/", ".ci/"))
        ):
            continue
        text = (BASE_DIR / f).read_text(errors="ignore")
        out[f] = _ast_words(text) if f.endswith(".py") else set(re.findall(r"[A-Z][A-Z0-9_]+", text))
    # Config.database builds Django's DATABASES from DATABASE_URL inside the declarations
    out.setdefault("millm_site/config.py", set()).add("DATABASE_URL")
    return out


def _ast_words(text: str) -> set[str]:
    """Upper-case names a Python file uses as code (names, attributes, strings that are
    exactly a name): comments, docstrings and messages do not count."""
    import ast
    import re

    upper = re.compile(r"[A-Z][A-Z0-9_]+")
    words = set()
    for node in ast.walk(ast.parse(text)):
        value = (
            node.id
            if isinstance(node, ast.Name)
            else node.attr
            if isinstance(node, ast.Attribute)
            else node.value
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
            else None
        )
        if value is not None and upper.fullmatch(value):
            words.add(value)
    return words


def test_no_variable_is_accepted_and_read_by_nothing():
    """Every variable of the reference is read by product code, or declared not built
    (and then read by nothing, so building it means dropping the declaration)."""
    from millm_site.config import VARIABLES

    words = _product_words()
    read = {v.name: [f for f, w in words.items() if v.name in w] for v in VARIABLES}
    assert [v.name for v in VARIABLES if not v.unbuilt and not read[v.name]] == []
    assert {v.name: read[v.name] for v in VARIABLES if v.unbuilt and read[v.name]} == {}
    assert "orchestration/services.py" in read["GRACEFUL_UNLOAD_TIMEOUT"]  # the scan finds readers


def test_a_variable_not_built_yet_is_refused_unless_left_as_it_is(monkeypatch):
    """The declaration for a variable of the original's reference that nothing reads yet
    (none is left today: a stand-in is declared here)."""
    from millm_site import config

    stand_in = config.Var(
        "MILLM_NOT_BUILT",
        "Performance",
        "tristate",
        None,
        "a stand-in",
        unbuilt="a feature of the reference (test)",
        unbuilt_ok=(None, False),
    )
    monkeypatch.setattr(config, "VARIABLES", (*config.VARIABLES, stand_in))
    load_config({"MILLM_NOT_BUILT": "false"})
    with pytest.raises(ConfigError) as exc:
        load_config({"MILLM_NOT_BUILT": "true"})
    assert str(exc.value).startswith("MILLM_NOT_BUILT: ") and "not built yet" in str(exc.value)


def test_compile_and_cache_settings_are_accepted():
    config = load_config({"TORCH_COMPILE": "true", "TORCH_COMPILE_MODE": "max-autotune", "KV_CACHE_MODE": "static"})
    assert (config.TORCH_COMPILE, config.TORCH_COMPILE_MODE, config.KV_CACHE_MODE) == (True, "max-autotune", "static")
    assert load_config({"TORCH_COMPILE": "auto"}).TORCH_COMPILE is None


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (
            {"SPECULATIVE_MODEL": "self:layers=2", "ENABLE_CONTINUOUS_BATCHING": "true"},
            "speculative decoding runs on the serial path",
        ),
        ({"SPECULATIVE_MODEL": "self:layers=0"}, "self:layers=N"),
        ({"SPECULATIVE_MODEL": "self:4"}, "self:layers=N"),
        ({"SPECULATIVE_MODEL": "self:layers=2", "TORCH_COMPILE": "true"}, "runs eagerly"),
        ({"SPECULATIVE_MODEL": "self:layers=2", "KV_CACHE_MODE": "static"}, "runs eagerly"),
    ],
)
def test_speculative_settings_are_checked_together(env, message):
    with pytest.raises(ConfigError) as exc:
        load_config(env)
    assert str(exc.value).startswith("SPECULATIVE_MODEL: ") and message in str(exc.value)
    load_config({"SPECULATIVE_MODEL": "self:layers=2"})


def test_check_config_says_where_each_variable_takes_effect(tmp_path):
    from millm_site.config import VARIABLES

    result = manage("check_config", env={"MILLM_DATA_DIR": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    notes = {
        line.split("=", 1)[0]: line.split("    # ", 1)[1] for line in result.stdout.splitlines() if "    # " in line
    }
    assert set(notes) == {v.name for v in VARIABLES}
    words = _product_words()
    for v in VARIABLES:
        if v.unbuilt:
            assert notes[v.name].startswith("not built yet: "), v.name
        else:
            want = sorted(f for f, w in words.items() if v.name in w)
            assert notes[v.name] == "read in " + ", ".join(want), v.name


def test_check_config_says_which_setting_sizes_the_slots_on_each_backend(tmp_path):
    def slots(**env: str) -> list[str]:
        result = manage("check_config", env={"MILLM_DATA_DIR": str(tmp_path), **env})
        assert result.returncode == 0, result.stderr
        lines = result.stdout.splitlines()
        start = next(i for i, line in enumerate(lines) if line.startswith("[Generation slots of /v1]"))
        return lines[start : start + 4]

    assert slots(VLLM_MAX_NUM_SEQS="8") == [
        "[Generation slots of /v1] MAX_CONCURRENT_REQUESTS unset (0): they follow the loaded model's backend",
        "a model on transformers: 1 slot(s), from default",
        "a model on vllm: 8 slot(s), from VLLM_MAX_NUM_SEQS",
        "a model on llamacpp: 1 slot(s), from default",
    ]
    # set, it caps every backend; vLLM's own batch caps it in turn (the smaller wins)
    assert slots(MAX_CONCURRENT_REQUESTS="12", VLLM_MAX_NUM_SEQS="8")[1:] == [
        "a model on transformers: 12 slot(s), from MAX_CONCURRENT_REQUESTS",
        "a model on vllm: 8 slot(s), from VLLM_MAX_NUM_SEQS",
        "a model on llamacpp: 12 slot(s), from MAX_CONCURRENT_REQUESTS",
    ]
    assert slots(MAX_CONCURRENT_REQUESTS="2")[2] == "a model on vllm: 2 slot(s), from MAX_CONCURRENT_REQUESTS"


def test_check_config_counts_code_not_prose_as_reading_a_variable():
    """check_config's "read in" column: a comment, a docstring or a message naming a
    variable does not make a file its reader; a name or a whole-string key does."""
    from millm_site.config_readers import _code_words

    source = '''"""Mentions PROSE_DOC in a docstring."""
# and PROSE_COMMENT in a comment
import os
from django.conf import settings

raise ValueError("raise PROSE_MESSAGE to fix this")
a = settings.READ_ATTR + getattr(settings, "READ_GETATTR") + os.environ["READ_ENV"]
'''
    words = _code_words(source)
    assert {"READ_ATTR", "READ_GETATTR", "READ_ENV"} <= words
    assert not {"PROSE_DOC", "PROSE_COMMENT", "PROSE_MESSAGE"} & words
