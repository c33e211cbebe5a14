"""What the web's Redis Streams client speaks: the envelope codec and the key names
(``gpu_engine.server.wire``, ``gpu_engine.server.keys``; the server itself is not here)."""

from gpu_engine.server.keys import Keys
from gpu_engine.server.wire import Envelope, decode_event, is_final

__all__ = ["Envelope", "Keys", "decode_event", "is_final"]
