"""Attach an SAE to the loaded model at a layer."""

from django.core.management.base import BaseCommand

from core.errors import MillmError
from orchestration import services
from registry import selectors
from registry.management.commands._progress import fail, require_engine


class Command(BaseCommand):
    help = "Attach an SAE (by id) to the loaded model at a layer."

    def add_arguments(self, parser):
        parser.add_argument("sae_id")
        parser.add_argument("layer", type=int)

    def handle(self, *args, sae_id, layer, **options):
        require_engine()
        try:
            result = services.sae_attach(sae=selectors.sae_get(sae_id=sae_id), layer=layer)
        except MillmError as exc:
            raise fail(exc) from exc
        for warning in result.warnings:
            self.stderr.write(f"warning: {warning}")
        self.stdout.write(self.style.SUCCESS(f"Attached {result.sae_id} at {result.layer_module_path}"))
