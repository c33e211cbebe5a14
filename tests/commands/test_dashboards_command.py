"""``manage.py dashboards``: the services behind POST /api/saes/{id}/dashboards with the same
checks, a run queued or run in the foreground (``--wait``) to completion, ``--list``, and
every refusal one line ``CODE: message`` with exit status 2 and nothing created."""

from __future__ import annotations

import json
from functools import partial

import pytest

from batches.files import file_create
from features.management.commands.dashboards import Command
from features.models import DashboardRun, FeatureDashboard
from tests.api.conftest import engine_client, llama_saes, tiny_llama  # noqa: F401 - fixtures
from tests.commands.helpers import SAE, load_and_attach, refused_command, run_command

pytestmark = pytest.mark.django_db


_run = partial(run_command, "dashboards")
_refused = partial(refused_command, "dashboards")


@pytest.fixture
def attached(settings, engine_client, tiny_llama, llama_saes, tmp_path):  # noqa: F811 - fixtures
    """As in distributed mode (the command reaches the engine): tiny-llama resident with the
    L1 SAE attached at layer 1."""
    settings.EMBEDDED = False
    settings.DASHBOARD_DIR = str(tmp_path / "dashboards")
    settings.DASHBOARD_MAX_TOKENS = 4096
    return load_and_attach(tiny_llama, llama_saes)


def test_a_refusal_is_one_line_and_exit_status_2(llama_saes, capsys):  # noqa: F811 - fixture
    with pytest.raises(SystemExit) as info:
        Command().run_from_argv(["manage.py", "dashboards", "--list", "sae_nope"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == ["CommandError: SAE_NOT_FOUND: SAE 'sae_nope' not found"]


def test_refusals_create_nothing(settings, engine_client, llama_saes):  # noqa: F811 - fixtures
    sae = llama_saes[SAE]
    settings.DASHBOARD_MAX_TOKENS = 100
    settings.EMBEDDED = False
    assert "token_budget" in str(_refused(sae.id, "--sample"))
    error = _refused(sae.id, "--sample", "--budget", "101")
    assert str(error).startswith("VALIDATION_ERROR: token_budget") and "DASHBOARD_MAX_TOKENS" in str(error)
    assert str(_refused(sae.id, "--budget", "64", "--context-tokens", "4")).startswith(
        "VALIDATION_ERROR: context_tokens"
    )
    assert str(_refused(sae.id, "--file-id", "file-x", "--budget", "64", "--text-field", "../x")).startswith(
        "VALIDATION_ERROR: text_field"
    )
    assert str(_refused("sae_nope", "--sample", "--budget", "64")).startswith("SAE_NOT_FOUND")
    # no model resident: the SAE is attached nowhere
    assert str(_refused(sae.id, "--sample", "--budget", "64")).startswith("SAE_NOT_ATTACHED")
    settings.EMBEDDED = True
    assert "POST /api/saes/" in str(_refused(sae.id, "--sample", "--budget", "64"))
    assert DashboardRun.objects.count() == 0


def test_list(llama_saes):  # noqa: F811 - fixture
    sae = llama_saes[SAE]
    out, _ = _run("--list", sae.id)
    assert out.strip() == f"No dashboard runs for {sae.id}"
    done = DashboardRun.objects.create(
        sae=sae, layer=1, token_budget=64, status="completed", complete=True, contexts_total=4, contexts_done=4
    )
    failed = DashboardRun.objects.create(
        sae=sae, layer=1, token_budget=32, status="failed", error={"code": "ENGINE_UNAVAILABLE", "message": "gone"}
    )
    lines = _run("--list", sae.id)[0].strip().splitlines()
    assert len(lines) == 2
    assert lines[0].startswith(f"{failed.id}  failed") and lines[0].endswith("ENGINE_UNAVAILABLE: gone")
    assert lines[1].startswith(f"{done.id}  completed") and "4/4 contexts" in lines[1]
    assert lines[1].endswith("complete")


def test_queue_a_run(attached):
    file_id = file_create(
        filename="c.jsonl", purpose="batch", content=b'{"text": "a line of text"}\n', owner="key:alice"
    ).id
    out, _ = _run(attached.id, "--file-id", file_id, "--budget", "256", "--context-tokens", "16")
    run = DashboardRun.objects.get()
    assert out.startswith(f"Queued {run.id} (layer 1)")
    # the command is the operator: any key's file is its to read
    assert (run.status, run.corpus, run.corpus_file_id, run.token_budget, run.context_tokens) == (
        "queued",
        "file",
        file_id,
        256,
        16,
    )


@pytest.mark.django_db(transaction=True)  # the run's thread reads what the command committed
def test_wait_runs_it_to_completion_in_the_foreground(attached):
    out, err = _run(attached.id, "--sample", "--budget", "256", "--context-tokens", "32", "--wait")
    run = DashboardRun.objects.get()
    assert (run.status, run.complete, run.tokens_done) == ("completed", True, 256)
    printed = json.loads(out[: out.rindex("}") + 1])
    assert printed["id"] == run.id and printed["status"] == "completed"
    assert printed["summary"]["tokens"] == 256
    assert f"Completed {run.id}: 256 tokens" in out
    assert f"{run.id} completed: 8/8 contexts, 256 tokens" in err
    assert FeatureDashboard.objects.filter(run=run).count() > 0
