"""The admin pages (profiles, clusters, circuits, leases) with their import views and
export actions, and the export_profiles / import_profiles commands — all through the
same services as the API."""

from __future__ import annotations

import json

import pytest
from django.core.management import CommandError, call_command

from leases.models import Lease
from leases.services import lease_grant
from steering.models import Circuit, Cluster, Profile
from steering.services import cluster_import, profile_create
from tests.documents.test_circuits import circuit, feature
from tests.documents.test_clusters import definition

pytestmark = pytest.mark.django_db


def test_admin_pages_import_and_export(admin_client, relu, llama):
    profile_create(name="p1", steering={"1": 2.0})
    cluster_import(document=definition())
    for page in (
        "steering/profile",
        "steering/cluster",
        "steering/circuit",
        "leases/lease",
        "steering/livesteering",
        "monitoring/activationrecord",
    ):
        assert admin_client.get(f"/admin/{page}/").status_code == 200, page

    # import views
    page = admin_client.get("/admin/steering/cluster/import/")
    assert page.status_code == 200 and b"cluster-bundle" in page.content
    text = json.dumps(definition("via-admin"))
    done = admin_client.post("/admin/steering/cluster/import/", {"document": text})
    assert done.status_code == 302 and Cluster.objects.get(name="via-admin").document == text
    doc = circuit("c-admin", [{"mistudio_sae_id": relu.id, "layer": 1}], [feature(1, 1, 2)])
    admin_client.post("/admin/steering/circuit/import/", {"document": json.dumps(doc)})
    assert Circuit.objects.filter(name="c-admin").exists()
    bad = admin_client.post("/admin/steering/circuit/import/", {"document": "{}"}, follow=True)
    assert b"UNKNOWN_KIND" in bad.content
    export = {"version": "1.0", "name": "imported", "sae_id": relu.id, "layer": 1, "steering": {"4": 1.5}}
    admin_client.post("/admin/steering/profile/import/", {"document": json.dumps(export)})
    assert Profile.objects.get(name="imported").steering == {"4": 1.5}

    # export actions
    p1 = Profile.objects.get(name="p1")
    out = admin_client.post("/admin/steering/profile/", {"action": "export", "_selected_action": [p1.pk]})
    assert json.loads(out.content)["steering"] == {"1": 2.0}
    via = Cluster.objects.get(name="via-admin")
    out = admin_client.post("/admin/steering/cluster/", {"action": "export", "_selected_action": [via.pk]})
    assert out.content.decode() == text
    # activation through an action reads like the API's refusals
    admin_client.post("/admin/steering/cluster/", {"action": "activate", "_selected_action": [via.pk]})
    assert Cluster.objects.get(pk=via.pk).is_active
    # adding a profile in the admin goes through the service's checks
    added = admin_client.post(
        "/admin/steering/profile/add/",
        {
            "name": "added",
            "description": "",
            "model_name": "",
            "sae_id": relu.id,
            "layer": 1,
            "steering": '{"3": 250}',
            "intensity": 1,
        },
    )
    assert added.status_code == 200 and not Profile.objects.filter(name="added").exists()
    added = admin_client.post(
        "/admin/steering/profile/add/",
        {
            "name": "added",
            "description": "",
            "model_name": "",
            "sae_id": relu.id,
            "layer": 1,
            "steering": '{"30": 1}',
            "intensity": 1,
        },
    )
    assert added.status_code == 302 and Profile.objects.get(name="added").steering == {"30": 1.0}
    # controls too, through the same rules
    gated = {
        "name": "gated",
        "description": "",
        "model_name": "",
        "sae_id": relu.id,
        "layer": 1,
        "steering": '{"3": 1}',
        "intensity": 1,
    }
    added = admin_client.post("/admin/steering/profile/add/", {**gated, "controls": '[{"index": 4, "mode": "clamp"}]'})
    assert added.status_code == 200 and not Profile.objects.filter(name="gated").exists()
    added = admin_client.post(
        "/admin/steering/profile/add/", {**gated, "controls": '[{"index": 3, "mode": "ablate"}]'}
    )  # 3 twice
    assert added.status_code == 200 and not Profile.objects.filter(name="gated").exists()
    added = admin_client.post("/admin/steering/profile/add/", {**gated, "controls": '[{"index": 4, "mode": "ablate"}]'})
    assert added.status_code == 302
    assert Profile.objects.get(name="gated").controls == [{"index": 4, "mode": "ablate"}]

    # leases: read-only rows, ended by an action
    lease_grant(model=llama.model, holder="h", reason="r")
    assert b"h" in admin_client.get("/admin/leases/lease/").content
    admin_client.post("/admin/leases/lease/", {"action": "revoke", "_selected_action": [Lease.objects.get().pk]})
    assert Lease.objects.get().end_reason == "revoked"


def test_export_and_import_profile_commands(relu, tmp_path, capsys):
    profile_create(name="one", steering={"1": 2.0}, description="first")
    profile_create(name="two", steering={"3": -4.5})
    target = tmp_path / "profiles.json"
    call_command("export_profiles", "-o", str(target))
    docs = json.loads(target.read_text())
    assert [d["name"] for d in docs] == ["one", "two"]
    call_command("export_profiles", "one")
    assert json.loads(capsys.readouterr().out)["description"] == "first"
    with pytest.raises(CommandError, match="PROFILE_ALREADY_EXISTS"):
        call_command("import_profiles", str(target))
    Profile.objects.all().delete()
    call_command("import_profiles", str(target))
    again = tmp_path / "again.json"
    call_command("export_profiles", "-o", str(again))
    assert json.loads(again.read_text()) == docs  # lossless, times included
    call_command("import_profiles", str(target), "--on-conflict", "rename")
    assert Profile.objects.filter(name__endswith="(2)").count() == 2


def test_profile_commands_refuse_unreadable_paths_in_one_line(relu, tmp_path):
    profile_create(name="kept", steering={"1": 2.0})
    latin1 = tmp_path / "latin1.json"
    latin1.write_bytes(b'{"name": "caf\xe9"}')
    for path, message in (
        (tmp_path / "missing.json", "cannot read it"),
        (tmp_path, "cannot read it"),
        (latin1, "is not UTF-8 text"),
    ):
        with pytest.raises(CommandError, match=message):
            call_command("import_profiles", str(path))
    with pytest.raises(CommandError, match="cannot write it"):
        call_command("export_profiles", "-o", str(tmp_path / "no" / "such" / "dir.json"))
    # a batch whose second entry is refused imports nothing, and says nothing was imported
    batch = tmp_path / "batch.json"
    batch.write_text(
        json.dumps(
            [
                {"version": 1, "name": "fresh", "steering": {"2": 1.0}},
                {"version": 1, "name": "kept", "steering": {"2": 1.0}},
            ]
        )
    )
    with pytest.raises(CommandError, match="nothing was imported"):
        call_command("import_profiles", str(batch))
    assert sorted(Profile.objects.values_list("name", flat=True)) == ["kept"]
