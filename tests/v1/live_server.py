"""daphne — the project's ASGI server — on a free loopback port, in a thread of the test
process, so tests reach /v1 over a real socket while sharing the engine and the
admission controller with the server (to compute references and inspect the slot).

Twisted's reactor runs once per process and cannot be restarted, so there is one server
per test session (``live_server()`` hands out the same one); it stops at exit.
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass

_server: LiveServer | None = None
_lock = threading.Lock()


@dataclass
class LiveServer:
    host: str
    port: int
    thread: threading.Thread

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self, timeout_s: float = 15.0) -> None:
        from twisted.internet import reactor

        if reactor.running:
            reactor.callFromThread(reactor.stop)
        self.thread.join(timeout_s)


def _wait_until_accepting(host: str, port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=1):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"daphne did not accept connections on {host}:{port} in {timeout_s}s")


def live_server(timeout_s: float = 30.0) -> LiveServer:
    """Start daphne (once) and return it when it accepts connections."""
    global _server
    with _lock:
        if _server is not None:
            return _server
        # daphne.server installs the asyncio reactor on import; it must come first
        from daphne.server import Server

        from millm_site.asgi import application

        server = Server(
            application,
            endpoints=["tcp:port=0:interface=127.0.0.1"],
            signal_handlers=False,
            verbosity=0,
            http_timeout=None,
            application_close_timeout=10,
        )
        errors: list[BaseException] = []

        def run() -> None:
            try:
                server.run()
            except BaseException as exc:  # noqa: BLE001 - reported to the starter
                errors.append(exc)

        thread = threading.Thread(target=run, name="daphne-test", daemon=True)
        thread.start()
        deadline = time.monotonic() + timeout_s
        while not server.listening_addresses:
            if errors or not thread.is_alive():
                raise RuntimeError(f"daphne failed to start: {errors!r}")
            if time.monotonic() > deadline:
                raise RuntimeError("daphne did not start listening in time")
            time.sleep(0.02)
        host, port = server.listening_addresses[0]
        _wait_until_accepting(host, port, timeout_s)
        _server = LiveServer(host, port, thread)
        return _server
