"""The registry's attacks (issue 31, items 2, 6, 8, 9 and the strict bodies): remote code,
paths outside the allowed roots, a delete that takes another row's files, a download that
fills the disk, and bodies whose unknown or mistyped fields were dropped or converted.

The first four run against a live ``manage.py serve`` (daphne, embedded engine, its own
job pools) downloading from the stand-in hub, with an admin key and an inference key; the
rest go through the in-process API client, where the disk can be faked."""

from __future__ import annotations

import json
import shutil
import time
import urllib.error
import urllib.request
from collections import namedtuple
from dataclasses import dataclass
from pathlib import Path

import pytest
from rest_framework.test import APIClient

from tests.api.conftest import MODEL_REPO, SAE_REPO, SAELENS_DIR, hub, standin_hub  # noqa: F401
from tests.envelope import ok, refused
from tests.served import served_process

ADMIN_KEY = "registry-security-admin-key"
USER_KEY = "registry-security-inference-key"
REMOTE_REPO = "millm-test/remote-code-llama"
# imported by transformers with trust_remote_code: it leaves a marker and fails the load
MARKER_CODE = (
    "import os, pathlib\npathlib.Path(os.environ.get('MILLM_DATA_DIR', '/tmp'), 'REMOTE_CODE_RAN').write_text('ran')\n"
)

pytestmark = pytest.mark.django_db


@dataclass
class Served:
    url: str
    root: Path
    log: Path

    def call(
        self, method: str, path: str, body: dict | None = None, *, key: str | None = ADMIN_KEY
    ) -> tuple[int, dict]:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, method=method)
        request.add_header("Content-Type", "application/json")
        if key:
            request.add_header("Authorization", f"Bearer {key}")
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    def wait_model(self, model_id: int, status: str = "ready", timeout: float = 60) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            code, body = self.call("GET", f"/api/models/{model_id}")
            assert code == 200, body
            if body["data"]["status"] == status:
                return body["data"]
            assert body["data"]["status"] != "error", body
            assert time.monotonic() < deadline, body
            time.sleep(0.2)


@pytest.fixture(scope="module")
def remote_repo(standin_hub, tiny_assets):  # noqa: F811 - the stand-in hub fixture
    repo = standin_hub.add_directory(
        REMOTE_REPO, tiny_assets.models["tiny-llama"].path, extra={"modeling_x.py": MARKER_CODE.encode()}
    )
    repo.config["auto_map"] = {"AutoModelForCausalLM": "modeling_x.XForCausalLM"}
    return repo


@pytest.fixture(scope="module")
def served(
    django_db_setup,
    django_db_blocker,
    standin_hub,
    remote_repo,  # noqa: F811
    tmp_path_factory,
):
    from registry.models import SAE, Attachment, Job, Model

    root = tmp_path_factory.mktemp("registry-served")
    # LOCAL_MODEL_ROOTS and ALLOW_REMOTE_CODE unset: the defaults are what is under test
    env = {
        "SECRET_KEY": "registry-security-secret-key-0123456789abcdef",
        "MILLM_DATA_DIR": str(root / "data"),
        "HF_ENDPOINT": standin_hub.url,
        "MILLM_API_KEYS": f"alice:{USER_KEY}",
        "MILLM_ADMIN_API_KEYS": f"ops:{ADMIN_KEY}",
        "MILLM_ENGINE_DEVICE": "cpu",
        "MILLM_ENGINE_DTYPE": "float32",
        "LOG_LEVEL": "WARNING",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "OMP_NUM_THREADS": "1",
    }
    try:
        with served_process(root, env) as serving:
            yield Served(serving.url, root, serving.log)
    finally:
        with django_db_blocker.unblock():
            for model in (Attachment, Job, SAE, Model):
                model.objects.all().delete()


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


# --- item 2: remote code ---------------------------------------------------------------


def test_remote_code_is_refused_and_nothing_is_fetched(served, standin_hub):  # noqa: F811
    seen = len(standin_hub.requests)
    for key in (ADMIN_KEY, USER_KEY):
        for body in (
            {"repo_id": REMOTE_REPO, "trust_remote_code": True},
            {"source": "local", "local_path": str(served.root / "data"), "trust_remote_code": True},
        ):
            code, answer = served.call("POST", "/api/models", body, key=key)
            if key == USER_KEY:  # an inference key changes no registry at all
                assert code == 403 and answer["error"]["code"] == "FORBIDDEN", answer
                continue
            assert code == 400, answer
            error = answer["error"]
            assert error["code"] == "REMOTE_CODE_NOT_ALLOWED", answer
            assert "trust_remote_code" in error["message"] and "ALLOW_REMOTE_CODE" in error["message"]
            assert (error["details"]["field"], error["details"]["setting"]) == (
                "trust_remote_code",
                "ALLOW_REMOTE_CODE",
            )
    code, answer = served.call("GET", "/api/models")
    assert answer["data"]["total"] == 0
    # no file of the repository was fetched, the .py least of all, and nothing ran
    fetched = [r.path for r in standin_hub.requests[seen:] if "/resolve/" in r.path]
    assert fetched == []
    data = served.root / "data"
    assert not any(p.suffix == ".py" for p in data.rglob("*"))
    assert not (data / "REMOTE_CODE_RAN").exists()


# --- item 9: local paths ---------------------------------------------------------------


def test_a_path_outside_the_roots_gets_one_answer_whether_it_exists_or_not(served, tmp_path, tiny_assets):
    # a real checkpoint outside the data directory, a real secret folder, missing paths
    secret = tmp_path / ".ssh"
    secret.mkdir()
    (secret / "id_rsa").write_text("not for you")
    inside = served.root / "data" / "link-out"
    inside.symlink_to(tiny_assets.models["tiny-llama"].path)  # a symlink out of a root
    paths = [
        str(tiny_assets.models["tiny-llama"].path),
        str(secret),
        str(tmp_path / "missing"),
        "/root/.ssh",
        "/etc/shadow",
        str(served.root / "data" / ".." / ".." / secret.name),
        str(inside),
    ]
    answers = []
    for path in paths:
        for route, body in (
            ("/api/models", {"source": "local", "local_path": path}),
            ("/api/saes", {"source": "local", "local_path": path}),
        ):
            code, answer = served.call("POST", route, body)
            assert not answer["success"], (route, path, answer)
            error = answer["error"]
            answers.append(
                (code, error["code"], error["message"], tuple(sorted(k for k in error["details"] if k != "local_path")))
            )
            assert error["details"]["local_path"] == path
            # an inference key is refused before any path is looked at
            code, answer = served.call("POST", route, body, key=USER_KEY)
            assert code == 403 and answer["error"]["code"] == "FORBIDDEN", answer
    assert len(set(answers)) == 1, answers
    code, error_code, message, _ = answers[0]
    assert (code, error_code) == (400, "INVALID_LOCAL_PATH")
    assert "LOCAL_MODEL_ROOTS" in message
    assert served.call("GET", "/api/models")[1]["data"]["total"] == 0
    assert served.call("GET", "/api/saes")[1]["data"]["total"] == 0


# --- item 8: a delete never takes another row's files ------------------------------------


def test_deleting_a_local_alias_keeps_the_downloaded_models_files(served):
    code, answer = served.call(
        "POST", "/api/models", {"repo_id": MODEL_REPO, "quantization": "FP32", "custom_name": "downloaded"}
    )
    assert code == 202, answer
    downloaded = served.wait_model(answer["data"]["model"]["id"])
    folder = Path(downloaded["local_path"])
    before = _files(folder)
    assert "model.safetensors" in before
    # the same files registered again (under the data directory, so allowed), as Q8
    code, answer = served.call(
        "POST",
        "/api/models",
        {"source": "local", "local_path": str(folder), "custom_name": "alias", "quantization": "Q8"},
    )
    assert code == 201, answer
    alias = answer["data"]["model"]
    code, answer = served.call("DELETE", f"/api/models/{alias['id']}")
    assert code == 200, answer
    assert _files(folder) == before  # the download is whole
    assert served.call("GET", f"/api/models/{downloaded['id']}")[0] == 200
    # an alias again, and this time the downloaded row goes first: its folder stays while
    # the alias reads it (the alias's weights), and the alias, which downloaded nothing,
    # never removes it either (manage.py prune_cache does, once no row reads it)
    code, answer = served.call(
        "POST",
        "/api/models",
        {"source": "local", "local_path": str(folder), "custom_name": "alias2", "quantization": "Q8"},
    )
    assert code == 201, answer
    alias2 = answer["data"]["model"]
    assert served.call("DELETE", f"/api/models/{downloaded['id']}")[0] == 200
    assert _files(folder) == before
    assert served.call("DELETE", f"/api/models/{alias2['id']}")[0] == 200
    assert _files(folder) == before


def test_deleting_a_downloaded_model_removes_its_own_download(served):
    code, answer = served.call("POST", "/api/models", {"repo_id": "millm-test/tiny-gpt2", "quantization": "FP32"})
    assert code == 202, answer
    downloaded = served.wait_model(answer["data"]["model"]["id"])
    folder = Path(downloaded["local_path"])
    assert folder.is_dir()
    assert served.call("DELETE", f"/api/models/{downloaded['id']}")[0] == 200
    deadline = time.monotonic() + 10  # removed after the delete commits
    while folder.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not folder.exists()


# --- item 6: a download checks the free space first ------------------------------------

DiskUsage = namedtuple("DiskUsage", "total used free")


def test_a_download_that_does_not_fit_is_refused_before_anything(
    hub,
    settings,  # noqa: F811
    monkeypatch,
):
    from registry.models import SAE, Job, Model

    files = hub.repos[MODEL_REPO].files
    needed = sum(
        len(data)
        for name, data in files.items()
        if "/" not in name and name.endswith((".safetensors", ".json", ".txt", ".model", ".jinja", ".tiktoken"))
    )
    free = needed - 1
    monkeypatch.setattr(shutil, "disk_usage", lambda path: DiskUsage(10 * needed, 10 * needed - free, free))
    seen = len(hub.requests)
    # (the served tests' rows, committed by another process, may be there too)
    rows = (Model.objects.count(), SAE.objects.count(), Job.objects.count())
    api = APIClient()
    error = refused(api.post("/api/models", {"repo_id": MODEL_REPO}, format="json"), 507, "INSUFFICIENT_STORAGE")
    assert (error["details"]["needed_bytes"], error["details"]["free_bytes"]) == (needed, free)
    assert str(needed) in error["message"] and str(free) in error["message"]
    sae_files = hub.repos[SAE_REPO].files
    sae_needed = sum(len(d) for n, d in sae_files.items() if n.startswith(f"{SAELENS_DIR}/"))
    monkeypatch.setattr(shutil, "disk_usage", lambda path: DiskUsage(sae_needed, sae_needed, sae_needed - 1))
    error = refused(
        api.post("/api/saes/download", {"repository_id": SAE_REPO, "file_path": SAELENS_DIR}, format="json"),
        507,
        "INSUFFICIENT_STORAGE",
    )
    assert error["details"]["needed_bytes"] == sae_needed
    assert (Model.objects.count(), SAE.objects.count(), Job.objects.count()) == rows
    assert not any("/resolve/" in r.path and r.method == "GET" for r in hub.requests[seen:])
    assert not Path(settings.MODEL_CACHE_DIR).exists() or not any(Path(settings.MODEL_CACHE_DIR).iterdir())


# --- remote code at load: a row saved earlier runs none once the setting is off ---------


def test_a_row_registered_with_remote_code_is_refused_at_load(tiny_assets, settings):
    from registry.models import Job, Model

    row = Model.objects.create(
        name="legacy",
        source="local",
        status="ready",
        local_path=str(tiny_assets.models["tiny-llama"].path),
        trust_remote_code=True,
    )
    settings.ALLOW_REMOTE_CODE = False
    jobs = Job.objects.count()
    error = refused(APIClient().post(f"/api/models/{row.id}/load"), 400, "REMOTE_CODE_NOT_ALLOWED")
    assert (error["details"]["setting"], error["details"]["model_id"]) == ("ALLOW_REMOTE_CODE", row.id)
    assert Job.objects.count() == jobs
    row.refresh_from_db()
    assert row.status == "ready"
    # and whatever calls the engine directly is asked for no remote code
    from orchestration.services import load_job

    assert load_job(row, device="cpu", dtype="float32").trust_remote_code is False
    settings.ALLOW_REMOTE_CODE = True
    assert load_job(row, device="cpu", dtype="float32").trust_remote_code is True


# --- strict /api bodies ------------------------------------------------------------------


def test_unknown_and_mistyped_fields_are_refused_naming_them(tiny_assets):
    from registry.models import Model

    api = APIClient()
    path = str(tiny_assets.models["tiny-llama"].path)
    cases = [
        # "name" is custom_name's name elsewhere: it used to be dropped in silence
        ({"source": "local", "local_path": path, "name": "mine"}, "name"),
        ({"source": "local", "local_path": path, "trust_remote_code": "false"}, "trust_remote_code"),
        ({"source": "local", "local_path": path, "custom_name": 7}, "custom_name"),
    ]
    for body, field in cases:
        error = refused(api.post("/api/models", body, format="json"), 422, "VALIDATION_ERROR")
        assert field in error["details"]["fields"], error
        assert field in error["message"]
    assert not Model.objects.filter(local_path=path).exists()
    made = ok(
        api.post("/api/models", {"source": "local", "local_path": path, "custom_name": "mine"}, format="json"), 201
    )["model"]
    error = refused(
        api.patch(f"/api/models/{made['id']}", {"backend": "", "name": "x"}, format="json"), 422, "VALIDATION_ERROR"
    )
    assert list(error["details"]["fields"]) == ["name"]
    error = refused(api.get("/api/jobs?limit=2x"), 422, "VALIDATION_ERROR")  # still checked
    ok(api.get("/api/jobs?limit=2"))  # a query string is text: "2" is 2 there
    assert Model.objects.get(pk=made["id"]).name == "mine"


def test_the_same_checkpoint_is_registered_once(tiny_assets):
    from registry.models import Model

    api = APIClient()
    path = tiny_assets.models["tiny-llama"].path
    first = ok(
        api.post("/api/models", {"source": "local", "local_path": str(path), "custom_name": "one"}, format="json"), 201
    )["model"]
    for spelling in (str(path), f"{path}/", str(path.parent / "." / path.name)):
        error = refused(
            api.post("/api/models", {"source": "local", "local_path": spelling, "custom_name": "two"}, format="json"),
            409,
            "MODEL_ALREADY_EXISTS",
        )
        assert error["details"]["model_id"] == first["id"] and "'one'" in error["message"]
    assert Model.objects.filter(local_path=str(path.resolve())).count() == 1


@pytest.mark.parametrize(
    ("collection", "name"),
    [
        ("clusters", "active"),
        ("clusters", "import"),
        ("clusters", "12"),
        ("circuits", "active"),
        ("circuits", "import"),
        ("circuits", "claims"),
    ],
)
def test_document_names_that_shadow_their_routes_are_refused(collection, name):
    from steering.models import Circuit, Cluster

    if collection == "clusters":
        doc = {
            "kind": "mistudio.cluster-definition",
            "schema_version": "1",
            "name": name,
            "members": [{"feature_idx": 1, "strength": 50}],
        }
    else:
        doc = {
            "kind": "mistudio.circuit-definition",
            "schema_version": "1",
            "name": name,
            "saes": [{"sae_id": "some-sae", "layer": 1}],
            "members": [{"layer": 1, "feature": {"feature_idx": 1, "strength": 5}}],
        }
    error = refused(APIClient().post(f"/api/{collection}/import", doc, format="json"), 422, "VALIDATION_ERROR")
    assert "name" in error["details"]["fields"] and repr(name) in error["message"]
    assert not Cluster.objects.exists() and not Circuit.objects.exists()
