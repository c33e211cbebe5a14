"""vLLM as a product serves it, beyond the Llama engine of test_vllm_engine:

- blocks that return the residual stream itself (GPT-2), not vLLM's Llama-family
  ``(hidden, residual)`` pair: steering, monitoring and capture on tiny-gpt2 equal the
  transformers backend on the same weights (the pair-only hooks once crashed vLLM's worker
  on the first steered request, and the engine died);
- ``manage.py serve`` with a vLLM model resident stops on SIGTERM."""

from __future__ import annotations

import pytest

from gpu_engine.api.artifacts import load_capture
from gpu_engine.runtime.engine import Engine
from gpu_engine.api.protocol import AttachSpec, LoadModelJob, MonitorEntry

from .conftest import require_vllm
from .test_vllm_capture import close, job, worst
from .test_vllm_engine import assert_records_close, check_steered

SAE = "tiny-gpt2-L1-relu"


@pytest.fixture(scope="module")
def engines(tiny_assets):
    require_vllm()
    asset, sae = tiny_assets.models["tiny-gpt2"], tiny_assets.saes[SAE]
    vllm = Engine(drain_timeout_s=300)
    vllm.load_model(
        LoadModelJob(
            "tiny-gpt2",
            str(asset.path),
            dtype="float32",
            device="cpu",
            backend="vllm",
            options={"distributed_executor_backend": "uni"},
        )
    )
    hf = Engine()
    hf.load_model(LoadModelJob("tiny-gpt2", str(asset.path), dtype="float32", device="cpu"))
    for eng in (vllm, hf):
        eng.attach(AttachSpec(SAE, str(sae.path), sae.layer))
    yield vllm, hf, sae.layer
    vllm.shutdown()
    hf.shutdown()


def test_gpt2_steering_monitoring_and_capture_equal_transformers(engines):
    from gpu_engine.api.protocol import CaptureSpec

    vllm, hf, layer = engines
    steering = {(SAE, layer): {3: 8.0, 17: -5.0}}
    monitor = [MonitorEntry(SAE, layer, top_k=4, features=[3, 17], read_point="pre_steering", positions="all")]
    spec = CaptureSpec(layers=[0, layer], positions="all")
    plain = vllm.generate_sync(job("plain", n=8))
    got = vllm.generate_sync(job("s", spec, steering=steering, monitor=monitor, n=8))
    want = hf.generate_sync(job("s", spec, steering=steering, monitor=monitor, n=8))
    assert got.token_ids == want.token_ids
    check_steered(got, plain)
    assert_records_close(got.activations, want.activations)
    a, b = load_capture(got.capture.data), load_capture(want.capture.data)
    for captured in (0, layer):
        assert close(a.hidden[captured], b.hidden[captured]), worst(a.hidden[captured], b.hidden[captured])


def test_serve_exits_on_sigterm_with_a_vllm_model_resident(tiny_assets, tmp_path):
    """The embedded server with a vLLM model loaded stops on SIGTERM (the engine-core
    process it left running kept the interpreter waiting at exit, for good)."""
    import os
    import signal
    import socket
    import subprocess
    import sys
    import time
    import urllib.request

    from tests.conftest import REPO, manage

    require_vllm()
    env = {"MILLM_DATA_DIR": str(tmp_path), "MILLM_ENGINE_DEVICE": "cpu", "MILLM_ENGINE_DTYPE": "float32"}
    # the database, the tiny models registered and tiny-llama's backend set to vLLM, in one
    # process (each manage.py start costs seconds; what the test is about is serve's)
    setup = (
        "from django.core.management import call_command\n"
        "from registry.models import Model\n"
        "call_command('migrate', interactive=False, verbosity=0)\n"
        f"call_command('create_demo_assets', '--tiny-only', '--output', {str(tiny_assets.root)!r})\n"
        "assert Model.objects.filter(name='tiny-llama').update(backend='vllm') == 1\n"
    )
    result = manage("shell", "-c", setup, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    base = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "TMPDIR")}
    log = (tmp_path / "serve.log").open("w")
    server = subprocess.Popen(
        [sys.executable, str(REPO / "manage.py"), "serve", "--port", str(port)],
        env={**base, **env, "MILLM_ENV_FILE": "/nonexistent/.env", "AUTO_LOAD_MODEL": "tiny-llama"},
        cwd=REPO,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            assert server.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/health/ready", timeout=5) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            time.sleep(1)
        else:
            pytest.fail((tmp_path / "serve.log").read_text()[-3000:])
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=60) is not None
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
        log.close()


def test_a_max_model_len_above_the_models_window_serves_the_models_own(tiny_assets):
    """VLLM_MAX_MODEL_LEN is a ceiling (as GGUF_CONTEXT_LENGTH is): above the model's own
    window vLLM had refused the load, after the resident model was already gone."""
    import json

    require_vllm()
    asset = tiny_assets.models["tiny-llama"]
    own = json.loads((asset.path / "config.json").read_text())["max_position_embeddings"]
    eng = Engine(drain_timeout_s=300)
    try:
        status = eng.load_model(
            LoadModelJob(
                "tiny-llama",
                str(asset.path),
                dtype="float32",
                device="cpu",
                backend="vllm",
                options={"distributed_executor_backend": "uni", "max_model_len": own * 8},
            )
        )
        assert status.context_length == own
    finally:
        eng.shutdown()
