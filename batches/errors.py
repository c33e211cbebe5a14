"""Errors of the Files and Batches routes. /v1 answers them in OpenAI's shape with the
lower-cased code (``inference.errors.openai_error_from_exception``); ``details.param``
names the offending field."""

from __future__ import annotations

from core.errors import MillmError


class InvalidFile(MillmError):
    """An upload the Batch API cannot take: purpose, format, or one of the limits."""

    code, status = "INVALID_FILE", 400


class FileTooLarge(MillmError):
    code, status = "FILE_TOO_LARGE", 400


class TooManyLines(MillmError):
    code, status = "TOO_MANY_LINES", 400


class LineTooLarge(MillmError):
    code, status = "LINE_TOO_LARGE", 400


class FileNotFound(MillmError):
    code, status = "FILE_NOT_FOUND", 404


class BatchNotFound(MillmError):
    code, status = "BATCH_NOT_FOUND", 404


class InvalidBatchRequest(MillmError):
    code, status = "INVALID_BATCH_REQUEST", 400


class BatchNotCancellable(MillmError):
    code, status = "BATCH_NOT_CANCELLABLE", 409


class FilesQuotaExceeded(MillmError):
    """The caller's files would pass FILES_MAX_BYTES_PER_OWNER."""

    code, status = "FILES_QUOTA_EXCEEDED", 413


class InsufficientStorage(MillmError):
    """All files together would pass FILES_MAX_BYTES_TOTAL."""

    code, status = "INSUFFICIENT_STORAGE", 507
