"""The body limits and the keyless refusal of ``millm_site.boundary``, applied inside
daphne, which reads a whole request body (into memory, or a temporary file past 100 kB)
before it calls the ASGI application: there a check would come after the disk had filled.

``GuardedRequest`` decides when the headers are complete (twisted's ``gotLength``): a Host
that is not this server is 400, a foreign page's state change 403, a body declared larger
than the surface's limit 413, a request with a body and no valid key for a protected path
401 (an inference key's admin action 403), all before a byte of the body is read; a
chunked body is counted as it arrives and cut at the limit. ``install()`` makes daphne use it
(``manage.py serve`` calls it before starting daphne).
"""

from __future__ import annotations

from urllib.parse import unquote, urlsplit

from daphne import http_protocol
from django.conf import settings

from millm_site import boundary


class GuardedRequest(http_protocol.WebRequest):
    _millm_refused = False
    _millm_limit: int | None = None
    _millm_read = 0
    _millm_path = "/"

    def _scope(self) -> dict:
        raw_path = getattr(self.channel, "_path", b"/") or b"/"
        path = unquote(urlsplit(raw_path.decode("latin-1")).path)
        headers = [(name.lower(), value) for name, values in self.requestHeaders.getAllRawHeaders() for value in values]
        method = (getattr(self.channel, "_command", b"GET") or b"GET").decode("latin-1")
        return {
            "type": "http",
            "method": method.upper(),
            "path": path,
            "headers": headers,
            "root_path": settings.MILLM_ROOT_PATH,
        }

    def _refuse(self, status: int, body: bytes, extra: list[tuple[bytes, bytes]]) -> None:
        self._millm_refused = True
        reason = {401: b"Unauthorized", 403: b"Forbidden", 413: b"Payload Too Large"}.get(status, b"Bad Request")
        head = [
            b"HTTP/1.1 %d %s" % (status, reason),
            b"Content-Type: application/json",
            b"Content-Length: %d" % len(body),
            b"Connection: close",
            *(b"%s: %s" % pair for pair in extra),
        ]
        self.channel.transport.write(b"\r\n".join(head) + b"\r\n\r\n" + body)
        self.channel.loseConnection()

    def gotLength(self, length):  # noqa: N802 - twisted's name
        try:
            scope = self._scope()
            path = boundary.routed_path(scope)
            self._millm_path = path
            self._millm_limit = boundary.body_limit(scope, path)
            refusal = boundary.header_refusal(scope, path, length)
            if refusal is not None:
                # an empty content buffer: twisted may still finish the request (a body of
                # 0 bytes), which then reaches process() and stops there
                super().gotLength(0)
                return self._refuse(*refusal)
        except Exception:  # noqa: BLE001 - never let the guard break the server
            self._millm_limit = None
        return super().gotLength(length)

    def handleContentChunk(self, data):  # noqa: N802 - twisted's name
        if self._millm_refused:
            return None
        self._millm_read += len(data)
        if self._millm_limit is not None and self._millm_read > self._millm_limit:
            return self._refuse(413, boundary.too_large(self._millm_path, self._millm_limit), [])
        return super().handleContentChunk(data)

    def process(self):
        if self._millm_refused:
            return None
        return super().process()


def install() -> None:
    """Daphne builds every HTTP request with GuardedRequest from now on."""
    factory = http_protocol.HTTPFactory
    if getattr(factory, "_millm_guarded", False):
        return
    build = factory.buildProtocol

    def buildProtocol(self, addr):  # noqa: N802 - twisted's name
        protocol = build(self, addr)
        if protocol is not None and getattr(protocol, "requestFactory", None) is http_protocol.WebRequest:
            protocol.requestFactory = GuardedRequest
        return protocol

    factory.buildProtocol = buildProtocol
    factory._millm_guarded = True
