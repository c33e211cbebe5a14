"""Several engines, one front (docs/deploy.md, "Several models, several engines"): the
work on an SAE — a dashboard run, an experiment — addresses the engine holding the SAE's
model, not the default one. In one process: the model runs on the embedded engine, which
the test installs as engine ``gpu1``'s client behind a recorder; the default engine is a
recorder that refuses every call, so a call that reaches it fails the run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from core.runtime import runtime
from gpu_engine.api.errors import EngineError
from registry.models import Model

pytestmark = pytest.mark.django_db(transaction=True)

SAE = "tiny-llama-L1-relu"


def anon():
    from core.auth import Principal

    return Principal(owner="anonymous", label="anonymous", admin=True)


class Recorder:
    """An engine client that records each call's name; with ``real`` it passes the call
    on, without it refuses (the engine the work must not reach)."""

    def __init__(self, real: Any = None) -> None:
        self.real = real
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        if self.real is None:

            def refused(*args: Any, **kwargs: Any) -> Any:
                self.calls.append(name)
                raise EngineError("WRONG_ENGINE", f"the default engine was asked for {name}")

            return refused
        attr = getattr(self.real, name)
        if not callable(attr):
            return attr

        def passed(*args: Any, **kwargs: Any) -> Any:
            self.calls.append(name)
            return attr(*args, **kwargs)

        return passed


@pytest.fixture
def on_gpu1(settings, tmp_path, engine_client, tiny_llama, llama_saes):
    """tiny-llama loaded with the L1 SAE attached at layer 1, then ENGINE_MODELS puts it on
    ``gpu1``, whose client is the embedded engine (recorded); the default engine refuses."""
    from orchestration import services
    from orchestration.attachments import sae_attach_set

    settings.DASHBOARD_DIR = str(tmp_path / "dashboards")
    services.model_load(model=tiny_llama)
    sae = llama_saes[SAE]
    sae_attach_set(items=[(sae, 1)])
    settings.ENGINE_MODELS = "gpu1:tiny-llama;default:*"
    Model.objects.filter(pk=tiny_llama.pk).update(engine="gpu1")
    gpu1, default = Recorder(engine_client), Recorder()
    engines = runtime().engines
    engines._clients["gpu1"] = gpu1
    try:
        with runtime().replaced(engine=default):
            yield sae, gpu1, default
    finally:
        engines._clients.pop("gpu1", None)


def test_a_dashboard_run_addresses_the_engine_of_its_saes_model(on_gpu1):
    from features import runner, services
    from features.models import DashboardRun

    sae, gpu1, default = on_gpu1
    run = services.dashboard_start(
        sae_id=sae.id, layer=1, corpus="sample", token_budget=256, context_tokens=16, principal=anon()
    )
    assert runner.dashboard_run(run_id=run.id, force=True) == "completed"
    row = DashboardRun.objects.get(pk=run.id)
    assert (row.status, row.summary["model"]) == ("completed", "tiny-llama")
    assert default.calls == []
    assert {"status", "tokenize", "agenerate", "feature_logits"} <= set(gpu1.calls)


def test_probe_reads_address_the_engine_of_the_probes_model(on_gpu1, api):
    sae, gpu1, default = on_gpu1
    body = {"name": "p", "sae_id": sae.id, "layer": 1, "features": [1], "weights": [1.0]}
    created = api.post("/api/probes", body, format="json")
    assert created.status_code == 201, created.content
    assert created.json()["data"]["validated"] is False
    validated = api.post("/api/probes/p/validate")
    assert validated.status_code == 200, validated.content
    data = validated.json()["data"]
    # validated against what gpu1 holds: tiny-llama with the SAE at layer 1
    assert data["validated"] is True and data["validation"]["model"] == "tiny-llama"
    listed = api.get("/api/probes").json()["data"]["probes"]
    assert [(p["name"], p["validated"]) for p in listed] == [("p", True)]
    assert api.get("/api/probes/p").json()["data"]["validated"] is True
    armed = api.post("/api/probes/p/arm")
    assert armed.status_code == 200, armed.content
    assert armed.json()["data"]["armed"] is True
    assert default.calls == []
    assert gpu1.calls.count("status") >= 4


def test_sensing_reads_the_engine_holding_the_watched_saes(on_gpu1, api):
    from steering.models import Cluster

    sae, gpu1, default = on_gpu1
    cluster = Cluster.objects.create(
        name="c", document="{}", sae_id=sae.id, layer=1, members=[{"feature_idx": 3, "strength": 1.0}]
    )
    armed = api.post("/api/monitoring/sensing", {"kind": "cluster", "id": cluster.id}, format="json")
    assert armed.status_code in (200, 201), armed.content
    (watched,) = api.get("/api/monitoring/sensing").json()["data"]["watched"]
    assert watched["watched_now"] is True  # gpu1 holds the SAE at layer 1
    assert default.calls == []
    assert "status" in gpu1.calls


def test_vector_compute_reads_the_residuals_on_the_engine_of_the_model_it_names(on_gpu1):
    from orchestration.vectors import vector_compute
    from registry.errors import VectorInvalid

    _sae, gpu1, default = on_gpu1
    pairs = [("a happy day", "a sad day")]
    with pytest.raises(VectorInvalid, match="name the model"):
        vector_compute(name="v0", layer=1, pairs=pairs)  # which engine's model? refused
    row = vector_compute(name="v1", layer=1, pairs=pairs, model_name="tiny-llama")
    assert row.trained_on_model == "tiny-llama"
    assert default.calls == []
    assert "hidden_states" in gpu1.calls


def test_capture_in_distributed_mode_runs_on_the_engine_holding_the_model(on_gpu1, settings, tmp_path):
    import json

    from django.core.management import call_command

    _sae, gpu1, default = on_gpu1
    settings.EMBEDDED = False  # as with run_engine: the command addresses the engines
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "prompt": "Hello there"}) + "\n")
    out = tmp_path / "caps"
    call_command("capture", "tiny-llama", "--input", str(prompts), "--out", str(out), "--layers", "1")
    assert (out / "index.jsonl").exists()
    index = [json.loads(line) for line in (out / "index.jsonl").read_text().splitlines() if line]
    assert [r["id"] for r in index] == ["a"]
    assert default.calls == []
    assert "status" in gpu1.calls


def test_a_fidelity_run_addresses_the_engine_of_its_saes_model(on_gpu1):
    from experiments import runner
    from experiments.fidelity_apis import fidelity_start
    from experiments.models import ExperimentRun

    sae, gpu1, default = on_gpu1
    data = {"sae_id": sae.id, "layer": 1, "token_budget": 64, "context_tokens": 16, "corpus": "sample"}
    run = fidelity_start(data=data, who=anon())
    assert runner.experiment_run(run_id=run.id, force=True) == "completed"
    row = ExperimentRun.objects.get(pk=run.id)
    assert row.status == "completed", row.error
    assert default.calls == []
    assert {"status", "agenerate"} <= set(gpu1.calls)


def test_a_sweep_addresses_the_engine_of_its_variants_sae(on_gpu1):
    from experiments import runner, services
    from experiments.models import ExperimentRun

    sae, gpu1, default = on_gpu1
    data = {"prompts": ["Hello"], "variants": [{"sae_id": sae.id, "index": 3}], "strengths": [2.0], "max_tokens": 2}
    run = services.experiment_sweep_start(principal=anon(), data=data)
    assert runner.experiment_run(run_id=run.id, force=True) == "completed"
    row = ExperimentRun.objects.get(pk=run.id)
    assert (row.status, row.done, row.total) == ("completed", 2, 2), row.error
    assert default.calls == []
    assert {"status", "agenerate"} <= set(gpu1.calls)


def test_a_circuit_attaches_and_steers_on_the_engine_of_its_saes_model(on_gpu1, api):
    """Activating a circuit attaches its member SAEs where their model is held (gpu1) and
    checks its live steering against that engine's backend: nothing reaches the default
    engine, and the circuit then serves."""
    from registry.models import SAE as SAERow

    _, gpu1, default = on_gpu1
    sae3 = SAERow.objects.get(name="tiny-llama-L3-relu")
    doc = {
        "kind": "mistudio.circuit-definition",
        "schema_version": "1",
        "name": "on-gpu1",
        "saes": [{"mistudio_sae_id": sae3.id, "layer": 3, "n_features": sae3.d_sae}],
        "members": [{"layer": 3, "feature": {"feature_idx": 5, "strength": 2.0}}],
        "edges": [],
    }
    created = api.post("/api/circuits/import", doc, format="json")
    assert created.status_code == 201, created.content
    cid = created.json()["data"]["id"]
    gpu1.calls.clear()
    active = api.post(f"/api/circuits/{cid}/activate?acknowledge_unvalidated=true")
    assert active.status_code == 200, active.content
    assert default.calls == []
    assert {"attach_set", "status"} <= set(gpu1.calls)
    served = api.get("/api/circuits/active").json()["data"]["circuits"]
    assert [c["name"] for c in served] == ["on-gpu1"]
    # the engine behind gpu1 now holds the layer-3 SAE's files
    held = {(a.path, a.layer) for a in gpu1.real.status().attachments}
    assert any(layer == 3 and Path(path).resolve() == Path(sae3.local_path).resolve() for path, layer in held), held
