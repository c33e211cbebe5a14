"""Load a registered model into the engine (distributed mode: the engine process)."""

from django.core.management.base import BaseCommand

from core.errors import MillmError
from orchestration import services
from registry import maintenance
from registry import services as registry_services
from registry.management.commands._progress import fail, require_engine


class Command(BaseCommand):
    help = "Load a registered model (by name or id) into the engine."

    def add_arguments(self, parser):
        parser.add_argument("model", help="name or id")
        parser.add_argument(
            "--backend",
            default=None,
            help="load it on this backend (transformers, vllm, llamacpp) and "
            "keep that choice on the model; default: the model's own, "
            "else MILLM_BACKEND",
        )

    def handle(self, *args, model, backend=None, **options):
        require_engine()
        try:
            row = maintenance.model_by_name_or_id(model)
            if backend is not None and backend != row.backend:
                row = registry_services.model_set_backend(model=row, backend=backend)
            services.model_load(model=row)
        except MillmError as exc:
            raise fail(exc) from exc
        row.refresh_from_db()
        self.stdout.write(
            self.style.SUCCESS(f"Loaded {row.name} on {row.device} ({row.dtype}, {row.effective_backend()} backend)")
        )
