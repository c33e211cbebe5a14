"""Delete stored captures older than CAPTURE_RETENTION_S (rows and files)."""

from __future__ import annotations

from django.core.management.base import BaseCommand

from monitoring.services import capture_prune


class Command(BaseCommand):
    help = "Delete expired captures and capture files no row names (CAPTURE_RETENTION_S)."

    def handle(self, *args, **options) -> None:  # type: ignore[no-untyped-def]
        result = capture_prune()
        self.stdout.write(f"deleted {result['deleted']} capture(s), {result['orphan_files']} orphan file(s)")
