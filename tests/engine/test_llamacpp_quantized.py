"""A quantized GGUF (the demo SmolLM2-135M, Q4_1) through llama.cpp's CPU kernels.

The tiny float32 GGUF of test_llamacpp.py never reaches the kernels for quantized
weights, and those are where a build can go wrong on one machine and not another: with
GGML_NATIVE on a CPU with AMX, llama.cpp 0.3.36's AMX matmul (Q4_0, Q4_1, Q8_0, Q4_K…)
compiled by GCC < 14 loads a tile config whose rows and columns the compiler dropped, and
the first prompt of two or more tokens dies with SIGSEGV (``scripts/setup llamacpp``
builds without AMX).  A crash there kills the whole test process, so the forward runs in
a child process: a segfault fails this test instead of ending the session.

Also here: the eval callback checks a layer output's layout (strides) before it reads
or writes the rows in place.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# prefill (several tokens: the batched matmul path), then one decode step (one token)
FORWARD = r"""
import json, sys
import numpy as np
from gpu_engine.backends.llamacpp import native
from gpu_engine.backends.llamacpp.native import ContextSettings, NativeContext, NativeModel

model = NativeModel(native.resolve_gguf(sys.argv[1], None), gpu_layers=0, tensor_split=None)
ctx = NativeContext(model, ContextSettings(n_ctx=256, n_seq=1, n_batch=64, kv_type="f16",
                                           flash_attention=False, n_threads=2), None)
ids = model.tokenize("Tell me about your weekend, and then about the weather.",
                     add_special=True)
ctx.decode([(t, i, 0, True) for i, t in enumerate(ids)])
prefill = ctx.logits_rows(list(range(len(ids))))
nxt = int(prefill[-1].argmax())
ctx.decode([(nxt, len(ids), 0, True)])
step = ctx.logits(0)
print(json.dumps({"n": len(ids), "finite": bool(np.isfinite(prefill).all()
                                                and np.isfinite(step).all()),
                  "next": nxt}))
ctx.close()
model.close()
"""


def _amx_compiled_in() -> bool | None:
    from gpu_engine.backends.llamacpp import native

    lib = native._load_ggml("ggml-cpu")
    if lib is None or not hasattr(lib, "ggml_cpu_has_amx_int8"):
        return None
    return bool(lib.ggml_cpu_has_amx_int8())


def test_quantized_gguf_prefills_and_decodes_on_this_cpu(demo_assets, llamacpp):
    from offline_assets import demo_gguf_path

    done = subprocess.run(
        [sys.executable, "-c", FORWARD, str(demo_gguf_path())],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, (
        f"a Q4_1 forward ended with {done.returncode} (negative: killed by that signal); "
        f"ggml AMX kernels compiled in: {_amx_compiled_in()} — rebuild the wheel with "
        f"scripts/setup llamacpp\n{done.stderr[-3000:]}"
    )
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["n"] > 8 and got["finite"]


def _tensor(arr, ne0: int, n: int):
    """A ``ggml_tensor`` over ``arr`` (float32): ``n`` rows of ``ne0`` values, rows
    ``arr.shape[1] * 4`` bytes apart."""
    import ctypes

    from gpu_engine.backends.llamacpp.native import GGML_TYPE_F32, GGMLTensor

    t = GGMLTensor()
    t.type = GGML_TYPE_F32
    t.ne[:] = [ne0, n, 1, 1]
    row = arr.shape[1] * 4
    t.nb[:] = [4, row, row * n, row * n]
    t.data = arr.ctypes.data_as(ctypes.c_void_p)
    return t


def test_eval_callback_refuses_a_layer_output_it_cannot_address(llamacpp):
    """The callback reads and writes a layer output as one dense (rows, d) block; a
    tensor laid out otherwise (padded rows here) is an error, not a write past it."""
    import numpy as np
    import pytest
    import torch

    from gpu_engine.backends.llamacpp.taps import EvalTaps, ForwardPlan, LayerPlan
    from gpu_engine.interp.hooks import BatchContext

    taps = EvalTaps(2)
    key = ("sae", 0)
    rows = BatchContext([], row_slots=torch.tensor([0, 1, 2]), delta_tables={key: torch.ones((3, 4))})
    lp = LayerPlan(keys=[key])
    dense = np.zeros((3, 4), dtype=np.float32)
    taps._apply(_tensor(dense, 4, 3), 0, lp, ForwardPlan({0: lp}, 3, [0, 1, 2], ctx=rows))
    np.testing.assert_array_equal(dense, np.ones((3, 4)))

    padded = np.zeros((3, 8), dtype=np.float32)
    taps._offsets = {}
    with pytest.raises(RuntimeError, match="not a dense float32 matrix"):
        taps._apply(_tensor(padded, 4, 3), 0, lp, ForwardPlan({0: lp}, 3, [0, 1, 2], ctx=rows))
    assert not padded.any()
