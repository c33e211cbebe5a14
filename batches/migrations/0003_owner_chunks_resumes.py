"""Files and batches get an owner (existing rows: the anonymous owner, core.auth); a
file's bytes move from one column to chunk rows (written and read a chunk at a time);
a batch counts the sweeper's resumes."""

import django.db.models.deletion
from django.db import migrations, models


CHUNK_BYTES = 256 * 1024  # batches.services.CHUNK_BYTES when this was written


def content_to_chunks(apps, schema_editor):
    File = apps.get_model("batches", "File")
    FileChunk = apps.get_model("batches", "FileChunk")
    for file_id in File.objects.values_list("id", flat=True).iterator():
        content = bytes(File.objects.filter(id=file_id).values_list("content", flat=True)[0])
        FileChunk.objects.bulk_create(
            FileChunk(file_id=file_id, index=i, data=content[start : start + CHUNK_BYTES])
            for i, start in enumerate(range(0, len(content), CHUNK_BYTES))
        )


def chunks_to_content(apps, schema_editor):
    File = apps.get_model("batches", "File")
    FileChunk = apps.get_model("batches", "FileChunk")
    for file in File.objects.all().iterator():
        file.content = b"".join(
            bytes(x) for x in FileChunk.objects.filter(file_id=file.id).order_by("index").values_list("data", flat=True)
        )
        file.save(update_fields=["content"])


class Migration(migrations.Migration):
    dependencies = [
        ("batches", "0002_batch_verbose_name_plural"),
    ]

    operations = [
        migrations.AddField(
            model_name="batch",
            name="owner",
            field=models.CharField(db_index=True, default="anonymous", max_length=80),
        ),
        migrations.AddField(
            model_name="batch",
            name="resumes",
            field=models.IntegerField(default=0),
        ),
        migrations.AddField(
            model_name="file",
            name="complete",
            field=models.BooleanField(default=True),
        ),
        migrations.AddField(
            model_name="file",
            name="owner",
            field=models.CharField(db_index=True, default="anonymous", max_length=80),
        ),
        migrations.CreateModel(
            name="FileChunk",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                ("index", models.IntegerField()),
                ("data", models.BinaryField()),
                (
                    "file",
                    models.ForeignKey(
                        on_delete=django.db.models.deletion.CASCADE, related_name="chunks", to="batches.file"
                    ),
                ),
            ],
            options={
                "constraints": [models.UniqueConstraint(fields=("file", "index"), name="file_chunk_unique")],
            },
        ),
        migrations.RunPython(content_to_chunks, chunks_to_content),
        migrations.RemoveField(
            model_name="file",
            name="content",
        ),
    ]
