"""Attribution of one logit to an SAE's features: activation × gradient, as tensors.

With the SAE spliced in at its hook point and its error term kept — ``x' = x_hat +
stopgrad(x - x_hat)``, so the forward is the model's own — the residual written there at
position p depends on feature i only through ``f_i(x_p) · W_dec[i]``, and

    attribution(i, p) = f_i(x_p) · ∂logit / ∂f_i(x_p) = f_i(x_p) · (g_p · W_dec[i])

with ``g_p`` the gradient of the logit with respect to the residual written at p (one
backward pass gives every p). Zeroing feature i at every position subtracts
``f_i(x_p) · W_dec[i]`` from each row (``ablation_delta``); its effect on the logit is
what the estimate is checked against. Raw decoder rows, as steering and the feature
controls use them (``interp.controls``: clamping to 0 is the same ablation).

No backend here: a backend runs the forwards (``backends/transformers/attribution.py``)
and hands the rows it read and the gradient to ``attribute``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..api.monitoring import PackedRows
from ..api.results import AttributionFeature
from ..sae.module import SAE

# activation × gradient is computed for this many (row, feature) products at a time
CHUNK_ELEMENTS = 1 << 21


@dataclass
class Attribution:
    """Every non-zero ``f_i(x_p) · (g_p · W_dec[i])`` of the prompt (``packed``: row p =
    position p) and, per feature, float64 sums over positions and the position of its
    largest value by magnitude."""

    packed: PackedRows
    attribution_sum: torch.Tensor  # (d_sae,) float64
    activation_sum: torch.Tensor  # (d_sae,) float64
    max_position: torch.Tensor  # (d_sae,) long
    max_value: torch.Tensor  # (d_sae,) float32, signed

    def top(self, n: int) -> list[AttributionFeature]:
        """The ``n`` features with the largest summed attribution by magnitude (fewer where
        fewer attribute anything), largest first; ties by index."""
        total = self.attribution_sum
        # every feature with a non-zero value at some position (a sum may cancel to 0)
        candidates = torch.nonzero(self.max_value != 0).flatten()
        if candidates.numel() == 0:
            return []
        # descending magnitude, ascending index on ties (a stable sort of the index order)
        order = torch.sort(total[candidates].abs(), descending=True, stable=True).indices
        chosen = candidates[order[:n]].tolist()
        return [
            AttributionFeature(
                index=int(i),
                attribution=float(total[i]),
                activation_sum=float(self.activation_sum[i]),
                max_position=int(self.max_position[i]),
                max_attribution=float(self.max_value[i]),
            )
            for i in chosen
        ]


def attribute(sae: SAE, read: torch.Tensor, grad: torch.Tensor) -> Attribution:
    """``read`` (T, d_in): the rows the SAE encodes (the hook point's residual, or a
    transcoder's input); ``grad`` (T, d_out): the logit's gradient with respect to the
    rows the SAE writes. Encoded and multiplied in chunks of positions, so no dense
    (T, d_sae) tensor is ever held."""
    rows, d_sae = read.shape[0], sae.d_sae
    device = sae.W_dec.device
    step = max(1, CHUNK_ELEMENTS // d_sae)
    attr_sum = torch.zeros(d_sae, dtype=torch.float64, device=device)
    act_sum = torch.zeros(d_sae, dtype=torch.float64, device=device)
    best = torch.zeros(d_sae, dtype=sae.dtype, device=device)  # |value| of the best so far
    best_value = torch.zeros(d_sae, dtype=sae.dtype, device=device)
    best_pos = torch.zeros(d_sae, dtype=torch.long, device=device)
    counts, indices, values = [], [], []
    w_dec_t = sae.W_dec.t()
    for lo in range(0, rows, step):
        hi = min(lo + step, rows)
        acts = sae.encode(read[lo:hi].to(device))  # (n, d_sae), the SAE's dtype
        products = acts * (grad[lo:hi].to(device=device, dtype=sae.dtype) @ w_dec_t)
        attr_sum += products.sum(0, dtype=torch.float64)
        act_sum += acts.sum(0, dtype=torch.float64)
        mags, where = products.abs().max(0)
        better = mags > best
        best = torch.where(better, mags, best)
        best_value = torch.where(better, products.gather(0, where[None])[0], best_value)
        best_pos = torch.where(better, where + lo, best_pos)
        nz = products != 0
        counts.append(nz.sum(1))
        rc = torch.nonzero(nz)  # row-major: rows ascending, features ascending within a row
        indices.append(rc[:, 1].to(torch.int32))
        values.append(products[nz].float())
    row_ptr = torch.zeros(rows + 1, dtype=torch.int64)
    if counts:
        row_ptr[1:] = torch.cat(counts).cpu().cumsum(0)
    packed = PackedRows(
        rows=rows,
        row_ptr=row_ptr.to(torch.int32).numpy().astype("<i4").tobytes(),
        indices=(torch.cat(indices).cpu().numpy().astype("<i4").tobytes() if indices else b""),
        values=(torch.cat(values).cpu().numpy().astype("<f4").tobytes() if values else b""),
    )
    return Attribution(packed, attr_sum.cpu(), act_sum.cpu(), best_pos.cpu(), best_value.float().cpu())


def ablation_rows(sae: SAE, read: torch.Tensor, features: list[int]) -> torch.Tensor:
    """What zeroing each of ``features`` at every position subtracts from the rows the SAE
    writes: ``read`` (B, T, d_in) holds B copies of one prompt's rows, row b ≥ 1 ablating
    ``features[b - 1]`` and row 0 nothing; returns (B, T, d_out) in the SAE's dtype."""
    batch = read.shape[0]
    idx = torch.tensor(features, dtype=torch.long, device=sae.W_dec.device)
    acts = sae.encode_selected(read.to(sae.W_dec.device), idx)  # (B, T, k)
    coef = torch.zeros_like(acts)
    for b in range(1, batch):
        coef[b, :, b - 1] = acts[b, :, b - 1]
    return coef @ sae.W_dec.index_select(0, idx)


__all__ = ["CHUNK_ELEMENTS", "Attribution", "ablation_rows", "attribute"]
