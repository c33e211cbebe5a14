"""Every hook point on the vLLM backend (docs/engine.md, "Hook point and read points"):
resid_pre of layer 0 (the embeddings' output), attn_out, mlp_out and a transcoder (reads
the MLP's input, writes its output), each an SAE whose ``cfg.json`` names the point (built
offline from the tiny SAEs as tests/engine/test_hook_points.py builds them), attached on
vLLM and on the transformers backend with the same fp32 weights.  In one vLLM batch each
steered and monitored request gives the transformers backend's greedy tokens and
monitored activations (within ``VLLM_ACT_ATOL``), its steering counted once per forward
pass, and other tokens than its unsteered run (positive control: a hook that never ran, or
ran on the wrong tensor, fails).  tests/engine/test_hook_points.py holds the transformers
backend to the module each point names, so agreeing with it puts vLLM's hook on the same
tensor.  Compiled (``enforce_eager=False``) the same batch runs through the loader's taps
(test_vllm_compiled.py calls ``assert_hook_points_equal_transformers``).  A point a model
cannot give exactly — here a sub-block whose output a tensor-parallel rank holds only a
shard of — is refused naming the points it supports.  One vLLM engine for the module
(tests/vllm/conftest.py)."""

from __future__ import annotations

import pytest

from gpu_engine.api.errors import SAEIncompatible
from gpu_engine.api.protocol import AttachSpec, GenerationJob, MonitorEntry, MonitorSpec, SamplingParams, SteeringSpec
from gpu_engine.backends.vllm import wire
from tests.engine.test_hook_points import EXPECTED, REQUESTED, sae_at

from .test_vllm_engine import assert_records_close

CASES = ("resid_pre_0", "attn_out", "mlp_out", "mlp_transcoder")
PROMPT = "the cat sat on the mat and"
FEATURES = {3: 8.0, 17: -5.0}


def hook_point_jobs(keys: dict[str, tuple[str, int]]) -> dict[str, GenerationJob]:
    """Per case: greedy, steered at its point, monitored there before and after the steer."""
    return {
        case: GenerationJob(
            case,
            prompt=PROMPT,
            sampling=SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
            steering=SteeringSpec.from_mapping({key: FEATURES}),
            monitor=MonitorSpec(
                [
                    MonitorEntry(
                        key[0], key[1], top_k=5, features=REQUESTED, read_point="pre_steering", positions="all"
                    ),
                    MonitorEntry(key[0], key[1], features=REQUESTED, positions="all"),
                ]
            ),
        )
        for case, key in keys.items()
    }


def assert_hook_points_equal_transformers(vllm_engine, hf_engine, tiny_assets, tmp_path) -> None:
    keys = {}
    for case in CASES:
        path, _, layer = sae_at(tmp_path, tiny_assets, case, name=f"vllm-{case}")
        keys[case] = (f"hp-{case}", layer)
        got_paths = [eng.attach(AttachSpec(keys[case][0], str(path), layer)) for eng in (vllm_engine, hf_engine)]
        # the same module path on both (model.embed_tokens, model.layers.2.self_attn, …)
        assert [r.layer_module_path for r in got_paths] == [EXPECTED[case][3]] * 2, case
        assert [r.hook_point for r in got_paths] == [case.removesuffix("_0")] * 2, case
    try:
        jobs = hook_point_jobs(keys)
        want = {case: hf_engine.generate_sync(j, timeout_s=120) for case, j in jobs.items()}
        streams = {case: vllm_engine.generate(j) for case, j in jobs.items()}  # one batch
        got = {case: s.result(300) for case, s in streams.items()}
        plain = vllm_engine.generate_sync(
            GenerationJob("plain", prompt=PROMPT, sampling=jobs[CASES[0]].sampling), timeout_s=120
        )
        for case in CASES:
            g, w = got[case], want[case]
            assert g.token_ids == w.token_ids, case
            assert g.forward_passes == w.forward_passes == len(g.token_ids), case
            # the steer ran at every forward pass, on vLLM as on transformers
            assert [(c.sae_id, c.layer, c.count, c.modes) for c in g.steering_apply_count] == [
                (keys[case][0], keys[case][1], g.forward_passes, {"add": g.forward_passes})
            ], case
            assert [(c.count, c.modes) for c in w.steering_apply_count] == [
                (c.count, c.modes) for c in g.steering_apply_count
            ], case
            assert g.activations and any(f.activation > 0 for r in g.activations for f in r.features), case
            assert_records_close(g.activations, w.activations)
            assert g.token_ids != plain.token_ids, case  # positive control
    finally:
        for eng in (vllm_engine, hf_engine):
            for sae_id, _ in keys.values():
                eng.detach(sae_id)


def test_the_backend_reports_every_hook_point(vllm_engine):
    caps = vllm_engine.status().batching["capabilities"]
    assert caps["hook_points"] == ["resid_post", "resid_pre", "attn_out", "mlp_out", "mlp_transcoder"]


def test_every_hook_point_steers_and_monitors_like_transformers(vllm_engine, hf_engine, tiny_assets, tmp_path):
    assert_hook_points_equal_transformers(vllm_engine, hf_engine, tiny_assets, tmp_path)


def test_a_sub_block_whose_output_is_a_shard_is_refused(vllm_engine, tiny_assets, tmp_path):
    """Under tensor parallelism an attention whose output projection does not all-reduce
    (``reduce_results=False``) leaves each rank a shard: attn_out is refused there, naming
    the points still supported, and the others stay.  (The worker's real model, its
    projection switched for the check and restored.)"""

    def sites_with_a_sharded_attention(worker):  # type: ignore[no-untyped-def]
        from gpu_engine.backends.vllm.loader import hook_sites

        model = worker._millm_state.model
        whole = hook_sites(model, 2)  # every projection all-reduces: all kept
        projections = [layer.self_attn.o_proj for layer in worker._millm_state.layers]
        saved = [(p.reduce_results, p.tp_size) for p in projections]
        try:
            for p in projections:
                p.reduce_results, p.tp_size = False, 2
            return whole, hook_sites(model, 2), hook_sites(model, 1)
        finally:
            for p, (r, t) in zip(projections, saved):
                p.reduce_results, p.tp_size = r, t

    (whole, sharded, single), *_ = vllm_engine.backend.engine.collective_rpc(sites_with_a_sharded_attention)
    assert whole["attn_out"] == "self_attn" and whole["mlp_transcoder"] == "mlp"
    assert single["attn_out"] == "self_attn"  # one rank holds the whole output anyway
    assert sharded["attn_out"] is None and sharded["mlp_out"] == "mlp" and sharded["embed"] == "model.embed_tokens"
    with pytest.raises(SAEIncompatible, match="attn_out.*shard") as err:
        wire.hook_site(2, "attn_out", sharded)
    assert err.value.code == "sae_incompatible"
    assert err.value.details["supported"] == ["resid_post", "resid_pre", "mlp_out", "mlp_transcoder"]
    assert wire.hook_site(2, "mlp_out", sharded) == ("model.layers.2.mlp", 2, "output")
    # the engine refuses it at attach, before anything is loaded or installed
    backend = vllm_engine.backend
    before = [(a.sae_id, a.layer) for a in vllm_engine.status().attachments]
    path, _, layer = sae_at(tmp_path, tiny_assets, "attn_out", name="sharded")
    whole_sites, backend.hook_sites = backend.hook_sites, sharded
    try:
        with pytest.raises(SAEIncompatible, match="vLLM backend cannot hook attn_out"):
            vllm_engine.attach(AttachSpec("sharded", str(path), layer))
    finally:
        backend.hook_sites = whole_sites
    assert [(a.sae_id, a.layer) for a in vllm_engine.status().attachments] == before


def test_resid_pre_of_layer_0_is_refused_where_the_embeddings_are_changed_outside_their_module():
    """vLLM's Gemma scales the embeddings after the module, GPT-2 adds position embeddings:
    the embedding module's output is not what layer 0 reads (torch-free: wire only)."""
    gemma = {
        "layers": "model.layers",
        "embed": None,
        "attn_out": "post_attention_layernorm",
        "mlp_out": "post_feedforward_layernorm",
        "mlp_transcoder": None,
        "why": {"embed": "vLLM's Gemma2Model changes the embeddings' output before layer 0"},
    }
    with pytest.raises(SAEIncompatible, match="resid_pre of layer 0.*Gemma2Model") as err:
        wire.hook_site(0, "resid_pre", gemma)
    assert err.value.details["supported"] == ["resid_post", "resid_pre", "attn_out", "mlp_out"]
    assert wire.hook_site(1, "resid_pre", gemma) == ("model.layers.0", 0, "pair")
    assert wire.hook_site(1, "attn_out", gemma) == ("model.layers.1.post_attention_layernorm", 1, "output")
