"""A feature's direct logit effect: its decoder row through the model's unembedding.

``feature_logit_effects`` computes ``W_dec[i] @ W_U.T`` for chunks of features at a time
(a chunk times the vocabulary stays under ``CHUNK_ELEMENTS`` floats, so every feature of
a 65k SAE over a 128k vocabulary never holds more than one chunk's logits) and keeps
the ``top_n`` highest and lowest of each row.  ``unembedding_from_safetensors`` reads
``W_U`` from a transformers checkpoint's files (the vLLM backend's model lives in worker
processes).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..api.errors import UnsupportedArchitecture

# logits of at most this many (feature, token) pairs at once: 32 Mi floats = 128 MiB
CHUNK_ELEMENTS = 1 << 25

# the unembedding's tensor names, most specific first: an untied head, then the input
# embedding a tied head shares (Llama/Mistral/Qwen/Gemma, GPT-2, GPT-NeoX, BLOOM, OPT)
_HEAD_NAMES = ("lm_head.weight", "embed_out.weight")
_TIED_NAMES = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight", "embed_in.weight")


def feature_logit_effects(
    w_dec: torch.Tensor, w_u: torch.Tensor, features: torch.Tensor, top_n: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(top_values, top_ids, bottom_values, bottom_ids)``, each [len(features), n] with
    n = min(top_n, vocab): the highest logit effects in descending order and the lowest
    in ascending order, in float32 on ``w_u``'s device."""
    vocab = int(w_u.shape[0])
    n = min(int(top_n), vocab)
    w_u = w_u.float()
    features = features.to(device=w_dec.device, dtype=torch.long)
    chunk = max(1, CHUNK_ELEMENTS // max(vocab, 1))
    tops_v, tops_i, bots_v, bots_i = [], [], [], []
    for off in range(0, int(features.shape[0]), chunk):
        rows = w_dec.index_select(0, features[off : off + chunk]).to(device=w_u.device, dtype=torch.float32)
        logits = rows @ w_u.T
        top = torch.topk(logits, n, dim=-1, largest=True, sorted=True)
        bottom = torch.topk(logits, n, dim=-1, largest=False, sorted=True)
        tops_v.append(top.values)
        tops_i.append(top.indices)
        bots_v.append(bottom.values)
        bots_i.append(bottom.indices)
        del logits
    if not tops_v:
        empty_v = torch.zeros((0, n), dtype=torch.float32)
        empty_i = torch.zeros((0, n), dtype=torch.long)
        return empty_v, empty_i, empty_v, empty_i
    return torch.cat(tops_v), torch.cat(tops_i), torch.cat(bots_v), torch.cat(bots_i)


def _weight_files(root: Path) -> list[Path]:
    index = root / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [root / n for n in names]
    return sorted(root.glob("*.safetensors"))


def unembedding_name(names: list[str]) -> str | None:
    """The tensor of ``names`` that is the unembedding: the output head, else the tied
    input embedding (None: neither is there)."""
    for wanted in (_HEAD_NAMES, _TIED_NAMES):
        for suffix in wanted:
            found = [n for n in names if n == suffix or n.endswith("." + suffix)]
            if found:
                return min(found, key=len)
    return None


def unembedding_from_safetensors(path: str | Path) -> torch.Tensor:
    """``W_U`` [vocab, d_model] float32 on the host, from a checkpoint directory's
    safetensors files: ``lm_head.weight`` (or its architecture's name), else the tied
    input embedding."""
    from safetensors import safe_open

    root = Path(path)
    files = _weight_files(root)
    names: dict[str, Path] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():  # noqa: SIM118 - safe_open is not a mapping
                names.setdefault(k, f)
    name = unembedding_name(list(names))
    if name is None:
        raise UnsupportedArchitecture(
            f"the checkpoint at {root} holds no unembedding (no lm_head or tied embedding tensor)",
            details={"path": str(root)},
        )
    with safe_open(str(names[name]), framework="pt") as h:
        return h.get_tensor(name).float()


__all__ = ["CHUNK_ELEMENTS", "feature_logit_effects", "unembedding_from_safetensors", "unembedding_name"]
