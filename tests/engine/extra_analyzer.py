"""A deployment's own analyzer, loaded through ANALYZERS_EXTRA in the tests."""

from gpu_engine.analysis import CaptureNeed


class Echo:
    name = "echo"
    description = "returns its params (tests)"

    def prepare(self, params, ctx):
        return dict(params)

    def needs(self, prepared):
        return CaptureNeed(layers=(0,), positions="last")

    def run(self, capture, prepared, ctx):
        return {"params": prepared, "rows": int(len(capture.positions))}


def register(registry):
    registry.register(Echo())
