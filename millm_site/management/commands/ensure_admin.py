"""Create the first admin account for the embedded quick start, once.

The password is random, written to MILLM_DATA_DIR/admin_password (mode 600) and printed
once, so a fresh machine gets a working admin login without a prompt.
"""

import os
import secrets
from pathlib import Path

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand


class Command(BaseCommand):
    help = "Create an 'admin' superuser with a generated password if no superuser exists."

    def add_arguments(self, parser):
        parser.add_argument("--username", default="admin")

    def handle(self, *args, username: str, **options):
        User = get_user_model()
        if User.objects.filter(is_superuser=True).exists():
            self.stdout.write("An admin account already exists.")
            return
        password = secrets.token_urlsafe(12)
        User.objects.create_superuser(username=username, email="", password=password)
        path = Path(settings.DATA_DIR) / "admin_password"
        # created 0600: never readable by others, not even for a moment
        path.unlink(missing_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as sink:
            sink.write(f"{username}:{password}\n")
        self.stdout.write(
            self.style.SUCCESS(f"Created admin login {username!r} with password {password!r} (saved in {path}).")
        )
