"""What a feature means: dashboards computed over a corpus (docs/features.md).

A ``DashboardRun`` is one job: a corpus run through the resident model with one attached
SAE. Its ``FeatureDashboard`` rows are written in one transaction when the run completes
(``complete`` is set in that same transaction), so a cancelled or crashed run never leaves
rows that claim to be a finished dashboard. Labels and explanations live in the registry
(``registry.FeatureExplanation``) because monitoring, /v1 and the steering documents,
which sit below this app, show them too.
"""

from __future__ import annotations

import secrets

from django.db import models

from core.json_fields import FastJSONEncoder

from registry.models import SAE

OWNER_MAX_CHARS = 200


def _run_id() -> str:
    return f"dash_{secrets.token_hex(8)}"


class DashboardRun(models.Model):
    class Status(models.TextChoices):
        QUEUED = "queued"
        RUNNING = "running"
        CANCELLING = "cancelling"
        CANCELLED = "cancelled"
        FAILED = "failed"
        COMPLETED = "completed"

    TERMINAL = (Status.CANCELLED, Status.FAILED, Status.COMPLETED)

    class Corpus(models.TextChoices):
        SAMPLE = "sample", "The built-in offline sample"
        FILE = "file", "A /v1/files upload"

    id = models.CharField(primary_key=True, max_length=40, default=_run_id, editable=False)
    sae = models.ForeignKey(SAE, on_delete=models.CASCADE, related_name="dashboard_runs")
    layer = models.IntegerField(help_text="The attachment's layer the corpus is read at.")
    owner = models.CharField(max_length=OWNER_MAX_CHARS, default="anonymous", db_index=True)
    corpus = models.CharField(max_length=8, choices=Corpus.choices, default=Corpus.SAMPLE)
    corpus_file_id = models.CharField(max_length=40, blank=True)
    text_field = models.CharField(max_length=100, blank=True, default="text")
    token_budget = models.PositiveIntegerField()
    context_tokens = models.PositiveIntegerField(default=64)
    top_k = models.PositiveSmallIntegerField(default=10, help_text="Top contexts kept per feature.")
    window = models.PositiveSmallIntegerField(default=8, help_text="Tokens kept each side of a context's max.")
    status = models.CharField(max_length=12, choices=Status.choices, default=Status.QUEUED, db_index=True)
    complete = models.BooleanField(default=False, help_text="Every feature's dashboard of this run is stored.")
    contexts_total = models.PositiveIntegerField(default=0)
    contexts_done = models.PositiveIntegerField(default=0)
    tokens_done = models.BigIntegerField(default=0)
    error = models.JSONField(null=True, blank=True)  # {code, message}
    # corpus-wide figures: tokens, dead and dense features, the L0 distribution, backend
    summary = models.JSONField(default=dict, blank=True)
    # who runs it now and when it last said so; where its accumulators are checkpointed
    runner = models.CharField(max_length=64, null=True, blank=True)
    runner_seen_at = models.DateTimeField(null=True, blank=True)
    checkpoint_path = models.CharField(max_length=1000, blank=True)
    # how often another runner took it over from one that died (BATCH_MAX_RESUMES)
    resumes = models.PositiveIntegerField(default=0)
    created_at = models.DateTimeField(auto_now_add=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return self.id


class FeatureDashboard(models.Model):
    """One feature's figures from one completed run."""

    run = models.ForeignKey(DashboardRun, on_delete=models.CASCADE, related_name="dashboards")
    sae = models.ForeignKey(SAE, on_delete=models.CASCADE, related_name="feature_dashboards")
    index = models.PositiveIntegerField()
    count = models.BigIntegerField(default=0, help_text="Tokens at which the feature is above 0.")
    density = models.FloatField(default=0.0, help_text="Share of the corpus's tokens above 0.")
    mean = models.FloatField(default=0.0, help_text="Mean over the tokens above 0.")
    max = models.FloatField(default=0.0)
    # {"edges": [n+1 floats], "counts": [n ints]} over the non-zero activations
    histogram = models.JSONField(default=dict, blank=True, encoder=FastJSONEncoder)
    # [{context, tokens: [str], token_ids, activations: [float], max_position, max_activation}]
    top_contexts = models.JSONField(default=list, blank=True, encoder=FastJSONEncoder)
    # [{band: [lo, hi], contexts: [same shape]}], lower quantiles
    quantile_samples = models.JSONField(default=list, blank=True, encoder=FastJSONEncoder)
    # [{token_id, token, value}] of W_dec[i] @ W_U, highest and lowest
    logit_top = models.JSONField(default=list, blank=True, encoder=FastJSONEncoder)
    logit_bottom = models.JSONField(default=list, blank=True, encoder=FastJSONEncoder)
    # the top contexts' and logit effects' tokens, lower-cased, for search
    search_tokens = models.TextField(blank=True)

    class Meta:
        ordering = ["sae_id", "index"]
        constraints = [models.UniqueConstraint(fields=["run", "index"], name="dashboard_unique_feature")]
        indexes = [models.Index(fields=["sae", "index"])]
