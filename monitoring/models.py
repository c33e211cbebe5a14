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

from monitoring.ownership import ANONYMOUS, OWNER_MAX_CHARS


def _owner_field():  # type: ignore[no-untyped-def]
    # the principal that made the row (monitoring.ownership): other inference keys never
    # list or read it
    return models.CharField(max_length=OWNER_MAX_CHARS, default=ANONYMOUS, db_index=True)


class MonitoringConfig(models.Model):
    class Positions(models.TextChoices):
        LAST = "last", "The last position of each generation"
        COMPLETION = "completion", "Every generated token"
        ALL = "all", "Every position, prompt included"

    enabled = models.BooleanField(default=False)
    sae_id = models.CharField(max_length=40, blank=True, help_text="The monitored SAE; empty: the only one attached.")
    layer = models.PositiveIntegerField(null=True, blank=True)
    features = models.JSONField(null=True, blank=True, help_text="Feature indices to record; null: all (top-k).")
    history_size = models.PositiveIntegerField(default=100)
    top_k = models.PositiveSmallIntegerField(default=10)
    positions = models.CharField(max_length=16, choices=Positions.choices, default=Positions.LAST)
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
    activations = models.JSONField(
        default=list,
        help_text="[{feature_index, activation}] of the monitored features (zeros included), or the top-k.",
    )
    top_k = models.JSONField(default=list)
    owner = _owner_field()

    class Meta:
        ordering = ["-id"]

    def __str__(self) -> str:
        return f"{self.request_id}@{self.token_position}"


class Capture(models.Model):
    """A stored hidden-state capture (issue 15): its safetensors file and JSON sidecar
    live under CAPTURE_DIR as ``<id>.safetensors`` / ``<id>.json``; captures small enough
    to come back inline have no row."""

    id = models.CharField(primary_key=True, max_length=32)  # 32 hex digits, the file stem
    request_id = models.CharField(max_length=100, db_index=True, help_text="The /v1 response id that produced it.")
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
    owner = _owner_field()

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"capture {self.id}"


class Probe(models.Model):
    """A trained linear probe (docs/monitoring.md, Probes): ``score = Σ w·x + b`` over
    ``x`` = the activations of ``features`` of the SAE attached at ``layer`` (basis
    ``sae_features``) or the hidden state of block ``layer`` (basis ``hidden_states``),
    standardised first (``(x - norm_mean) / norm_std``) when those are given; read at the
    rows ``positions`` names and judged ``score >= threshold``. Rows are data; the rules
    live in ``monitoring.probes``."""

    class Basis(models.TextChoices):
        SAE_FEATURES = "sae_features", "SAE feature activations"
        HIDDEN_STATES = "hidden_states", "Hidden states"

    id = models.CharField(primary_key=True, max_length=24)  # prb_<hex>
    name = models.CharField(max_length=120)
    description = models.TextField(blank=True)
    owner = _owner_field()
    basis = models.CharField(max_length=16, choices=Basis.choices)
    sae_id = models.CharField(max_length=40, blank=True, help_text="The SAE whose features it reads (sae_features).")
    layer = models.PositiveIntegerField()
    features = models.JSONField(default=list, blank=True, help_text="Feature indices, one per weight (sae_features).")
    weights = models.JSONField(default=list)
    bias = models.FloatField(default=0.0)
    threshold = models.FloatField(null=True, blank=True, help_text="Verdict when score >= threshold; null: no verdict.")
    norm_mean = models.JSONField(null=True, blank=True)
    norm_std = models.JSONField(null=True, blank=True)
    positions = models.CharField(max_length=16, default="last")
    validation = models.JSONField(
        default=dict, blank=True, help_text="The last successful validation: {model, sae_id, layer, d_in, checked_at}."
    )
    armed = models.BooleanField(default=False, help_text="Scored on /v1 requests that bring no probes.")
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]
        # names are the owner's: another key's probe of the same name is not revealed
        constraints = [models.UniqueConstraint(fields=["owner", "name"], name="probe_owner_name_unique")]

    def __str__(self) -> str:
        return self.name


class ProbeVerdict(models.Model):
    """One probe's verdict on one /v1 choice (the probe history)."""

    timestamp = models.DateTimeField(db_index=True)
    request_id = models.CharField(max_length=100, db_index=True)
    choice = models.PositiveIntegerField(default=0)
    probe_id = models.CharField(max_length=24, db_index=True)
    name = models.CharField(max_length=120)
    scored = models.BooleanField(default=True)
    reason = models.CharField(max_length=64, blank=True)
    score = models.FloatField(null=True, blank=True)
    threshold = models.FloatField(null=True, blank=True)
    verdict = models.BooleanField(null=True, blank=True)
    positions = models.CharField(max_length=16)
    rows = models.PositiveIntegerField(default=0)
    owner = _owner_field()

    class Meta:
        ordering = ["-id"]

    def __str__(self) -> str:
        return f"{self.name}@{self.request_id}"


class SensingArm(models.Model):
    """A cluster or circuit watched for co-firing without being active (sensing observes,
    it never steers)."""

    kind = models.CharField(max_length=16, choices=[("cluster", "cluster"), ("circuit", "circuit")])
    object_id = models.PositiveIntegerField()
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["kind", "object_id"], name="sensing_arm_unique")]

    def __str__(self) -> str:
        return f"sensing {self.kind} {self.object_id}"
