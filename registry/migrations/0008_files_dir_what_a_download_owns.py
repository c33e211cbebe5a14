"""``files_dir``: the folder the registry downloaded a row's files into, so deleting a row
removes what that row's download wrote and nothing else (a ``source: local`` alias of a
downloaded model used to take the download's files with it). Rows downloaded before are
given the folder their download used."""

import re
from pathlib import Path

from django.conf import settings
from django.db import migrations, models


def _slug(repo_id: str) -> str:  # registry.downloads._slug as of this migration
    return re.sub(r"[^A-Za-z0-9._-]+", "-", repo_id.replace("/", "--"))


def record_downloads(apps, schema_editor):
    Model = apps.get_model("registry", "Model")
    SAE = apps.get_model("registry", "SAE")
    for row in Model.objects.filter(source="huggingface").exclude(repo_id=""):
        row.files_dir = str(Path(settings.MODEL_CACHE_DIR) / f"{_slug(row.repo_id)}--m{row.id}")
        row.save(update_fields=["files_dir"])
    for row in SAE.objects.exclude(repository_id=""):
        row.files_dir = str(Path(settings.SAE_CACHE_DIR) / _slug(row.repository_id) / row.id)
        row.save(update_fields=["files_dir"])


class Migration(migrations.Migration):
    dependencies = [("registry", "0007_model_locked_by_operator")]

    operations = [
        migrations.AddField(
            model_name="model",
            name="files_dir",
            field=models.CharField(
                blank=True,
                max_length=1000,
                help_text="The folder the registry downloaded this row's files into; deleting "
                "the row removes it and nothing else (empty: the row owns no "
                "files).",
            ),
        ),
        migrations.AddField(
            model_name="sae",
            name="files_dir",
            field=models.CharField(
                blank=True,
                max_length=1000,
                help_text="The folder the registry downloaded this row's files into; deleting "
                "the row removes it and nothing else (empty: no download).",
            ),
        ),
        migrations.RunPython(record_downloads, migrations.RunPython.noop),
    ]
