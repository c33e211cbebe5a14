"""Write profiles as their versioned JSON export (one document, or a list of them)."""

from __future__ import annotations

import json
from pathlib import Path

from django.core.management.base import BaseCommand, CommandError

from core.errors import MillmError
from steering import services
from steering.models import Profile


class Command(BaseCommand):
    help = "Export profiles (all, or the named ones) as JSON: stdout, or --output FILE."

    def add_arguments(self, parser):
        parser.add_argument("names", nargs="*", help="Profile names or ids (default: all)")
        parser.add_argument("--output", "-o", help="File to write (default: stdout)")

    def handle(self, *args, names, output, **options):
        try:
            profiles = [services.profile_get(profile_id=n) for n in names] if names else list(Profile.objects.all())
        except MillmError as exc:
            raise CommandError(exc.message) from None
        docs = [services.profile_export(profile=p) for p in profiles]
        text = json.dumps(docs[0] if len(names) == 1 else docs, indent=2) + "\n"
        if output:
            try:
                Path(output).write_text(text, encoding="utf-8")
            except OSError as exc:
                raise CommandError(f"{output}: cannot write it ({exc.strerror})") from None
            self.stderr.write(f"Exported {len(docs)} profile(s) to {output}")
        else:
            self.stdout.write(text, ending="")
