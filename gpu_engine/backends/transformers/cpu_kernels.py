"""Prepacked linear weights for CPU inference (oneDNN's blocked layout).

A plain ``nn.Linear`` on CPU calls MKL's ``sgemm`` with the weight in PyTorch's row-major
layout, and ``sgemm`` repacks that weight into its own panel format on every call.  At the
batch sizes of decoding (1–16 rows) the repack is a large share of the work: it reads and
writes the whole weight each step.  oneDNN can take the weight already in its blocked
layout (``mkldnn._reorder_linear_weight``, done once at load) and multiply straight from
it (``mkldnn._linear_pointwise``) — the same kernels PyTorch's own CPU inference paths
(inductor with ``freezing``) use.

Measured on the development machine (2 vCPUs, AVX2, SmolLM2-135M, float32):

- output projection 49,152 × 576: 15.4 → 8.6 ms at 1 row, 39.2 → 16.1 ms at 16 rows;
- a whole 16-row decode step: 245–258 → 169–171 ms (the batch gains most: the repack
  cost grows with the rows, a prepacked weight does not repack at all).

The results differ from MKL's in the last bits (≤ 2e-4 absolute on SmolLM2's logits), as
any change of kernel or blocking does.  Every forward in the engine goes through the same
packed modules (serial, batched, ``model.generate``), and the batch-versus-solo equivalence
tests (identical greedy tokens in float32) hold as before.  Only float32 is packed, the dtype these figures were measured in; bf16 and
fp16 (whose oneDNN speed depends on CPU instructions this machine lacks) and every CUDA
load keep PyTorch's own kernels.

Memory: an untied layer's original weight is released (the packed copy replaces it); an
output projection tied to the input embeddings keeps the embedding table and adds one
packed copy (113 MB for SmolLM2's 49,152 × 576, ~20% of the model).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

log = logging.getLogger("gpu_engine.transformers")


def packing_available(device: torch.device, dtype: torch.dtype) -> bool:
    return (device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


class PackedLinear(torch.nn.Module):
    """``nn.Linear`` whose weight lives in oneDNN's blocked layout (inference only)."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        with torch.no_grad():
            packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach())
        self.register_buffer("packed_weight", packed, persistent=False)
        bias = linear.bias.detach() if linear.bias is not None else None
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, packed=onednn"


def one_row_probe(linear: torch.nn.Module, reps: int = 5) -> dict[str, float]:
    """One-row products through ``linear``'s weight (the output projection: the largest
    weight, read from memory rather than cache), prepacked and in PyTorch's layout, best
    of ``reps`` each, in milliseconds: what ``MILLM_ENGINE_PACK_WEIGHTS=auto`` chooses
    by.  Which is faster depends on the CPU: MKL's one-row path read 20.8 GB/s against
    oneDNN's 17.5 on an Intel Xeon with AVX-512, and 8–12 against 16 on an AMD EPYC
    with AVX2 (docs/performance.md, "Prepacked CPU weights")."""
    import time

    weight = linear.weight.detach()
    x = torch.randn(1, weight.shape[1], dtype=weight.dtype)
    with torch.inference_mode():
        packed = torch.ops.mkldnn._reorder_linear_weight(weight)

        def best(fn: Callable[[], torch.Tensor]) -> float:
            fn()
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            return min(times) * 1e3

        default_ms = best(lambda: torch.nn.functional.linear(x, weight))
        packed_ms = best(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""))
    del packed
    return {"packed_ms": round(packed_ms, 3), "default_ms": round(default_ms, 3)}


def pack_linears(model: torch.nn.Module) -> int:
    """Replace every float32 ``nn.Linear`` of ``model`` by a ``PackedLinear``; returns how
    many.  Quantized layers (a Q8/Q4 load's ``WeightOnlyLinear``, a pre-quantized
    checkpoint's tensor-subclass weights) keep their own kernels."""
    targets = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children()
               if type(child) is torch.nn.Linear and type(child.weight) is torch.nn.Parameter
               and child.weight.dtype == torch.float32]
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child))
    log.info("packed %d linear layers into oneDNN's blocked layout", len(targets))
    return len(targets)


__all__ = ["PackedLinear", "one_row_probe", "pack_linears", "packing_available"]
