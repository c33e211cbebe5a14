"""``manage.py sweep`` and ``manage.py calibrate``: the services behind POST
/api/experiments/sweep and /calibrate with the same checks, a run queued or run in the
foreground (``--wait``) to completion, ``--list``, ``--download`` (the same file as the
route's), and every refusal one line ``CODE: message`` with exit status 2 and nothing
created."""

from __future__ import annotations

import json

import pytest

from experiments.models import ExperimentPoint, ExperimentRun
from tests.api.conftest import engine_client, llama_saes, tiny_llama  # noqa: F401 - fixtures
from tests.commands.helpers import load_and_attach
from tests.commands.helpers import refused_command as _refused
from tests.commands.helpers import run_command as _run

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def attached(settings, engine_client, tiny_llama, llama_saes):  # noqa: F811 - fixtures
    """As in distributed mode (the command reaches the engine): tiny-llama resident with the
    L1 SAE attached at layer 1."""
    settings.EMBEDDED = False
    yield load_and_attach(tiny_llama, llama_saes)
    settings.EMBEDDED = True


def body_file(tmp_path, body: dict) -> str:
    path = tmp_path / "body.json"
    path.write_text(json.dumps(body))
    return str(path)


def test_refusals_are_one_line_and_create_nothing(attached, tmp_path, settings):
    sae = attached
    assert str(_refused("sweep")).startswith("VALIDATION_ERROR: body")
    assert str(_refused("sweep", str(tmp_path / "missing.json"))).startswith("VALIDATION_ERROR: body")
    bad = body_file(tmp_path, {"prompts": ["a"], "variants": [{"index": 999}], "strengths": [1.0]})
    assert str(_refused("sweep", bad)).startswith("INVALID_FEATURE_INDEX: variants[0].index")
    settings.EXPERIMENT_MAX_POINTS = 3
    big = body_file(tmp_path, {"prompts": ["a", "b"], "variants": [{"index": 1}], "strengths": [1.0, 2.0]})
    assert "EXPERIMENT_MAX_POINTS" in str(_refused("sweep", big))
    settings.EXPERIMENT_MAX_POINTS = 256
    calib = body_file(tmp_path, {"prompts": ["a"], "variant": {"index": 1}, "target_kl": 0.1, "bounds": [3, 1]})
    assert str(_refused("calibrate", calib)).startswith("VALIDATION_ERROR: bounds")
    assert str(_refused("sweep", "--download", "exp_0000000000000000")).startswith("EXPERIMENT_NOT_FOUND")
    settings.EMBEDDED = True
    good = body_file(tmp_path, {"prompts": ["a"], "variants": [{"index": 1}], "strengths": [1.0]})
    assert str(_refused("sweep", good)).startswith("ENGINE_UNAVAILABLE")
    assert not ExperimentRun.objects.exists()
    assert sae


def test_a_sweep_and_a_calibration_run_in_the_foreground(attached, tmp_path):
    body = {"prompts": ["the cat sat"], "variants": [{"index": 3}], "strengths": [0.0, 4.0], "max_tokens": 3}
    out, err = _run("sweep", body_file(tmp_path, body), "--wait")
    run = ExperimentRun.objects.get(kind="sweep")
    assert run.status == "completed" and f"Completed {run.id}: 3 points" in out
    assert json.loads(out[: out.rindex("}") + 1])["id"] == run.id
    assert f"{run.id} completed: 3/3" in err
    listed, _ = _run("sweep", "--list")
    assert run.id in listed and "completed" in listed
    target = tmp_path / "points.jsonl"
    _run("sweep", "--download", run.id, "--format", "jsonl", "--out", str(target))
    rows = [json.loads(line) for line in target.read_text().splitlines()]
    assert [r["ordinal"] for r in rows] == list(
        ExperimentPoint.objects.filter(run=run).order_by("ordinal").values_list("ordinal", flat=True)
    )
    point = ExperimentPoint.objects.get(run=run, strength=4.0)
    assert rows[point.ordinal]["kl_per_position"] == point.kl_per_position

    calib = {"prompts": ["the cat sat"], "variant": {"index": 3}, "target_kl": 99.0, "bounds": [0, 1], "max_tokens": 3}
    out, _ = _run("calibrate", body_file(tmp_path, calib), "--wait")
    done = ExperimentRun.objects.get(kind="calibration")
    assert done.status == "completed" and done.result["converged"] is False
    assert "widen the bounds" in done.result["reason"]
