"""Durable model leases: one holder reserves the resident model for a while, so nobody
else loads another model over it, unloads it or swaps it.

A lease is a row. Its id is shown once, at grant, and only its sha256 is stored; every
later call presents the id (``X-miLLM-Lease``) and is matched by hash. At most one live
lease per model is enforced by the database (a partial unique index on live rows), so two
web workers racing to grant one cannot both win. Ended leases are kept (up to
LEASE_ENDED_MEMORY rows) so that renewing or releasing a seen id answers with why it ended.
"""

from __future__ import annotations

from django.db import models


class Lease(models.Model):
    class EndReason(models.TextChoices):
        EXPIRED = "expired", "Expired"
        RELEASED = "released", "Released"
        MODEL_UNLOADED = "model_unloaded", "Model unloaded"
        REVOKED = "revoked", "Revoked by an administrator"

    model = models.ForeignKey("registry.Model", on_delete=models.CASCADE, related_name="leases")
    id_hash = models.CharField(
        max_length=64, unique=True, editable=False, help_text="sha256 of the lease id; the id itself is never stored."
    )
    holder = models.CharField(max_length=512)
    reason = models.TextField()
    ttl_seconds = models.PositiveIntegerField()
    acquired_at = models.DateTimeField()
    renewed_at = models.DateTimeField()
    expires_at = models.DateTimeField(db_index=True)
    ended_at = models.DateTimeField(null=True, blank=True, db_index=True)
    end_reason = models.CharField(max_length=16, choices=EndReason.choices, blank=True)

    class Meta:
        ordering = ["-acquired_at"]
        constraints = [
            models.UniqueConstraint(
                fields=["model"], condition=models.Q(ended_at__isnull=True), name="lease_one_live_per_model"
            ),
            models.CheckConstraint(
                name="lease_ended_has_reason",
                condition=models.Q(ended_at__isnull=True, end_reason="")
                | (models.Q(ended_at__isnull=False) & ~models.Q(end_reason="")),
            ),
        ]

    def __str__(self) -> str:
        state = self.end_reason or "live"
        return f"lease of {self.model_id} by {self.holder} ({state})"
