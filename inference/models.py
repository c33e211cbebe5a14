"""Stored responses of the Responses API (``POST /v1/responses`` with ``store``, the default):
the Response object a caller was answered, the input items of its request, and the link to
the response it continued (``previous_response_id``), owned by the caller's key as files
and batches are (``monitoring.ownership``). A ``background`` response is also a job: its
request waits here (``request``) until a runner takes it (``inference.responses_runner``).
"""

from __future__ import annotations

from django.core.validators import MaxValueValidator, MinValueValidator, RegexValidator
from django.db import models

OWNER_MAX_CHARS = 80  # "anonymous" or "key:<label>" (core.auth: labels up to 64)


class StoredResponse(models.Model):
    class Status(models.TextChoices):
        QUEUED = "queued"
        IN_PROGRESS = "in_progress"
        COMPLETED = "completed"
        FAILED = "failed"
        INCOMPLETE = "incomplete"
        CANCELLED = "cancelled"

    TERMINAL = (Status.COMPLETED, Status.FAILED, Status.INCOMPLETE, Status.CANCELLED)

    id = models.CharField(primary_key=True, max_length=64)  # resp_<hex>
    owner = models.CharField(max_length=OWNER_MAX_CHARS, default="anonymous", db_index=True)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.COMPLETED)
    model = models.CharField(max_length=255, blank=True)
    # the Response object as GET answers it (its status kept equal to ``status``)
    body = models.JSONField()
    # this request's own input items (not the chain's), each with its id
    input_items = models.JSONField(default=list)
    previous_response_id = models.CharField(max_length=64, null=True, blank=True)
    # bytes of body and input_items as stored (RESPONSES_MAX_STORED_BYTES)
    bytes = models.BigIntegerField(default=0)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)
    # background runs: the request to run, who runs it and when it last said so
    # (BATCH_RUNNER_STALE_S), how often a dead runner's response was queued again
    background = models.BooleanField(default=False)
    request = models.JSONField(null=True, blank=True)
    policy = models.CharField(max_length=32, blank=True)
    lease = models.TextField(blank=True)  # the X-miLLM-Lease header as sent
    runner = models.CharField(max_length=64, null=True, blank=True)
    runner_seen_at = models.DateTimeField(null=True, blank=True)
    resumes = models.IntegerField(default=0)

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [
            models.Index(fields=["created_at"]),
            models.Index(fields=["background", "status"]),
        ]

    def __str__(self) -> str:
        return f"{self.id} ({self.status})"

    @property
    def terminal(self) -> bool:
        return self.status in self.TERMINAL


class KeyUsage(models.Model):
    """What one key used on one day (UTC): /v1 requests (Batch API lines and stored
    responses included), their prompt and completion tokens as the answers reported them,
    and how many ran steered. One upsert per request (``inference.usage``); read at
    ``GET /api/usage`` and in the admin, never changed by hand."""

    owner = models.CharField(max_length=OWNER_MAX_CHARS)  # "anonymous" or "key:<label>"
    day = models.DateField()
    requests = models.BigIntegerField(default=0)
    prompt_tokens = models.BigIntegerField(default=0)
    completion_tokens = models.BigIntegerField(default=0)
    steered_requests = models.BigIntegerField(default=0)
    updated_at = models.DateTimeField()

    class Meta:
        ordering = ["-day", "owner"]
        constraints = [models.UniqueConstraint(fields=["owner", "day"], name="inference_keyusage_owner_day")]
        verbose_name_plural = "key usage"

    def __str__(self) -> str:
        return f"{self.owner} {self.day}"


class KeyLimit(models.Model):
    """A staff-managed override of ``KEY_LIMITS`` for one key label (or ``*``), edited in
    the Django admin: each field it sets replaces that field of the setting's entry; an
    empty field keeps what the setting says. Every web process reads the rows again within
    ``inference.quotas.ROWS_REFRESH_S`` seconds (the process that saved one at once)."""

    label = models.CharField(
        max_length=64,
        unique=True,
        validators=[RegexValidator(r"^(\*|[A-Za-z0-9_.@-]{1,64})$", "a key label (letters, digits, _ . @ -) or *")],
        help_text="The key's label (the part before ':' in MILLM_API_KEYS / MILLM_ADMIN_API_KEYS), or * for every inference key.",
    )
    rpm = models.PositiveBigIntegerField(
        null=True,
        blank=True,
        validators=[MinValueValidator(1), MaxValueValidator(10**12)],
        help_text="requests per minute",
    )
    tpm = models.PositiveBigIntegerField(
        null=True,
        blank=True,
        validators=[MinValueValidator(1), MaxValueValidator(10**12)],
        help_text="prompt + completion tokens per minute",
    )
    concurrent = models.PositiveBigIntegerField(
        null=True,
        blank=True,
        validators=[MinValueValidator(1), MaxValueValidator(10**12)],
        help_text="requests at once",
    )
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["label"]

    def __str__(self) -> str:
        return self.label

    def fields(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in ("rpm", "tpm", "concurrent") if getattr(self, name) is not None}
