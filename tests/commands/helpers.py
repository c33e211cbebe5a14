"""What the tests of the run commands (``manage.py dashboards``, ``sweep``, ``calibrate``)
share: a command's output, its one-line refusal, and tiny-llama loaded with its L1 SAE
attached through the API as in distributed mode."""

from __future__ import annotations

from io import StringIO
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from orchestration import tasks
from tests.api.conftest import ok, run_job

SAE = "tiny-llama-L1-relu"


def run_command(name: str, *args: str) -> tuple[str, str]:
    """``manage.py name args``: what it wrote to stdout and to stderr."""
    out, err = StringIO(), StringIO()
    call_command(name, *args, stdout=out, stderr=err)
    return out.getvalue(), err.getvalue()


def refused_command(name: str, *args: str) -> CommandError:
    """The command's refusal: exit status 2, one line."""
    with pytest.raises(CommandError) as info:
        run_command(name, *args)
    assert info.value.returncode == 2, info.value
    assert "\n" not in str(info.value)
    return info.value


def load_and_attach(tiny_llama: Any, llama_saes: dict[str, Any]) -> Any:
    """tiny-llama resident with the L1 SAE attached at layer 1, through the API (the load
    job run here); the SAE's row."""
    from rest_framework.test import APIClient

    api = APIClient()
    data = ok(api.post(f"/api/models/{tiny_llama.id}/load"), 202)
    assert run_job(tasks.model_load_task, data["job"]["id"]) == "succeeded"
    sae = llama_saes[SAE]
    ok(api.post(f"/api/saes/{sae.id}/attach", {"layer": 1}, format="json"))
    return sae
