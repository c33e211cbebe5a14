"""Download an SAE from the hub in the foreground, with a progress bar. The same services
as POST /api/saes/download (idempotent per repository, revision and file path)."""

from django.core.management.base import BaseCommand, CommandError

from core.errors import MillmError
from registry import download_run, downloads
from registry.management.commands._progress import byte_bar, fail, token_from_env


class Command(BaseCommand):
    help = "Download an SAE from the Hugging Face hub into SAE_CACHE_DIR and register it."

    def add_arguments(self, parser):
        parser.add_argument("repository_id", help="owner/name on the hub")
        parser.add_argument(
            "file_path", nargs="?", default="", help="the SAE inside the repository (a file or its folder)"
        )
        parser.add_argument("--revision", default="main")
        parser.add_argument(
            "--hf-token-env", metavar="VAR", help="environment variable holding a token for this download"
        )

    def handle(self, *args, repository_id, file_path, revision, hf_token_env, **options):
        try:
            token = token_from_env(hf_token_env)
            sae, job, state = downloads.sae_download_start(
                repository_id=repository_id, file_path=file_path, revision=revision, hf_token=token, dispatch=False
            )
            if state != "downloading":
                self.stdout.write(f"{sae.id}: {state}")
                return
            with byte_bar(sae.name, self.stderr) as update:
                result = download_run.sae_download_run(job_id=job.id, hf_token=token, on_progress=update)
        except MillmError as exc:
            raise fail(exc) from exc
        if result is None:
            job.refresh_from_db()
            raise CommandError(f"Download of {repository_id}/{file_path} {job.status}: {job.error}")
        self.stdout.write(
            self.style.SUCCESS(
                f"Downloaded {result.id} ({result.format}, d_in={result.d_in}, "
                f"d_sae={result.d_sae}) into {result.local_path}"
            )
        )
