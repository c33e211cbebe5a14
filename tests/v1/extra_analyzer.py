"""A deployment's own analyzer, loaded through ANALYZERS_EXTRA in tests/v1/test_analyze.py."""

import numpy as np

from gpu_engine.analysis import CaptureNeed


class LastRowSum:
    name = "last_row_sum"
    description = "the sum of a layer's last captured row (tests)"

    def prepare(self, params, ctx):
        return {"layer": int(params.get("layer", 0)), "tag": params.get("tag")}

    def needs(self, prepared):
        return CaptureNeed(layers=(prepared["layer"],), positions="last")

    def run(self, capture, prepared, ctx):
        row = np.asarray(capture.hidden[prepared["layer"]], dtype=np.float64)[-1]
        return {"sum": float(row.sum()), "tag": prepared["tag"]}


def register(registry):
    registry.register(LastRowSum())
