"""Unload the resident model (after GRACEFUL_UNLOAD_TIMEOUT for running requests)."""

from django.core.management.base import BaseCommand

from core.errors import MillmError
from orchestration import services
from registry import maintenance
from registry.management.commands._progress import fail, require_engine


class Command(BaseCommand):
    help = "Unload a loaded model (by name or id)."

    def add_arguments(self, parser):
        parser.add_argument("model", help="name or id")

    def handle(self, *args, model, **options):
        require_engine()
        try:
            row = services.model_unload(model=maintenance.model_by_name_or_id(model))
        except MillmError as exc:
            raise fail(exc) from exc
        self.stdout.write(self.style.SUCCESS(f"Unloaded {row.name}"))
