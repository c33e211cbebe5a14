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

Linears of one input — an attention's q/k/v, an MLP's gate/up — are packed as one weight
(``PackedGroup``): one product instead of three or two, each costing a call's fixed work
at one row; their modules become ``PackedSlice``s of it.

Memory: an untied layer's original weight is released (the packed copy replaces it); an
output projection tied to the input embeddings keeps the embedding table and adds one
packed copy (113 MB for SmolLM2's 49,152 × 576, ~20% of the model).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

log = logging.getLogger("gpu_engine.transformers")


def packing_available(device: torch.device, dtype: torch.dtype) -> bool:
    return (
        device.type == "cpu"
        and dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


class _PackedProduct(torch.autograd.Function):
    """oneDNN's prepacked product with a gradient for its input (none for the weight):
    ``_linear_pointwise`` has no autograd kernel, and an attribution's backward
    (``Engine.attribution``) runs through every linear after its hook point. The dense
    weight is read back from the packed one (``to_dense``) for the backward only."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(packed)
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (packed,) = ctx.saved_tensors
        return grad @ packed.to_dense(), None, None


class PackedLinear(torch.nn.Module):
    """``nn.Linear`` whose weight lives in oneDNN's blocked layout (inference; an input
    that requires a gradient takes ``_PackedProduct``)."""

    def __init__(
        self,
        linear: torch.nn.Linear | None = None,
        *,
        weight: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        if linear is not None:
            weight = linear.weight.detach()
            bias = linear.bias.detach() if linear.bias is not None else None
        assert weight is not None
        self.out_features, self.in_features = weight.shape
        with torch.no_grad():
            packed = torch.ops.mkldnn._reorder_linear_weight(weight)
        self.register_buffer("packed_weight", packed, persistent=False)
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.requires_grad and torch.is_grad_enabled():
            return _PackedProduct.apply(x, self.packed_weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, packed=onednn"


# linears of one module that read the same input, packed as one weight each (``PackedGroup``)
GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class PackedGroup(PackedLinear):
    """Several linears of the same input (an attention's q/k/v, an MLP's gate/up) packed
    as one weight, their rows concatenated in order: one product instead of several, which
    is what one-row decoding pays per call (docs/performance.md).  The members become
    ``PackedSlice`` modules.  ``model.forward`` calls them one after another on the same
    input tensor, so ``rows`` computes the product at the first call and hands the same
    result to the others: it is kept until every member has read it (held by reference,
    so the input it was computed from cannot be another tensor at the same address).  The
    lean decode step calls ``forward`` itself, once a step."""

    def __init__(self, linears: list[torch.nn.Linear]) -> None:
        weight = torch.cat([m.weight.detach() for m in linears])
        bias = torch.cat([m.bias.detach() for m in linears]) if linears[0].bias is not None else None
        super().__init__(weight=weight, bias=bias)
        self.sizes = [m.out_features for m in linears]
        self._x: torch.Tensor | None = None
        self._out: torch.Tensor | None = None
        self._left = 0

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        if self._x is not x:
            self._out, self._x, self._left = self.forward(x), x, len(self.sizes)
        out = self._out
        self._left -= 1
        if self._left <= 0:  # every member has it: nothing stays referenced
            self._x = self._out = None
        return out  # type: ignore[return-value]

    def extra_repr(self) -> str:
        return super().extra_repr() + f", members={self.sizes}"


class PackedSlice(torch.nn.Module):
    """One member of a ``PackedGroup``: its rows ``start:end`` of the group's product (a
    view), what the ``nn.Linear`` it replaces computed."""

    def __init__(self, group: PackedGroup, start: int, end: int) -> None:
        super().__init__()
        self.in_features, self.out_features = group.in_features, end - start
        self.start, self.end = start, end
        object.__setattr__(self, "group", group)  # not a child: its module owns it, once

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.rows(x)[..., self.start : self.end]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, rows={self.start}:{self.end} of a packed group"


PROBE_BYTES = 256 << 20


def one_row_probe(model: torch.nn.Module, *, budget: int = PROBE_BYTES, rounds: int = 7) -> dict[str, float]:
    """One-row products through ``model``'s float32 linear weights, prepacked and in
    PyTorch's layout, in milliseconds (the median of ``rounds`` passes each, the two
    interleaved so that drift hits both): what ``MILLM_ENGINE_PACK_WEIGHTS=auto`` chooses
    by.  The weights taken are the output projection and then the decoder's linears in
    order, up to ``budget`` bytes (packed copies of them exist only during the probe):
    more than any cache holds, so the products read memory as decoding does.  Which is
    faster depends on the CPU: MKL's one-row path read 20.8 GB/s against oneDNN's 17.5 on
    an Intel Xeon with AVX-512, and 8–12 against 16 on an AMD EPYC with AVX2
    (docs/performance.md, "Prepacked CPU weights")."""
    import statistics
    import time

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    linears = [head] if isinstance(head, torch.nn.Linear) else []
    linears += [m for m in model.modules() if type(m) is torch.nn.Linear and m is not head]
    weights: list[torch.Tensor] = []
    total = 0
    for m in linears:
        if m.weight.dtype != torch.float32 or type(m.weight) is not torch.nn.Parameter or total >= budget:
            continue
        weights.append(m.weight.detach())
        total += m.weight.numel() * 4
    with torch.inference_mode():
        packed = [torch.ops.mkldnn._reorder_linear_weight(w) for w in weights]
        xs = [torch.randn(1, w.shape[1]) for w in weights]

        def plain_pass() -> None:
            for x, w in zip(xs, weights):
                torch.nn.functional.linear(x, w)

        def packed_pass() -> None:
            for x, w in zip(xs, packed):
                torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")

        times: dict[str, list[float]] = {"default_ms": [], "packed_ms": []}
        plain_pass()
        packed_pass()
        for _ in range(rounds):
            for key, fn in (("default_ms", plain_pass), ("packed_ms", packed_pass)):
                t0 = time.perf_counter()
                fn()
                times[key].append((time.perf_counter() - t0) * 1e3)
    return {key: round(statistics.median(v), 3) for key, v in times.items()} | {"bytes": total}


def _packable(m: Any) -> bool:
    return type(m) is torch.nn.Linear and type(m.weight) is torch.nn.Parameter and m.weight.dtype == torch.float32


def pack_linears(model: torch.nn.Module) -> int:
    """Replace every float32 ``nn.Linear`` of ``model`` by a prepacked one; returns how
    many.  An attention's q/k/v and an MLP's gate/up (``GROUPS``: plain linears of one
    input size, all with a bias or none) are packed as one weight each (``PackedGroup``);
    the others one by one (``PackedLinear``).  Quantized layers (a Q8/Q4 load's
    ``WeightOnlyLinear``, a pre-quantized checkpoint's tensor-subclass weights) keep their
    own kernels."""
    n = 0
    for parent in list(model.modules()):
        for names in GROUPS:
            members = [getattr(parent, name, None) for name in names]
            if (
                not all(_packable(m) for m in members)
                or len({(m.in_features, m.bias is None, m.weight.device) for m in members}) != 1
            ):  # type: ignore[union-attr]
                continue
            group = PackedGroup(members)  # type: ignore[arg-type]
            parent.add_module("packed_" + "_".join(name.split("_")[0] for name in names), group)
            start = 0
            for name, size in zip(names, group.sizes):
                setattr(parent, name, PackedSlice(group, start, start + size))
                start += size
            n += len(names)
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if _packable(child)
    ]
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child))
    n += len(targets)
    log.info("packed %d linear layers into oneDNN's blocked layout", n)
    return n


__all__ = ["GROUPS", "PackedGroup", "PackedLinear", "PackedSlice", "one_row_probe", "pack_linears", "packing_available"]
