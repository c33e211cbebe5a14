"""Detach an SAE (one layer, or every layer it is attached at)."""

from django.core.management.base import BaseCommand

from core.errors import MillmError
from orchestration import services
from registry import selectors
from registry.management.commands._progress import fail, require_engine


class Command(BaseCommand):
    help = "Detach an SAE (by id) from the loaded model."

    def add_arguments(self, parser):
        parser.add_argument("sae_id")
        parser.add_argument("--layer", type=int, default=None)

    def handle(self, *args, sae_id, layer, **options):
        require_engine()
        try:
            keys = services.sae_detach(sae=selectors.sae_get(sae_id=sae_id), layer=layer)
        except MillmError as exc:
            raise fail(exc) from exc
        layers = ", ".join(str(k[1]) for k in keys) or str(layer)
        self.stdout.write(self.style.SUCCESS(f"Detached {sae_id} (layers {layers})"))
