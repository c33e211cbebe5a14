"""Settings for the test suite: the real settings with test defaults filled in first.

PostgreSQL is the default test database (CI and the development machines run one on
127.0.0.1); ``MILLM_TEST_DATABASE_URL=`` (empty) runs the suite on SQLite instead.
"""

import os
import tempfile

os.environ.setdefault(
    "DATABASE_URL", os.environ.get("MILLM_TEST_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
)
os.environ.setdefault("SECRET_KEY", "test-secret-key-not-for-production-0123456789")
os.environ.setdefault("MILLM_DATA_DIR", tempfile.mkdtemp(prefix="millm-test-data-"))
os.environ.setdefault("LOG_LEVEL", "WARNING")
# Tests register local checkpoints from the asset cache and their own tmp_path folders;
# tests/security narrows the roots itself to check the refusal.
os.environ.setdefault(
    "LOCAL_MODEL_ROOTS",
    ",".join(
        (
            tempfile.gettempdir(),
            os.environ.get("MILLM_TEST_ASSET_DIR")
            or os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".cache", "test-assets"),
        )
    ),
)
# The grammar deadline of the test servers' engines: a legitimate schema's first build (the
# builder child's xgrammar import included) can pass the product's 10 s on a loaded 2-core
# machine; tests/security/test_costly_inputs.py sets its own short one to test the deadline.
os.environ.setdefault("STRUCTURED_COMPILE_TIMEOUT_S", "300")
# A developer's own .env must not leak into the suite.
os.environ["MILLM_ENV_FILE"] = "/nonexistent/.env"

from millm_site.settings import *  # noqa: E402,F401,F403

PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
# Tests import the ASGI application; what is resident is their fixtures' business.
MILLM_APPLICATION_START = False
# A refresher thread reads through its own connection, which cannot see the rows a
# non-transactional test writes; tests/documents/test_monitoring.py turns it on itself.
MILLM_PROCESS_COPY_REFRESH = False
