"""Raw steering vectors through /api/vectors, manage.py vector and the admin: created by
upload or computed from prompt pairs on the resident model, attached through the SAE
routes, steering exactly ``strength · v``.  Vectors are written here with numpy, and the
computed one is checked against this test's own transformers forward."""

from __future__ import annotations

import hashlib
import io
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import TestCase
from safetensors.numpy import load_file, save_file

from gpu_engine.api.protocol import (
    FeatureControl,
    GenerationJob,
    SamplingParams,
    SteeringEntry,
    SteeringSpec,
)
from orchestration import tasks
from registry.models import SAE
from tests.api.conftest import ok, refused, run_job

pytestmark = pytest.mark.django_db

D = 64  # the tiny models' hidden size
PROMPT = "the sea and the sky"


@pytest.fixture
def cache(settings, tmp_path):
    settings.SAE_CACHE_DIR = str(tmp_path / "sae_cache")
    return Path(settings.SAE_CACHE_DIR)


def write_vectors(path: Path, layers=(1, 2), *, d: int = D, seed: int = 3) -> dict[int, np.ndarray]:
    rng = np.random.default_rng(seed)
    vectors = {L: rng.normal(size=d).astype(np.float32) for L in layers}
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({f"layer.{L}": v for L, v in vectors.items()}, str(path))
    return vectors


def upload(api, path: Path, **fields):
    with open(path, "rb") as fh:
        return api.post("/api/vectors", {"file": fh, **fields}, format="multipart")


def our_file(row: SAE) -> Path:
    return Path(row.local_path) / "vector.safetensors"


def fingerprint(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def load(api, model) -> None:
    job = ok(api.post(f"/api/models/{model.id}/load"), 202)["job"]
    assert run_job(tasks.model_load_task, job["id"]) == "succeeded"


def rows_through(engine_client, layer: int, steering: SteeringSpec | None):
    """(raw, post): block ``layer``'s output before and after the engine's hook, every row
    of a greedy generation, float64."""
    module = engine_client.engine.backend.model.model.layers[layer]
    raw, post = [], []

    def grab(into):
        def hook(mod, args, output):
            out = output[0] if isinstance(output, tuple) else output
            into.append(out[0].detach().double().numpy().copy())

        return hook

    handles = [module.register_forward_hook(grab(raw), prepend=True), module.register_forward_hook(grab(post))]
    try:
        handle = engine_client.generate(
            GenerationJob(
                request_id=f"r-{os.urandom(4).hex()}",
                prompt=PROMPT,
                steering=steering,
                sampling=SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
            )
        )
        events = list(handle.events(timeout_s=60))
    finally:
        for h in handles:
            h.remove()
    assert type(events[-1]).__name__ == "FinishEvent", events[-1]
    return np.concatenate(raw), np.concatenate(post)


# --- upload -> attach -> steer ---------------------------------------------------------------


def test_upload_attach_and_steer_by_exactly_strength_times_v(api, engine_client, tiny_llama, cache, tmp_path):
    sent = write_vectors(tmp_path / "mine" / "honesty.safetensors")
    data = ok(upload(api, tmp_path / "mine" / "honesty.safetensors", name="honesty", model="tiny-llama", layer=1), 201)
    row = SAE.objects.get()
    assert (
        data["id"],
        data["name"],
        data["model"],
        data["layers"],
        data["d_model"],
        data["source"],
        data["hook_point"],
    ) == (row.id, "honesty", "tiny-llama", [1], D, "upload", "resid_post")
    norm = float(np.linalg.norm(sent[1].astype(np.float64)))
    assert data["norms"] == {"1": pytest.approx(norm)}
    assert (row.format, row.d_in, row.d_sae, row.activation, row.files_owned, row.vector_layers) == (
        "vector",
        D,
        1,
        "none",
        True,
        [1],
    )
    assert our_file(row).parent.parent == cache / "vectors"
    written = load_file(str(our_file(row)))
    assert list(written) == ["layer.1"]  # only the layer asked for
    v = written["layer.1"].astype(np.float64)
    np.testing.assert_array_equal(v, sent[1].astype(np.float64))
    assert ok(api.get("/api/vectors"))["total"] == 1
    assert ok(api.get(f"/api/vectors/{row.id}"))["norms"] == data["norms"]

    load(api, tiny_llama)
    attached = ok(api.post(f"/api/saes/{row.id}/attach", {"layer": 1}, format="json"))
    assert attached["layer_module_path"] == "model.layers.1"
    assert ok(api.get(f"/api/vectors/{row.id}"))["attached_layers"] == [1]

    raw, post = rows_through(engine_client, 1, SteeringSpec.from_mapping({(row.id, 1): {0: 4.0}}))
    np.testing.assert_allclose(post, raw + 4.0 * v, atol=2e-5, rtol=1e-5)
    assert (np.abs(post - raw).max(axis=-1) > 0.5).all()  # positive control: every row moved
    raw0, post0 = rows_through(engine_client, 1, None)
    np.testing.assert_array_equal(post0, raw0)  # attached but unasked: nothing added

    ablate = SteeringSpec([SteeringEntry(row.id, 1, controls=[FeatureControl(0, mode="ablate")])])
    raw, post = rows_through(engine_client, 1, ablate)
    unit = v / np.linalg.norm(v)
    np.testing.assert_allclose(post @ unit, 0.0, atol=1e-4)
    np.testing.assert_allclose(post, raw - np.outer(raw @ unit, unit), atol=2e-5, rtol=1e-5)
    assert np.abs(raw @ unit).max() > 0.5

    # with an SAE at the same layer in the same request: both deltas land
    from registry import services

    sae = services.sae_register_local(local_path=str(_tiny_sae_path()), name="l1")
    ok(api.post(f"/api/saes/{sae.id}/attach", {"layer": 1}, format="json"))
    w_dec = load_file(str(_tiny_sae_path() / "sae_weights.safetensors"))["W_dec"].astype(np.float64)
    both = SteeringSpec.from_mapping({(row.id, 1): {0: 2.0}, (sae.id, 1): {3: 5.0}})
    raw, post = rows_through(engine_client, 1, both)
    np.testing.assert_allclose(post, raw + 2.0 * v + 5.0 * w_dec[3], atol=5e-5, rtol=1e-5)

    refused(api.delete(f"/api/vectors/{row.id}"), 409, "SAE_ALREADY_ATTACHED")
    ok(api.post(f"/api/saes/{row.id}/detach", {}, format="json"))
    folder = our_file(row).parent
    with TestCase.captureOnCommitCallbacks(execute=True):
        ok(api.delete(f"/api/vectors/{row.id}"))
    assert not folder.exists() and not SAE.objects.filter(pk=row.id).exists()
    assert (tmp_path / "mine" / "honesty.safetensors").exists()  # the uploader's own file


_TINY = {}


def _tiny_sae_path() -> Path:
    return _TINY["l1"]


@pytest.fixture(autouse=True)
def _tiny_paths(tiny_assets):
    _TINY["l1"] = Path(tiny_assets.saes["tiny-llama-L1-relu"].path)


def test_encoder_modes_and_monitoring_on_a_vector_are_refused(api, engine_client, tiny_llama, cache, tmp_path):
    from gpu_engine.api.protocol import SteeringCondition

    write_vectors(tmp_path / "v.safetensors", layers=(1,))
    vid = ok(upload(api, tmp_path / "v.safetensors", name="v", model="tiny-llama"), 201)["id"]
    load(api, tiny_llama)
    ok(api.post(f"/api/saes/{vid}/attach", {"layer": 1}, format="json"))
    for control, param in (
        (FeatureControl(0, mode="clamp", value=1.0), "steering.features.mode"),
        (FeatureControl(0, mode="scale", value=2.0), "steering.features.mode"),
        (FeatureControl(0, value=2.0, condition=SteeringCondition(0, 0.0)), "steering.features.condition"),
    ):
        handle = engine_client.generate(
            GenerationJob(
                request_id=f"r-{os.urandom(4).hex()}",
                prompt=PROMPT,
                steering=SteeringSpec([SteeringEntry(vid, 1, controls=[control])]),
                sampling=SamplingParams(max_tokens=2),
            )
        )
        events = list(handle.events(timeout_s=60))
        assert [type(e).__name__ for e in events] == ["ErrorEvent"]  # before any token
        assert events[0].code == "invalid_parameter" and events[0].details["param"] == param
    # /v1: monitoring a vector is a 400 naming the field, before generation
    response = api.post(
        "/v1/completions",
        {
            "model": "tiny-llama",
            "prompt": PROMPT,
            "max_tokens": 2,
            "return_sae_activations": {"sae_id": vid, "top_k": 1},
        },
        format="json",
    )
    body = json.loads(response.content)
    assert response.status_code == 400, body
    assert "raw steering vector" in body["error"]["message"], body
    assert body["error"]["param"] == "monitor.sae_id", body
    error = refused(
        api.post("/api/monitoring/configure", {"sae_id": vid, "top_k": 3}, format="json"), 400, "VECTOR_INVALID"
    )
    assert error["details"]["field"] == "sae_id"


# --- refusals --------------------------------------------------------------------------------


def test_upload_refusals_create_nothing(api, tiny_llama, cache, tmp_path):
    write_vectors(tmp_path / "narrow.safetensors", d=32)
    write_vectors(tmp_path / "deep.safetensors", layers=(9,))
    write_vectors(tmp_path / "ok.safetensors", layers=(1,))
    torch.save({"layer.1": torch.ones(D)}, tmp_path / "pickled.safetensors")
    save_file({"direction": np.ones(D, np.float32)}, str(tmp_path / "named.safetensors"))
    (tmp_path / "junk.safetensors").write_bytes(b"\x80\x04\x95 not a safetensors file")
    cases = [
        ("narrow", {}, 400, "VECTOR_INVALID", "file"),
        ("pickled", {}, 400, "VECTOR_INVALID", "file"),
        ("named", {}, 400, "VECTOR_INVALID", "file"),
        ("junk", {}, 400, "VECTOR_INVALID", "file"),
        ("deep", {}, 400, "VECTOR_INVALID", "layer"),  # the model has 4 blocks
        ("ok", {"layer": 2}, 400, "VECTOR_INVALID", "layer"),  # the file has no layer 2
    ]
    for stem, extra, status, code, field in cases:
        error = refused(
            upload(api, tmp_path / f"{stem}.safetensors", name=stem, model="tiny-llama", **extra), status, code
        )
        assert error["details"]["field"] == field, (stem, error)
    refused(upload(api, tmp_path / "ok.safetensors", name="x", model="nope"), 404, "MODEL_NOT_FOUND")
    refused(upload(api, tmp_path / "ok.safetensors", model="tiny-llama"), 422, "VALIDATION_ERROR")
    assert not SAE.objects.exists()
    assert not (cache / "vectors").exists() or not list((cache / "vectors").iterdir())
    ok(upload(api, tmp_path / "ok.safetensors", name="once", model="tiny-llama"), 201)
    refused(upload(api, tmp_path / "ok.safetensors", name="once", model="tiny-llama"), 409, "VECTOR_ALREADY_EXISTS")
    assert SAE.objects.count() == 1
    refused(api.get("/api/vectors/sae_nothere"), 404, "VECTOR_NOT_FOUND")


def test_a_vector_without_the_layer_is_refused_at_attach(api, engine_client, tiny_llama, cache, tmp_path):
    write_vectors(tmp_path / "v.safetensors", layers=(1,))
    vid = ok(upload(api, tmp_path / "v.safetensors", name="v", model="tiny-llama"), 201)["id"]
    load(api, tiny_llama)
    error = refused(api.post(f"/api/saes/{vid}/attach", {"layer": 2}, format="json"), 400, "SAE_INCOMPATIBLE")
    assert error["details"]["layer"] == 2 and error["details"]["layers"] == [1]
    assert engine_client.attachments() == []


# --- compute from pairs ----------------------------------------------------------------------

PAIRS = [
    ("I love this, it is wonderful", "I hate this, it is awful"),
    ("a happy bright day", "a sad dark day"),
    ("joy", "grief"),
]


def hf_mean_difference(path: Path, layer: int) -> np.ndarray:
    """This test's own reference: transformers' hidden_states[L + 1] (block L's output) at
    the last token, mean over positives minus mean over negatives, float64."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()

    def last(text: str) -> np.ndarray:
        ids = tok(text, return_tensors="pt")["input_ids"]
        with torch.inference_mode():
            hs = model(ids, output_hidden_states=True).hidden_states
        return hs[layer + 1][0, -1].double().numpy()

    pos = np.mean([last(p) for p, _ in PAIRS], axis=0)
    neg = np.mean([last(n) for _, n in PAIRS], axis=0)
    return pos - neg


def test_compute_from_pairs_equals_an_independent_mean_difference(api, engine_client, tiny_llama, cache, tiny_assets):
    body = {"name": "joy", "layer": 2, "pairs": [{"positive": p, "negative": n} for p, n in PAIRS]}
    refused(api.post("/api/vectors/compute", body, format="json"), 400, "MODEL_NOT_LOADED")
    load(api, tiny_llama)
    data = ok(api.post("/api/vectors/compute", body, format="json"), 201)
    row = SAE.objects.get()
    want = hf_mean_difference(tiny_assets.models["tiny-llama"].path, 2)
    got = load_file(str(our_file(row)))["layer.2"].astype(np.float64)
    np.testing.assert_allclose(got, want, atol=1e-5)
    assert np.linalg.norm(want) > 0.1  # the pairs really differ
    assert (data["source"], data["layers"], data["model"]) == ("computed", [2], "tiny-llama")
    assert data["norms"]["2"] == pytest.approx(float(np.linalg.norm(got)), rel=1e-6)
    assert data["recipe"]["pairs"] == 3 and data["recipe"]["pooling"] == "last"
    for bad, code, status in (
        ({**body, "name": "x", "layer": 7}, "VECTOR_INVALID", 400),
        ({**body, "name": "y", "pairs": []}, "VALIDATION_ERROR", 422),
        ({**body, "name": "z", "model": "other"}, "VECTOR_INVALID", 400),
        (body, "VECTOR_ALREADY_EXISTS", 409),
    ):
        refused(api.post("/api/vectors/compute", bad, format="json"), status, code)
    assert SAE.objects.count() == 1


# --- manage.py vector ------------------------------------------------------------------------


def _run(*args) -> dict:
    out, err = io.StringIO(), io.StringIO()
    call_command("vector", *args, stdout=out, stderr=err)
    return json.loads(out.getvalue())


def test_vector_command_import_list_delete_keeps_the_source(tiny_llama, cache, tmp_path):
    source = tmp_path / "theirs" / "dir.safetensors"
    sent = write_vectors(source, layers=(0, 3))
    before = fingerprint(source)
    answer = _run("import", str(source), "--name", "cli", "--model", "tiny-llama")
    assert answer["success"] is True and answer["error"] is None
    assert answer["data"]["layers"] == [0, 3] and answer["data"]["source"] == "upload"
    row = SAE.objects.get()
    np.testing.assert_array_equal(load_file(str(our_file(row)))["layer.3"], sent[3])
    assert _run("list")["data"]["total"] == 1
    out = io.StringIO()
    with pytest.raises(CommandError, match="VECTOR_INVALID"):
        call_command(
            "vector",
            "import",
            str(source),
            "--name",
            "again",
            "--model",
            "tiny-llama",
            "--layer",
            "1",
            stdout=out,
            stderr=io.StringIO(),
        )
    error = json.loads(out.getvalue())
    assert error["success"] is False and error["error"]["code"] == "VECTOR_INVALID"
    assert error["error"]["details"]["field"] == "layer"
    folder = our_file(row).parent
    with TestCase.captureOnCommitCallbacks(execute=True):
        assert _run("delete", row.id)["data"]["status"] == "deleted"
    assert not folder.exists() and fingerprint(source) == before  # only our copy went


def test_vector_command_compute(settings, api, engine_client, tiny_llama, cache, tiny_assets, tmp_path):
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"positive": p, "negative": n}) + "\n" for p, n in PAIRS))
    with pytest.raises(CommandError, match="Embedded mode"):
        _run("compute", "--pairs", str(pairs), "--layer", "1", "--name", "cli")
    settings.EMBEDDED = False  # as in distributed mode, where run_engine is reachable
    load(api, tiny_llama)
    data = _run("compute", "--pairs", str(pairs), "--layer", "1", "--name", "cli")["data"]
    row = SAE.objects.get(pk=data["id"])
    got = load_file(str(our_file(row)))["layer.1"].astype(np.float64)
    np.testing.assert_allclose(got, hf_mean_difference(tiny_assets.models["tiny-llama"].path, 1), atol=1e-5)


# --- admin -----------------------------------------------------------------------------------


def test_admin_imports_and_deletes_through_the_services(tiny_llama, cache, tmp_path):
    from django.contrib.auth import get_user_model
    from django.test import Client

    user = get_user_model().objects.create_superuser("root", "", "pw-for-tests")
    client = Client()
    client.force_login(user)
    source = tmp_path / "a.safetensors"
    write_vectors(source, layers=(1,), d=32)
    page = client.post(
        "/admin/registry/steeringvector/add/", {"name": "adm", "path": str(source), "model": tiny_llama.pk, "layer": ""}
    )
    assert page.status_code == 200 and "VECTOR_INVALID" in page.content.decode()
    write_vectors(source, layers=(1,))
    page = client.post(
        "/admin/registry/steeringvector/add/", {"name": "adm", "path": str(source), "model": tiny_llama.pk, "layer": ""}
    )
    assert page.status_code == 302, page.content.decode()[:2000]
    row = SAE.objects.get()
    assert (row.name, row.format, row.vector_layers) == ("adm", "vector", [1])
    assert "adm" in client.get("/admin/registry/steeringvector/").content.decode()
    with TestCase.captureOnCommitCallbacks(execute=True):
        client.post("/admin/registry/steeringvector/", {"action": "delete_vectors", "_selected_action": [row.pk]})
    assert not SAE.objects.exists() and source.exists()
