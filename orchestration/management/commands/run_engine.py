"""Run the engine as its own process (distributed mode: REDIS_URL set).

The process owns the weights, the hooks and the GPU; web workers, Celery workers and
maintenance commands reach it only over Redis Streams (``gpu_engine.server``). On start it
restores what the database records as resident — the loaded model, its SAE attachments
and (once the steering documents keep any) live steering; ``orchestration.restore``,
which the embedded mode's start-up shares — then serves until SIGTERM,
when running requests get ENGINE_SHUTDOWN_GRACE_S to finish and the rest fail cleanly.

Exit status: 0 after a clean shutdown, 1 on a fatal error (logged), 3 when another
engine took this engine's prefix while it stalled. A supervisor (systemd, Kubernetes)
restarts it; a recorded state that keeps killing the engine is given up after
ENGINE_MAX_DELIVERIES attempts (the model row says so) instead of crash-looping.
"""

from __future__ import annotations

import signal
import threading
from typing import Any

import structlog
from django.conf import settings
from django.core.management.base import BaseCommand, CommandError
from django.db import close_old_connections, connections

log = structlog.get_logger("millm.engine")


# --------------------------------------------------------------------------- process


def server_config(name: str | None = None) -> Any:
    """``name``: the engine's (``--name``, else ENGINE_NAME); its prefix is
    ``core.engines.engine_prefix(name)``."""
    from core.engine_options import engine_bounds
    from core.engines import engine_prefix
    from gpu_engine.server.config import ServerConfig

    return ServerConfig(
        prefix=engine_prefix(name or settings.ENGINE_NAME),
        heartbeat_s=settings.ENGINE_HEARTBEAT_S,
        dead_after_s=settings.ENGINE_DEAD_AFTER_S,
        max_deliveries=settings.ENGINE_MAX_DELIVERIES,
        max_in_flight=engine_bounds().max_in_flight,  # admission decides; this is a net
        result_ttl_s=settings.ENGINE_RESULT_TTL_S,
        shutdown_grace_s=settings.ENGINE_SHUTDOWN_GRACE_S,
    )


def host_description(name: str = "default") -> Any:
    """The heartbeat's extra fields: what ``auto`` device/dtype mean on this host (the web
    tier asks, having no torch) and the free memory of each CUDA device."""
    import torch

    from core.engine_client import _resolve_here
    from gpu_engine.api.host import host_memory

    device, dtype = _resolve_here(settings.MILLM_ENGINE_DEVICE, settings.MILLM_ENGINE_DTYPE)
    cuda = torch.cuda.is_available()

    def describe() -> dict[str, Any]:
        memory: dict[str, Any] = {}
        host = host_memory()
        if host is not None:
            memory["cpu"] = host
        if cuda:
            for index in range(torch.cuda.device_count()):
                free, total = torch.cuda.mem_get_info(index)
                memory[f"cuda:{index}"] = {"free": int(free), "total": int(total)}
            memory["cuda"] = memory.get(f"cuda:{torch.cuda.current_device()}")
        return {"defaults": {"device": device, "dtype": dtype}, "memory": memory, "engine_name": name}

    return describe


def _on_engine_event(event: Any) -> None:
    from orchestration import engine_events

    try:
        engine_events.handle(event)
    except Exception:  # noqa: BLE001 - an event must not break the engine's worker
        log.exception("engine_event_failed", event_name=event.name)


class Command(BaseCommand):
    help = (
        "Run the engine process: serve web workers over Redis Streams (needs REDIS_URL), "
        "restoring the model and SAEs the database records as resident."
    )

    def add_arguments(self, parser):
        parser.add_argument(
            "--no-restore", action="store_true", help="Start empty instead of restoring the recorded state."
        )
        parser.add_argument(
            "--engine-id", default=None, help="Consumer name on the streams (default: host-pid-random)."
        )
        parser.add_argument(
            "--name",
            default=None,
            help="This engine's name (default: ENGINE_NAME, `default`): its streams and the models it restores.",
        )

    def handle(self, *args, no_restore: bool, engine_id: str | None, name: str | None, **options):
        if settings.EMBEDDED:
            raise CommandError(
                "run_engine needs REDIS_URL: without it the engine runs inside `manage.py serve` (embedded mode)"
            )
        from core.engines import engine_names, valid_engine_name

        name = name or settings.ENGINE_NAME
        if not valid_engine_name(name):
            raise CommandError(f"--name {name!r}: must be 1-40 letters, digits, _ or -")
        if name not in engine_names():
            # the web tier would never route a model to it
            raise CommandError(
                f"engine {name!r} is not one ENGINE_MODELS routes to ({', '.join(engine_names())}); "
                f"add `{name}:<model>` to ENGINE_MODELS on every process"
            )
        from core.errors import MillmError
        from orchestration.load_checks import check_engine_device

        try:
            check_engine_device()  # MILLM_ENGINE_DEVICE=cuda:N names a card of this host
        except MillmError as exc:
            raise CommandError(exc.message) from None
        import redis

        from core.engine_options import batching_options, idle_release_s
        from gpu_engine.runtime.engine import Engine
        from gpu_engine.server.server import EngineAlreadyRunning, EngineServer

        stop = threading.Event()

        def on_signal(signum, frame):  # noqa: ARG001 - signal handler signature
            if stop.is_set():
                log.warning(
                    "engine_second_signal_ignored",
                    signal=signum,
                    note="in-flight requests are being finished or failed",
                )
                return
            log.info("engine_stopping", signal=signal.Signals(signum).name)
            stop.set()

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)

        config = server_config(name)
        client = redis.Redis.from_url(
            settings.REDIS_URL,
            decode_responses=True,
            socket_timeout=15,
            socket_connect_timeout=5,
            health_check_interval=30,
        )
        engine = Engine(
            on_event=_on_engine_event,
            drain_timeout_s=settings.GRACEFUL_UNLOAD_TIMEOUT,
            batching=batching_options(),
            idle_release_s=idle_release_s(),
            structured_timeout_s=float(settings.STRUCTURED_COMPILE_TIMEOUT_S),
        )
        server = EngineServer(engine, client, config, engine_id=engine_id, describe=host_description(name))
        log.info(
            "engine_starting",
            engine=name,
            engine_id=server.engine_id,
            prefix=config.prefix,
            max_in_flight=config.max_in_flight,
            batching=engine.batching.enabled,
        )

        def restore() -> None:
            if no_restore:
                return
            from orchestration.restore import restore_recorded_state

            try:
                restore_recorded_state(
                    engine=engine,
                    begin_restore=server.begin_restore,
                    end_restore=server.end_restore,
                    engine_name=name,
                )
            finally:
                # the restore's connections must not linger through the serving life
                close_old_connections()
                connections.close_all()

        try:
            server.run(stop, restore=restore)
        except EngineAlreadyRunning as exc:
            engine.shutdown()
            raise CommandError(str(exc)) from exc
        except Exception:
            log.exception("engine_fatal_error", engine_id=server.engine_id)
            engine.shutdown()
            raise SystemExit(1) from None
        engine.shutdown()
        client.close()
        if server.lost_ownership:
            raise SystemExit(3)
        log.info("engine_stopped", engine_id=server.engine_id)
