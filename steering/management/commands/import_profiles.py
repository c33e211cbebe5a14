"""Import profiles from a file written by export_profiles (or the API's export)."""

from __future__ import annotations

import json
from pathlib import Path

from django.core.management.base import BaseCommand, CommandError
from django.db import transaction

from core.errors import MillmError
from steering import services


class Command(BaseCommand):
    help = "Import profiles from a JSON file: one export document or a list of them."

    def add_arguments(self, parser):
        parser.add_argument("file", help="The JSON file ('-' for stdin)")
        parser.add_argument("--on-conflict", choices=("fail", "rename"), default="fail",
                            help="A name that exists: refuse (default) or import renamed")

    def handle(self, *args, file, on_conflict, **options):
        import sys

        text = sys.stdin.read() if file == "-" else Path(file).read_text()
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise CommandError(f"{file} is not JSON: {exc}") from None
        docs = data if isinstance(data, list) else [data]
        try:
            with transaction.atomic():  # all or nothing
                for doc in docs:
                    if not isinstance(doc, dict):
                        raise CommandError("Every entry must be a profile document")
                    profile = services.profile_import(document=doc, on_conflict=on_conflict)
                    self.stdout.write(f"Imported {profile.name!r}")
        except MillmError as exc:
            raise CommandError(f"{exc.message} ({exc.code}); nothing was imported") from None
