"""Monitoring: which SAE features fire on /v1 generations.

``MonitoringConfig`` (one row) says what /v1 requests read: the attachment, the features
(or all, via the top-k), the positions, ``pre_steering`` (the residual stream before this
layer's steering delta). ``ActivationRecord`` rows are the history: one per position read,
attributed to the request (its response id) that produced it, bounded to the newest
``history_size`` rows. In the database rather than in a process's memory, so every web
worker (each records the generations it served) writes to one history and reads the same
statistics, and a restart keeps it; the bound keeps the table small.
"""

from __future__ import annotations

from django.db import models


class MonitoringConfig(models.Model):
    class Positions(models.TextChoices):
        LAST = "last", "The last position of each generation"
        COMPLETION = "completion", "Every generated token"
        ALL = "all", "Every position, prompt included"

    enabled = models.BooleanField(default=False)
    sae_id = models.CharField(max_length=40, blank=True,
                              help_text="The monitored SAE; empty: the only one attached.")
    layer = models.PositiveIntegerField(null=True, blank=True)
    features = models.JSONField(null=True, blank=True,
                                help_text="Feature indices to record; null: all (top-k).")
    history_size = models.PositiveIntegerField(default=100)
    top_k = models.PositiveSmallIntegerField(default=10)
    positions = models.CharField(max_length=16, choices=Positions.choices,
                                 default=Positions.LAST)
    statistics_since = models.DateTimeField(null=True, blank=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        verbose_name = "monitoring configuration"

    def __str__(self) -> str:
        return "monitoring " + ("on" if self.enabled else "off")


class ActivationRecord(models.Model):
    timestamp = models.DateTimeField(db_index=True)
    request_id = models.CharField(max_length=100, db_index=True)
    sae_id = models.CharField(max_length=40)
    layer = models.PositiveIntegerField()
    token_position = models.PositiveIntegerField(help_text="Residual row (prompt, then output).")
    completion_token_index = models.PositiveIntegerField(null=True, blank=True)
    activations = models.JSONField(default=list,
                                   help_text="[{feature_index, activation}] of the monitored "
                                             "features (zeros included), or the top-k.")
    top_k = models.JSONField(default=list)

    class Meta:
        ordering = ["-id"]

    def __str__(self) -> str:
        return f"{self.request_id}@{self.token_position}"


class Capture(models.Model):
    """A stored hidden-state capture (issue 15): its safetensors file and JSON sidecar
    live under CAPTURE_DIR as ``<id>.safetensors`` / ``<id>.json``; captures small enough
    to come back inline have no row."""

    id = models.CharField(primary_key=True, max_length=32)  # 32 hex digits, the file stem
    request_id = models.CharField(max_length=100, db_index=True,
                                  help_text="The /v1 response id that produced it.")
    engine_request_id = models.CharField(max_length=100, blank=True)
    model = models.CharField(max_length=500, blank=True)
    backend = models.CharField(max_length=40, blank=True)
    layers = models.JSONField(default=list)
    positions = models.CharField(max_length=16)
    rows = models.PositiveIntegerField(default=0)
    dtype = models.CharField(max_length=16, blank=True)
    steering_hash = models.CharField(max_length=80, blank=True)
    nbytes = models.PositiveBigIntegerField(default=0)
    created_at = models.DateTimeField(db_index=True)
    expires_at = models.DateTimeField(null=True, blank=True, db_index=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"capture {self.id}"
