"""The audit log from /v1, served by the real ASGI application (daphne, /v1's own
handler and middlewares): a key's deletion of its own file and an admin key's on-demand
load name the key's label (docs/security.md, "Audit log")."""

from __future__ import annotations

import io
import json

from audit.models import AuditEntry


def test_a_keys_file_deletion_names_its_label(llama, keyed):
    alice = keyed["alice"]
    file = alice.files.create(file=("input.jsonl", io.BytesIO(b'{"a": 1}\n')), purpose="batch")
    assert alice.files.delete(file.id).deleted is True
    entry = AuditEntry.objects.get(action="file.delete")
    assert (entry.actor, entry.actor_kind, entry.target_kind, entry.target_id, entry.result) == (
        "alice",
        "inference_key",
        "file",
        file.id,
        "ok",
    )
    assert entry.target_name == "input.jsonl"
    assert "sk-" not in json.dumps([entry.actor, entry.params, entry.message])


def test_an_on_demand_load_names_the_admin_key_that_asked(llama, keyed):
    AuditEntry.objects.all().delete()  # the fixture's own load ran outside a request
    answer = keyed["root"].completions.create(model="tiny-gpt2", prompt="the sea", max_tokens=2)
    assert answer.model == "tiny-gpt2"
    entry = AuditEntry.objects.get(action="model.load")
    assert (entry.actor, entry.actor_kind, entry.target_name, entry.result, entry.params) == (
        "root",
        "admin_key",
        "tiny-gpt2",
        "ok",
        {"on_demand": True},
    )
