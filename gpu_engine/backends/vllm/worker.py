"""The worker side of the vLLM backend: a worker extension (vLLM's ``worker_extension_cls``)
mixed into every vLLM worker, reached by the driver through ``collective_rpc`` — so the
same calls work in-process, with multiprocessing and on every rank of a tensor- or
pipeline-parallel group.

What it does on the worker:

- ``millm_attach`` / ``millm_detach``: load an SAE from its files onto this worker's
  device and install (remove) the engine's own attachment hook (``gpu_engine.hooks``) on
  that decoder layer — on the ranks that hold the layer (pipeline parallelism).
- Around every forward pass of the model, a pre-hook maps each token row to its request
  from the runner's batch (``input_batch.req_ids`` in batch order, ``query_start_loc``,
  ``num_computed_tokens`` for positions) and publishes a ``BatchContext``: per attachment
  a delta table with each steered request's delta in its slot, ``row_slots`` for the one
  gather, and the monitored requests' row segments.  A request's steering and monitors
  come from its own ``SamplingParams.extra_args`` (``wire``), read the first time the
  worker sees it.  The post-hook counts, per request, its forward passes and the passes
  in which each of its deltas was really added (``steering_apply_count``).
- ``millm_collect``: the counts and monitor records of the requests the driver names
  (encoded here, next to the SAE), as builtins; ``final`` forgets them.

Under tensor parallelism every rank holds the full hidden state after its all-reduce, so
every rank adds the same delta; monitors are encoded on the first TP rank only.  vLLM's
decoder layers return ``(hidden, residual)``: the hook reads their sum and adds the delta
to ``hidden`` once (``HookManager.install(..., residual_pair=True)``).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ...hooks import (
    AttachmentPlan,
    AttachmentStats,
    BatchContext,
    HookManager,
    MonitorPlan,
    RequestHooks,
    Segment,
)
from ...protocol import AttachmentKey, to_builtins
from ...sae.layouts import get_layout
from ...sae.module import SAE
from .wire import EXTRA_KEY, decode_args, hook_layer

log = logging.getLogger("gpu_engine.vllm.worker")

# requests vLLM dropped before the driver collected them (aborted, or collected late) are
# kept this long, then forgotten: the worker never grows without bound
FORGET_AFTER_S = 120.0


def find_layers(model: torch.nn.Module) -> tuple[str, torch.nn.ModuleList]:
    """The decoder layers of a vLLM model: the largest ``ModuleList`` named ``layers``/``h``."""
    best: tuple[str, torch.nn.ModuleList] | None = None
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.ModuleList) and name.rsplit(".", 1)[-1] in ("layers", "h"):
            if best is None or len(mod) > len(best[1]):
                best = (name, mod)
    if best is None:
        raise RuntimeError(f"no decoder layer list found in {type(model).__name__}")
    return best


class _Request:
    """A request as this worker knows it: its hooks, its delta-table slot, its counts."""

    __slots__ = ("forwards", "hooks", "last_seen", "slot", "steered")

    def __init__(self, hooks: RequestHooks, slot: int, steered: list[AttachmentKey]) -> None:
        self.hooks = hooks
        self.slot = slot
        self.steered = steered
        self.forwards = 0
        self.last_seen = time.monotonic()


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
        self.manager = HookManager()
        self.saes: dict[AttachmentKey, SAE] = {}
        self.stats: dict[AttachmentKey, AttachmentStats] = {}
        self.requests: dict[str, _Request] = {}
        self.gone: OrderedDict[str, _Request] = OrderedDict()
        self.tables: dict[AttachmentKey, torch.Tensor] = {}
        self.free_slots: list[int] = []
        self.capacity = 0
        self.ctx_reqs: list[_Request] = []
        try:
            from vllm.distributed import get_tensor_model_parallel_rank

            self.monitor_rank = get_tensor_model_parallel_rank() == 0
        except Exception:  # noqa: BLE001 - no distributed state: a single worker
            self.monitor_rank = True
        self._handles = [self.model.register_forward_pre_hook(self._before),
                         self.model.register_forward_hook(self._after)]

    # ------------------------------------------------------------------ attachments

    def holds(self, layer: int) -> bool:
        """Whether this rank runs ``layer`` (pipeline parallelism leaves the others empty)."""
        return type(self.layers[layer]).__name__ != "PPMissingLayer"

    def attach(self, sae_id: str, layer: int, path: str, layout: str) -> bool:
        key = (sae_id, layer)
        self.detach(sae_id, layer)
        lay = get_layout(layout)
        found = lay.detect(Path(path))
        cfg = lay.read_metadata(found if found is not None else Path(path))
        # the key keeps the attach layer; the hook sits on the layer whose output pair is
        # the SAE's point (layer - 1 for resid_pre)
        module_layer = hook_layer(layer, cfg.hook_point)
        if not self.holds(module_layer):
            return False
        self.saes[key] = SAE(cfg, lay.load_tensors(cfg), device=self.device)
        self.stats[key] = AttachmentStats()
        self.manager.install(key, self.layers[module_layer], self.stats[key], residual_pair=True)
        return True

    def detach(self, sae_id: str, layer: int) -> None:
        key = (sae_id, layer)
        self.manager.remove(key)
        self.saes.pop(key, None)
        self.stats.pop(key, None)
        self.tables.pop(key, None)

    # ------------------------------------------------------------------ requests

    def _slot(self) -> int:
        if not self.free_slots:
            old = self.capacity
            self.capacity = max(16, old * 2)
            self.free_slots = list(range(self.capacity - 1, old - 1, -1))
            for key, table in list(self.tables.items()):
                grown = torch.zeros((self.capacity, table.shape[1]), dtype=table.dtype, device=table.device)
                grown[:old] = table
                self.tables[key] = grown
        return self.free_slots.pop()

    def _table(self, key: AttachmentKey, d: int) -> torch.Tensor:
        table = self.tables.get(key)
        if table is None:
            self._slot_capacity()
            table = torch.zeros((self.capacity, d), dtype=self.dtype, device=self.device)
            self.tables[key] = table
        return table

    def _slot_capacity(self) -> None:
        if self.capacity == 0:
            self.capacity = 16
            self.free_slots = list(range(self.capacity - 1, -1, -1))

    def _new_request(self, req_id: str) -> _Request | None:
        state = self.runner.requests.get(req_id)
        params = getattr(state, "sampling_params", None)
        extra = (getattr(params, "extra_args", None) or {}).get(EXTRA_KEY)
        plans: dict[AttachmentKey, AttachmentPlan] = {}
        steered: list[AttachmentKey] = []
        n_prompt = len(getattr(state, "prompt_token_ids", None) or [])
        if extra:
            steering, monitors = decode_args(extra)
            for key, feats in steering.items():
                sae = self.saes.get(key)
                if sae is None:
                    continue  # not on this rank (pipeline parallelism); the driver checked it exists
                plans.setdefault(key, AttachmentPlan(key)).delta = sae.steering_delta(
                    feats, dtype=self.dtype, device=self.device)
                steered.append(key)
            for entry in monitors if self.monitor_rank else []:
                sae = self.saes.get(entry.key)
                if sae is None:
                    continue
                plan = plans.setdefault(entry.key, AttachmentPlan(entry.key))
                mp = MonitorPlan(entry, sae, prompt_len=n_prompt)
                (plan.pre if entry.read_point == "pre_steering" else plan.post).append(mp)
        self._slot_capacity()
        req = _Request(RequestHooks(req_id, plans), self._slot() if steered else -1, steered)
        for key in steered:
            delta = plans[key].delta
            self._table(key, delta.shape[-1])[req.slot] = delta  # type: ignore[union-attr]
        return req

    def _release(self, req: _Request) -> None:
        if req.slot >= 0:
            for key in req.steered:
                table = self.tables.get(key)
                if table is not None:
                    table[req.slot].zero_()
            self.free_slots.append(req.slot)
            req.slot = -1

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
        for rid in req_ids:
            req = self.requests.get(rid)
            if req is None:
                req = self.gone.pop(rid, None) or self._new_request(rid)
                self.requests[rid] = req  # type: ignore[assignment]
            req.last_seen = time.monotonic()  # type: ignore[union-attr]
            reqs.append(req)  # type: ignore[arg-type]
        keys = {k for r in reqs for k in r.steered}
        monitored = [i for i, r in enumerate(reqs) if r.hooks.monitors()]
        if not keys and not monitored:
            self.ctx_reqs = reqs
            return
        counts = np.diff(qsl)
        slots = np.array([r.slot if r.slot >= 0 else self._zero_slot() for r in reqs], dtype=np.int64)
        row_slots = torch.from_numpy(np.repeat(slots, counts)).to(self.device)
        segments = [Segment(reqs[i].hooks, int(qsl[i]), int(qsl[i + 1]), int(starts[i])) for i in monitored]
        self.manager.current = BatchContext(segments, row_slots=row_slots,
                                            delta_tables={k: self.tables[k] for k in keys if k in self.tables})
        self.ctx_reqs = reqs

    def _zero_slot(self) -> int:
        """A slot whose rows are zero in every table (unsteered requests share it)."""
        if not hasattr(self, "_zero"):
            self._zero = self._slot()
        return self._zero

    def _after(self, module: Any, args: Any, output: Any) -> None:
        ctx = self.manager.current
        self.manager.current = None
        applied = ctx.applied if ctx is not None else set()
        for req in self.ctx_reqs:
            req.forwards += 1
            for key in req.steered:
                if key in applied:
                    req.hooks.plans[key].applied()
        self.ctx_reqs = []

    # ------------------------------------------------------------------ results

    def collect(self, request_ids: list[str], final: bool) -> dict[str, Any]:
        """``{"requests": {id: {forwards, applied, records}}, "stats": [[sae_id, layer, n]]}``
        (``stats``: this worker's cumulative steering_apply_count per attachment)."""
        out: dict[str, Any] = {}
        for rid in request_ids:
            req = self.requests.get(rid) or self.gone.get(rid)
            if req is None:
                continue
            with torch.inference_mode():
                records = req.hooks.finalize() if final else req.hooks.collect()
            out[rid] = {
                "forwards": req.forwards,
                "applied": [[c.sae_id, c.layer, c.count] for c in req.hooks.steering_counts()],
                "records": [to_builtins(r) for r in records],
            }
            if final:
                if self.requests.pop(rid, None) is not None:
                    self._release(req)
                self.gone.pop(rid, None)
        stats = [[k[0], k[1], st.steering_apply_count] for k, st in self.stats.items()]
        return {"requests": out, "stats": stats}

    def close(self) -> None:
        self.manager.remove_all()
        for handle in self._handles:
            handle.remove()
        self._handles = []


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
        return {"layers_path": s.layers_path, "num_layers": len(s.layers), "device": str(s.device),
                "dtype": str(s.dtype).replace("torch.", ""), "monitor_rank": s.monitor_rank,
                "hidden_size": int(getattr(s.runner.model_config.hf_text_config, "hidden_size", 0))}

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


__all__ = ["MillmWorkerExtension", "find_layers"]
