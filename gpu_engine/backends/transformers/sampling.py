"""Per-request token selection on device, without host syncs.

Penalties follow vLLM: repetition over prompt + generated tokens (HF's divide/multiply
rule), presence/frequency over generated tokens only (OpenAI's subtraction rule).
"""

from __future__ import annotations

import os

import torch

from ...protocol import SamplingParams


class Sampler:
    def __init__(self, params: SamplingParams, *, vocab_size: int, device: torch.device, prompt_ids: torch.Tensor) -> None:
        self.p = params
        self.greedy = params.temperature == 0.0 or params.top_k == 1
        self.rep = params.repetition_penalty != 1.0
        self.pres_freq = params.presence_penalty != 0.0 or params.frequency_penalty != 0.0
        # argmax of the raw logits: rows like this are sampled together in a batch
        self.plain_greedy = self.greedy and not self.rep and not self.pres_freq
        self.seen: torch.Tensor | None = None
        self.counts: torch.Tensor | None = None
        if self.rep:
            self.seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            self.seen[prompt_ids.reshape(-1)] = True
        if self.pres_freq:
            self.counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)
        self.generator: torch.Generator | None = None
        if not self.greedy:
            # a private generator: the request's seed alone decides its samples
            seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(seed % (2**63))
        self._one = torch.ones(1, dtype=torch.float32, device=device)

    def observe(self, token: torch.Tensor) -> None:
        """Record a generated token (1-element long tensor) for the penalties."""
        if self.seen is not None:
            self.seen[token] = True
        if self.counts is not None:
            self.counts.index_add_(0, token, self._one)

    def process(self, logits: torch.Tensor) -> torch.Tensor:
        """Penalised logits (V,) in float32."""
        logits = logits.float()
        if self.seen is not None:
            r = self.p.repetition_penalty
            logits = torch.where(self.seen, torch.where(logits > 0, logits / r, logits * r), logits)
        if self.counts is not None:
            logits = logits - self.p.frequency_penalty * self.counts - self.p.presence_penalty * (self.counts > 0).float()
        return logits

    def sample(self, logits: torch.Tensor) -> torch.Tensor:
        """One token id as a 1-element long tensor (still on device)."""
        logits = self.process(logits)
        if self.greedy:
            return torch.argmax(logits, dim=-1, keepdim=True)
        logits = logits / self.p.temperature
        k = self.p.top_k
        if k > 0 and k < logits.shape[-1]:
            kth = torch.topk(logits, k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if self.p.top_p < 1.0:
            sorted_logits, order = torch.sort(logits, descending=True)
            probs = torch.softmax(sorted_logits, dim=-1)
            # keep the smallest prefix whose mass reaches top_p (always the first token)
            drop = (torch.cumsum(probs, dim=-1) - probs) >= self.p.top_p
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
            logits = torch.full_like(logits, float("-inf")).scatter(0, order, sorted_logits)
        probs = torch.softmax(logits, dim=-1)
        return torch.multinomial(probs, 1, generator=self.generator)


def sample_rows(samplers: list[Sampler], logits: torch.Tensor) -> torch.Tensor:
    """One token per row of ``logits`` (rows, V), each with its own request's sampler.

    Plain greedy rows share one argmax; the others go through their own ``Sampler`` (own
    generator, penalties, top-k/top-p), so a seeded request draws the same numbers in a
    batch as alone.  Returns a (rows,) long tensor, still on device.
    """
    n = len(samplers)
    plain = [i for i, s in enumerate(samplers) if s.plain_greedy]
    if len(plain) == n:
        return torch.argmax(logits.float(), dim=-1)
    out = torch.empty(n, dtype=torch.long, device=logits.device)
    if plain:
        idx = torch.tensor(plain, dtype=torch.long, device=logits.device)
        out[idx] = torch.argmax(logits.index_select(0, idx).float(), dim=-1)
    for i, s in enumerate(samplers):
        if not s.plain_greedy:
            out[i : i + 1] = s.sample(logits[i])
    return out


__all__ = ["Sampler", "sample_rows"]
