"""Leases live in the database: two clients racing for one lease on PostgreSQL get exactly
one grant, and another process (a second web worker, or this one restarted) sees and
enforces the lease."""

from __future__ import annotations

import threading
import time

import pytest
from django.db import connection, connections, transaction

from core.errors import MillmError
from leases.models import Lease
from leases.services import lease_grant, lease_hash
from registry.models import Model
from tests.conftest import manage

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def resident(tiny_assets, transactional_db):
    # the row is enough here: leases are a database matter (no engine call is made)
    from registry.services import model_register_local

    model = model_register_local(local_path=str(tiny_assets.models["tiny-llama"].path), name="tiny-llama")
    Model.objects.filter(pk=model.pk).update(status=Model.Status.LOADED)
    return model


def test_two_racing_clients_get_exactly_one_lease(resident):
    if connection.vendor != "postgresql":
        pytest.skip(f"the race is decided by PostgreSQL's unique index; this run is on {connection.vendor}")
    barrier = threading.Barrier(2)
    outcomes: list[tuple[str, str]] = []

    def client(name: str) -> None:
        try:
            # each client holds its transaction open past its insert, so the two inserts
            # overlap and only the database can decide
            with transaction.atomic():
                barrier.wait(5)
                try:
                    lease_grant(model=Model.objects.get(pk=resident.pk), holder=name, reason="race")
                    outcomes.append((name, "granted"))
                except MillmError as exc:
                    outcomes.append((name, exc.code))
                time.sleep(0.3)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=client, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(code for _, code in outcomes) == ["MODEL_LEASED", "granted"]
    winner = next(name for name, code in outcomes if code == "granted")
    assert list(Lease.objects.values_list("holder", "ended_at")) == [(winner, None)]


def test_another_process_sees_and_enforces_the_lease(resident, tmp_path):
    _, lease_id = lease_grant(model=resident, holder="worker-1", reason="shared")
    db = connection.settings_dict
    url = (
        f"postgresql://{db['USER']}@{db['HOST']}:{db['PORT']}/{db['NAME']}"
        if connection.vendor == "postgresql"
        else None
    )
    if url is None:
        pytest.skip("needs a database another process can open (PostgreSQL)")
    script = (
        "from leases.services import lease_check_change, lease_renew\n"
        "from registry.models import Model\n"
        "m = Model.objects.get(name='tiny-llama')\n"
        "try:\n"
        "    lease_check_change(operation='unload', target_model=m)\n"
        "    print('NOT-BLOCKED')\n"
        "except Exception as exc:\n"
        "    print('BLOCKED', exc.code, exc.details['holder'])\n"
        f"lease_check_change(operation='unload', target_model=m, lease_id='{lease_id}')\n"
        f"print('RENEWED', lease_renew(model=m, lease_id='{lease_id}', ttl_seconds=42)"
        ".ttl_seconds)\n"
    )
    out = manage(
        "shell",
        "-c",
        script,
        env={"DATABASE_URL": url, "SECRET_KEY": "x" * 40, "LOG_LEVEL": "ERROR", "MILLM_DATA_DIR": str(tmp_path)},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "BLOCKED MODEL_LEASED worker-1" in out.stdout
    assert "RENEWED 42" in out.stdout
    assert Lease.objects.get().ttl_seconds == 42
    assert Lease.objects.get().id_hash == lease_hash(lease_id)
