"""The serial path's one-token decode step for Llama-family models, without the
transformers forward around it.

A batch-1 decode step of SmolLM2-135M (30 blocks) spends ~27 ms in its 211 matrix-vector
products and, through ``model.forward``, another ~20 ms in everything else: per-module
``__call__`` dispatch, the cache object's bookkeeping, mask and position set-up, and the
~400 small ops between the products (measured 2026-12-03, Intel Xeon, 2 vCPUs:
docs/performance.md, "Serial decode step").  This module computes the same step
directly from the model's own modules and weights:

- every projection is the module's own ``forward`` (plain, prepacked or quantized
  weights alike), so nothing is copied and the prefill, the batch and this step share
  one set of weights — except that plain q/k/v and gate/up weights are concatenated once
  into one product each, the modules' weights becoming views of their rows (``_fuse``);
- keys and values live in preallocated per-layer buffers, filled from the prefill's
  ``DynamicCache`` and written in place, so nothing grows or is concatenated per step;
- rotary embeddings come from tables computed once per request exactly as the model's
  rotary module computes them (``position * inv_freq``, cos/sin, ``attention_scaling``),
  and ``rotate_half`` swaps the halves with the sign folded into the sine table;
- attention is two batched products over the cached positions (one query: no mask).

Steering, monitoring and hidden-state capture are the forward hooks the engine installed
on the decoder blocks (and, for ``attn_out`` / ``mlp_out`` / transcoder attachments, on
``self_attn`` / ``mlp``): this step runs those modules' forward hooks with the arguments
and outputs ``nn.Module.__call__`` would pass, in order, and hands an armed Q/K capture
tap (``qk_tap``) the rotated query and the cached keys the attention function would get.
A request runs the step only when every hook in the model is one it runs (``usable``): a
pre-hook, a hook with kwargs or a hook on any other module makes that request take
``model.forward`` as before.  Numerically the step differs from ``model.forward`` in the
last bits only (attention as two products instead of the SDPA kernel);
``tests/engine/test_lean_decode.py`` holds it to the transformers forward.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.modules import module as _nn_module

from .qk_tap import TAP_ATTR

# architectures whose decoder block is exactly LlamaDecoderLayer's computation
SUPPORTED = ("LlamaForCausalLM",)
# rotary types whose inverse frequencies do not change with the sequence length
_STATIC_ROPE = ("default", "linear", "llama3", "yarn")


def why_not(model: Any) -> str | None:
    """Why ``model`` cannot decode through this step, or None when it can."""
    name = type(model).__name__
    if name not in SUPPORTED:
        return f"{name} is not a Llama-family model this step implements"
    cfg = model.config
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"activation {cfg.hidden_act}"
    if int(getattr(cfg, "pretraining_tp", 1) or 1) > 1:
        return "pretraining_tp > 1"
    rotary = getattr(model.model, "rotary_emb", None)
    if rotary is None or getattr(rotary, "rope_type", None) not in _STATIC_ROPE:
        return f"rotary type {getattr(rotary, 'rope_type', None)}"
    layers = model.model.layers
    if len(layers) != cfg.num_hidden_layers:
        return "layer count differs from the config"
    for block in layers:
        attn, mlp = getattr(block, "self_attn", None), getattr(block, "mlp", None)
        if attn is None or mlp is None or not all(
                hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj", "scaling")) or not all(
                hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
            return "a decoder block of another shape"
        if not all(hasattr(n, "variance_epsilon") and hasattr(n, "weight")
                   for n in (block.input_layernorm, block.post_attention_layernorm)):
            return "a norm other than LlamaRMSNorm"
    if not hasattr(model.model.norm, "variance_epsilon"):
        return "a final norm other than LlamaRMSNorm"
    return None


def _fuse(*linears: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None, int] | None:
    """One weight for ``linears`` (plain ``nn.Linear`` of one input, dtype and device:
    q/k/v, gate/up) so that a step makes one product instead of several: the rows are
    concatenated once and each module's weight (and bias) becomes a view of its rows, so
    nothing is held twice and the modules compute what they did.  None where they are not
    plain linears (prepacked, quantized) or differ; returns (weight, bias, first size)."""
    if not all(type(m) is torch.nn.Linear and type(m.weight) is torch.nn.Parameter for m in linears):
        return None
    ref = linears[0].weight
    if any(m.weight.shape[1] != ref.shape[1] or m.weight.dtype != ref.dtype or m.weight.device != ref.device
           or (m.bias is None) != (linears[0].bias is None) for m in linears):
        return None
    with torch.no_grad():
        weight = torch.cat([m.weight.detach() for m in linears])
        bias = torch.cat([m.bias.detach() for m in linears]) if linears[0].bias is not None else None
        row = 0
        for m in linears:
            n = m.weight.shape[0]
            m.weight = torch.nn.Parameter(weight[row:row + n], requires_grad=False)
            if bias is not None:
                m.bias = torch.nn.Parameter(bias[row:row + n], requires_grad=False)
            row += n
    return weight, bias, linears[0].weight.shape[0]


def _rms(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``LlamaRMSNorm.forward``'s arithmetic, without its dtype round trips in float32."""
    if x.dtype != torch.float32:
        return norm.forward(x)
    return norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon))


def _run_hooks(module: torch.nn.Module, args: tuple, output: Any) -> Any:
    """``module``'s forward hooks on ``(args, output)``, as ``nn.Module.__call__`` runs them."""
    for hook in module._forward_hooks.values():
        result = hook(module, args, output)
        if result is not None:
            output = result
    return output


class LeanDecode:
    """The one-token decode step of one loaded Llama-family model (``why_not`` is None)."""

    def __init__(self, model: Any) -> None:
        cfg = model.config
        self.layers = list(model.model.layers)
        attn = self.layers[0].self_attn
        self.heads = int(cfg.num_attention_heads)
        self.kv_heads = int(getattr(cfg, "num_key_value_heads", None) or self.heads)
        self.head_dim = int(attn.head_dim)
        self.group = self.heads // self.kv_heads
        self.scaling = float(attn.scaling)
        self.embed = model.model.embed_tokens
        self.norm = model.model.norm
        self.head = model.lm_head
        self.rotary = model.model.rotary_emb
        # the modules whose forward hooks this step runs; a hook anywhere else (or of a kind
        # it does not run) sends the request through model.forward
        self._hooked = {id(m) for b in self.layers for m in (b, b.self_attn, b.mlp)} | {id(self.embed)}
        self._all = list(model.modules())
        # q/k/v and gate/up as one product each where the weights are plain (views: no copy)
        self.fused = [(_fuse(b.self_attn.q_proj, b.self_attn.k_proj, b.self_attn.v_proj),
                       _fuse(b.mlp.gate_proj, b.mlp.up_proj)) for b in self.layers]
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.cos = self.sin = None

    # ------------------------------------------------------------------ eligibility

    def usable(self) -> bool:
        """Whether every hook now in the model is one this step runs (checked once per
        request: attachments and captures change only between requests)."""
        if (_nn_module._global_forward_hooks or _nn_module._global_forward_pre_hooks
                or getattr(_nn_module, "_global_forward_hooks_always_called", None)):
            return False
        for m in self._all:
            if m._forward_pre_hooks or m._forward_hooks_with_kwargs:
                return False
            if m._forward_hooks and id(m) not in self._hooked:
                return False
        return True

    # ------------------------------------------------------------------ per request

    def start(self, past: Any, n_prompt: int, needed: int) -> None:
        """Take the prefill's cache (``DynamicCache`` of ``n_prompt`` positions) into
        buffers of ``needed`` positions, and this request's rotary tables."""
        ref = past.layers[0].keys
        shape = (self.kv_heads, needed, self.head_dim)
        # new buffers each request (``release`` drops them when it ends)
        self.k = [torch.empty(shape, dtype=ref.dtype, device=ref.device) for _ in self.layers]
        self.v = [torch.empty(shape, dtype=ref.dtype, device=ref.device) for _ in self.layers]
        for i, layer in enumerate(past.layers):
            self.k[i][:, :n_prompt].copy_(layer.keys[0, :, -n_prompt:])
            self.v[i][:, :n_prompt].copy_(layer.values[0, :, -n_prompt:])
        # exactly LlamaRotaryEmbedding.forward's arithmetic, for positions 0 .. needed-1
        inv = self.rotary.inv_freq
        freqs = torch.arange(needed, device=inv.device)[:, None].float() * inv.float()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        scale = self.rotary.attention_scaling
        cos = (emb.cos() * scale).to(ref.dtype)
        sin = (emb.sin() * scale).to(ref.dtype)
        # rotate_half(x) * sin == swap_halves(x) * sin_signed: the first half's sign goes into sin
        half = self.head_dim // 2
        sin[:, :half] = -sin[:, :half]
        self.cos, self.sin = cos, sin

    def release(self) -> None:
        """Drop the KV buffers (idle cache release, unload)."""
        self.k = self.v = []
        self.cos = self.sin = None

    def cache_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))

    # ------------------------------------------------------------------ the step

    def step(self, input_ids: torch.Tensor, position: int) -> torch.Tensor:
        """Logits (1, V) of the token ``input_ids`` (1, 1) at ``position``; its key and
        value are written to the buffers at ``position``."""
        heads, kv, hd, group = self.heads, self.kv_heads, self.head_dim, self.group
        n_qk = (heads + kv) * hd
        cos, sin, half = self.cos[position], self.sin[position], hd // 2
        end = position + 1
        h = self.embed(input_ids)  # (1, 1, d); its hooks (resid_pre of layer 0) run
        for i, block in enumerate(self.layers):
            attn, mlp = block.self_attn, block.mlp
            block_in = h
            x = _rms(block.input_layernorm, h)
            qkv_w, gate_up_w = self.fused[i]
            if qkv_w is not None:
                qkv = torch.nn.functional.linear(x, qkv_w[0], qkv_w[1])
                qk, v = qkv[..., :n_qk].view(heads + kv, hd), qkv[..., n_qk:]
            else:
                qk = torch.cat((attn.q_proj.forward(x), attn.k_proj.forward(x)), dim=-1).view(heads + kv, hd)
                v = attn.v_proj.forward(x)
            qk = qk * cos + torch.cat((qk[:, half:], qk[:, :half]), dim=-1) * sin
            keys, values = self.k[i], self.v[i]
            keys[:, position] = qk[heads:]
            values[:, position] = v.view(kv, hd)
            tap = getattr(attn, TAP_ATTR, None)
            if tap is not None:  # a Q/K capture: what the attention function would be handed
                tap(qk[:heads].view(1, heads, 1, hd), keys[:, :end][None])
            scores = torch.bmm(qk[:heads].view(kv, group, hd), keys[:, :end].transpose(1, 2))
            probs = torch.softmax(scores.mul_(self.scaling), dim=-1, dtype=torch.float32).to(qk.dtype)
            o = torch.bmm(probs, values[:, :end]).view(1, 1, heads * hd)
            o = attn.o_proj.forward(o)
            if attn._forward_hooks:
                o = _run_hooks(attn, (), (o, None))[0]  # called with keywords
            h = h + o
            x = _rms(block.post_attention_layernorm, h)
            if gate_up_w is not None:
                gu = torch.nn.functional.linear(x, gate_up_w[0], gate_up_w[1])
                gate, up = gu[..., :gate_up_w[2]], gu[..., gate_up_w[2]:]
            else:
                gate, up = mlp.gate_proj.forward(x), mlp.up_proj.forward(x)
            m = mlp.down_proj.forward(torch.nn.functional.silu(gate) * up)
            if mlp._forward_hooks:
                m = _run_hooks(mlp, (x,), m)
            h = h + m
            if block._forward_hooks:
                h = _run_hooks(block, (block_in,), h)
        return self.head.forward(_rms(self.norm, h))[0]


__all__ = ["LeanDecode", "SUPPORTED", "why_not"]
