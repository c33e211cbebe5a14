"""Remove from MODEL_CACHE_DIR and SAE_CACHE_DIR what no registry row references."""

from django.core.management.base import BaseCommand
from django.template.defaultfilters import filesizeformat

from registry import maintenance


class Command(BaseCommand):
    help = (
        "Delete cache files and folders that no model or SAE row references (--dry-run lists them and deletes nothing)."
    )

    def add_arguments(self, parser):
        parser.add_argument("--dry-run", action="store_true")

    def handle(self, *args, dry_run: bool, **options):
        report = maintenance.cache_prune(dry_run=dry_run)
        verb = "would remove" if dry_run else "removed"
        for path in report.removed:
            self.stdout.write(f"{verb} {path}")
        summary = (
            f"{len(report.removed)} unreferenced item(s), {filesizeformat(report.bytes_freed)}; {len(report.kept)} kept"
        )
        self.stdout.write(self.style.SUCCESS(f"Dry run: {summary}" if dry_run else f"Pruned {summary}"))
