"""A vLLM engine core that dies on its own (docs/engine.md, "The vLLM backend"): with
multiprocessing on (the default executor) vLLM runs its ``EngineCore`` in a child
process; the test kills it with SIGKILL, as the kernel's OOM killer would, while a stream
is generating.

- the running stream ends with an error (``engine_shutdown`` naming the dead process)
  instead of waiting forever for outputs that will never come;
- the engine's status keeps the model but says why it cannot serve (``failure``), and
  every later command is refused the same way at once;
- the web tier: ``/api/health/ready`` is 503 ``NOT_READY`` with the engine check failed
  and the reason, ``/api/health/detailed`` reports the engine unhealthy with it,
  ``/api/health/inference`` carries it as ``engine_failure``, and a ``/v1`` request is
  ``503 engine_unavailable`` with Retry-After;
- unloading then works (no wait on the dead core) and a fresh load serves again.

The second part: what vLLM's workers hold, ``/api/health/inference``'s ``weights``,
equals the checkpoint's tensors as the test reads them from its safetensors file."""

from __future__ import annotations

import json
import os
import signal
import struct
import threading
from pathlib import Path

import pytest

from gpu_engine.api.errors import EngineShutdown
from gpu_engine.api.protocol import GenerationJob, SamplingParams

from .conftest import require_vllm, vllm_job

pytestmark = pytest.mark.django_db(transaction=True)

DTYPE_BYTES = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I64": 8, "I32": 4, "I8": 1, "U8": 1}


def _checkpoint_bytes(model_dir: Path) -> dict[str, int]:
    """The tensors of the checkpoint's safetensors files, bytes per stored dtype, read from
    the files' own headers (8-byte length, then JSON) — a tied head is stored once."""
    out: dict[str, int] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        with f.open("rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, info in header.items():
            if name == "__metadata__":
                continue
            count = 1
            for d in info["shape"]:
                count *= int(d)
            out[info["dtype"]] = out.get(info["dtype"], 0) + count * DTYPE_BYTES[info["dtype"]]
    return out


def _is_child(pid: int) -> bool:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[1]) == os.getpid()


@pytest.fixture
def served(tiny_assets):
    """The web tier's engine client holding tiny-llama on vLLM, its engine core a child
    process (multiprocessing on); the registry says it is loaded."""
    from django.conf import settings

    from core.engine_client import EmbeddedEngineClient
    from core.runtime import runtime
    from registry.models import Model
    from registry.services import demo_assets_install, model_set_status
    from tests.fixtures.assets import asset_cache_dir

    require_vllm()
    saved = settings.MILLM_ENGINE_DEVICE, settings.MILLM_ENGINE_DTYPE
    settings.MILLM_ENGINE_DEVICE, settings.MILLM_ENGINE_DTYPE = "cpu", "float32"
    if not Model.objects.filter(name="tiny-llama").exists():
        demo_assets_install(root=asset_cache_dir(), include_demo=False)
    client = EmbeddedEngineClient()
    client.engine.load_model(vllm_job(tiny_assets, max_num_seqs=4))
    model_set_status(model=Model.objects.get(name="tiny-llama"), status=Model.Status.LOADED)
    try:
        with runtime().replaced(engine=client):
            yield client.engine
    finally:
        client.shutdown()
        settings.MILLM_ENGINE_DEVICE, settings.MILLM_ENGINE_DTYPE = saved


def test_a_dead_engine_core_is_reported_and_refuses_work(served, tiny_assets, client):
    engine = served
    backend = engine.backend
    pids = backend._core_watch.pids
    assert pids and all(_is_child(pid) for pid in pids), pids  # the core is its own process
    assert engine.status().failure is None
    ready = client.get("/api/health/ready")
    assert ready.status_code == 200, ready.content

    # weights: what vLLM's workers hold, against the checkpoint's own tensors
    info = client.get("/api/health/inference").json()["data"]
    want = _checkpoint_bytes(Path(tiny_assets.models["tiny-llama"].path))
    assert set(want) == {"F32"}  # tiny-llama is stored float32 and loaded float32
    assert info["weights"]["bytes_by_dtype"] == {"float32": want["F32"]}
    assert info["weights"]["bytes"] == want["F32"]
    assert info["weights"]["quantization"] is None and info["weights"]["checkpoint_quantization"] is None

    # a stream is generating when the core is killed
    stream = engine.generate(
        GenerationJob(
            request_id="long",
            prompt="once upon a time",
            sampling=SamplingParams(max_tokens=400, temperature=0, ignore_eos=True),
        )
    )
    events: list = []
    first = threading.Event()

    def read() -> None:
        for event in stream.events():
            events.append(event)
            first.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    assert first.wait(120), "no token came"
    os.kill(pids[0], signal.SIGKILL)
    reader.join(timeout=120)
    assert not reader.is_alive(), "the stream never ended after its engine core died"
    last = events[-1]
    assert last.type == "error" and last.code == "engine_shutdown", last
    assert f"pid {pids[0]}" in last.message and "exited with code -9" in last.message, last.message

    status = engine.status()
    assert status.state == "ready" and status.model_id == "tiny-llama"
    assert status.failure == f"vLLM's engine core process (pid {pids[0]}) exited with code -9"
    with pytest.raises(EngineShutdown) as refused:
        engine.generate_sync(
            GenerationJob(request_id="after", prompt="hi", sampling=SamplingParams(max_tokens=2)), timeout_s=60
        )
    assert refused.value.details["failure"] == status.failure

    # the web tier says so, with the reason
    ready = client.get("/api/health/ready")
    assert ready.status_code == 503 and ready.headers["Retry-After"], ready.content
    body = ready.json()["error"]
    assert body["code"] == "NOT_READY" and body["details"]["checks"]["engine"] is False
    assert body["details"]["engine_failure"] == status.failure
    detail = client.get("/api/health/detailed").json()["data"]
    component = next(c for c in detail["components"] if c["name"] == "engine")
    assert (component["status"], component["message"]) == ("unhealthy", status.failure)
    assert detail["status"] == "unhealthy"
    assert client.get("/api/health/inference").json()["data"]["engine_failure"] == status.failure
    answer = client.post(
        "/v1/completions",
        data={"model": "tiny-llama", "prompt": "hi", "max_tokens": 2},
        content_type="application/json",
    )
    assert answer.status_code == 503, answer.content
    assert answer.json()["error"]["code"] == "engine_unavailable"
    assert status.failure in answer.json()["error"]["message"]
    assert int(answer.headers["Retry-After"]) > 0

    # the operator's way out: unload (nothing waits on the dead core), load again
    engine.unload_model()
    assert engine.status().state == "empty" and engine.status().failure is None
    engine.load_model(vllm_job(tiny_assets, max_num_seqs=4))
    again = engine.generate_sync(
        GenerationJob(request_id="again", prompt="hi", sampling=SamplingParams(max_tokens=2, ignore_eos=True)),
        timeout_s=120,
    )
    assert again.usage.completion_tokens == 2
    assert engine.status().failure is None
