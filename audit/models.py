"""One row per change of state asked of the server (docs/security.md, "Audit log")."""

from __future__ import annotations

from django.db import models
from django.utils import timezone


class AuditEntry(models.Model):
    class ActorKind(models.TextChoices):
        ADMIN_KEY = "admin_key", "Admin key"
        INFERENCE_KEY = "inference_key", "Inference key"
        ADMIN_USER = "admin_user", "Django admin user"
        ANONYMOUS = "anonymous", "Anonymous (keys off)"
        SYSTEM = "system", "The server itself"

    # result: "ok", "pending" (asynchronous work not yet ended), or the error code
    OK, PENDING = "ok", "pending"

    created_at = models.DateTimeField(default=timezone.now, db_index=True)
    actor = models.CharField(max_length=150, db_index=True, help_text="Key label, admin user name, anonymous or system")
    actor_kind = models.CharField(max_length=16, choices=ActorKind.choices)
    action = models.CharField(max_length=64, db_index=True)
    target_kind = models.CharField(max_length=32, blank=True)
    target_id = models.CharField(max_length=200, blank=True, db_index=True)
    target_name = models.CharField(max_length=300, blank=True)
    params = models.JSONField(default=dict, blank=True)
    result = models.CharField(max_length=64, default=OK, db_index=True)
    message = models.CharField(max_length=500, blank=True)
    job_id = models.BigIntegerField(null=True, blank=True, db_index=True, help_text="The job that finishes it")
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        verbose_name = "audit entry"
        verbose_name_plural = "audit log"

    def __str__(self) -> str:
        return f"{self.created_at:%Y-%m-%d %H:%M:%S} {self.actor} {self.action} {self.target_kind}:{self.target_id} {self.result}"
