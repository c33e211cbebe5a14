"""Weight-only quantized loads (the registry's Q8 and Q4) and pre-quantized checkpoints.

What a Q8 or Q4 load does: the checkpoint is read at the engine's dtype as usual, then
every linear layer *inside the decoder blocks* (attention and MLP projections; GPT-2's
``Conv1D`` too) is replaced by a ``WeightOnlyLinear`` whose weight is held quantized:

- **Q8**: int8, one symmetric scale per output row (torchao's per-row int8 weight-only
  quantization, ``Int8WeightOnlyConfig``'s scheme), multiplied by torch's
  ``_weight_int8pack_mm`` kernel;
- **Q4**: int4 in groups of 32 input features with a scale and a zero point per group
  (torchao's tinygemm int4 scheme, ``Int4OpaqueTensor`` on the CPU, the tile-packed
  ``Int4TilePackedTo4dTensor`` on CUDA), multiplied by ``_weight_int4pack_mm_for_cpu`` /
  ``_weight_int4pack_mm``.

The embeddings, the output projection (``lm_head``, tied to the embeddings in many small
models) and the norms stay at the engine's dtype: the logits come from an unquantized
head, and the CPU's float32 head keeps its oneDNN packing (``cpu_kernels``).  A block
linear whose shape the kernel cannot take (Q4: output rows not a multiple of 16, input
features not a multiple of the group) also stays, and the load reports how many did.

Why these kernels and not torchao's own linear paths: measured on the development
machine (AVX-512, 1 thread), torchao 0.18's ``Int8WeightOnlyConfig`` multiplies by
casting the whole int8 weight to float on every call (SmolLM2-135M decoded *slower* than
float32 with it: 8.8 against 10 tok/s), and both int8 and int4 CPU kernels are fast only
for bfloat16 activations (float32 activations take a scalar path ~10x slower than
float32 matmul).  So the layer rounds its input to bfloat16, multiplies in the kernel
(float32 accumulation), and hands the result back in the model's dtype: the residual
stream, the norms, the attention and every hook stay float32.  Numerically a quantized
load is a bfloat16-activation, int8/int4-weight model; greedy tokens follow float32 for a
while and then may part (docs/engine.md gives the measured agreement).

Steering and monitoring are untouched: their hooks sit on decoder-block outputs (and on
the attention / MLP sub-blocks), which these layers feed but never replace.

A **pre-quantized checkpoint** (``quantization_config`` in its ``config.json``: a
bitsandbytes, GPTQ, AWQ, torchao … export) loads at its own precision through
transformers' own quantizer and is never quantized again, whatever the registry row
says.  ``check_prequantized`` asks transformers whether that method can load on this
device (its quantizer's ``validate_environment``) and refuses by name before anything
is read or unloaded.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ...api.errors import UnsupportedQuantization

log = logging.getLogger("gpu_engine.transformers")

# the dtype the weight-only kernels take their activations in (see the module docstring)
KERNEL_DTYPE = torch.bfloat16
# Q4's group: 32 input features per scale and zero point (GGUF's Q4 blocks are 32 too)
Q4_GROUP_SIZE = 32


@dataclass(frozen=True)
class Method:
    name: str
    bits: int
    # what multiplies, per device type
    kernels: dict[str, str]
    # packages beyond torch the quantization needs
    requires: tuple[str, ...] = ("torchao",)


METHODS: dict[str, Method] = {
    "Q8": Method(
        "Q8",
        8,
        {
            "cpu": "aten._weight_int8pack_mm (int8 weights, bf16 activations)",
            "cuda": "aten._weight_int8pack_mm (int8 weights, bf16 activations)",
        },
    ),
    "Q4": Method(
        "Q4",
        4,
        {
            "cpu": "aten._weight_int4pack_mm_for_cpu (torchao Int4OpaqueTensor)",
            "cuda": "aten._weight_int4pack_mm (torchao Int4TilePackedTo4dTensor)",
        },
    ),
}

# registry quantizations no kernel here runs, and why (refused by name at load)
REFUSED: dict[str, str] = {
    "Q2": "there is no 2-bit weight matmul kernel for x86 CPUs or CUDA in torch or torchao "
    "(torchao's 2-bit IntxWeightOnlyConfig runs fast only on ARM CPUs, and anywhere "
    "else dequantizes the weight on every call, slower than FP32)",
}


def import_torchao_quietly() -> None:
    """Import torchao (when installed) once, without the warnings it logs on a CPU-only
    torch: it tries to load its CUDA-only extensions (mxfp8, CUTLASS sm90a), which cannot
    load there and are not used here, and torch warns about an Enum it registers for
    torch.compile.  transformers imports torchao at every ``from_pretrained`` once it is
    installed (its torchao quantizer), so the runner calls this before loading."""
    if "torchao" in sys.modules or importlib.util.find_spec("torchao") is None:
        return
    names = () if torch.cuda.is_available() else ("torchao", "torch.utils._pytree")
    quiet = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in quiet]
    for lg in quiet:
        lg.setLevel(logging.ERROR)
    try:
        import torchao  # noqa: F401

        # what transformers' torchao quantizer imports too (more of the same Enum warnings)
        with contextlib.suppress(ImportError):
            importlib.import_module("torchao.prototype.safetensors.safetensors_support")
    finally:
        for lg, level in zip(quiet, levels):
            lg.setLevel(level)


def quantization_report() -> dict[str, dict[str, Any]]:
    """Per registry quantization below 16 bits: whether a load can apply it here, with the
    kernel or the reason (``backends_report``; looks for packages without importing them)."""
    report: dict[str, dict[str, Any]] = {}
    for name, method in METHODS.items():
        missing = [p for p in method.requires if importlib.util.find_spec(p) is None]
        report[name] = {"available": not missing, "missing": missing, "kernels": dict(method.kernels)}
    for name, reason in REFUSED.items():
        report[name] = {"available": False, "missing": [], "reason": reason}
    return report


def check_method(name: str, device: str) -> Method:
    """The method for the registry's ``name`` on ``device``, or UnsupportedQuantization
    saying why not (refused before anything is read or unloaded)."""
    if name in REFUSED:
        raise UnsupportedQuantization(
            f"{name} cannot load on the transformers backend: {REFUSED[name]}",
            details={"quantization": name, "supported": sorted(METHODS)},
        )
    method = METHODS.get(name)
    if method is None:
        raise UnsupportedQuantization(
            f"unknown quantization {name!r}; the transformers backend applies {', '.join(sorted(METHODS))} at load",
            details={"quantization": name, "supported": sorted(METHODS)},
        )
    missing = [p for p in method.requires if importlib.util.find_spec(p) is None]
    if missing:
        raise UnsupportedQuantization(
            f"{name} needs {', '.join(missing)}, not installed on the engine's host; install "
            "it with `scripts/setup run` (requirements/engine.txt)",
            details={"quantization": name, "missing": missing},
        )
    if _device_type(device) not in method.kernels:
        raise UnsupportedQuantization(
            f"{name} has no kernel on {device}", details={"quantization": name, "device": device}
        )
    return method


def _device_type(device: str) -> str:
    """ "cuda" or "cpu" for a load job's device (``auto`` as ``pick_device`` resolves it)."""
    if device.startswith("cuda") or (device == "auto" and torch.cuda.is_available()):
        return "cuda"
    return "cpu"


# ------------------------------------------------------------------ pre-quantized checkpoints


def checkpoint_quantization(path: str | Path) -> dict[str, Any] | None:
    """The ``quantization_config`` a checkpoint's config.json carries (or its text
    config's), or None for an unquantized checkpoint."""
    try:
        cfg = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return None  # the load itself reports an unreadable checkpoint
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}
    found = cfg.get("quantization_config") or text.get("quantization_config")
    return dict(found) if isinstance(found, dict) else None


def method_name(qconfig: dict[str, Any]) -> str:
    method = str(qconfig.get("quant_method") or "unknown")
    if method == "bitsandbytes":  # transformers names its two quantizers apart
        method += "_4bit" if qconfig.get("load_in_4bit") else "_8bit"
    return method


def check_prequantized(qconfig: dict[str, Any], device: str) -> str:
    """Refuse (UnsupportedQuantization, naming the method) a pre-quantized checkpoint whose
    method cannot load on ``device`` here: transformers decides, through the method's own
    quantizer.  Returns the method's name."""
    from transformers.quantizers.auto import AutoHfQuantizer

    method = method_name(qconfig)
    details = {"checkpoint_quantization": method, "device": device}
    if not AutoHfQuantizer.supports_quant_method(qconfig):
        # transformers would load the packed weights as if they were plain: never
        raise UnsupportedQuantization(
            f"the checkpoint is pre-quantized with {method!r}, a method transformers "
            f"{__import__('transformers').__version__} does not know",
            details=details,
        )
    target = _device_type(device)
    try:
        quantizer = AutoHfQuantizer.from_config(qconfig, pre_quantized=True)
        quantizer.validate_environment(device_map={"": target}, weights_only=True)
    except (ImportError, ValueError, RuntimeError, NotImplementedError, TypeError) as exc:
        raise UnsupportedQuantization(
            f"the checkpoint is pre-quantized with {method!r}, which cannot load on {target} here: {exc}",
            details={**details, "reason": str(exc)},
        ) from exc
    return method


# ------------------------------------------------------------------ the quantized layer


def _int4_layout(device: torch.device) -> Any:
    """torchao's int4 tensor for ``device``: tinygemm's CPU packing, or its CUDA tiles."""
    if device.type == "cuda":
        from torchao.quantization.quantize_.workflows.int4 import int4_tile_packed_to_4d_tensor

        return int4_tile_packed_to_4d_tensor.Int4TilePackedTo4dTensor
    from torchao.prototype.quantization.int4.int4_opaque_tensor import Int4OpaqueTensor

    return Int4OpaqueTensor


class WeightOnlyLinear(torch.nn.Module):
    """A linear layer with an int8 or int4 weight, run by torch's weight-only kernels on
    bfloat16 activations; input and output in the model's dtype."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, method: Method) -> None:
        super().__init__()
        self.out_features, self.in_features = (int(s) for s in weight.shape)
        self.method = method.name
        w = weight.detach()
        import_torchao_quietly()
        if method.bits == 8:
            from torchao.quantization.quant_primitives import (
                MappingType,
                choose_qparams_affine,
                quantize_affine,
            )

            block = (1, self.in_features)  # one scale per output row
            scale, zero = choose_qparams_affine(w.float(), MappingType.SYMMETRIC, block, torch.int8)
            qdata = quantize_affine(w.float(), block, scale, zero, torch.int8)
            self.register_buffer("qweight", qdata.contiguous(), persistent=False)
            self.register_buffer("scales", scale.reshape(-1).to(KERNEL_DTYPE), persistent=False)
            self.register_buffer("qweight4", None, persistent=False)
        else:
            packed = _int4_layout(w.device).from_hp(w.to(KERNEL_DTYPE).contiguous(), [1, Q4_GROUP_SIZE])
            self.register_buffer("qweight4", packed, persistent=False)
        self.register_buffer("bias", bias.detach() if bias is not None else None, persistent=False)

    @staticmethod
    def accepts(weight: torch.Tensor, method: Method) -> bool:
        """Whether the kernel takes this weight's shape (others stay unquantized)."""
        out_features, in_features = weight.shape
        if method.bits == 4:
            return out_features % 16 == 0 and in_features % Q4_GROUP_SIZE == 0
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, self.in_features).to(KERNEL_DTYPE)
        if self.qweight4 is None:
            y = torch._weight_int8pack_mm(flat, self.qweight, self.scales)
        else:
            y = torch.nn.functional.linear(flat, self.qweight4)
        y = y.to(x.dtype).reshape(*shape[:-1], self.out_features)
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, quantization={self.method}"
        )


def _linear_weight(module: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(weight as out × in, bias) of a plain linear layer, or None for anything else."""
    if type(module) is torch.nn.Linear and type(module.weight) is torch.nn.Parameter:
        return module.weight, module.bias
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # pragma: no cover - transformers is this backend's dependency
        return None
    if type(module) is Conv1D:  # GPT-2: y = x @ W + b with W in × out
        return module.weight.t(), module.bias
    return None


@dataclass
class QuantizationResult:
    method: str
    quantized: int
    kept: list[str]


def quantize_blocks(blocks: torch.nn.ModuleList, blocks_path: str, name: str) -> QuantizationResult:
    """Replace the linear layers inside ``blocks`` (the decoder blocks) by
    ``WeightOnlyLinear`` at ``name`` (Q8/Q4); the rest of the model is left as it is."""
    method = METHODS[name]
    quantized, kept = 0, []
    for index, block in enumerate(blocks):
        targets = [
            (parent, child_name, child, f"{blocks_path}.{index}.{parent_name}".rstrip("."))
            for parent_name, parent in block.named_modules()
            for child_name, child in parent.named_children()
        ]
        for parent, child_name, child, where in targets:
            found = _linear_weight(child)
            if found is None:
                continue
            weight, bias = found
            if not WeightOnlyLinear.accepts(weight, method):
                kept.append(f"{where}.{child_name}")
                continue
            setattr(parent, child_name, WeightOnlyLinear(weight, bias, method))
            quantized += 1
    log.info("quantized %d linear layers to %s (%d kept unquantized)", quantized, name, len(kept))
    return QuantizationResult(name, quantized, kept)


def weight_bytes(model: torch.nn.Module) -> dict[str, int]:
    """What the model's parameters and buffers take in memory, per dtype (each tensor
    once; a tensor subclass by its inner tensors; a oneDNN-packed weight by its
    elements, as PyTorch reports them)."""
    seen: set[Any] = set()
    by_dtype: dict[str, int] = {}

    def add(t: torch.Tensor) -> None:
        if hasattr(t, "__tensor_flatten__") and type(t) not in (torch.Tensor, torch.nn.Parameter):
            names, _ = t.__tensor_flatten__()
            for inner in names:
                add(getattr(t, inner))
            return
        try:
            key: Any = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
            size = t.untyped_storage().nbytes() if t.storage_offset() == 0 else t.numel() * t.element_size()
        except (RuntimeError, NotImplementedError):  # opaque (oneDNN) tensors have no storage
            key, size = ("opaque", id(t)), t.numel() * t.element_size()
        if key in seen:
            return
        seen.add(key)
        dtype = str(t.dtype).removeprefix("torch.")
        by_dtype[dtype] = by_dtype.get(dtype, 0) + int(size)

    for module in model.modules():
        for tensor in [*module._parameters.values(), *module._buffers.values()]:
            if tensor is not None:
                add(tensor)
    return by_dtype


__all__ = [
    "KERNEL_DTYPE",
    "METHODS",
    "Q4_GROUP_SIZE",
    "REFUSED",
    "QuantizationResult",
    "WeightOnlyLinear",
    "check_method",
    "check_prequantized",
    "checkpoint_quantization",
    "import_torchao_quietly",
    "method_name",
    "quantization_report",
    "quantize_blocks",
    "weight_bytes",
]
