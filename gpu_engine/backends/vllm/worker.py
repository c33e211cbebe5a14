"""The worker side of the vLLM backend: a worker extension (vLLM's ``worker_extension_cls``)
mixed into every vLLM worker, reached by the driver through ``collective_rpc`` — so the
same calls work in-process, with multiprocessing and on every rank of a tensor- or
pipeline-parallel group.

What it does on the worker:

- ``millm_attach`` / ``millm_detach``: load an SAE from its files onto this worker's
  device and install (remove) the engine's own attachment hook (``gpu_engine.interp.hooks``) on
  the module of its hook point (``loader.hook_sites``, ``wire.hook_site``): a decoder
  layer's output pair (resid_post, resid_pre of L >= 1), the embedding module (resid_pre
  of 0), a layer's attention or MLP module (attn_out, mlp_out; a transcoder reads the
  MLP's input) — on the ranks that hold it (pipeline parallelism).
- Around every forward pass of the model, a pre-hook maps each token row to its request
  from the runner's batch (``input_batch.req_ids`` in batch order, ``query_start_loc``,
  ``num_computed_tokens`` for positions) and publishes the row router's ``BatchContext``
  (``gpu_engine.interp.rows``): per attachment a delta table with each steered request's
  delta in its slot, ``row_slots`` for the one gather, the batch ``ControlTable`` of the
  requests' feature controls (clamp, scale, ablate, phases, windows, conditions: one
  masked pass, ``interp.hooks.route``) with every row's sequence position, and the row
  segments of the requests that monitor or keep gates.  A row's position is vLLM's own
  (the RoPE position it computes the same way): the request's ``num_computed_tokens``
  before this forward plus its offset in the forward's rows, so prefill chunks, decode
  steps, prefix-cache hits (their rows are never run) and a preempted request's
  recompute (from its cached prefix, or 0) all land on the positions the transformers
  backend gives them.  A request's steering and monitors come from its own
  ``SamplingParams.extra_args`` (``wire``), read the first time the worker sees it, and
  become its plans through the engine's own builder (``gpu_engine.interp.plans``) from
  the SAEs this worker holds.  The post-hook counts, per request, its forward passes and
  the passes in which its steering at each attachment was really added, per mode
  (``steering_apply_count``); conditional controls keep their gates until the final
  collect reads where they opened (``steering_fired``).
- Capture (``gpu_engine.interp.capture``): a request whose ``extra_args`` carry a capture spec
  gets a plan of its own on each worker for what that worker holds (``for_shard``):
  hidden states on the first TP rank only (every rank has the same stream after the
  all-reduce), Q/K of the asked heads this rank's shard holds.  While it runs, its
  layers carry the engine's capture hook (the last hook on the layer, so it reads the
  steered pair's sum) and its attention layers a forward pre-hook on vLLM's
  ``Attention`` module, whose ``query``/``key`` are the rotated q and k the model's
  attention reads (vLLM's Llama: ``self.attn(q, k, v)`` after ``rotary_emb``).  Rows
  reach the plan by the same row segments the monitors use.
- ``millm_collect``: the counts and monitor records of the requests the driver names
  (encoded here, next to the SAE), as builtins, and with ``final`` each capturing
  request's part (the safetensors bytes of what this worker took, with its TP rank and
  global heads); ``final`` forgets them.

Under tensor parallelism every rank holds the full hidden state after its all-reduce, so
every rank adds the same delta and computes the same controls and gates; monitors are
encoded, and fired positions reported, on the first TP rank only.  vLLM's
decoder layers return ``(hidden, residual)``: the hook reads their sum and adds the delta
to ``hidden`` once (``HookManager.install(..., residual_pair=True)``).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from ...interp.capture import AttentionGeometry, CapturePlan, HeadShard, for_shard, route_qk
from ...interp.hooks import AttachmentStats, HookManager, RequestHooks
from ...interp.plans import build_hooks
from ...interp.rows import Row, RowRouter
from ...api.protocol import AttachmentKey, to_builtins
from ...sae.layouts import config_at_layer, get_layout
from ...sae.module import SAE
from .loader import find_attention, find_layers, held, hook_sites, taps_of
from .wire import EXTRA_KEY, decode_args, decode_capture, hook_site

log = logging.getLogger("gpu_engine.vllm.worker")

# requests vLLM dropped before the driver collected them (aborted, or collected late) are
# kept this long, then forgotten: the worker never grows without bound
FORGET_AFTER_S = 120.0


class _Request:
    """A request as this worker knows it: its hooks, its row in the router (None while
    vLLM does not run it), its counts, and its capture (``hooks.capture``: this worker's
    plan; ``heads``/``kv_heads``: the global heads of its Q/K rows; ``armed``: its hooks
    are on)."""

    __slots__ = ("armed", "forwards", "heads", "hooks", "kv_heads", "last_seen", "row")

    def __init__(self, hooks: RequestHooks) -> None:
        self.hooks = hooks
        self.row: Row | None = None
        self.forwards = 0
        self.last_seen = time.monotonic()
        self.heads: list[int] = []
        self.kv_heads: list[int] = []
        self.armed = False


def parameter_bytes(model: torch.nn.Module) -> dict[str, int]:
    """Bytes of ``model``'s parameters per dtype, each tensor once (a tied head is the
    embedding's); vLLM's buffers (its rotary caches) and KV cache are its own profile's.
    On the CPU vLLM prepacks a linear layer's weight into a oneDNN handle and leaves an
    empty ``weight`` behind: that layer counts at its weight's own size (this rank's
    ``output_size_per_partition`` × ``input_size_per_partition`` at ``params_dtype``)."""
    out: dict[str, int] = {}
    seen: set[tuple[int, int]] = set()

    def add(dtype: torch.dtype, n: int) -> None:
        name = str(dtype).replace("torch.", "")
        out[name] = out.get(name, 0) + n

    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            packed = (
                name == "weight"
                and p.numel() == 0
                and hasattr(module, "cpu_linear")
                and hasattr(module, "output_size_per_partition")
                and hasattr(module, "input_size_per_partition")
            )
            if packed:
                dtype = getattr(module, "params_dtype", None) or p.dtype
                count = int(module.output_size_per_partition) * int(module.input_size_per_partition)
                add(dtype, count * torch.empty((), dtype=dtype).element_size())
                continue
            key = (p.data_ptr(), p.numel())
            if p.numel() == 0 or key in seen:
                continue
            seen.add(key)
            add(p.dtype, p.numel() * p.element_size())
    return out


class _State:
    """Everything the extension keeps on one worker."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        runner = worker.model_runner
        self.runner = runner
        self.model = runner.get_model()
        self.layers_path, self.layers = find_layers(self.model)
        self.device = next(self.model.parameters()).device
        self.dtype = runner.model_config.dtype
        # compiled (load_format millm): the hooks go on the layers' taps, which the graph calls
        self.manager = HookManager(taps_of(self.model))
        self.saes: dict[AttachmentKey, SAE] = {}
        self.stats: dict[AttachmentKey, AttachmentStats] = {}
        self.requests: dict[str, _Request] = {}
        self.gone: OrderedDict[str, _Request] = OrderedDict()
        self.router = RowRouter(device=self.device)  # grows with the requests vLLM runs
        self.ctx_reqs: list[_Request] = []
        try:
            from vllm.distributed import (
                get_tensor_model_parallel_rank,
                get_tensor_model_parallel_world_size,
            )

            self.tp_rank, self.tp_size = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
        except Exception:  # noqa: BLE001 - no distributed state: a single worker
            self.tp_rank, self.tp_size = 0, 1
        self.monitor_rank = self.tp_rank == 0
        # where each hook point is on this model (the driver refuses the others first)
        self.sites = hook_sites(self.model, self.tp_size)
        text_cfg = runner.model_config.hf_text_config
        self.hidden_size = int(getattr(text_cfg, "hidden_size", 0))
        # Q/K capture: each layer's attention module and the heads this rank's shard holds
        self.attention = [find_attention(layer) if self.holds(i) else None for i, layer in enumerate(self.layers)]
        first = next((a for a in self.attention if a is not None), None)
        self.shard: HeadShard | None = None
        if first is not None:  # the model's heads: each rank's times the ranks
            self.num_heads = int(first.num_heads) * self.tp_size
            self.num_kv_heads = int(getattr(text_cfg, "num_key_value_heads", None) or self.num_heads)
            self.shard = HeadShard.of(
                self.tp_rank,
                self.tp_size,
                num_heads=self.num_heads,
                num_kv_heads=self.num_kv_heads,
                head_dim=int(first.head_size),
            )
        self.qk_hooks: dict[int, list[Any]] = {}  # layer -> [handle, references]
        self._handles = [
            self.model.register_forward_pre_hook(self._before),
            self.model.register_forward_hook(self._after),
        ]

    # ------------------------------------------------------------------ attachments

    def holds(self, layer: int) -> bool:
        """Whether this rank runs ``layer`` (pipeline parallelism leaves the others empty)."""
        return held(self.layers[layer])

    def attach(self, sae_id: str, layer: int, path: str, layout: str) -> bool:
        key = (sae_id, layer)
        self.detach(sae_id, layer)
        lay = get_layout(layout)
        found = lay.detect(Path(path))
        # a raw vector file holds a vector per layer: the one of the attach layer
        cfg = config_at_layer(lay, lay.read_metadata(found if found is not None else Path(path)), layer)
        # the key keeps the attach layer; the hook sits on the module of the SAE's point
        # (layer - 1's output pair for resid_pre, the embeddings for resid_pre of 0, …)
        path, module_layer, kind = hook_site(layer, cfg.hook_point, self.sites)
        if not self.holds(module_layer):
            return False
        self.saes[key] = SAE(cfg, lay.load_tensors(cfg), device=self.device)
        self.stats[key] = AttachmentStats()
        # the same BatchContext rows at every point: each module's output (the
        # embeddings' too) has one row per token of the forward, in the batch's order
        self.manager.install(
            key,
            self.model.get_submodule(path),
            self.stats[key],
            residual_pair=kind == "pair",
            read_input=kind == "input",
        )
        return True

    def detach(self, sae_id: str, layer: int) -> None:
        key = (sae_id, layer)
        self.manager.remove(key)
        self.saes.pop(key, None)
        self.stats.pop(key, None)
        self.router.forget(key)

    # ------------------------------------------------------------------ capture

    def describe_attention(self) -> dict[str, Any] | None:
        """The model's attention geometry (global heads) and each layer's q·k scale, for
        the driver's capture checks and sidecar; None when no layer has vLLM's Attention."""
        if self.shard is None:
            return None
        scaling = [None if a is None else getattr(getattr(a, "impl", None), "scale", None) for a in self.attention]
        return {
            "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.shard.head_dim,
            "layers": [i for i, a in enumerate(self.attention) if a is not None],
            "scaling": [None if v is None else float(v) for v in scaling],
        }

    def _capture_plan(self, req_id: str, raw: Any, n_prompt: int, max_tokens: int) -> tuple[Any, list[int], list[int]]:
        spec = decode_capture(raw)
        if spec is None:
            return None, [], []
        held = {i for i in range(len(self.layers)) if self.holds(i)}
        shard = self.shard or HeadShard(self.tp_rank, 0, 0, 0, 0, 0)
        local, heads, kv_heads = for_shard(spec, shard, hidden=self.tp_rank == 0, held=held)
        if local is None:
            return None, [], []
        geometry = None
        if local.attention is not None:
            geometry = AttentionGeometry(shard.num_heads, shard.num_kv_heads, shard.head_dim)
        plan = CapturePlan(
            local,
            request_id=req_id,
            prompt_len=n_prompt,
            max_tokens=max_tokens,
            hidden_size=self.hidden_size,
            dtype=self.dtype,
            device=self.device,
            model="",
            backend="vllm",
            steering_hash=None,
            geometry=geometry,
        )
        return plan, heads, kv_heads

    def _arm(self, req: _Request) -> None:
        plan = req.hooks.capture
        for layer in plan.layers:
            self.manager.arm_capture(layer, self.layers[layer], residual_pair=True)
        for layer in plan.qk_layers:
            entry = self.qk_hooks.get(layer)
            if entry is not None:
                entry[1] += 1
                continue
            module = self.attention[layer]
            hook = _QKHook(layer, self.manager, module)  # type: ignore[arg-type]
            handle = self.manager.register(module, hook, pre=True)  # type: ignore[arg-type]
            self.qk_hooks[layer] = [handle, 1]
        req.armed = True

    def _disarm(self, req: _Request) -> None:
        if not req.armed:
            return
        plan = req.hooks.capture
        for layer in plan.layers:
            self.manager.disarm_capture(layer)
        for layer in plan.qk_layers:
            entry = self.qk_hooks.get(layer)
            if entry is None:
                continue
            entry[1] -= 1
            if entry[1] <= 0:
                entry[0].remove()
                del self.qk_hooks[layer]
        req.armed = False

    def armed(self) -> dict[str, list[int]]:
        """The layers whose capture hooks are on (tests: nothing outlives its requests)."""
        return {"hidden": self.manager.armed_captures(), "qk": sorted(self.qk_hooks)}

    # ------------------------------------------------------------------ requests

    def _new_request(self, req_id: str) -> _Request:
        """The request's plans, built from its ``extra_args`` by the engine's builder with
        the SAEs this worker holds (an attachment on another pipeline stage is skipped;
        the driver checked everything), and its capture plan for this worker's share."""
        state = self.runner.requests.get(req_id)
        params = getattr(state, "sampling_params", None)
        extra = (getattr(params, "extra_args", None) or {}).get(EXTRA_KEY)
        n_prompt = len(getattr(state, "prompt_token_ids", None) or [])
        hooks = RequestHooks(req_id)
        heads: list[int] = []
        kv_heads: list[int] = []
        if extra:
            steering, monitors = decode_args(extra)
            hooks = build_hooks(
                self.saes,
                req_id,
                steering,
                monitors if self.monitor_rank else [],
                n_prompt=n_prompt,
                dtype=self.dtype,
                device=self.device,
            )
            hooks.capture, heads, kv_heads = self._capture_plan(req_id, extra, n_prompt, int(params.max_tokens or 1))
        req = _Request(hooks)
        req.heads, req.kv_heads = heads, kv_heads
        return req

    def _run(self, req: _Request) -> None:
        """The request runs again (new, or back from ``gone``): its row and its capture hooks."""
        if req.row is None:
            req.row = self.router.add(req.hooks)
        if req.hooks.capture is not None and not req.armed:
            self._arm(req)

    def _release(self, req: _Request) -> None:
        self._disarm(req)
        if req.row is not None:
            self.router.remove(req.row)
            req.row = None

    def _forget_old(self) -> None:
        """Requests vLLM no longer runs move to ``gone`` (until collected or too old)."""
        live = self.runner.requests
        for rid in [r for r in self.requests if r not in live]:
            req = self.requests.pop(rid)
            self._release(req)
            self.gone[rid] = req
        limit = time.monotonic() - FORGET_AFTER_S
        while self.gone and next(iter(self.gone.values())).last_seen < limit:
            self.gone.popitem(last=False)

    # ------------------------------------------------------------------ forward

    def _before(self, module: Any, args: Any) -> None:
        self.manager.current = None
        self.ctx_reqs = []
        batch = self.runner.input_batch
        num_reqs = int(batch.num_reqs)
        if num_reqs == 0:
            return
        self._forget_old()
        req_ids = batch.req_ids[:num_reqs]
        qsl = self.runner.query_start_loc.np[: num_reqs + 1]
        starts = batch.num_computed_tokens_cpu[:num_reqs]
        reqs: list[_Request] = []
        now = time.monotonic()
        for rid in req_ids:
            req = self.requests.get(rid)
            if req is None:
                req = self.gone.pop(rid, None) or self._new_request(rid)
                self._run(req)
                self.requests[rid] = req
            req.last_seen = now
            reqs.append(req)
        self.ctx_reqs = reqs
        if not any(r.row.keys or r.row.watched for r in reqs):  # type: ignore[union-attr]
            return
        parts = [(r.row, int(qsl[i]), int(qsl[i + 1]), int(starts[i])) for i, r in enumerate(reqs)]
        self.manager.current = self.router.context(parts, only_present=True)  # type: ignore[arg-type]

    def _after(self, module: Any, args: Any, output: Any) -> None:
        ctx = self.manager.current
        self.manager.current = None
        for req in self.ctx_reqs:
            req.forwards += 1
        if ctx is not None:
            self.router.count((r.row for r in self.ctx_reqs if r.row is not None), ctx.applied)
        self.ctx_reqs = []

    # ------------------------------------------------------------------ results

    def collect(self, request_ids: list[str], final: bool) -> dict[str, Any]:
        """``{"requests": {id: {forwards, applied, fired, records, capture}}, "stats": [[sae_id,
        layer, n]]}``: ``applied`` ``[[sae_id, layer, count, {mode: count}]]``, the forwards
        in which the request's steering at an attachment was added, in all and per mode
        (``AttachmentPlan.applied``); ``fired`` (``final`` only, first TP rank only: every
        rank computes the same gates) ``[[sae_id, layer, index, mode, positions]]``, where
        each conditional control's gate opened (``AttachmentPlan.fired``), in the plan's
        order; ``stats``: this worker's cumulative steering_apply_count per attachment."""
        out: dict[str, Any] = {}
        for rid in request_ids:
            req = self.requests.get(rid) or self.gone.get(rid)
            if req is None:
                continue
            with torch.inference_mode():
                records = req.hooks.finalize() if final else req.hooks.collect()
            fired = []
            if final and req.hooks.conditional:
                # read (and so dropped) on every rank; reported by the first
                got = req.hooks.steering_fired()
                if self.monitor_rank:
                    fired = [[f.sae_id, f.layer, f.index, f.mode, f.positions] for f in got]
            out[rid] = {
                "forwards": req.forwards,
                "applied": [[c.sae_id, c.layer, c.count, c.modes] for c in req.hooks.steering_counts()],
                "fired": fired,
                "records": [to_builtins(r) for r in records],
                "capture": [self._part(req)] if final and req.hooks.capture is not None else [],
            }
            if final:
                if self.requests.pop(rid, None) is not None:
                    self._release(req)
                self.gone.pop(rid, None)
        stats = [[k[0], k[1], st.steering_apply_count] for k, st in self.stats.items()]
        return {"requests": out, "stats": stats}

    def _part(self, req: _Request) -> dict[str, Any]:
        """This worker's part of a request's capture: the safetensors bytes of the rows it
        took (drained to the host), its TP rank and the global heads of its Q/K."""
        from safetensors.torch import save

        return {
            "rank": self.tp_rank,
            "data": save(req.hooks.capture.drain()),
            "heads": list(req.heads),
            "kv_heads": list(req.kv_heads),
        }

    def close(self) -> None:
        for req in [*self.requests.values(), *self.gone.values()]:
            self._disarm(req)
        self.manager.remove_all()
        for handle in self._handles:
            handle.remove()
        self._handles = []


class _QKHook:
    """The forward pre-hook on one layer's vLLM ``Attention`` while some request captures
    its Q/K: ``query`` (tokens, heads × head_dim) and ``key`` (tokens, kv_heads × head_dim)
    of this rank's heads, rows in the batch's token order, to the capturing requests'
    plans (``capture.route_qk``).  Changes nothing."""

    def __init__(self, layer: int, manager: HookManager, attention: torch.nn.Module) -> None:
        self.layer = layer
        self.manager = manager
        self.heads = int(attention.num_heads)
        self.kv_heads = int(attention.num_kv_heads)
        self.head_dim = int(attention.head_size)

    def __call__(self, module: torch.nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        ctx = self.manager.current
        if ctx is None:
            return None
        query = args[0] if len(args) > 0 else kwargs["query"]
        key = args[1] if len(args) > 1 else kwargs["key"]
        n = query.shape[0]
        route_qk(
            ctx, self.layer, query.reshape(n, self.heads, self.head_dim), key.reshape(n, self.kv_heads, self.head_dim)
        )
        return None


class MillmWorkerExtension:
    """Mixed into vLLM's worker class (``worker_extension_cls``); every public method is a
    ``collective_rpc`` target, prefixed ``millm_`` so it cannot shadow a worker method."""

    def _millm(self) -> _State:
        state = getattr(self, "_millm_state", None)
        if state is None:
            state = _State(self)
            self._millm_state = state
        return state

    def millm_describe(self) -> dict[str, Any]:
        s = self._millm()
        return {
            "layers_path": s.layers_path,
            "num_layers": len(s.layers),
            "device": str(s.device),
            "dtype": str(s.dtype).replace("torch.", ""),
            "monitor_rank": s.monitor_rank,
            "hidden_size": s.hidden_size,
            "tp_rank": s.tp_rank,
            "tp_size": s.tp_size,
            "attention": s.describe_attention(),
            "hook_sites": s.sites,
            # what this rank's parameters take, per dtype (EngineStatus.weights)
            "parameter_bytes": parameter_bytes(s.model),
        }

    def millm_armed(self) -> dict[str, list[int]]:
        return self._millm().armed()

    # the tables are made and written under the forward's inference mode; an RPC that
    # writes them (a released slot zeroed) must run under it too (worker processes)
    def millm_attach(self, sae_id: str, layer: int, path: str, layout: str) -> bool:
        with torch.inference_mode():
            return self._millm().attach(sae_id, layer, path, layout)

    def millm_detach(self, sae_id: str, layer: int) -> None:
        with torch.inference_mode():
            self._millm().detach(sae_id, layer)

    def millm_collect(self, request_ids: list[str], final: bool) -> dict[str, Any]:
        with torch.inference_mode():
            return self._millm().collect(list(request_ids), bool(final))

    def millm_close(self) -> None:
        state = getattr(self, "_millm_state", None)
        if state is not None:
            state.close()
            self._millm_state = None


__all__ = ["MillmWorkerExtension"]
