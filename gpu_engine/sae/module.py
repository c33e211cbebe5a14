"""The SAE as tensors: encode (ReLU / JumpReLU / TopK / gated), decoder rows, steering deltas.

Encoding follows SAELens's inference classes (``StandardSAE``, ``JumpReLUSAE``,
``TopKSAE``, ``GatedSAE``) step for step, normalisation included:

- ``expected_average_only_in``: SAELens scales inputs by a constant estimated in
  training and folds it into the weights (``fold_activation_norm_scaling_factor``:
  W_enc·s, W_dec/s, b_dec/s) before an SAE is used; a file giving
  ``norm_scaling_factor`` is folded the same way here, so the decoder rows are the
  model-space rows.  Without a factor SAELens's ``load_from_disk`` applies nothing, and
  neither do we.
- ``constant_norm_rescale``: each input row is scaled to norm sqrt(d_in) before encoding
  (``run_time_activation_norm_fn_in``); decoding divides by the same per-row factor,
  which a steering delta has no row of, so steering adds raw decoder rows (SPEC §3).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

from ..api.errors import InvalidFeatureIndex
from .config import SAEConfig
from .layouts import resolve_layout


class SAE:
    """Weights in canonical orientation: ``W_enc`` (d_in, d_sae), ``W_dec`` (d_sae, d_in).

    The SAE keeps its own dtype (float32 by default) whatever the model's; inputs are cast
    on the way in, so monitoring a bf16 model is still encoded in float32.
    """

    def __init__(
        self,
        cfg: SAEConfig,
        tensors: Mapping[str, torch.Tensor],
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.cfg = cfg
        self.device = torch.device(device)
        self.dtype = dtype

        def put(t: torch.Tensor) -> torch.Tensor:
            return t.to(device=self.device, dtype=dtype).contiguous()

        # a raw steering vector (layout "vector") has decoder rows only
        self.W_enc = put(tensors["W_enc"]) if "W_enc" in tensors else None
        self.W_dec = put(tensors["W_dec"])
        self.b_enc = put(tensors["b_enc"]) if "b_enc" in tensors else None
        self.b_dec = put(tensors["b_dec"])
        self.threshold = put(tensors["threshold"]) if "threshold" in tensors else None
        gated = cfg.activation == "gated"
        self.b_gate = put(tensors["b_gate"]) if gated else None
        self.b_mag = put(tensors["b_mag"]) if gated else None
        # the magnitude path's encoder is W_enc with column j scaled by exp(r_mag[j]): the
        # scale is applied to the shared matmul's result instead of a second W_enc copy
        self.mag_scale = put(tensors["r_mag"]).exp() if gated else None
        if gated:
            # SAELens's gated SAE has no b_enc; ours is the gate bias for code that reads it
            self.b_enc = self.b_gate  # type: ignore[assignment]
        factor = cfg.norm_scaling_factor
        if cfg.normalize_activations == "expected_average_only_in" and factor is not None:
            # exactly SAELens's fold_activation_norm_scaling_factor
            self.W_enc = self.W_enc * factor
            self.W_dec = self.W_dec / factor
            self.b_dec = self.b_dec / factor
        self.dec_norms = self.W_dec.norm(dim=-1) if cfg.rescale_acts_by_decoder_norm else None

    @property
    def d_in(self) -> int:
        return self.cfg.d_in

    @property
    def d_sae(self) -> int:
        return self.cfg.d_sae

    @property
    def activation(self) -> str:
        return self.cfg.activation

    @property
    def has_encoder(self) -> bool:
        return self.W_enc is not None

    def nbytes(self) -> int:
        ts = [
            self.W_enc,
            self.W_dec,
            self.b_enc,
            self.b_dec,
            self.threshold,
            self.b_mag,
            self.mag_scale,
            self.dec_norms,
        ]
        unique = {id(t): t for t in ts if t is not None}
        return sum(t.numel() * t.element_size() for t in unique.values())

    # ------------------------------------------------------------------ encode

    def _prepare(self, x: torch.Tensor) -> torch.Tensor:
        """SAELens's ``process_sae_in``: cast, normalise, subtract b_dec."""
        if self.W_enc is None:  # requests.request_hooks refuses what would get here
            raise ValueError(f"{self.cfg.path} has no encoder (a raw steering vector)")
        x = x.to(self.dtype)
        if self.cfg.normalize_activations == "constant_norm_rescale":
            x = x * ((self.cfg.d_in**0.5) / x.norm(dim=-1, keepdim=True))
        return x - self.b_dec if self.cfg.apply_b_dec_to_input else x

    def pre_activations(self, x: torch.Tensor) -> torch.Tensor:
        pre = self._prepare(x) @ self.W_enc + self.b_enc
        return pre * self.dec_norms if self.dec_norms is not None else pre

    def _activate(self, pre: torch.Tensor, threshold: torch.Tensor | None) -> torch.Tensor:
        acts = torch.relu(pre)
        if self.activation == "jumprelu":
            acts = acts * (pre > threshold)
        return acts

    def _gated(
        self, proj: torch.Tensor, b_gate: torch.Tensor, b_mag: torch.Tensor, scale: torch.Tensor
    ) -> torch.Tensor:
        """``proj`` = the prepared input times (some of) W_enc's columns."""
        active = (proj + b_gate > 0).to(self.dtype)
        return active * torch.relu(proj * scale + b_mag)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Feature activations (..., d_sae)."""
        if self.activation == "gated":
            return self._gated(self._prepare(x) @ self.W_enc, self.b_gate, self.b_mag, self.mag_scale)  # type: ignore[arg-type]
        pre = self.pre_activations(x)
        if self.activation == "topk":
            k = int(self.cfg.k or 0)
            top = torch.topk(pre, k, dim=-1)
            return torch.zeros_like(pre).scatter_(-1, top.indices, torch.relu(top.values))
        return self._activate(pre, self.threshold)

    def encode_selected(self, x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """Activations of ``indices`` only (..., len(indices)).

        ReLU/JumpReLU/gated features are independent, so only their encoder columns are
        used; a TopK feature's value depends on all others, so TopK encodes fully.
        """
        return SelectedEncoder(self, indices)(x)

    def top_features(self, x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(values, indices) of the ``k`` largest activations per row (zeros included)."""
        if self.activation == "topk":
            pre = self.pre_activations(x)
            kk = min(k, int(self.cfg.k or 0))
            top = torch.topk(pre, kk, dim=-1)
            return torch.relu(top.values), top.indices
        acts = self.encode(x)
        top = torch.topk(acts, min(k, self.d_sae), dim=-1)
        return top.values, top.indices

    # ------------------------------------------------------------------ decode / steer

    def decode(self, acts: torch.Tensor, x: torch.Tensor | None = None) -> torch.Tensor:
        """The reconstruction of feature activations ``acts`` (..., d_sae) in the model's
        space, as SAELens's ``decode``: ``acts @ W_dec + b_dec`` (``acts`` divided by the
        decoder norms first where the SAE rescales by them); a ``constant_norm_rescale``
        SAE undoes the per-row input scaling, which needs the rows ``x`` encoded."""
        if self.dec_norms is not None:
            acts = acts / self.dec_norms
        out = acts.to(self.dtype) @ self.W_dec + self.b_dec
        if self.cfg.normalize_activations == "constant_norm_rescale":
            if x is None:
                raise ValueError("a constant_norm_rescale SAE decodes with the rows it encoded")
            x = x.to(self.dtype)
            out = out / ((self.cfg.d_in**0.5) / x.norm(dim=-1, keepdim=True))
        return out

    def reconstruct(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(acts, x_hat)``: the rows' activations and ``decode(encode(x))``."""
        acts = self.encode(x)
        return acts, self.decode(acts, x)

    def check_indices(self, sae_id: str, indices: Iterable[int], param: str | None = None) -> None:
        for i in indices:
            if not 0 <= int(i) < self.d_sae:
                raise InvalidFeatureIndex(sae_id=sae_id, index=int(i), d_sae=self.d_sae, param=param)

    def steering_delta(
        self, features: Mapping[int, float], *, dtype: torch.dtype, device: torch.device | str
    ) -> torch.Tensor:
        """``Σ s_i · W_dec[i]`` (raw rows), summed in the SAE dtype and cast once."""
        idx = torch.tensor(list(features.keys()), dtype=torch.long, device=self.W_dec.device)
        strengths = torch.tensor(list(features.values()), dtype=self.dtype, device=self.W_dec.device)
        delta = strengths @ self.W_dec.index_select(0, idx)
        return delta.to(device=device, dtype=dtype)


class SelectedEncoder:
    """``SAE.encode_selected`` for a fixed set of feature indices, their encoder columns
    gathered once: a steering control encodes the same few features at every forward."""

    def __init__(self, sae: SAE, indices: torch.Tensor) -> None:
        self.sae = sae
        self.indices = indices
        self.full = sae.activation == "topk"
        if self.full:
            return
        self.W = sae.W_enc.index_select(1, indices).contiguous()
        if sae.activation == "gated":
            self.b_gate = sae.b_gate.index_select(0, indices)  # type: ignore[union-attr]
            self.b_mag = sae.b_mag.index_select(0, indices)  # type: ignore[union-attr]
            self.mag_scale = sae.mag_scale.index_select(0, indices)  # type: ignore[union-attr]
        else:
            self.b = sae.b_enc.index_select(0, indices)
            self.thr = sae.threshold.index_select(0, indices) if sae.threshold is not None else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        sae = self.sae
        if self.full:
            return sae.encode(x).index_select(-1, self.indices)
        proj = sae._prepare(x) @ self.W
        if sae.activation == "gated":
            return sae._gated(proj, self.b_gate, self.b_mag, self.mag_scale)
        return sae._activate(proj + self.b, self.thr)


def load_sae(
    path: str | Path,
    *,
    layout: str | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> SAE:
    found_layout, found = resolve_layout(path, layout)
    cfg = found_layout.read_metadata(found)
    tensors = found_layout.load_tensors(cfg)
    return SAE(cfg, tensors, device=device, dtype=dtype)


__all__ = ["SAE", "SelectedEncoder", "load_sae"]
