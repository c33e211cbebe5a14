"""Rows of the Batch API: uploaded files, batches and the lines of a batch.

A batch's lines are copied out of its input file at creation, one row each, with the
request id (``batch_req_…``) that is the line's idempotency key: a line is answered at
most once (``services.batch_line_answer`` writes only a line not answered yet), so a
runner that dies mid-batch and the one that takes over never answer a line twice, and
the lines answered before the crash are never run again.
"""

from __future__ import annotations

from django.db import models


OWNER_MAX_CHARS = 80  # "anonymous" or "key:<label>" (core.auth: labels up to 64)


class File(models.Model):
    class Purpose(models.TextChoices):
        BATCH = "batch"
        BATCH_OUTPUT = "batch_output"
        # text for the server's own readers (a feature-dashboard corpus: text lines or
        # JSONL), OpenAI's purpose for files that are neither batch input nor model input
        USER_DATA = "user_data"

    id = models.CharField(primary_key=True, max_length=40)  # file-<hex>
    # the principal that uploaded it (core.auth.Principal.owner); a batch's output and
    # error files are its batch's owner's
    owner = models.CharField(max_length=OWNER_MAX_CHARS, default="anonymous", db_index=True)
    filename = models.CharField(max_length=255)
    purpose = models.CharField(max_length=20, choices=Purpose.choices)
    bytes = models.BigIntegerField()
    lines = models.IntegerField(default=0)
    # False while a batch's output is being written (never listed nor read until then)
    complete = models.BooleanField(default=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return f"{self.id} ({self.filename})"


class FileChunk(models.Model):
    """A file's bytes, in order, at most ``services.CHUNK_BYTES`` a row: in the database,
    so every web worker and Celery worker reads the same file, and written and read a
    chunk at a time, so no file is ever whole in memory."""

    file = models.ForeignKey(File, on_delete=models.CASCADE, related_name="chunks")
    index = models.IntegerField()
    data = models.BinaryField()

    class Meta:
        constraints = [models.UniqueConstraint(fields=["file", "index"], name="file_chunk_unique")]


class Batch(models.Model):
    class Status(models.TextChoices):
        VALIDATING = "validating"
        FAILED = "failed"
        IN_PROGRESS = "in_progress"
        FINALIZING = "finalizing"
        COMPLETED = "completed"
        EXPIRED = "expired"
        CANCELLING = "cancelling"
        CANCELLED = "cancelled"

    TERMINAL = (Status.FAILED, Status.COMPLETED, Status.EXPIRED, Status.CANCELLED)

    id = models.CharField(primary_key=True, max_length=40)  # batch_<hex>
    owner = models.CharField(max_length=OWNER_MAX_CHARS, default="anonymous", db_index=True)
    endpoint = models.CharField(max_length=64)
    model = models.CharField(max_length=255, blank=True)
    input_file_id = models.CharField(max_length=40)
    completion_window = models.CharField(max_length=8, default="24h")
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.VALIDATING)
    errors = models.JSONField(null=True, blank=True)  # [{code, message, param, line}]
    output_file_id = models.CharField(max_length=40, null=True, blank=True)
    error_file_id = models.CharField(max_length=40, null=True, blank=True)
    metadata = models.JSONField(null=True, blank=True)
    total = models.IntegerField(default=0)
    completed = models.IntegerField(default=0)
    failed = models.IntegerField(default=0)
    input_tokens = models.BigIntegerField(default=0)
    output_tokens = models.BigIntegerField(default=0)
    created_at = models.DateTimeField(auto_now_add=True)
    in_progress_at = models.DateTimeField(null=True, blank=True)
    expires_at = models.DateTimeField()
    finalizing_at = models.DateTimeField(null=True, blank=True)
    completed_at = models.DateTimeField(null=True, blank=True)
    failed_at = models.DateTimeField(null=True, blank=True)
    expired_at = models.DateTimeField(null=True, blank=True)
    cancelling_at = models.DateTimeField(null=True, blank=True)
    cancelled_at = models.DateTimeField(null=True, blank=True)
    # who runs it now, and when it last said so (BATCH_RUNNER_STALE_S)
    runner = models.CharField(max_length=64, null=True, blank=True)
    runner_seen_at = models.DateTimeField(null=True, blank=True)
    # how often the sweeper found its runner dead and queued another (BATCH_MAX_RESUMES)
    resumes = models.IntegerField(default=0)
    # with keys on, the owner's live steering scope as it was at creation (steering.live
    # ``scope_snapshot``): what its lines without steering of their own run; null (keys
    # off, or a batch from before scopes) runs the global live steering as of each line
    live_steering = models.JSONField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        verbose_name_plural = "batches"

    def __str__(self) -> str:
        return f"{self.id} ({self.status})"

    @property
    def terminal(self) -> bool:
        return self.status in self.TERMINAL


class BatchLine(models.Model):
    class Status(models.TextChoices):
        PENDING = "pending"
        RUNNING = "running"
        DONE = "done"

    batch = models.ForeignKey(Batch, on_delete=models.CASCADE, related_name="lines")
    line = models.IntegerField()  # 1-based line number in the input file
    custom_id = models.CharField(max_length=512)
    request_id = models.CharField(max_length=48, unique=True)  # batch_req_<hex>
    body = models.JSONField()
    status = models.CharField(max_length=8, choices=Status.choices, default=Status.PENDING)
    runner = models.CharField(max_length=64, null=True, blank=True)
    attempts = models.IntegerField(default=0)
    # the answer: an HTTP status and body as the synchronous route gives them ...
    status_code = models.IntegerField(null=True, blank=True)
    response = models.JSONField(null=True, blank=True)
    headers = models.JSONField(null=True, blank=True)
    # ... or, for a line never run (expired, cancelled), OpenAI's {code, message}
    error = models.JSONField(null=True, blank=True)
    answered_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["batch", "line"]
        constraints = [
            models.UniqueConstraint(fields=["batch", "line"], name="batch_line_unique"),
            models.UniqueConstraint(fields=["batch", "custom_id"], name="batch_custom_id_unique"),
        ]
        indexes = [models.Index(fields=["batch", "status", "line"])]

    def __str__(self) -> str:
        return f"{self.batch_id}:{self.line} ({self.custom_id})"
