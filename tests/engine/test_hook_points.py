"""SAEs hook where their ``hook_name`` says they were trained.

The test names the module each hook point must land on itself (``EXPECTED``: resid_pre
of L is block L-1's output, the embeddings' for L = 0; attn_out / mlp_out the sub-block
outputs; a transcoder reads the MLP's input and writes its output), then checks on that
module, with its own forward hooks:

- steering: the module's output after the engine is its raw output + Σ s_i·W_dec[i], and
  greedy generation equals a run where the *test's* hook adds the delta there; the old
  placement (block L's output whatever the hook name) gives other tokens where it is not
  the same sum (positive control: a test that cannot tell the two places apart fails);
- monitoring: the reported activations are an independent float64 encode of what that
  module emits (its input, for a transcoder) — and not of block L's output.
"""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from gpu_engine.api.errors import SAEIncompatible
from gpu_engine.api.protocol import (
    AttachSpec,
    GenerationJob,
    MonitorEntry,
    MonitorSpec,
    SamplingParams,
    SteeringSpec,
)

from .helpers import RefSAE, add_delta, capture
from .tolerances import ENCODE_ATOL, ENCODE_RTOL, HOOK_ATOL, HOOK_RTOL, POSITIVE_CONTROL_MIN

PROMPT = "the cat sat on the mat and"
FEATURES = {3: 8.0, 17: -5.0}
REQUESTED = [0, 3, 7, 17, 100]

# (hook_name, hook_name_out, attach layer, the module the test expects, reads its input)
EXPECTED = {
    "resid_pre": ("blocks.{L}.hook_resid_pre", None, 2, "model.layers.1", False),
    "resid_pre_0": ("blocks.{L}.hook_resid_pre", None, 0, "model.embed_tokens", False),
    "resid_post": ("blocks.{L}.hook_resid_post", None, 2, "model.layers.2", False),
    "attn_out": ("blocks.{L}.hook_attn_out", None, 2, "model.layers.2.self_attn", False),
    "mlp_out": ("blocks.{L}.hook_mlp_out", None, 2, "model.layers.2.mlp", False),
    "mlp_transcoder": ("blocks.{L}.ln2.hook_normalized", "blocks.{L}.hook_mlp_out", 2, "model.layers.2.mlp", True),
}


def greedy(rid: str, steering=None, monitor=None, max_tokens: int = 8) -> GenerationJob:
    return GenerationJob(
        rid,
        prompt=PROMPT,
        steering=steering,
        monitor=monitor,
        sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
    )


def sae_at(tmp_path, tiny_assets, case: str, *, source: str = "tiny-llama-L1-relu", name: str | None = None):
    """A copy of a tiny SAE whose cfg.json names the case's hook point."""
    hook_name, hook_name_out, layer, _, _ = EXPECTED[case]
    asset = tiny_assets.saes[source]
    path = tmp_path / (name or f"sae-{case}")
    shutil.copytree(asset.path, path)
    cfg = json.loads((path / "cfg.json").read_text())
    cfg.pop("hook_point", None)
    cfg["hook_name"] = hook_name.format(L=layer)
    if hook_name_out:
        cfg["hook_name_out"] = hook_name_out.format(L=layer)
        cfg["architecture"] = "transcoder" if asset.activation == "relu" else "jumprelu_transcoder"
        cfg["apply_b_dec_to_input"] = False
        # the MLP's input is a normalised row, far smaller than the residual this SAE was
        # made for: a higher encoder bias makes features fire there (or the monitoring
        # check would compare zeros)
        from safetensors.numpy import load_file, save_file

        weights = load_file(str(path / "sae_weights.safetensors"))
        weights["b_enc"] = weights["b_enc"] + np.float32(0.3)
        save_file(weights, str(path / "sae_weights.safetensors"))
    (path / "cfg.json").write_text(json.dumps(cfg))
    ref_asset = SimpleNamespace(path=path, layout="saelens", activation=asset.activation, k=asset.k)
    return path, RefSAE(ref_asset), layer


def _capture_input(module):
    seen: list[np.ndarray] = []
    handle = module.register_forward_hook(lambda m, args, out: seen.append(args[0][0].detach().double().numpy().copy()))
    return seen, handle


@pytest.mark.parametrize("case", list(EXPECTED))
def test_steering_lands_on_the_hook_points_module(engine, tiny_assets, tmp_path, case):
    path, ref, layer = sae_at(tmp_path, tiny_assets, case)
    _, _, _, module_path, _ = EXPECTED[case]
    result = engine.attach(AttachSpec("hp", str(path), layer))
    assert result.layer_module_path == module_path
    assert result.hook_point == case.removesuffix("_0")
    assert engine.status().attachments[0].hook_point == result.hook_point

    model = engine.backend.model
    module = model.get_submodule(module_path)
    delta = ref.delta(FEATURES)
    steering = SteeringSpec.from_mapping({("hp", layer): FEATURES})
    with capture(module, before_engine=True) as raw, capture(module) as post:
        steered = engine.generate_sync(greedy("s", steering))
    assert len(raw) == len(post) == steered.forward_passes
    for r, p in zip(raw, post):
        np.testing.assert_allclose(p, r + delta, atol=HOOK_ATOL, rtol=HOOK_RTOL)
        assert np.abs(p - r).max(axis=-1).min() > POSITIVE_CONTROL_MIN

    engine.detach("hp")
    with add_delta(module, delta):
        reference = engine.generate_sync(greedy("ref"))
    assert steered.token_ids == reference.token_ids
    # the old placement: block L's output, whatever the SAE's hook name.  For mlp_out (and
    # a transcoder's write) it is the same sum — the MLP's output is the block's last add —
    # so only the monitoring test can tell those apart
    late = model.get_submodule(f"model.layers.{layer}")
    if case in ("resid_pre", "resid_pre_0", "attn_out"):
        with add_delta(late, delta):
            wrong = engine.generate_sync(greedy("late"))
        assert wrong.token_ids != steered.token_ids


@pytest.mark.parametrize("case", list(EXPECTED))
def test_monitoring_reads_the_hook_points_module(engine, tiny_assets, tmp_path, case):
    path, ref, layer = sae_at(tmp_path, tiny_assets, case)
    _, _, _, module_path, reads_input = EXPECTED[case]
    engine.attach(AttachSpec("hp", str(path), layer))
    module = engine.backend.model.get_submodule(module_path)
    monitor = MonitorSpec(
        [MonitorEntry("hp", layer, top_k=5, features=REQUESTED, read_point="pre_steering", positions="all")]
    )
    late = engine.backend.model.get_submodule(f"model.layers.{layer}")
    if reads_input:
        seen, handle = _capture_input(module)
        try:
            with capture(late) as late_rows:
                out = engine.generate_sync(greedy("m", monitor=monitor, max_tokens=4))
        finally:
            handle.remove()
    else:
        with capture(module, before_engine=True) as seen, capture(late) as late_rows:
            out = engine.generate_sync(greedy("m", monitor=monitor, max_tokens=4))
    expected = ref.encode(np.concatenate(seen, axis=0))
    assert len(out.activations) == expected.shape[0]
    got = np.array([[f.activation for f in rec.features] for rec in out.activations])
    np.testing.assert_allclose(got, expected[:, REQUESTED], atol=ENCODE_ATOL, rtol=ENCODE_RTOL)
    assert (expected[:, REQUESTED] > 0).any()  # features fire: the comparison is not all zeros
    if late is not module:
        wrong = ref.encode(np.concatenate(late_rows, axis=0))
        assert np.abs(wrong[:, REQUESTED] - got).max() > 1e-2


def test_two_saes_on_one_module_both_apply(engine, tiny_assets, tmp_path):
    """resid_post of 1 and resid_pre of 2 are the same tensor: both deltas land on block 1."""
    p1, ref1, _ = sae_at(tmp_path, tiny_assets, "resid_post", name="post1")
    cfg = json.loads((p1 / "cfg.json").read_text())
    cfg["hook_name"] = "blocks.1.hook_resid_post"
    (p1 / "cfg.json").write_text(json.dumps(cfg))
    p2, ref2, _ = sae_at(tmp_path, tiny_assets, "resid_pre", name="pre2")
    results = engine.attach_set([AttachSpec("a", str(p1), 1), AttachSpec("b", str(p2), 2)])
    assert [r.layer_module_path for r in results] == ["model.layers.1", "model.layers.1"]
    f2 = {5: 4.0}
    spec = SteeringSpec.from_mapping({("a", 1): FEATURES, ("b", 2): f2})
    module = engine.backend.model.get_submodule("model.layers.1")
    with capture(module, before_engine=True) as raw, capture(module) as post:
        engine.generate_sync(greedy("both", spec, max_tokens=3))
    for r, p in zip(raw, post):
        np.testing.assert_allclose(p, r + ref1.delta(FEATURES) + ref2.delta(f2), atol=HOOK_ATOL, rtol=HOOK_RTOL)


def test_a_transcoder_is_refused_on_sandwich_norm_blocks_before_anything_is_installed(
    engine_factory, tiny_assets, tmp_path
):
    eng = engine_factory("tiny-gemma2")
    path, _, layer = sae_at(tmp_path, tiny_assets, "mlp_transcoder", source="tiny-gemma2-L1-jumprelu")
    with pytest.raises(SAEIncompatible, match="post-feedforward norm") as err:
        eng.attach(AttachSpec("tc", str(path), layer))
    assert err.value.code == "sae_incompatible"
    assert eng.status().attachments == [] and eng.backend.hooks.installed() == []


def test_gemma2_sub_block_outputs_are_the_normalised_ones(engine_factory, tiny_assets, tmp_path):
    eng = engine_factory("tiny-gemma2")
    path, _, _ = sae_at(tmp_path, tiny_assets, "mlp_out", source="tiny-gemma2-L1-jumprelu")
    assert eng.attach(AttachSpec("m", str(path), 1)).layer_module_path == "model.layers.1.post_feedforward_layernorm"
    eng.detach("m")
    path, _, _ = sae_at(tmp_path, tiny_assets, "attn_out", source="tiny-gemma2-L1-jumprelu")
    assert eng.attach(AttachSpec("a", str(path), 1)).layer_module_path == "model.layers.1.post_attention_layernorm"
    eng.detach("a")


def test_gpt2_resid_pre_of_layer_0_includes_position_embeddings(engine_factory, tiny_assets, tmp_path):
    eng = engine_factory("tiny-gpt2")
    path, ref, _ = sae_at(tmp_path, tiny_assets, "resid_pre_0", source="tiny-gpt2-L1-relu")
    assert eng.attach(AttachSpec("e", str(path), 0)).layer_module_path == "transformer.drop"
    model = eng.backend.model
    seen: list[torch.Tensor] = []
    handle = model.transformer.h[0].register_forward_pre_hook(lambda m, args: seen.append(args[0][0].clone()))
    try:
        monitor = MonitorSpec([MonitorEntry("e", 0, features=REQUESTED, read_point="pre_steering", positions="prompt")])
        out = eng.generate_sync(greedy("g", monitor=monitor, max_tokens=1))
    finally:
        handle.remove()
        eng.detach("e")
    # what block 0 reads (wte + wpe) is what was monitored
    expected = ref.encode(seen[0].double().numpy())
    got = np.array([[f.activation for f in rec.features] for rec in out.activations])
    np.testing.assert_allclose(got, expected[:, REQUESTED], atol=ENCODE_ATOL, rtol=ENCODE_RTOL)


def test_llamacpp_and_vllm_refuse_what_they_cannot_hook():
    from gpu_engine.backends.vllm.wire import hook_site

    # vLLM reaches every point where its model gives it exactly (its workers' sites);
    # tests/vllm/test_vllm_hook_points.py holds each to this backend
    sites = {"layers": "model.layers", "embed": None, "attn_out": "self_attn", "mlp_out": None, "why": {}}
    sites["mlp_transcoder"] = None
    assert hook_site(3, "resid_post", sites)[0] == "model.layers.3"
    assert hook_site(3, "resid_pre", sites)[0] == "model.layers.2"
    assert hook_site(3, "attn_out", sites)[0] == "model.layers.3.self_attn"
    for point, layer in (("resid_pre", 0), ("mlp_out", 2), ("mlp_transcoder", 2)):
        with pytest.raises(SAEIncompatible, match=point):
            hook_site(layer, point, sites)
    from tests.fixtures.backends import require_backend

    require_backend("llamacpp")  # skips, or fails under MILLM_REQUIRE_LLAMACPP=1 (CI)
    from gpu_engine.backends.llamacpp.backend import SWAP_HOOK_POINTS, LlamaCppBackend

    # under swapped control vectors (test_llamacpp_hook_points.py runs every point per row)
    fake = SimpleNamespace(
        name="llamacpp",
        steering_mode="control_vector_swap",
        steering_mode_reason="forced",
        hook_points=SWAP_HOOK_POINTS,
        architecture="llama",
    )
    assert LlamaCppBackend.layer_module_path(fake, 2) == "l_out-2"
    assert LlamaCppBackend.layer_module_path(fake, 2, "resid_pre") == "l_out-1"
    for point in ("attn_out", "mlp_out", "mlp_transcoder"):
        with pytest.raises(SAEIncompatible, match=point):
            LlamaCppBackend.layer_module_path(fake, 2, point)
