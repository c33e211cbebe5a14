"""A middleware base that runs its hooks inline on the event loop.

Django's ``MiddlewareMixin`` is async-capable, but under an async handler it calls every
``process_request``/``process_response`` through ``sync_to_async`` — one thread hop per
hook per request, several milliseconds on a loaded 2-core machine, paid before the first
byte of a /v1 stream. Our hooks are cheap, non-blocking code (no database, no I/O), so
they run directly on the loop instead.
"""

from __future__ import annotations

from asgiref.sync import iscoroutinefunction, markcoroutinefunction


class LoopMiddleware:
    sync_capable = True
    async_capable = True

    def __init__(self, get_response):
        self.get_response = get_response
        if iscoroutinefunction(get_response):
            markcoroutinefunction(self)

    def process_request(self, request):
        return None

    def process_response(self, request, response):
        return response

    def __call__(self, request):
        if iscoroutinefunction(self):
            return self.__acall__(request)
        response = self.process_request(request)
        if response is None:
            response = self.get_response(request)
        return self.process_response(request, response)

    async def __acall__(self, request):
        response = self.process_request(request)
        if response is None:
            response = await self.get_response(request)
        return self.process_response(request, response)
