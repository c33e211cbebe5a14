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
        parser.add_argument(
            "--on-conflict",
            choices=("fail", "rename"),
            default="fail",
            help="A name that exists: refuse (default) or import renamed",
        )

    def handle(self, *args, file, on_conflict, **options):
        import sys

        try:
            text = sys.stdin.read() if file == "-" else Path(file).read_text(encoding="utf-8")
        except OSError as exc:
            raise CommandError(f"{file}: cannot read it ({exc.strerror})") from None
        except UnicodeDecodeError:
            raise CommandError(f"{file} is not UTF-8 text") from None
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise CommandError(f"{file} is not JSON: {exc}") from None
        docs = data if isinstance(data, list) else [data]
        if not all(isinstance(doc, dict) for doc in docs):
            raise CommandError("Every entry must be a profile document; nothing was imported")
        try:
            with transaction.atomic():  # all or nothing
                imported = [services.profile_import(document=doc, on_conflict=on_conflict) for doc in docs]
        except MillmError as exc:
            raise CommandError(f"{exc.message} ({exc.code}); nothing was imported") from None
        for profile in imported:
            self.stdout.write(f"Imported {profile.name!r}")
