"""What steering does, measured server-side (docs/experiments.md).

An ``ExperimentRun`` is one job of a ``kind``: a **sweep** (prompts × steering variants ×
strengths, plus each prompt's unsteered DEFAULT), a **calibration** (the strength whose
mean KL meets a budget, by bisection) or a corpus **fidelity** run of an SAE. Its
``ExperimentPoint`` rows are written as each point completes, so a cancelled run keeps
the points already done (``partial``) and a runner that died is resumed by the next from
the points stored: nothing is computed twice.
"""

from __future__ import annotations

import secrets

from django.db import models

OWNER_MAX_CHARS = 200


def _run_id() -> str:
    return f"exp_{secrets.token_hex(8)}"


class ExperimentRun(models.Model):
    class Kind(models.TextChoices):
        SWEEP = "sweep"
        CALIBRATION = "calibration"
        FIDELITY = "fidelity"

    class Status(models.TextChoices):
        QUEUED = "queued"
        RUNNING = "running"
        CANCELLING = "cancelling"
        CANCELLED = "cancelled"
        FAILED = "failed"
        COMPLETED = "completed"

    TERMINAL = (Status.CANCELLED, Status.FAILED, Status.COMPLETED)

    id = models.CharField(primary_key=True, max_length=40, default=_run_id, editable=False)
    kind = models.CharField(max_length=12, choices=Kind.choices, db_index=True)
    owner = models.CharField(max_length=OWNER_MAX_CHARS, default="anonymous", db_index=True)
    # the SAE (and layer) the run is about where there is one (a fidelity run, a
    # calibration of a feature): ``GET /api/saes/{id}/fidelity`` looks runs up by it
    sae_id = models.CharField(max_length=200, blank=True, default="", db_index=True)
    layer = models.IntegerField(null=True, blank=True)
    # the request as validated (prompts, variants, strengths, sampling...): what a
    # resumed runner runs again
    spec = models.JSONField(default=dict)
    status = models.CharField(max_length=12, choices=Status.choices, default=Status.QUEUED, db_index=True)
    done = models.PositiveIntegerField(default=0)
    total = models.PositiveIntegerField(default=0)
    # ended (cancelled or failed) with some points but not all of them stored
    partial = models.BooleanField(default=False)
    error = models.JSONField(null=True, blank=True)  # {code, message}
    # the run's figures: a calibration's {strength, kl, curve, iterations}, a fidelity
    # run's, what the backend could not measure ({"kl_unavailable": reason}), backend, model
    result = models.JSONField(default=dict, blank=True)
    # who runs it now and when it last said so (core.jobs.LongRuns)
    runner = models.CharField(max_length=64, null=True, blank=True)
    runner_seen_at = models.DateTimeField(null=True, blank=True)
    # how often another runner took it over from one that died (BATCH_MAX_RESUMES)
    resumes = models.PositiveIntegerField(default=0)
    created_at = models.DateTimeField(auto_now_add=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return self.id


class ExperimentPoint(models.Model):
    """One point of a run, stored when it is complete.

    A sweep's point is one prompt under one variant at one strength (``is_default``: the
    prompt unsteered): its generated ``text`` and ``token_ids``; ``kl_per_position`` (and
    its mean): KL(steered ‖ default) of the next-token distributions teacher-forced on the
    prompt's DEFAULT continuation (null where the backend cannot give them; the run's
    ``result.kl_unavailable`` says why); the target feature's activation at each steered
    position read before (``target_before``, ``pre_steering``) and after
    (``target_after``, ``post_steering``) the layer's steering, and their means; the
    steered text's log-likelihood under the unsteered model. A calibration's point is
    one prompt at one strength tried (KL only). ``data`` holds what a kind adds (a
    fidelity run's figures)."""

    run = models.ForeignKey(ExperimentRun, on_delete=models.CASCADE, related_name="points")
    ordinal = models.PositiveIntegerField(help_text="The point's place in the run's grid.")
    prompt_index = models.PositiveIntegerField(default=0)
    variant_index = models.PositiveIntegerField(null=True, blank=True)
    strength = models.FloatField(null=True, blank=True)
    is_default = models.BooleanField(default=False)
    text = models.TextField(blank=True, default="")
    token_ids = models.JSONField(default=list, blank=True)
    finish_reason = models.CharField(max_length=16, blank=True, default="")
    kl_mean = models.FloatField(null=True, blank=True)
    kl_per_position = models.JSONField(null=True, blank=True)
    target_before = models.FloatField(null=True, blank=True)
    target_after = models.FloatField(null=True, blank=True)
    # [{position, activation}] at the steered positions the monitors read
    target_before_per_position = models.JSONField(null=True, blank=True)
    target_after_per_position = models.JSONField(null=True, blank=True)
    loglik = models.FloatField(null=True, blank=True)
    loglik_per_token = models.JSONField(null=True, blank=True)
    data = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["run_id", "ordinal"]
        constraints = [models.UniqueConstraint(fields=["run", "ordinal"], name="experiment_point_unique_ordinal")]
