"""Speculative decoding on the serial path (SPECULATIVE_MODEL, SPECULATIVE_NUM_TOKENS).

A draft proposes ``k`` tokens greedily; the main model — steered and monitored exactly as
in plain decoding — verifies them in one forward over ``[last token, d1 … dk]``. Token by
token, the request's own ``Sampler`` chooses from the main model's logits (so logit bias
and penalties apply as they would); drafts are taken while they equal that choice, and the
first choice that differs (or the one after the last draft) is the step's extra token. The
main model's KV cache is cut back to the accepted positions and every monitor forgets the
rows of rejected drafts, so the tokens, the monitoring records and the steering are those
of plain greedy decoding; only the number of forward passes changes.

The draft runs unsteered and unmonitored (the hooks see no context while it runs):

- ``self:layers=N`` drafts with the main model's own first N blocks, its final norm and
  head (no second model; the blocks and their weights are shared, the draft keeps a KV
  cache of its own);
- anything else is a checkpoint directory of a smaller model with the same vocabulary.

It applies to greedy requests (temperature 0 or top_k 1) without a grammar, a capture or
conditional steering; every other request decodes plainly, and says so in
``FinishEvent.speculative``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ...api.errors import InvalidParameter, ModelLoadFailed
from ...api.protocol import SpeculativeStats

SELF_PREFIX = "self:layers="


@dataclass
class SpecConfig:
    model: str  # "self:layers=N" or a checkpoint directory
    num_tokens: int


def spec_config(options: dict[str, Any]) -> SpecConfig | None:
    model = str(options.get("speculative_model") or "")
    if not model:
        return None
    k = int(options.get("speculative_num_tokens") or 5)
    if not 1 <= k <= 64:
        raise InvalidParameter("speculative_num_tokens must be 1..64", param="options.speculative_num_tokens")
    return SpecConfig(model, k)


def _truncated(model: Any, blocks_path: str, layers: int) -> Any:
    """A view of ``model`` that runs only its first ``layers`` blocks: the modules on the
    path to the block list are shallow copies with their own ``_modules`` (so the main
    model is untouched), every weight is the main model's own."""
    names = blocks_path.split(".")
    root = copy.copy(model)
    root._modules = dict(model._modules)
    parent, original = root, model
    for name in names[:-1]:
        child = copy.copy(original._modules[name])
        child._modules = dict(original._modules[name]._modules)
        parent._modules[name] = child
        parent, original = child, original._modules[name]
    blocks = original._modules[names[-1]]
    parent._modules[names[-1]] = torch.nn.ModuleList(list(blocks)[:layers])
    config = copy.deepcopy(model.config)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    text.num_hidden_layers = layers
    if getattr(text, "layer_types", None):
        text.layer_types = list(text.layer_types)[:layers]
    # every shallow copy that carries a config reads the truncated one
    for module in (root, *_path_modules(root, names[:-1])):
        if hasattr(module, "config"):
            module.config = config if module is root else text
    return root


def _path_modules(root: Any, names: list[str]) -> list[Any]:
    out, node = [], root
    for name in names:
        node = node._modules[name]
        out.append(node)
    return out


class Drafter:
    """Proposes draft tokens for one request at a time (the serial path runs one)."""

    def __init__(self, runner: Any, config: SpecConfig) -> None:
        self.runner = runner
        self.num_tokens = config.num_tokens
        self.source = config.model
        if config.model.startswith(SELF_PREFIX):
            try:
                layers = int(config.model[len(SELF_PREFIX) :])
            except ValueError:
                layers = 0
            if not 1 <= layers <= runner.num_layers:
                raise InvalidParameter(
                    f"SPECULATIVE_MODEL {config.model!r}: layers must be 1..{runner.num_layers} for this model",
                    param="options.speculative_model",
                )
            self.layers = layers
            self.model = _truncated(runner.model, runner.blocks_path, layers)
        else:
            self.layers = None
            self.model = self._load_draft(Path(config.model))
        self.cache: Any = None
        self.fed = 0  # tokens of the request whose keys/values the draft cache holds
        self.drafted = 0
        self.accepted = 0

    def _load_draft(self, path: Path) -> Any:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        try:
            model = AutoModelForCausalLM.from_pretrained(
                str(path), dtype=self.runner.dtype, local_files_only=True, use_safetensors=True
            )
            tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except (OSError, ValueError, KeyError) as exc:
            raise ModelLoadFailed(
                f"Cannot load the draft model from {path}: {exc}", details={"speculative_model": str(path)}
            ) from exc
        if tok.get_vocab() != self.runner.tokenizer.get_vocab():
            raise InvalidParameter(
                f"the draft model at {path} has another vocabulary than the loaded model: "
                "a draft must share its tokenizer",
                param="options.speculative_model",
            )
        return model.to(self.runner.device).eval()

    # ------------------------------------------------------------------ per request

    def start(self) -> None:
        from transformers import DynamicCache

        self.cache = DynamicCache()
        self.fed = 0

    def propose(self, context: list[int], k: int) -> list[int]:
        """``k`` greedy draft tokens after ``context`` (the prompt and what was accepted)."""
        device = self.runner.device
        pending = context[self.fed :]
        drafts: list[int] = []
        with self.runner.hooks.suppressed():
            for _ in range(k):
                ids = torch.tensor([pending], dtype=torch.long, device=device)
                pos = torch.arange(self.fed, self.fed + len(pending), device=device)
                out = self.model(
                    input_ids=ids, past_key_values=self.cache, cache_position=pos, use_cache=True, logits_to_keep=1
                )
                self.cache = out.past_key_values
                self.fed += len(pending)
                token = int(torch.argmax(out.logits[0, -1]))
                drafts.append(token)
                pending = [token]
        return drafts

    def settle(self, context_len: int) -> None:
        """After verification: the first ``context_len`` tokens are the request's; the draft
        cache keeps what it holds of them."""
        keep = min(self.fed, context_len)
        if keep < self.fed:
            cut_cache(self.cache, keep)
            self.fed = keep

    def stats(self) -> SpeculativeStats:
        return SpeculativeStats(
            used=True, source=self.source, num_tokens=self.num_tokens, drafted=self.drafted, accepted=self.accepted
        )


def cut_cache(cache: Any, keep: int) -> None:
    """Cut a ``DynamicCache`` back to its first ``keep`` positions (transformers' ``crop``
    with the count to remove, its current form)."""
    extra = cache.get_seq_length() - keep
    if extra > 0:
        cache.crop(-extra)


def spec_eligible(seq: Any) -> str | None:
    """None when ``seq`` can decode speculatively, else why not."""
    if not seq.sampler.greedy:
        return "sampling"
    if seq.grammar is not None:
        return "response_format"
    if seq.capture is not None:
        return "capture"
    if seq.gated:
        return "conditional_steering"
    return None


__all__ = ["Drafter", "SpecConfig", "cut_cache", "spec_config", "spec_eligible"]
