"""Capture inside a mixed continuous batch: each request's capture equals its solo capture.

The scenario of ``test_equivalence`` (steered and unsteered requests, joins at different
steps, a padded two-prompt prefill, a cancel) with a different capture on most requests:
tokens stay those of the run without capture, and every captured row equals the row the
same request captures alone on the serial engine (within the batch tolerance: only the
matmul blocking changes with the batch's shape).
"""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from gpu_engine.api.artifacts import load_capture
from gpu_engine.api.protocol import AttentionCaptureSpec, CaptureSpec
from tests.engine.tolerances import BATCH_ENCODE_ATOL, BATCH_ENCODE_RTOL

from .conftest import MODEL_SAE
from .test_equivalence import run_mixed_batch, scenario

CAPTURES = {
    "A": CaptureSpec(layers=[0, 1, 2, 3], positions="all"),
    "B": CaptureSpec(layers=[1], positions="completion"),
    "C": CaptureSpec(layers=[3], positions="last"),
    # D captures nothing
    "E": CaptureSpec(layers=[0, 2], positions="completion"),
    "F": CaptureSpec(layers=[2], positions="prompt"),
    "G": CaptureSpec(layers=[1, 3], positions="all"),
    "H": CaptureSpec(layers=[0], positions="last"),
}


@pytest.mark.parametrize("model_name", ["tiny-llama", "tiny-gemma2"])
def test_each_capture_in_a_mixed_batch_equals_its_solo_capture(engines, tiny_assets, model_name):
    batched, serial = engines(model_name)
    sae = tiny_assets.saes[MODEL_SAE[model_name]]
    plain_jobs = scenario(sae)
    jobs = {name: msgspec.structs.replace(job, capture=CAPTURES.get(name)) for name, job in plain_jobs.items()}
    mixed, choreo = run_mixed_batch(batched, jobs)
    assert max(choreo.batch_sizes) >= 6
    assert batched.hook_manager.armed_captures() == []  # every hook left with its request
    for name, res in mixed.items():
        if name == "E":
            continue
        # capture armed in the batch changes no token
        plain = batched.generate_sync(plain_jobs[name], timeout_s=60)
        assert res.token_ids == plain.token_ids, name
        if name not in CAPTURES:
            assert res.capture is None
            continue
        solo = serial.generate_sync(jobs[name], timeout_s=60)
        assert solo.token_ids == res.token_ids
        got, want = load_capture(res.capture.data), load_capture(solo.capture.data)
        assert got.positions.tolist() == want.positions.tolist() and len(got.positions) > 0, name
        assert got.token_ids.tolist() == want.token_ids.tolist()
        assert got.layers == want.layers == CAPTURES[name].layers
        for layer in got.layers:
            np.testing.assert_allclose(
                got.hidden[layer],
                want.hidden[layer],
                atol=BATCH_ENCODE_ATOL,
                rtol=BATCH_ENCODE_RTOL,
                err_msg=f"{name} layer {layer}",
            )
            # positive control: another request's rows (or zeros) do not pass
            assert not np.allclose(np.zeros_like(want.hidden[layer]), want.hidden[layer], atol=1e-3)
    a, g = load_capture(mixed["A"].capture.data), load_capture(mixed["G"].capture.data)
    assert not np.allclose(a.hidden[1][:5], g.hidden[1][:5], atol=1e-3)
    # the cancelled request still got the rows of the tokens it made
    e = mixed["E"]
    assert e.finish_reason == "cancelled"
    cap = load_capture(e.capture.data)
    p = e.usage.prompt_tokens
    assert cap.positions.tolist() == list(range(p - 1, p - 1 + len(e.token_ids)))


QK_CAPTURES = {
    "A": CaptureSpec(layers=[1], positions="all", attention=AttentionCaptureSpec(layers=[0, 3], positions="all")),
    "B": CaptureSpec(attention=AttentionCaptureSpec(layers=[1], heads=[1], positions="completion")),
    "C": CaptureSpec(attention=AttentionCaptureSpec(layers=[2], positions="prompt", q_positions="last")),
    # G and H prefill together in one left-padded forward
    "G": CaptureSpec(attention=AttentionCaptureSpec(layers=[0, 2], heads=[0], positions="all")),
    "H": CaptureSpec(attention=AttentionCaptureSpec(layers=[2], positions="prompt", q_positions="last_prompt")),
    "E": CaptureSpec(attention=AttentionCaptureSpec(layers=[3], positions="completion")),
}


@pytest.mark.parametrize("model_name", ["tiny-llama", "tiny-gemma2"])
def test_each_qk_capture_in_a_mixed_batch_equals_its_solo_capture(engines, tiny_assets, model_name):
    batched, serial = engines(model_name)
    sae = tiny_assets.saes[MODEL_SAE[model_name]]
    plain_jobs = scenario(sae)
    jobs = {name: msgspec.structs.replace(job, capture=QK_CAPTURES.get(name)) for name, job in plain_jobs.items()}
    mixed, choreo = run_mixed_batch(batched, jobs)
    assert max(choreo.batch_sizes) >= 6
    assert batched.backend.qk_taps.armed() == [] and batched.hook_manager.armed_captures() == []
    for name in ("A", "B", "C", "G", "H"):
        res = mixed[name]
        plain = batched.generate_sync(plain_jobs[name], timeout_s=60)
        assert res.token_ids == plain.token_ids, name  # arming Q/K in the batch changes no token
        solo = serial.generate_sync(jobs[name], timeout_s=60)
        got, want = load_capture(res.capture.data), load_capture(solo.capture.data)
        assert got.q_positions.tolist() == want.q_positions.tolist() and len(got.q_positions) > 0, name
        assert got.k_positions.tolist() == want.k_positions.tolist() and len(got.k_positions) > 0, name
        assert sorted(got.q) == sorted(want.q) == QK_CAPTURES[name].attention.layers
        for layer in got.q:
            for kind in ("q", "k"):
                g, w = getattr(got, kind)[layer], getattr(want, kind)[layer]
                np.testing.assert_allclose(
                    g, w, atol=BATCH_ENCODE_ATOL, rtol=BATCH_ENCODE_RTOL, err_msg=f"{name} {kind} layer {layer}"
                )
                assert not np.allclose(np.zeros_like(w), w, atol=1e-3)
        for layer in got.hidden:
            np.testing.assert_allclose(
                got.hidden[layer], want.hidden[layer], atol=BATCH_ENCODE_ATOL, rtol=BATCH_ENCODE_RTOL
            )
    # positive control: G's and A's layer-0 keys are different requests' keys
    a, g = load_capture(mixed["A"].capture.data), load_capture(mixed["G"].capture.data)
    assert not np.allclose(a.k[0][:4], g.k[0][:4], atol=1e-3)
    e = mixed["E"]
    cap = load_capture(e.capture.data)
    p = e.usage.prompt_tokens
    assert e.finish_reason == "cancelled"
    assert cap.k_positions.tolist() == list(range(p - 1, p - 1 + len(e.token_ids)))
