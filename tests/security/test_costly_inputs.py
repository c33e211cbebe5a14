"""Costly inputs on /v1 (issue 31, item 4, and strict fields), sent to a live
``manage.py serve`` in its own process:

- a schema whose regex repeats too often, or is too long, is refused with 400
  ``schema_too_complex`` naming the field, at once (nothing is compiled);
- a schema inside the caps that is still slow to build (many bounded patterns) ends as
  400 ``schema_too_complex`` at ``STRUCTURED_COMPILE_TIMEOUT_S``, a plain request sent
  while it builds is answered before it, and nothing keeps burning CPU afterwards;
- request fields are strict: ``"n": "2"``, ``"stream": "true"`` … are 400 naming the field.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest

from tests.served import served_process

MODEL = "costly-llama"
COMPILE_TIMEOUT_S = 3.0

pytestmark = pytest.mark.django_db


class Served:
    def __init__(self, url: str, process: subprocess.Popen, log: Path) -> None:
        self.url, self.process, self.log = url, process, log

    def post(self, path: str, body: dict, timeout: float = 120) -> tuple[int, dict]:
        request = urllib.request.Request(
            self.url + path, data=json.dumps(body).encode(), method="POST", headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    def cpu_s(self) -> float:
        """CPU seconds the server and every process under it have used."""
        total = 0.0
        for proc in [psutil.Process(self.process.pid), *psutil.Process(self.process.pid).children(recursive=True)]:
            try:
                times = proc.cpu_times()
            except psutil.NoSuchProcess:
                continue
            total += times.user + times.system
        return total


@pytest.fixture(scope="module")
def served(django_db_setup, django_db_blocker, tiny_assets, tmp_path_factory):
    from registry import services
    from registry.models import Job, Model

    with django_db_blocker.unblock():
        services.model_register_local(local_path=str(tiny_assets.models["tiny-llama"].path), name=MODEL)
    root = tmp_path_factory.mktemp("costly")
    env = {
        "SECRET_KEY": "costly-inputs-secret-key-0123456789abcdef",
        "MILLM_DATA_DIR": str(root),
        "AUTO_LOAD_MODEL": MODEL,
        "MILLM_ENGINE_DEVICE": "cpu",
        "MILLM_ENGINE_DTYPE": "float32",
        "LOG_LEVEL": "WARNING",
        "OMP_NUM_THREADS": "1",
        # the caps keep their defaults; only the deadline is short, for the test's sake
        "STRUCTURED_COMPILE_TIMEOUT_S": str(COMPILE_TIMEOUT_S),
        # the schema-wide cap well above its default: the deadline test's costly schema
        # (300 in-cap patterns) must reach the grammar builder
        "STRUCTURED_MAX_SCHEMA_REPEAT": "1000000",
    }
    try:
        with served_process(root, env, ready="/api/health/ready", timeout_s=180) as serving:
            yield Served(serving.url, serving.process, serving.log)
    finally:
        with django_db_blocker.unblock():
            Job.objects.filter(model__name=MODEL).delete()
            Model.objects.filter(name=MODEL).delete()


def _schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


def _completion(**extra) -> dict:
    return {"model": MODEL, "prompt": "Hello", "max_tokens": 4, "temperature": 0, **extra}


def _one_pattern(pattern: str) -> dict:
    return {"type": "object", "properties": {"a": {"type": "string", "pattern": pattern}}, "required": ["a"]}


def _assert_error(status: int, body: dict, code: str, param: str) -> None:
    assert status == 400, body
    assert body["error"]["code"] == code, body
    assert body["error"]["param"] == param, body
    assert body["error"]["type"] == "invalid_request_error", body


# ------------------------------------------------------------------------------- caps


@pytest.mark.parametrize(
    "pattern,why",
    [
        ("a{20000}", "STRUCTURED_MAX_REPEAT"),
        ("^(ab{100}){50}$", "STRUCTURED_MAX_REPEAT"),  # 5,000 with the group around it
        ("[a-z]{1," + "9" * 40 + "}", "STRUCTURED_MAX_REPEAT"),
        ("a" * 1001, "STRUCTURED_MAX_PATTERN_LENGTH"),
        # no bound over 999, but together 19,980 repeated atoms (2.8 s of xgrammar here)
        ("a{999}" * 20, "STRUCTURED_MAX_REPEAT"),
    ],
    ids=["repeat", "nested-repeat", "huge-bound", "length", "summed-repeats"],
)
def test_a_pattern_over_the_caps_is_refused_naming_it_before_anything_compiles(served, pattern, why):
    cpu = served.cpu_s()
    started = time.monotonic()
    status, body = served.post("/v1/completions", _completion(response_format=_schema_format(_one_pattern(pattern))))
    _assert_error(status, body, "schema_too_complex", 'response_format.json_schema.schema.properties["a"].pattern')
    assert why in body["error"]["message"]
    # refused from the schema's text: no grammar was built (a{20000} takes ~25 s of CPU)
    assert time.monotonic() - started < 5
    assert served.cpu_s() - cpu < 2.0


def test_the_schemas_patterns_together_are_capped(settings):
    """Each pattern within the caps, five of them past the schema's budget (the default
    STRUCTURED_MAX_SCHEMA_REPEAT, 4,000; the live server of this file raises it so that its
    deadline test reaches the builder, so this runs the web tier's check in-process)."""
    from core.openai_errors import OpenAIError
    from inference.structured import check_schema

    settings.STRUCTURED_MAX_SCHEMA_REPEAT = 4000
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string", "pattern": "^x{900}$"} for i in range(5)}}
    with pytest.raises(OpenAIError) as refused:
        check_schema(schema)
    assert (refused.value.status, refused.value.code, refused.value.param) == (
        400,
        "schema_too_complex",
        'response_format.json_schema.schema.properties["p4"].pattern',
    )
    assert "STRUCTURED_MAX_SCHEMA_REPEAT" in refused.value.message
    schema["properties"].pop("p4")
    check_schema(schema)  # four are within it


def test_a_pattern_property_and_a_tool_parameter_are_capped_too(served):
    schema = {"type": "object", "patternProperties": {"^x{5000}$": {"type": "integer"}}}
    status, body = served.post("/v1/completions", _completion(response_format=_schema_format(schema)))
    _assert_error(
        status, body, "schema_too_complex", 'response_format.json_schema.schema.patternProperties["^x{5000}$"]'
    )

    tools = [{"type": "function", "function": {"name": "lookup", "parameters": _one_pattern("a{20000}")}}]
    status, body = served.post(
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4,
            "tools": tools,
            "tool_choice": "required",
        },
    )
    _assert_error(status, body, "schema_too_complex", 'tools[0].function.parameters.properties["a"].pattern')


def test_realistic_patterns_stay_admitted(served):
    schema = {
        "type": "object",
        "properties": {
            "date": {"type": "string", "pattern": r"^\d{4}-\d{2}-\d{2}$"},
            "code": {"type": "string", "pattern": "^[A-Z]{2,8}$"},
        },
        "required": ["date", "code"],
    }
    status, body = served.post("/v1/completions", _completion(response_format=_schema_format(schema), max_tokens=40))
    assert status == 200, body


# --------------------------------------------------------------------------- deadline


def test_a_slow_schema_within_the_caps_times_out_while_plain_requests_run(served):
    # warm: the grammar builder's process and the model's first request
    assert (
        served.post(
            "/v1/completions", _completion(response_format=_schema_format(_one_pattern("^[a-z]{3}$")), max_tokens=12)
        )[0]
        == 200
    )
    assert served.post("/v1/completions", _completion())[0] == 200

    # every pattern within the caps (a{1000}), but 300 of them: ~30 s of xgrammar's time
    costly = {
        "type": "object",
        "properties": {f"p{i}": {"type": "string", "pattern": f"b{{{1000 - i}}}"} for i in range(300)},
    }
    answer: dict = {}

    def send() -> None:
        answer["reply"] = served.post(
            "/v1/completions", _completion(response_format=_schema_format(costly)), timeout=300
        )
        answer["at"] = time.monotonic()

    cpu = served.cpu_s()
    costly_thread = threading.Thread(target=send)
    costly_thread.start()
    # the server is building the costly grammar: it has spent a CPU second on it
    deadline = time.monotonic() + 60
    while served.cpu_s() - cpu < 1.0:
        assert costly_thread.is_alive(), f"answered before it cost anything: {answer}"
        assert time.monotonic() < deadline, "the server never started on the costly schema"
        time.sleep(0.05)

    status, body = served.post("/v1/completions", _completion(), timeout=300)
    plain_at = time.monotonic()
    assert status == 200, body
    assert body["usage"]["completion_tokens"] >= 1
    # answered while the costly schema was still being built
    assert costly_thread.is_alive(), "the plain request waited for the costly schema"

    costly_thread.join(300)
    status, body = answer["reply"]
    assert answer["at"] > plain_at
    _assert_error(status, body, "schema_too_complex", "response_format")
    assert "STRUCTURED_COMPILE_TIMEOUT_S" in body["error"]["message"]

    # nothing keeps building it after the answer: the server is idle again
    time.sleep(0.5)
    before = served.cpu_s()
    time.sleep(2.0)
    assert served.cpu_s() - before < 0.5

    # and the server still builds grammars
    assert (
        served.post(
            "/v1/completions", _completion(response_format=_schema_format(_one_pattern("^[a-z]{4}$")), max_tokens=12)
        )[0]
        == 200
    )


# ------------------------------------------------------------------------- strict fields


@pytest.mark.parametrize(
    "path,field,value",
    [
        ("/v1/completions", "n", "2"),
        ("/v1/completions", "max_tokens", "4"),
        ("/v1/completions", "max_tokens", 4.0),
        ("/v1/completions", "temperature", "0"),
        ("/v1/completions", "stream", "true"),
        ("/v1/completions", "echo", 1),
        ("/v1/completions", "seed", True),
        ("/v1/completions", "logprobs", "2"),
        ("/v1/chat/completions", "logprobs", "true"),
        ("/v1/chat/completions", "top_logprobs", "2"),
        ("/v1/chat/completions", "max_completion_tokens", "4"),
        ("/v1/chat/completions", "parallel_tool_calls", "false"),
    ],
)
def test_fields_are_strict(served, path, field, value):
    body = (
        _completion()
        if path == "/v1/completions"
        else {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    )
    if field == "top_logprobs":
        body["logprobs"] = True
    status, answer = served.post(path, {**body, field: value})
    _assert_error(status, answer, "invalid_parameter", field)


def test_strict_fields_still_take_what_clients_send(served):
    # integers for floats, null for "not given", JSON booleans
    status, body = served.post(
        "/v1/completions", _completion(temperature=0, top_p=1, presence_penalty=0, n=None, stream=False, echo=False)
    )
    assert status == 200, body
    status, body = served.post(
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2,
            "temperature": 1,
            "logprobs": True,
            "top_logprobs": 2,
            "seed": 7,
        },
    )
    assert status == 200, body
