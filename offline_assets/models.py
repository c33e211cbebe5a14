"""Random-initialised tiny checkpoints of the three architecture families the engine hooks.

Llama (tuple-free decoder blocks under ``model.layers``), Gemma2 (sliding-window
attention, soft-capping, scaled embeddings, zero-centred RMSNorm) and GPT-2 (fused
``c_attn``, learned positions, blocks under ``transformer.h``) cover the structural
variants that hook placement and the vLLM/llama.cpp backends must handle.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from offline_assets.tokenizer import BOS_TOKEN, EOS_TOKEN, IM_END, PAD_TOKEN, build_tokenizer

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerFast

HIDDEN_SIZE = 64
HEAD_DIM = 32
NUM_HEADS = HIDDEN_SIZE // HEAD_DIM
NUM_LAYERS = 4
INTERMEDIATE_SIZE = 128
MAX_POSITIONS = 512
INIT_STD = 0.02
TIED_EMBED_STD_BY_ARCH: dict[str, float] = {"gemma2": 0.25 / math.sqrt(HIDDEN_SIZE), "gpt2": 0.25}


@dataclass(frozen=True)
class ArchSpec:
    """What the rest of the package needs to know about one tiny architecture."""

    arch: str
    architecture_class: str
    layers_path: str


ARCHS: dict[str, ArchSpec] = {
    "llama": ArchSpec("llama", "LlamaForCausalLM", "model.layers"),
    "gemma2": ArchSpec("gemma2", "Gemma2ForCausalLM", "model.layers"),
    "gpt2": ArchSpec("gpt2", "GPT2LMHeadModel", "transformer.h"),
}


def _make_config(arch: str, tok: PreTrainedTokenizerFast) -> PretrainedConfig:
    """A config sized for speed, with head_dim 32 because vLLM's CPU attention needs >= 32."""
    from transformers import Gemma2Config, GPT2Config, LlamaConfig

    ids: dict[str, Any] = {
        "vocab_size": len(tok),
        "bos_token_id": tok.convert_tokens_to_ids(BOS_TOKEN),
        "eos_token_id": tok.convert_tokens_to_ids(EOS_TOKEN),
        "pad_token_id": tok.convert_tokens_to_ids(PAD_TOKEN),
    }
    if arch == "llama":
        return LlamaConfig(
            hidden_size=HIDDEN_SIZE,
            intermediate_size=INTERMEDIATE_SIZE,
            num_hidden_layers=NUM_LAYERS,
            num_attention_heads=NUM_HEADS,
            num_key_value_heads=1,
            head_dim=HEAD_DIM,
            max_position_embeddings=MAX_POSITIONS,
            initializer_range=INIT_STD,
            tie_word_embeddings=False,
            **ids,
        )
    if arch == "gemma2":
        return Gemma2Config(
            hidden_size=HIDDEN_SIZE,
            intermediate_size=INTERMEDIATE_SIZE,
            num_hidden_layers=NUM_LAYERS,
            num_attention_heads=NUM_HEADS,
            num_key_value_heads=1,
            head_dim=HEAD_DIM,
            max_position_embeddings=MAX_POSITIONS,
            query_pre_attn_scalar=HEAD_DIM,
            # Shorter than max positions so long-prompt tests exercise the sliding layers.
            sliding_window=128,
            initializer_range=INIT_STD,
            **ids,
        )
    if arch == "gpt2":
        return GPT2Config(
            n_embd=HIDDEN_SIZE,
            n_head=NUM_HEADS,
            n_layer=NUM_LAYERS,
            n_inner=INTERMEDIATE_SIZE,
            n_positions=MAX_POSITIONS,
            initializer_range=INIT_STD,
            **ids,
        )
    raise ValueError(f"unknown tiny architecture {arch!r}; expected one of {sorted(ARCHS)}")


def _init_std(arch: str, name: str, shape: torch.Size) -> float:
    """Per-tensor init scale: matrices at 1/sqrt(fan_in), embeddings per architecture.

    With 1/sqrt(fan_in) every block adds a contribution of the same order as the token
    embedding, so the residual stream changes from layer to layer and SAEs at different
    layers see different inputs. Llama's untied embeddings sit at unit scale; the tied
    ones (Gemma2, GPT-2) are drawn at 0.25 so the output projection does not just echo
    the current token, which made greedy text one token repeated. Gemma2 multiplies
    embeddings by sqrt(hidden), so its table is drawn that much smaller again.
    """
    if name.endswith(("embed_tokens.weight", "wte.weight", "wpe.weight")):
        return TIED_EMBED_STD_BY_ARCH.get(arch, 1.0)
    # GPT-2's Conv1D stores weights as (in, out); nn.Linear as (out, in).
    fan_in = shape[0] if arch == "gpt2" else shape[1]
    return 1.0 / math.sqrt(fan_in)


def _seeded_init(model: PreTrainedModel, arch: str, seed: int) -> None:
    """Overwrite every matrix from a private generator, in name order.

    The model constructor draws from torch's global RNG; refilling here makes the bytes a
    function of the seed alone. Vectors (norm scales, biases) keep their constant
    constructor values.
    """
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters(), key=lambda item: item[0]):
            if param.dim() < 2:
                continue
            std = _init_std(arch, name, param.shape)
            param.copy_(torch.randn(param.shape, generator=gen, dtype=torch.float32) * std)


def build_tiny_model(arch: str, out_dir: Path, *, seed: int = 0) -> Path:
    """Build and save a float32 random tiny model of ``arch`` with its tokenizer.

    The constructor runs inside ``torch.random.fork_rng`` so building never perturbs the
    caller's global RNG state.
    """
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    if arch not in ARCHS:
        raise ValueError(f"unknown tiny architecture {arch!r}; expected one of {sorted(ARCHS)}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(out_dir, seed=seed)
    config = _make_config(arch, tok)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _seeded_init(model, arch, seed)
    model.eval()
    eos_ids = [tok.convert_tokens_to_ids(EOS_TOKEN), tok.convert_tokens_to_ids(IM_END)]
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=eos_ids,
        pad_token_id=config.pad_token_id,
        do_sample=False,
    )
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir
