"""Load a registered model into the engine (distributed mode: the engine process)."""

from django.core.management.base import BaseCommand

from core.errors import MillmError
from orchestration import services
from registry import maintenance
from registry.management.commands._progress import fail, require_engine


class Command(BaseCommand):
    help = "Load a registered model (by name or id) into the engine."

    def add_arguments(self, parser):
        parser.add_argument("model", help="name or id")

    def handle(self, *args, model, **options):
        require_engine()
        try:
            row = maintenance.model_by_name_or_id(model)
            services.model_load(model=row)
        except MillmError as exc:
            raise fail(exc) from exc
        row.refresh_from_db()
        self.stdout.write(self.style.SUCCESS(f"Loaded {row.name} on {row.device} ({row.dtype})"))
