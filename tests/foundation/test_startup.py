"""The embedded default (SQLite in the data directory, generated secret key) and the
PostgreSQL database the suite itself runs on."""

from __future__ import annotations

import sqlite3

import pytest
from django.db import connection

from tests.conftest import manage


def test_embedded_default_uses_an_sqlite_file_and_keeps_a_generated_secret(tmp_path):
    data = tmp_path / "data"
    result = manage("migrate", "--noinput", env={"MILLM_DATA_DIR": str(data)})
    assert result.returncode == 0, result.stderr
    db = data / "millm.sqlite3"
    assert db.is_file()
    tables = {row[0] for row in sqlite3.connect(db).execute("select name from sqlite_master where type='table'")}
    assert {"registry_model", "registry_sae", "registry_job"} <= tables

    key_file = data / "secret_key"
    first = key_file.read_text()
    assert len(first) >= 50
    assert key_file.stat().st_mode & 0o777 == 0o600
    code = "from django.conf import settings; print(settings.SECRET_KEY)"
    again = manage("shell", "-v", "0", "-c", code, env={"MILLM_DATA_DIR": str(data)})
    assert again.stdout.strip() == first  # survives restarts: sessions stay valid


def test_explicit_secret_key_is_used_and_nothing_is_written(tmp_path):
    code = "from django.conf import settings; print(settings.SECRET_KEY)"
    result = manage("shell", "-v", "0", "-c", code, env={"MILLM_DATA_DIR": str(tmp_path), "SECRET_KEY": "k" * 40})
    assert result.stdout.strip() == "k" * 40
    assert not (tmp_path / "secret_key").exists()


@pytest.mark.django_db
def test_the_suite_runs_on_postgresql_through_psycopg3():
    # The test command points DATABASE_URL at the PostgreSQL server (README); an empty
    # MILLM_TEST_DATABASE_URL switches to SQLite, which the test above covers.
    if connection.vendor != "postgresql":
        pytest.fail("the test suite must run on PostgreSQL; start it or see README")
    import psycopg

    assert connection.connection.__class__.__module__.startswith("psycopg")
    assert psycopg.__version__.startswith("3.")
