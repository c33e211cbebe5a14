"""Steering documents and live steering.

- ``Profile``: a saved set of feature strengths on one SAE attachment; a /v1 request can
  name it (``profile`` or ``"<model>@<profile>"``), and activating it makes it the live
  steering.
- ``Cluster``: an imported ``mistudio.cluster-definition/v1`` document (members with tuned
  strengths on one SAE), kept verbatim for a lossless export; bound to an attachment when
  its feature space fits, unbound otherwise.
- ``Circuit``: an imported ``mistudio.circuit-definition/v1`` document: members on several
  layers, each through its own SAE, with an evidence rung.
- ``LiveSteering``: what runs on requests that bring no steering of their own, one row per
  attachment and scope (``global``, or ``key:<label>`` for one key's own: docs/steering.md,
  Scopes) with values, controls and an enabled flag. Stored here rather than in the engine
  so it survives restarts and every web worker resolves the same default.
- ``SteeringState``: one row, locked by every change of live steering so that changes from
  several workers apply one at a time; ``version`` counts them.

Rows hold data only; every rule lives in the services.
"""

from __future__ import annotations

from django.db import models


class Profile(models.Model):
    name = models.CharField(
        max_length=200, unique=True, help_text="What /v1 requests name as `profile` (or `model@name`)."
    )
    description = models.TextField(blank=True)
    model_name = models.CharField(
        max_length=200, blank=True, help_text="The model the profile was made for; empty for any."
    )
    sae_id = models.CharField(
        max_length=40,
        blank=True,
        help_text="The SAE whose decoder rows the strengths scale (empty: an unbound profile, which must be empty).",
    )
    layer = models.PositiveIntegerField(null=True, blank=True, help_text="The decoder block the SAE is attached at.")
    steering = models.JSONField(default=dict, blank=True, help_text='Feature strengths: {"<index>": strength}.')
    controls = models.JSONField(
        default=list,
        blank=True,
        help_text="Features steered in another mode or only where a "
        "gate is open: [{index, mode, value, phase, "
        "window, condition}] (docs/steering.md, Modes).",
    )
    intensity = models.FloatField(
        default=1.0, help_text="λ applied at activation (0-2); each scaled value is clamped to ±200."
    )
    is_active = models.BooleanField(default=False)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]
        constraints = [
            models.UniqueConstraint(
                fields=["is_active"], condition=models.Q(is_active=True), name="profile_one_active"
            ),
        ]

    def __str__(self) -> str:
        return self.name


class Cluster(models.Model):
    name = models.CharField(max_length=200, unique=True)
    narrative = models.TextField(blank=True)
    document = models.TextField(help_text="The definition exactly as imported (exported as is).")
    members = models.JSONField(default=list, help_text="[{feature_idx, strength, sign, label}] as authored.")
    model_ref = models.CharField(max_length=300, blank=True, help_text="The model the definition names (hf_id).")
    sae_ref = models.JSONField(default=dict, blank=True, help_text="The SAE reference of the definition.")
    n_features = models.PositiveIntegerField(null=True, blank=True, help_text="Declared feature space (d_sae).")
    intensity = models.FloatField(default=1.0)
    intensity_range = models.JSONField(null=True, blank=True)
    sae_id = models.CharField(max_length=40, blank=True, help_text="Bound SAE; empty: unbound.")
    layer = models.PositiveIntegerField(null=True, blank=True, help_text="Bound layer.")
    unbound_reason = models.CharField(max_length=500, blank=True)
    warnings = models.JSONField(default=list, blank=True)
    is_active = models.BooleanField(default=False)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]
        constraints = [
            models.UniqueConstraint(
                fields=["is_active"], condition=models.Q(is_active=True), name="cluster_one_active"
            ),
        ]

    def __str__(self) -> str:
        return self.name


class Circuit(models.Model):
    name = models.CharField(max_length=200, unique=True)
    narrative = models.TextField(blank=True)
    document = models.TextField(help_text="The definition exactly as imported (exported as is).")
    saes = models.JSONField(default=list, help_text="[{layer, ref, source_hint, n_features}]")
    members = models.JSONField(default=dict, help_text='{"<layer>": [{feature_idx, strength, sign, label}]}')
    edges_count = models.PositiveIntegerField(default=0)
    rung = models.PositiveSmallIntegerField(default=0, help_text="Minimum over the edges (0 without edges).")
    intensity = models.FloatField(default=1.0)
    intensity_range = models.JSONField(null=True, blank=True)
    is_active = models.BooleanField(default=False)
    serving = models.JSONField(
        default=dict, blank=True, help_text='While active: {"<layer>": sae_id} it steers through.'
    )
    composed_layers = models.JSONField(
        default=list, blank=True, help_text="Layers shared with another circuit (allow_layer_overlap)."
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]
        constraints = [
            models.CheckConstraint(name="circuit_rung_0_3", condition=models.Q(rung__lte=3)),
        ]

    def __str__(self) -> str:
        return self.name


class LiveSteering(models.Model):
    """Live steering of one attachment in one scope; goes with the attachment (detach clears it)."""

    class Source(models.TextChoices):
        MANUAL = "manual", "Set directly"
        PROFILE = "profile", "Profile"
        CLUSTER = "cluster", "Cluster"
        CIRCUIT = "circuit", "Circuit"

    attachment = models.ForeignKey("registry.Attachment", on_delete=models.CASCADE, related_name="live_steering")
    scope = models.CharField(
        max_length=80,
        default="global",
        help_text="Whose live steering: `global` (admin keys) or `key:<label>` (that key's own requests).",
    )
    enabled = models.BooleanField(default=False)
    values = models.JSONField(default=dict, blank=True, help_text='{"<index>": strength}, each within ±200.')
    controls = models.JSONField(
        default=list,
        blank=True,
        help_text="[{index, mode, value, phase, window, condition}]: the features steered otherwise than a plain add.",
    )
    source = models.CharField(max_length=16, choices=Source.choices, default=Source.MANUAL)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        verbose_name_plural = "live steering"
        constraints = [models.UniqueConstraint(fields=["attachment", "scope"], name="live_steering_one_per_scope")]

    def __str__(self) -> str:
        return f"live steering on {self.attachment} ({self.scope})"


class SteeringState(models.Model):
    version = models.PositiveBigIntegerField(default=0)
    updated_at = models.DateTimeField(auto_now=True)
