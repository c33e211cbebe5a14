"""An attachment going away (detach, OOM) takes its live steering with it, and every
profile, cluster or circuit steering through it stops being active.

Above both ``steering.live`` and ``steering.circuits`` (a circuit ends whole), so that
neither has to import the other back.
"""

from __future__ import annotations

from collections.abc import Iterable

from django.db import transaction

from registry.models import Attachment
from steering import live
from steering.circuits import circuit_deactivate
from steering.models import Circuit, Cluster, LiveSteering, Profile


def live_forget(*, attachments: Iterable[Attachment]) -> None:
    """An attachment is going away (detach, OOM): its live steering goes with it."""
    attachments = list(attachments)
    if not attachments:
        return
    with transaction.atomic():
        live.steering_lock()
        rows = LiveSteering.objects.filter(attachment__in=attachments)
        had = {(r.attachment_id, r.scope) for r in rows if r.values or r.controls or r.enabled}
        _documents_forget({(a.sae_id, a.layer) for a in attachments})
        LiveSteering.objects.filter(attachment__in=attachments).delete()
        for attachment in attachments:
            for attachment_id, scope in sorted(had, key=lambda h: (h[1] != live.GLOBAL, h[1])):
                if attachment_id != attachment.pk:
                    continue
                state = {
                    "sae_id": attachment.sae_id,
                    "layer": attachment.layer,
                    "enabled": False,
                    "values": {},
                    "controls": [],
                    "active_count": 0,
                    "source": LiveSteering.Source.MANUAL,
                }
                if scope != live.GLOBAL:
                    state["scope"] = scope
                transaction.on_commit(lambda st=state, sc=scope: live.publish_update(st, reason="detach", scope=sc))


def _documents_forget(keys: set[tuple[str, int]]) -> None:
    """The profile, cluster or circuits that steer through a forgotten (sae_id, layer) stop
    being active: what they claim no longer runs, and a re-attach starts unsteered. A
    circuit ends whole (claims released, its values gone from its other layers too)."""
    for document in (Profile, Cluster):
        for row in document.objects.filter(is_active=True):
            if (row.sae_id, row.layer) in keys:
                document.objects.filter(pk=row.pk).update(is_active=False)
    for circuit in Circuit.objects.filter(is_active=True):
        if any((sae_id, int(layer)) in keys for layer, sae_id in circuit.serving.items()):
            circuit_deactivate(circuit=circuit)
