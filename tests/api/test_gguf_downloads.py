"""GGUF repositories on the hub (the stand-in hub, the real huggingface_hub code path):
``repo:QUANT`` downloads that quantization's file only, a bare name over several
quantizations is ambiguous, and the downloaded model loads on the llamacpp backend with
no backend named."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpu_engine.api.protocol import GenerationJob, SamplingParams
from orchestration import tasks as orchestration_tasks
from registry import tasks
from registry.models import Model
from tests.api.conftest import ok, refused, run_job
from tests.api.standin_hub import Repo

pytestmark = pytest.mark.django_db

GGUF_REPO = "millm-test/tiny-gguf"


@pytest.fixture
def gguf_repo(hub, tiny_gguf):
    data = tiny_gguf.read_bytes()
    hub.add_repo(
        Repo(
            GGUF_REPO,
            {
                "tiny-llama.F32.gguf": data,
                "tiny-llama-Q8_0-00001-of-00002.gguf": b"part one",
                "tiny-llama-Q8_0-00002-of-00002.gguf": b"part two",
                "README.md": b"# gguf\n",
            },
        )
    )
    yield hub
    hub.repos.pop(GGUF_REPO, None)


def _download(api, repo_id: str, **extra):
    return api.post("/api/models", {"source": "huggingface", "repo_id": repo_id, **extra}, format="json")


def test_a_bare_name_over_several_quantizations_is_ambiguous(api, gguf_repo):
    error = refused(_download(api, GGUF_REPO), 400, "AMBIGUOUS_MODEL_NAME")
    assert error["details"]["quantizations"] == ["F32", "Q8_0"]
    refused(_download(api, f"{GGUF_REPO}:Q3_K"), 400, "MODEL_INVALID")
    assert not Model.objects.exists()


def test_repo_quant_downloads_that_file_and_loads_on_llamacpp(api, gguf_repo, engine_client, tiny_gguf):
    data = ok(_download(api, f"{GGUF_REPO}:f32"), 202)
    model = data["model"]
    assert model["name"] == "tiny-gguf:F32" and model["quantization"] == "FP32"
    assert tasks.model_download_task(data["job"]["id"]) == "succeeded"
    row = Model.objects.get(pk=model["id"])
    assert (row.status, row.format, row.gguf_file, row.backend) == ("ready", "gguf", "tiny-llama.F32.gguf", "")
    assert Path(row.local_path).read_bytes() == tiny_gguf.read_bytes()
    assert row.num_layers == 4 and row.hidden_size == 64
    fetched = {r.path.rsplit("/", 1)[-1] for r in gguf_repo.requests if "/resolve/" in r.path}
    assert fetched == {"tiny-llama.F32.gguf"}  # not the other quantization's parts
    # a split quantization: every part, first part first
    data = ok(_download(api, f"{GGUF_REPO}:Q8_0"), 202)
    assert Model.objects.get(pk=data["model"]["id"]).gguf_file == "tiny-llama-Q8_0-00001-of-00002.gguf"
    # loads with no backend named: GGUF means llamacpp
    load = ok(api.post(f"/api/models/{row.id}/load"), 202)
    assert run_job(orchestration_tasks.model_load_task, load["job"]["id"]) == "succeeded"
    status = engine_client.status()
    assert (status.backend, status.model_id) == ("llamacpp", "tiny-gguf:F32")
    out = engine_client.engine.generate_sync(
        GenerationJob("g", prompt="the cat", sampling=SamplingParams(max_tokens=3, ignore_eos=True))
    )
    assert out.usage.completion_tokens == 3


def test_a_local_gguf_takes_its_files_quantization(api, tiny_gguf):
    """The registry's quantization of a GGUF is its file's (general.file_type: F32 here):
    the form's default FP16 gives way to it, a quantized level the file does not have is
    400 UNSUPPORTED_QUANTIZATION (llama.cpp does not quantize at load), and nothing is
    registered."""
    made = ok(
        api.post("/api/models", {"source": "local", "local_path": str(tiny_gguf), "custom_name": "g1"}, format="json"),
        201,
    )
    assert (made["model"]["format"], made["model"]["quantization"]) == ("gguf", "FP32")
    error = refused(
        api.post(
            "/api/models",
            {"source": "local", "local_path": str(tiny_gguf), "custom_name": "g2", "quantization": "Q4"},
            format="json",
        ),
        400,
        "UNSUPPORTED_QUANTIZATION",
    )
    assert error["details"]["file_quantization"] == "FP32"
    assert not Model.objects.filter(name="g2").exists()
