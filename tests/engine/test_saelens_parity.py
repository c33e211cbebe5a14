"""Our SAE loading, encoding and decoder rows against SAELens's own classes, on files
SAELens itself wrote (``SAE.save_model``) with random weights.

Each case builds a SAELens inference SAE, randomises every parameter (biases and
thresholds too, so no term can hide behind a zero), saves it, then loads the same
directory twice: with SAELens (``SAE.load_from_disk``) and with ``gpu_engine.sae.load_sae``.
Encodings must agree to ``SAELENS_*`` (tolerances.py); a steering delta of one feature must
equal what SAELens's ``decode`` adds for that feature (``decode(s·e_i) - decode(0)``).
"""

from __future__ import annotations

import json

import pytest
import torch

from gpu_engine.api.errors import SAEFormatError
from gpu_engine.sae import load_sae, read_sae_metadata
from tests.engine.tolerances import SAELENS_ATOL, SAELENS_RTOL
from tests.saelens_ref import saelens

D_IN, D_SAE = 16, 48
FEATURES = {3: 2.5, 17: -1.25, 40: 0.5}


def _metadata(hook_name: str, **extra):
    from sae_lens.saes.sae import SAEMetadata

    return SAEMetadata(hook_name=hook_name, model_name="tiny-llama", **extra)


def _build(
    tmp_path,
    arch: str,
    *,
    hook_name: str = "blocks.1.hook_resid_pre",
    extra_cfg: dict | None = None,
    metadata: dict | None = None,
    **cfg_kwargs,
):
    sl = saelens()
    cls, cfg_cls = sl.classes[arch]
    cfg = cfg_cls(d_in=D_IN, d_sae=D_SAE, metadata=_metadata(hook_name, **(metadata or {})), **cfg_kwargs)
    sae = cls(cfg)
    gen = torch.Generator().manual_seed(sum(map(ord, arch)))
    with torch.no_grad():
        for name, p in sae.named_parameters():
            if name == "threshold":
                p.copy_(torch.rand(p.shape, generator=gen) * 0.6)
            elif name == "r_mag":
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * (0.3 if p.dim() > 1 else 0.2))
    path = tmp_path / arch
    sae.save_model(path)
    if extra_cfg:
        cfg_file = path / "cfg.json"
        cfg_file.write_text(json.dumps({**json.loads(cfg_file.read_text()), **extra_cfg}))
    return path


def _inputs() -> torch.Tensor:
    gen = torch.Generator().manual_seed(7)
    return torch.randn(2, 5, D_IN, generator=gen) * 3.0


def _compare(path, *, fold_factor: float | None = None, check_decode: bool = True):
    ref = saelens().SAE.load_from_disk(str(path))
    if fold_factor is not None:
        ref.fold_activation_norm_scaling_factor(fold_factor)
    ours = load_sae(path)
    x = _inputs()
    with torch.no_grad():
        expected = ref.encode(x)
        got = ours.encode(x)
        assert expected.abs().sum() > 0 and (expected == 0).any()  # a real sparse code, not all-zero
        torch.testing.assert_close(got, expected, atol=SAELENS_ATOL, rtol=SAELENS_RTOL)
        idx = torch.tensor(sorted(FEATURES), dtype=torch.long)
        torch.testing.assert_close(
            ours.encode_selected(x, idx), expected.index_select(-1, idx), atol=SAELENS_ATOL, rtol=SAELENS_RTOL
        )
        values, indices = ours.top_features(x.reshape(-1, D_IN), 5)
        ref_top = torch.topk(expected.reshape(-1, D_SAE), 5, dim=-1)
        torch.testing.assert_close(values, ref_top.values, atol=SAELENS_ATOL, rtol=SAELENS_RTOL)
        if check_decode:
            acts = torch.zeros(D_SAE)
            for i, s in FEATURES.items():
                acts[i] = s
            ref_delta = ref.decode(acts) - ref.decode(torch.zeros(D_SAE))
            delta = ours.steering_delta(FEATURES, dtype=torch.float32, device="cpu")
            torch.testing.assert_close(delta, ref_delta, atol=SAELENS_ATOL, rtol=SAELENS_RTOL)
    return ours


def test_standard_relu(tmp_path):
    ours = _compare(_build(tmp_path, "standard"))
    assert ours.cfg.activation == "relu" and ours.cfg.apply_b_dec_to_input
    assert ours.cfg.hook_point == "resid_pre"


def test_standard_without_b_dec_on_input(tmp_path):
    _compare(_build(tmp_path, "standard", apply_b_dec_to_input=False))


def test_jumprelu(tmp_path):
    assert _compare(_build(tmp_path, "jumprelu")).cfg.activation == "jumprelu"


def test_topk(tmp_path):
    assert _compare(_build(tmp_path, "topk", k=6)).cfg.k == 6


def test_topk_rescaled_by_decoder_norm(tmp_path):
    # SAELens ranks pre·|W_dec[i]| and divides by the norm again in decode, so only the
    # encode is compared; our steering rows stay raw (SPEC §3)
    ours = _compare(_build(tmp_path, "topk", k=6, rescale_acts_by_decoder_norm=True), check_decode=False)
    assert ours.cfg.rescale_acts_by_decoder_norm


def test_gated(tmp_path):
    ours = _compare(_build(tmp_path, "gated", hook_name="blocks.2.hook_resid_post"))
    assert ours.cfg.activation == "gated" and ours.cfg.hook_point == "resid_post"


def test_constant_norm_rescale(tmp_path):
    # decode divides by the encoded row's norm factor: no fixed row to compare with
    ours = _compare(_build(tmp_path, "standard", normalize_activations="constant_norm_rescale"), check_decode=False)
    assert ours.cfg.normalize_activations == "constant_norm_rescale"
    # the positive control: without the rescale the code differs
    x = _inputs()
    ref = saelens().SAE.load_from_disk(str(ours.cfg.path))
    ref.cfg.normalize_activations = "none"
    ref._setup_activation_normalization()
    with torch.no_grad():
        assert (ref.encode(x) - ours.encode(x)).abs().max() > 0.1


def test_gated_constant_norm_rescale(tmp_path):
    _compare(_build(tmp_path, "gated", normalize_activations="constant_norm_rescale"), check_decode=False)


def test_expected_average_with_a_stored_factor(tmp_path):
    """A file giving ``norm_scaling_factor`` is what SAELens's from_pretrained folds in."""
    path = _build(
        tmp_path, "standard", normalize_activations="expected_average_only_in", extra_cfg={"norm_scaling_factor": 2.75}
    )
    ours = _compare(path, fold_factor=2.75)
    assert ours.cfg.norm_scaling_factor == 2.75
    # positive control: the unfolded SAELens SAE encodes differently
    unfolded = saelens().SAE.load_from_disk(str(path))
    with torch.no_grad():
        assert (unfolded.encode(_inputs()) - ours.encode(_inputs())).abs().max() > 0.1


def test_expected_average_without_a_factor_is_what_load_from_disk_does(tmp_path):
    path = _build(tmp_path, "jumprelu", normalize_activations="expected_average_only_in")
    _compare(path)
    from gpu_engine.sae import check_compatibility

    report = check_compatibility(read_sae_metadata(path), hidden_size=D_IN, num_layers=4, layer=1)
    assert any("norm_scaling_factor" in w for w in report.warnings)


@pytest.mark.parametrize("arch", ["transcoder", "jumprelu_transcoder"])
def test_transcoder(tmp_path, arch):
    path = _build(
        tmp_path,
        arch,
        hook_name="blocks.1.ln2.hook_normalized",
        d_out=D_IN,
        apply_b_dec_to_input=False,
        metadata={"hook_name_out": "blocks.1.hook_mlp_out"},
    )
    ours = _compare(path)
    assert ours.cfg.hook_point == "mlp_transcoder" and not ours.cfg.apply_b_dec_to_input


def test_layer_norm_normalisation_is_refused_by_name(tmp_path):
    path = _build(tmp_path, "standard", normalize_activations="layer_norm")
    with pytest.raises(SAEFormatError, match="layer_norm") as err:
        read_sae_metadata(path)
    assert err.value.code == "sae_format_error"


@pytest.mark.parametrize("hook_name", ["blocks.1.attn.hook_z", "blocks.1.hook_resid_mid", "blocks.1.attn.hook_q"])
def test_unknown_hook_point_is_refused_by_name(tmp_path, hook_name):
    path = _build(tmp_path, "standard", hook_name=hook_name)
    with pytest.raises(SAEFormatError, match=hook_name.replace(".", r"\.")) as err:
        read_sae_metadata(path)
    assert err.value.code == "sae_format_error"
