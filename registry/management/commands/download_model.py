"""Download a model from the hub (or register a local checkpoint), in the foreground with a
progress bar. The same services as POST /api/models."""

from django.core.management.base import BaseCommand, CommandError

from core.errors import MillmError
from registry import download_run, downloads, services
from registry.management.commands._progress import byte_bar, fail, token_from_env
from registry.models import Model


class Command(BaseCommand):
    help = "Download a model from the Hugging Face hub into MODEL_CACHE_DIR and register it."

    def add_arguments(self, parser):
        parser.add_argument("repo_id", nargs="?", help="owner/name on the hub")
        parser.add_argument("--local", metavar="PATH", help="register a checkpoint already on disk instead")
        parser.add_argument("--revision", default="main")
        parser.add_argument("--quantization", default="FP16", choices=[q for q, _ in Model.Quantization.choices])
        parser.add_argument("--name", default=None, help="name clients use (default: repo)")
        parser.add_argument("--trust-remote-code", action="store_true")
        parser.add_argument(
            "--hf-token-env",
            metavar="VAR",
            help="environment variable holding a token for this download (default: HF_TOKEN from the configuration)",
        )

    def handle(self, *args, repo_id, local, revision, quantization, name, trust_remote_code, hf_token_env, **options):
        if bool(repo_id) == bool(local):
            raise CommandError("give a repo_id or --local PATH (one of them)")
        try:
            if local:
                model = services.model_register_local(
                    local_path=local, name=name, quantization=quantization, trust_remote_code=trust_remote_code
                )
                self.stdout.write(
                    self.style.SUCCESS(f"Registered {model.name} (id {model.id}) from {model.local_path}")
                )
                return
            token = token_from_env(hf_token_env)
            model, job = downloads.model_download_start(
                repo_id=repo_id,
                revision=revision,
                quantization=quantization,
                trust_remote_code=trust_remote_code,
                custom_name=name,
                hf_token=token,
                dispatch=False,
            )
            with byte_bar(model.name, self.stderr) as update:
                result = download_run.model_download_run(job_id=job.id, hf_token=token, on_progress=update)
        except MillmError as exc:
            raise fail(exc) from exc
        if result is None:
            job.refresh_from_db()
            raise CommandError(f"Download of {repo_id} {job.status}: {job.error}")
        self.stdout.write(
            self.style.SUCCESS(
                f"Downloaded {repo_id}@{revision} as {result.name} (id {result.id}) into {result.local_path}"
            )
        )
