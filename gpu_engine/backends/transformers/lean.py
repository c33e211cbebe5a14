"""The one-token decode step for Llama-family models, without the transformers forward
around it: the serial path's and the continuous batch's.

A batch-1 decode step of SmolLM2-135M (30 blocks) spends ~27 ms in its 211 matrix-vector
products and, through ``model.forward``, another ~20 ms in everything else: per-module
``__call__`` dispatch, the cache object's bookkeeping, mask and position set-up, and the
~400 small ops between the products (measured 2026-12-03, Intel Xeon, 2 vCPUs:
docs/performance.md, "Serial decode step").  This module computes the same step
directly from the model's own modules and weights:

- every projection is the module's own ``forward`` (plain, prepacked or quantized
  weights alike), so nothing is copied and the prefill, the batch and this step share
  one set of weights — and q/k/v and gate/up are one product each: prepacked, the packed
  group's (``cpu_kernels.PackedGroup``); plain, their weights concatenated once, the
  modules' weights becoming views of their rows (``_fuse``);
- keys and values live in preallocated per-layer buffers, filled from the prefill's
  ``DynamicCache`` and written in place, so nothing grows or is concatenated per step;
- rotary embeddings come from tables computed exactly as the model's rotary module
  computes them (``position * inv_freq``, cos/sin, ``attention_scaling``), grown on
  demand and kept, and ``rotate_half`` swaps the halves with the sign folded into the
  sine table;
- attention is two batched products over the cached positions (one query per row).

Steering, monitoring and hidden-state capture are the forward hooks the engine installed
on the decoder blocks (and, for ``attn_out`` / ``mlp_out`` / transcoder attachments, on
``self_attn`` / ``mlp``): this step runs those modules' forward hooks with the arguments
and outputs ``nn.Module.__call__`` would pass, in order, and hands an armed Q/K capture
tap (``qk_tap``) the rotated query and the cached keys the attention function would get.
The input embedding is called as a module, so every hook on it runs (test choreographies
count forward passes there).  A request runs the step only when every hook in the model
is one it runs (``usable``): a pre-hook or a hook with kwargs on another module, or a hook
on any module not named here, makes that request (or that batch step) take
``model.forward`` as before.

A continuous batch runs the same blocks over its slab cache (``step_rows``): each row
at its own position, the left padding before a row's first slot masked out of its
attention, every row's steering, monitoring and capture from the published
``BatchContext`` through the same hooks.

Numerically the step differs from ``model.forward`` in the last bits only (attention as
two products instead of the SDPA kernel); ``tests/engine/test_lean_decode.py`` holds it
to the transformers forward, and the batching suites hold each batched row to its solo
run.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.nn.modules import module as _nn_module

from .cpu_kernels import PackedSlice
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
        if (
            attn is None
            or mlp is None
            or not all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj", "scaling"))
            or not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj"))
        ):
            return "a decoder block of another shape"
        if not all(
            hasattr(n, "variance_epsilon") and hasattr(n, "weight")
            for n in (block.input_layernorm, block.post_attention_layernorm)
        ):
            return "a norm other than LlamaRMSNorm"
    if not hasattr(model.model.norm, "variance_epsilon"):
        return "a final norm other than LlamaRMSNorm"
    return None


def _fuse(*linears: torch.nn.Module) -> tuple[Callable[[torch.Tensor], torch.Tensor], int] | None:
    """One product for ``linears`` (q/k/v, gate/up) so that a step makes one call instead
    of several; returns (the product, the first member's size), or None where they cannot
    be one.  Prepacked members of one ``PackedGroup`` (cpu_kernels.py) already are: the
    group's own product.  Plain ``nn.Linear`` of one input, dtype and device are made one:
    the rows are concatenated once and each module's weight (and bias) becomes a view of
    its rows, so nothing is held twice and the modules compute what they did.  Anything
    else (quantized, mixed) stays one product per module."""
    if all(type(m) is PackedSlice for m in linears):
        group = linears[0].group  # type: ignore[union-attr]
        ends = [0] + [m.end for m in linears]  # type: ignore[union-attr]
        if all(m.group is group and m.start == ends[i] for i, m in enumerate(linears)) and ends[-1] == sum(group.sizes):  # type: ignore[union-attr]
            return group.forward, linears[0].out_features  # type: ignore[return-value]
        return None
    if not all(type(m) is torch.nn.Linear and type(m.weight) is torch.nn.Parameter for m in linears):
        return None
    ref = linears[0].weight
    if any(
        m.weight.shape[1] != ref.shape[1]
        or m.weight.dtype != ref.dtype
        or m.weight.device != ref.device
        or (m.bias is None) != (linears[0].bias is None)
        for m in linears
    ):
        return None
    with torch.no_grad():
        weight = torch.cat([m.weight.detach() for m in linears])
        bias = torch.cat([m.bias.detach() for m in linears]) if linears[0].bias is not None else None
        row = 0
        for m in linears:
            n = m.weight.shape[0]
            m.weight = torch.nn.Parameter(weight[row : row + n], requires_grad=False)
            if bias is not None:
                m.bias = torch.nn.Parameter(bias[row : row + n], requires_grad=False)
            row += n
    first = linears[0].weight.shape[0]
    return functools.partial(torch.nn.functional.linear, weight=weight, bias=bias), first


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
    """The one-token decode step of one loaded Llama-family model (``why_not`` is None):
    ``step`` for the serial path (one request, its own buffers), ``step_rows`` for a
    continuous batch (every running row over the slab cache, ``kv_cache.BatchKVCache``).
    Both run ``_blocks``, which computes every row of one decode step."""

    def __init__(self, model: Any, *, fused: bool | None = None) -> None:
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
        # q/k/v and gate/up as one product each: a packed group's, or plain weights made one
        # (views: no copy)
        self.fused = [
            (_fuse(b.self_attn.q_proj, b.self_attn.k_proj, b.self_attn.v_proj), _fuse(b.mlp.gate_proj, b.mlp.up_proj))
            for b in self.layers
        ]
        # MILLM_ENGINE_FUSED_KERNELS: the small ops between the products as C calls
        # (cpu_fused.py) on CPU float32: None = where they build, False = never
        self.kernels: Any = None
        self.kernels_reason: str | None = "off (fused_cpu_kernels)" if fused is False else None
        ref = self.layers[0].input_layernorm.weight
        if fused is not False:
            if ref.device.type != "cpu" or any(
                t.dtype != torch.float32
                for t in (ref, self.embed.weight, self.norm.weight, self.layers[-1].post_attention_layernorm.weight)
            ):
                self.kernels_reason = "not CPU float32"
            else:
                from . import cpu_fused

                self.kernels = cpu_fused.kernels()
                self.kernels_reason = cpu_fused.why_not() if self.kernels is None else None
        self.inter = (
            int(self.layers[0].mlp.down_proj.in_features)
            if hasattr(self.layers[0].mlp.down_proj, "in_features")
            else int(cfg.intermediate_size)
        )
        # the serial request's buffers, (1, kv_heads, needed, head_dim) per layer
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        # rotary tables for positions 0 .. len-1, grown on demand and kept (``_rope``)
        self.cos: torch.Tensor | None = None
        self.sin: torch.Tensor | None = None

    # ------------------------------------------------------------------ eligibility

    def usable(self) -> bool:
        """Whether every hook now in the model is one this step runs (the serial path checks
        once per request, the batch once per step: captures are armed as rows join)."""
        if (
            _nn_module._global_forward_hooks
            or _nn_module._global_forward_pre_hooks
            or getattr(_nn_module, "_global_forward_hooks_always_called", None)
        ):
            return False
        for m in self._all:
            if m is self.embed:  # called through __call__ by the step: all its hooks run
                continue
            if m._forward_pre_hooks or m._forward_hooks_with_kwargs:
                return False
            if m._forward_hooks and id(m) not in self._hooked:
                return False
        return True

    # ------------------------------------------------------------------ rotary tables

    def _rope(self, needed: int, dtype: torch.dtype) -> None:
        """Make the tables cover positions 0 .. ``needed``-1.  Each entry is exactly
        LlamaRotaryEmbedding.forward's arithmetic for its position (``position * inv_freq``
        in float32, cos/sin, ``attention_scaling``), whatever the table's length, so a table
        grown for a longer request gives the same rows."""
        if self.cos is not None and self.cos.shape[0] >= needed and self.cos.dtype == dtype:
            return
        if self.cos is not None and self.cos.dtype == dtype:
            needed = max(needed, 2 * self.cos.shape[0])  # grow by doubling: few rebuilds
        inv = self.rotary.inv_freq
        freqs = torch.arange(needed, device=inv.device)[:, None].float() * inv.float()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        scale = self.rotary.attention_scaling
        cos = (emb.cos() * scale).to(dtype)
        sin = (emb.sin() * scale).to(dtype)
        # rotate_half(x) * sin == swap_halves(x) * sin_signed: the first half's sign goes into sin
        half = self.head_dim // 2
        sin[:, :half] = -sin[:, :half]
        self.cos, self.sin = cos, sin

    # ------------------------------------------------------------------ serial requests

    def start(self, past: Any, n_prompt: int, needed: int) -> None:
        """Take the prefill's cache (``DynamicCache`` of ``n_prompt`` positions) into
        buffers of ``needed`` positions."""
        ref = past.layers[0].keys
        shape = (1, self.kv_heads, needed, self.head_dim)
        # new buffers each request (``release`` drops them when it ends)
        self.k = [torch.empty(shape, dtype=ref.dtype, device=ref.device) for _ in self.layers]
        self.v = [torch.empty(shape, dtype=ref.dtype, device=ref.device) for _ in self.layers]
        for i, layer in enumerate(past.layers):
            self.k[i][0, :, :n_prompt].copy_(layer.keys[0, :, -n_prompt:])
            self.v[i][0, :, :n_prompt].copy_(layer.values[0, :, -n_prompt:])
        self._rope(needed, ref.dtype)

    def release(self) -> None:
        """Drop the serial request's KV buffers (its end, idle cache release, unload)."""
        self.k = self.v = []

    def cache_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))

    # ------------------------------------------------------------------ the steps

    def step(self, input_ids: torch.Tensor, position: int) -> torch.Tensor:
        """Logits (1, V) of the token ``input_ids`` (1, 1) at ``position``; its key and
        value are written to the request's buffers at ``position``."""
        if self._fused_now(self.k[0]):
            x = self._blocks_fused(input_ids, torch.tensor([position]), self.k, self.v, position, None)
            return self.head.forward(x)
        pos = slice(position, position + 1)
        h = self._blocks(input_ids, self.cos[pos], self.sin[pos], self.k, self.v, position, None)  # type: ignore[index]
        return self.head.forward(_rms(self.norm, h))[0]

    def step_rows(
        self, input_ids: torch.Tensor, cache: Any, position_ids: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """One decode step of every row of the batch cache ``cache`` (``BatchKVCache``,
        growing layout): ``input_ids`` (rows, 1), at ``position_ids`` (rows, 1) with the
        padding ``mask`` (rows, length+1; 0 on a row's left padding, None when no row has
        any), both from ``cache.step_inputs()`` as ``model.forward`` gets them; each row's
        key and value go to slot ``cache.length`` (the caller advances it); returns the
        logits (rows, V)."""
        slot = cache.length
        self._rope(slot + 1, cache.layers[0].k_buf.dtype)
        positions = position_ids[:, 0]
        pad = None if mask is None else mask == 0
        if self._fused_now(cache.layers[0].k_buf):
            k_bufs = [layer.k_buf for layer in cache.layers]
            v_bufs = [layer.v_buf for layer in cache.layers]
            return self.head.forward(
                self._blocks_fused(
                    input_ids,
                    positions.to(torch.int64).contiguous(),
                    k_bufs,
                    v_bufs,
                    slot,
                    None if pad is None else pad.contiguous(),
                )
            )
        h = self._blocks(
            input_ids,
            self.cos[positions],
            self.sin[positions],  # type: ignore[index]
            [layer.k_buf for layer in cache.layers],
            [layer.v_buf for layer in cache.layers],
            slot,
            pad,
        )
        return self.head.forward(_rms(self.norm, h))[:, -1]

    def _fused_now(self, k_buf: torch.Tensor) -> bool:
        """Whether this step runs the C kernels: they are built, the cache (its first
        layer's keys ``k_buf``) is contiguous float32 as they read it, and no Q/K capture
        tap (which needs the rotated query as a tensor) is armed."""
        return (
            self.kernels is not None
            and k_buf.dtype == torch.float32
            and k_buf.is_contiguous()
            and not any(getattr(b.self_attn, TAP_ATTR, None) is not None for b in self.layers)
        )

    def _blocks_fused(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        k_bufs: list[torch.Tensor],
        v_bufs: list[torch.Tensor],
        slot: int,
        pad: torch.Tensor | None,
    ) -> torch.Tensor:
        """``_blocks`` and the final norm, with the small ops between the products as C
        calls (cpu_fused.c): the same products, hooks and cache writes, the rotary tables
        read at ``positions`` (rows,) int64; returns the normed last hidden state (rows, d)."""
        K = self.kernels
        heads, kv, hd = self.heads, self.kv_heads, self.head_dim
        rows, end = input_ids.shape[0], slot + 1
        slots = k_bufs[0].shape[2]
        empty = torch.empty
        h = self.embed(input_ids)  # (rows, 1, d); its hooks (resid_pre of layer 0) run
        d = h.shape[-1]
        h = h.reshape(rows, d).contiguous()
        scores = empty(rows * heads * end)
        att = empty(rows, heads * hd)
        act = empty(rows, self.inter)
        cos, sin = self.cos.data_ptr(), self.sin.data_ptr()  # type: ignore[union-attr]
        pos, mask = positions.data_ptr(), pad.data_ptr() if pad is not None else None
        pending: torch.Tensor | None = None  # the last block's MLP output, not yet added to h
        for i, block in enumerate(self.layers):
            attn, mlp = block.self_attn, block.mlp
            norm = block.input_layernorm
            x = empty(rows, d)
            if pending is None:
                K.add_rms(
                    h.data_ptr(), None, norm.weight.data_ptr(), norm.variance_epsilon, rows, d, None, x.data_ptr()
                )
            else:
                s = empty(rows, d)
                K.add_rms(
                    h.data_ptr(),
                    pending.data_ptr(),
                    norm.weight.data_ptr(),
                    norm.variance_epsilon,
                    rows,
                    d,
                    s.data_ptr(),
                    x.data_ptr(),
                )
                h = s
            block_in = h
            qkv_w, gate_up_w = self.fused[i]
            if qkv_w is not None:
                qkv = qkv_w[0](x).contiguous()  # (rows, (heads + 2 kv) · head_dim): already is
            else:
                qkv = torch.cat(
                    (attn.q_proj.forward(x), attn.k_proj.forward(x), attn.v_proj.forward(x)), dim=-1
                ).contiguous()
            K.attention(
                qkv.data_ptr(),
                cos,
                sin,
                pos,
                k_bufs[i].data_ptr(),
                v_bufs[i].data_ptr(),
                slots,
                slot,
                mask,
                rows,
                heads,
                kv,
                hd,
                self.scaling,
                scores.data_ptr(),
                att.data_ptr(),
            )
            o = attn.o_proj.forward(att)
            if attn._forward_hooks:
                o = _run_hooks(attn, (), (o.view(rows, 1, d), None))[0].reshape(rows, d)
            o = o.contiguous()
            norm = block.post_attention_layernorm
            s, x = empty(rows, d), empty(rows, d)
            K.add_rms(
                h.data_ptr(),
                o.data_ptr(),
                norm.weight.data_ptr(),
                norm.variance_epsilon,
                rows,
                d,
                s.data_ptr(),
                x.data_ptr(),
            )
            h = s
            if gate_up_w is not None:
                gu = gate_up_w[0](x).contiguous()
            else:
                gu = torch.cat((mlp.gate_proj.forward(x), mlp.up_proj.forward(x)), dim=-1).contiguous()
            K.silu_mul(gu.data_ptr(), rows, self.inter, act.data_ptr())
            m = mlp.down_proj.forward(act)
            if mlp._forward_hooks:
                m = _run_hooks(mlp, (x.view(rows, 1, d),), m.view(rows, 1, d)).reshape(rows, d)
            if block._forward_hooks:
                out = _run_hooks(block, (block_in.view(rows, 1, d),), (h + m).view(rows, 1, d))
                h = out.reshape(rows, d).contiguous()
                pending = None
            else:
                pending = m.contiguous()
        x = empty(rows, d)
        if pending is None:
            K.add_rms(
                h.data_ptr(), None, self.norm.weight.data_ptr(), self.norm.variance_epsilon, rows, d, None, x.data_ptr()
            )
        else:
            s = empty(rows, d)  # held: the C call writes it
            K.add_rms(
                h.data_ptr(),
                pending.data_ptr(),
                self.norm.weight.data_ptr(),
                self.norm.variance_epsilon,
                rows,
                d,
                s.data_ptr(),
                x.data_ptr(),
            )
        return x

    def _blocks(
        self,
        input_ids: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_bufs: list[torch.Tensor],
        v_bufs: list[torch.Tensor],
        slot: int,
        pad: torch.Tensor | None,
    ) -> torch.Tensor:
        """The decoder over ``input_ids`` (rows, 1), row r at the rotary angle ``cos[r]`` /
        ``sin[r]`` (rows, head_dim): each layer's new key and value are written to slot
        ``slot`` of its buffers (rows × kv_heads × slots × head_dim), and the query
        attends to slots ``0 .. slot`` except where ``pad`` (rows, slot+1) is True.
        Returns the last block's output (rows, 1, d), hooks applied."""
        heads, kv, hd, group = self.heads, self.kv_heads, self.head_dim, self.group
        rows, end = input_ids.shape[0], slot + 1
        n_qk = (heads + kv) * hd
        half = hd // 2
        cos, sin = cos[:, None, :], sin[:, None, :]
        h = self.embed(input_ids)  # (rows, 1, d); its hooks (resid_pre of layer 0) run
        for i, block in enumerate(self.layers):
            attn, mlp = block.self_attn, block.mlp
            block_in = h
            x = _rms(block.input_layernorm, h)
            qkv_w, gate_up_w = self.fused[i]
            if qkv_w is not None:
                qkv = qkv_w[0](x)
                qk, v = qkv[..., :n_qk].view(rows, heads + kv, hd), qkv[..., n_qk:]
            else:
                qk = torch.cat((attn.q_proj.forward(x), attn.k_proj.forward(x)), dim=-1).view(rows, heads + kv, hd)
                v = attn.v_proj.forward(x)
            qk = qk * cos + torch.cat((qk[..., half:], qk[..., :half]), dim=-1) * sin
            k_buf, v_buf = k_bufs[i], v_bufs[i]
            k_buf[:rows, :, slot] = qk[:, heads:]
            v_buf[:rows, :, slot] = v.view(rows, kv, hd)
            keys, values = k_buf[:rows, :, :end], v_buf[:rows, :, :end]
            q = qk[:, :heads]
            tap = getattr(attn, TAP_ATTR, None)
            if tap is not None:  # a Q/K capture: what the attention function would be handed
                tap(q[:, :, None], keys)
            # (rows·kv, group, hd) @ (rows·kv, hd, end): views, the buffers are not copied
            scores = torch.bmm(q.reshape(rows * kv, group, hd), keys.reshape(rows * kv, end, hd).transpose(1, 2))
            scores = scores.mul_(self.scaling)
            if pad is not None:
                scores.view(rows, kv * group, end).masked_fill_(pad[:, None, :], float("-inf"))
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(qk.dtype)
            o = torch.bmm(probs, values.reshape(rows * kv, end, hd)).view(rows, 1, heads * hd)
            o = attn.o_proj.forward(o)
            if attn._forward_hooks:
                o = _run_hooks(attn, (), (o, None))[0]  # called with keywords
            h = h + o
            x = _rms(block.post_attention_layernorm, h)
            if gate_up_w is not None:
                gu = gate_up_w[0](x)
                gate, up = gu[..., : gate_up_w[1]], gu[..., gate_up_w[1] :]
            else:
                gate, up = mlp.gate_proj.forward(x), mlp.up_proj.forward(x)
            m = mlp.down_proj.forward(torch.nn.functional.silu(gate) * up)
            if mlp._forward_hooks:
                m = _run_hooks(mlp, (x,), m)
            h = h + m
            if block._forward_hooks:
                h = _run_hooks(block, (block_in,), h)
        return h


__all__ = ["LeanDecode", "SUPPORTED", "why_not"]
