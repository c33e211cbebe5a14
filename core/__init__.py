"""The leaf of the Django side: the error base, the event bus, job dispatch, the two
error envelopes, the engine client and the runtime object. It imports no app."""
