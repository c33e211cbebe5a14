"""Register an SAE from a local directory (one you trained, say). The same service as
POST /api/saes with ``source: "local"``: the same checks, the same refusals."""

from django.core.management.base import BaseCommand

from core.errors import MillmError
from registry import services
from registry.management.commands._progress import fail


class Command(BaseCommand):
    help = (
        "Register an SAE already on disk (SAELens: cfg.json + sae_weights.safetensors; "
        "Gemma Scope: params.npz) and print its id. Its files are never deleted by "
        "miLLM."
    )

    def add_arguments(self, parser):
        parser.add_argument("path", help="the SAE's directory (or its params.npz), absolute")
        parser.add_argument("--name", default=None, help="display name (default: the directory's name)")
        parser.add_argument(
            "--model", default=None, metavar="NAME", help="the model it was trained on, where its files do not say"
        )
        parser.add_argument(
            "--layer", type=int, default=None, help="the layer it was trained on, where its files do not say"
        )

    def handle(self, *args, path, name, model, layer, **options):
        try:
            sae = services.sae_register_local(
                local_path=path, name=name, trained_on_model=model, trained_on_layer=layer
            )
        except MillmError as exc:
            raise fail(exc) from exc
        # the id alone on stdout, so a script can take it: SAE=$(manage.py register_sae …)
        self.stdout.write(sae.id)
        layer_text = "?" if sae.trained_on_layer is None else sae.trained_on_layer
        self.stderr.write(
            self.style.SUCCESS(
                f"Registered {sae.name} ({sae.format}, {sae.activation}, d_in={sae.d_in}, "
                f"d_sae={sae.d_sae}, layer {layer_text}) from {sae.local_path}"
            )
        )
