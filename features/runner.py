"""Running a dashboard: one runner per run, DASHBOARD_ENGINE_ROWS contexts at the engine.

The runner is a Celery task of the ``dashboards`` queue in distributed mode and a job of
the in-process ``dashboards`` pool embedded (``core.jobs``); either way it is this one
function, ``dashboard_run``. It takes the run over (``services.RUNS``, ``core.jobs.LongRuns``: a run
has one runner; one whose heartbeat is older than BATCH_RUNNER_STALE_S is presumed dead),
then:

1. reads the SAE's attachment from the engine (its d_sae; not attached: ``failed`` with
   SAE_NOT_ATTACHED);
2. reads the corpus (the offline sample, or the owner's /v1 file a chunk at a time),
   tokenizes it at the engine (``tokenize``) and packs the tokens into contexts of
   ``context_tokens`` up to ``token_budget`` (``features.corpus``); the contexts are kept
   in the run's working folder (DASHBOARD_DIR/<run id>), so a resumed run reads the same;
3. keeps DASHBOARD_ENGINE_ROWS contexts at the engine at once, each a greedy one-token
   ``GenerationJob`` of ``priority="batch"``, unsteered, with a packed monitor entry on
   the prompt (every non-zero feature of every token); each context's records go to the
   ``FeatureAccumulator`` in context order (a context that finishes early waits for the
   ones before it, at most AHEAD x DASHBOARD_ENGINE_ROWS of them), so a run's figures do
   not depend on the engine's timing;
4. every CHECKPOINT_CONTEXTS contexts saves the accumulator (``checkpoint.json`` names
   the last complete checkpoint; written after it, atomically): a runner that dies is
   resumed by the next from there;
5. heartbeat, progress (``dashboard:progress``) and the run's status every HEARTBEAT_S:
   ``cancelling`` cancels the contexts at the engine and ends the run ``cancelled``;
6. the logit effects of every feature (``feature_logits``; they need no corpus, so they
   are requested on a thread of their own when the corpus pass starts, and taken from the
   newest complete run of the same SAE, layer, backend and model when the engine's
   product for LOGIT_SPOT_CHECKS features agrees with it: ``_Runner._logits``); once every
   context is in, ``accumulator.finish`` and every feature's row with the summary and
   ``complete=True`` in one transaction (``services.dashboard_store``); the working
   folder is deleted.

An engine error (the model unloaded, the SAE detached) ends the run ``failed`` with the
error's code; nothing is stored. A crash (the ``stop`` event in tests, a killed worker)
leaves the run ``running`` with its checkpoint; a restarted server (``force``) or the next
worker once the heartbeat is stale resumes it.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
import contextvars
import uuid
from typing import Any

import numpy as np
import structlog
from django.conf import settings
from django.db import close_old_connections

from core.errors import MillmError
from core.jobs import RunDatabase, engine_command, run_error
from core.runtime import runtime
from features import services
from features.models import DashboardRun
from registry.engines import addressing, sae_engine

log = structlog.get_logger(__name__)

HEARTBEAT_S = 1.0
CHECKPOINT_CONTEXTS = 256  # contexts between two checkpoints of the accumulator
TOKENIZE_TEXTS = 256  # texts per tokenize command
LOGIT_FEATURES = 4096  # features per feature_logits command
LOGIT_TOP_N = 10
AHEAD = 4  # contexts read ahead of the oldest not yet accumulated, in DASHBOARD_ENGINE_ROWS
# contexts sent beyond DASHBOARD_ENGINE_ROWS, to wait in the engine's batch queue (which
# still runs at most its batch rows at once) so a row that frees is refilled at the next
# step: 4 measured slower on the 2-core benchmark machine (one loaded round: the corpus
# pass 0.57 of the plain forward against 0.85 with none), so none
QUEUED_EXTRA = 0
LOGIT_REUSE = True  # an earlier run's logit effects of the same SAE, layer, backend and model (see _logits)
LOGIT_SPOT_CHECKS = 8  # features recomputed before the logit effects of an earlier run are reused


class _Stopped(Exception):
    """The run stopped without an end of its own: a crash (``stop``) or taken over."""


def dashboard_run(*, run_id: str, force: bool = False, stop: threading.Event | None = None) -> str:
    """Run the dashboard to its end (``LongRuns.run``); ``force`` takes it over even from
    a runner that looks alive (embedded start-up: this process is the only runner there
    is). ``stop`` ends the run abruptly, as a crash would (tests). Returns how it ended."""
    return services.RUNS.run(run_id, force=force, main=lambda run, runner: _Runner(run, runner, stop).run)


class _Runner:
    def __init__(self, run: DashboardRun, runner: str, stop: threading.Event | None) -> None:
        self.run_id = run.id
        self.sae_id = run.sae_id
        self.layer = run.layer
        self.owner = run.owner
        self.corpus = run.corpus
        self.file_id = run.corpus_file_id
        self.text_field = run.text_field or "text"
        self.budget = run.token_budget
        self.context_tokens = run.context_tokens
        self.top_k = run.top_k
        self.window = run.window
        self.runner = runner
        self.stop = stop
        self.rows = int(settings.DASHBOARD_ENGINE_ROWS)
        self.workdir = services.workdir(run.id)
        self.backend: str | None = None
        self.model: str | None = None
        self.db = RunDatabase(thread_name_prefix="millm-dashboard-db")

    async def off(self, fn: Any, *args: Any) -> Any:
        """Blocking work (the engine's commands, numpy, files) off the loop, in this
        task's context (the engine it addresses, ``run``)."""
        ctx = contextvars.copy_context()
        return await asyncio.get_running_loop().run_in_executor(None, ctx.run, fn, *args)

    async def beating(self, fn: Any, *args: Any) -> Any:
        """``off(fn, *args)`` with the heartbeat kept up meanwhile (tokenizing a corpus,
        the logit effects, ``finish``: longer than BATCH_RUNNER_STALE_S on a large SAE or
        corpus); taken over meanwhile: ``_Stopped("lost")`` once it returns."""
        lost = False

        async def beat() -> None:
            nonlocal lost
            while True:
                await asyncio.sleep(HEARTBEAT_S)
                if await self.db(services.dashboard_heartbeat, run_id=self.run_id, runner=self.runner) is None:
                    lost = True

        task = asyncio.ensure_future(beat())
        try:
            result = await self.off(fn, *args)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        if lost:
            raise _Stopped("lost")
        return result

    async def run(self) -> str:
        # the engine of the SAE's model (registry.engines), derived again on every
        # resume: a run taken over after a restart addresses the same engine
        async with self.db:
            engine = await self.db(sae_engine, self.sae_id)
            with addressing(engine):
                return await self._run()

    async def _run(self) -> str:
        try:
            d_sae = await self.off(self._attachment)
            contexts = await self.beating(self._contexts)
            if not contexts:
                from features.corpus import CorpusError

                raise CorpusError(
                    "corpus_empty", "The corpus has no text to read (no context of 2 tokens or more)", "corpus"
                )
            acc, done, tokens = await self.beating(self._accumulator, d_sae)
            if not await self.db(
                services.dashboard_advance,
                run_id=self.run_id,
                runner=self.runner,
                contexts_done=done,
                tokens_done=tokens,
                contexts_total=len(contexts),
                force=True,
            ):
                raise _Stopped("lost")
            outcome = await self._loop(contexts, acc, done, tokens)
            if outcome != "read":
                return outcome
            # the logit effects after the corpus pass, not beside it: on 2 CPU cores the
            # engine's product took the forward's cores (the pass fell from 0.93 to 0.87 of
            # a plain forward on transformers, 0.78 on vLLM; docs/performance.md)
            logits = await self.beating(self._logits, d_sae)
            rows, summary = await self.beating(acc.finish, logits)
            summary = {**summary, "backend": self.backend, "model": self.model, "layer": self.layer}
            # its end deletes the working folder (services._ended), as a failure's and a cancel's do
            return await self.db(
                services.dashboard_store, run_id=self.run_id, runner=self.runner, rows=rows, summary=summary
            )
        except _Stopped as exc:
            return str(exc)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - every failure ends the run with its code
            code, message = _error_of(exc)
            if code == "INTERNAL_ERROR":
                log.exception("dashboard_run_error", run_id=self.run_id)
            await self.db(services.dashboard_fail, run_id=self.run_id, runner=self.runner, code=code, message=message)
            return "failed"

    # ------------------------------------------------------------------ before the loop

    def _attachment(self) -> int:
        status = runtime().engine.status()
        self.backend, self.model = status.backend, status.model_id
        attachment = services.attached_layer(sae_id=self.sae_id, layer=self.layer, attachments=list(status.attachments))
        return int(attachment.d_sae)

    def _token_lists(self) -> Any:
        """The corpus's documents as token lists, tokenized at the engine a few hundred
        at a time, until the budget is covered."""
        from gpu_engine.api.protocol import TokenizeJob

        seen = 0
        group: list[str] = []

        def tokenize(texts: list[str]) -> list[list[int]]:
            job = TokenizeJob(request_id=f"{self.run_id}-tok-{uuid.uuid4().hex[:8]}", texts=texts)
            return list(engine_command(runtime().engine.tokenize, job).token_ids)

        from gpu_engine.api.jobs import MAX_TOKENIZE_CHARS

        texts = services.corpus_texts(
            corpus=self.corpus, file_id=self.file_id, text_field=self.text_field, owner=self.owner
        )
        for text in texts:
            group.append(text[:MAX_TOKENIZE_CHARS])  # the rest of so long a text is past any budget
            if len(group) < TOKENIZE_TEXTS:
                continue
            for ids in tokenize(group):
                seen += len(ids)
                yield ids
            group = []
            if seen >= self.budget:
                return
        if group:
            yield from tokenize(group)

    def _contexts(self) -> list[list[int]]:
        """The run's contexts: packed once and kept in the working folder, so a resumed
        run reads exactly the same ones."""
        from features.corpus import pack_contexts

        path = self.workdir / "contexts.npz"
        if path.exists():
            with np.load(path) as data:
                flat, offsets = data["tokens"], data["offsets"]
            return [flat[offsets[i] : offsets[i + 1]].tolist() for i in range(len(offsets) - 1)]
        contexts = pack_contexts(self._token_lists(), context_tokens=self.context_tokens, budget=self.budget)
        self.workdir.mkdir(parents=True, exist_ok=True)
        offsets = np.cumsum([0] + [len(c) for c in contexts]).astype(np.int64)
        flat = np.asarray([t for c in contexts for t in c], dtype=np.int64)
        tmp = self.workdir / "contexts.tmp.npz"
        np.savez(tmp, tokens=flat, offsets=offsets)
        os.replace(tmp, path)
        return [list(c) for c in contexts]

    def _accumulator(self, d_sae: int) -> tuple[Any, int, int]:
        """A fresh accumulator, or the last checkpoint's with the contexts and tokens it
        holds."""
        from features.accumulate import FeatureAccumulator

        accdir = self.workdir / "acc"
        accdir.mkdir(parents=True, exist_ok=True)
        meta = self.workdir / "checkpoint.json"
        if meta.exists():
            saved = json.loads(meta.read_text())
            path = self.workdir / saved["file"]
            if path.exists():
                log.info("dashboard_resumed", run_id=self.run_id, contexts_done=saved["contexts_done"])
                return FeatureAccumulator.load(path, accdir), int(saved["contexts_done"]), int(saved["tokens_done"])
        acc = FeatureAccumulator(d_sae, top_k=self.top_k, window=self.window, workdir=accdir)
        return acc, 0, 0

    def _checkpoint(self, acc: Any, done: int, tokens: int) -> str:
        path = self.workdir / f"checkpoint-{done}.npz"
        acc.save(path)
        meta = self.workdir / "checkpoint.json"
        tmp = self.workdir / "checkpoint.json.tmp"
        tmp.write_text(json.dumps({"contexts_done": done, "tokens_done": tokens, "file": path.name}))
        os.replace(tmp, meta)
        for old in self.workdir.glob("checkpoint-*.npz"):
            if old != path:
                old.unlink(missing_ok=True)
        return str(path)

    # ------------------------------------------------------------------ the loop

    def _job(self, index: int, context: list[int]) -> Any:
        from gpu_engine.api.protocol import (
            GenerationJob,
            MonitorEntry,
            MonitorSpec,
            SamplingParams,
            SteeringSpec,
        )

        return GenerationJob(
            request_id=f"{self.run_id}-{index}-{uuid.uuid4().hex[:8]}",
            prompt_token_ids=context,
            add_special_tokens=False,
            sampling=SamplingParams(max_tokens=1, temperature=0, token_texts=True),
            monitor=MonitorSpec(
                [
                    MonitorEntry(
                        sae_id=self.sae_id,
                        layer=self.layer,
                        packed=True,
                        positions="prompt",
                        read_point="pre_steering",
                    )
                ]
            ),
            steering=SteeringSpec(),
            priority="batch",
        )

    async def _context(self, index: int, context: list[int]) -> tuple[list[str], Any, Any, Any]:
        """One context at the engine: its tokens' texts and its rows' CSR."""
        from gpu_engine.api.protocol import ErrorEvent, FinishEvent

        finish = None
        async for event in runtime().engine.agenerate(self._job(index, context)):
            if isinstance(event, ErrorEvent):
                raise event.to_exception()
            if isinstance(event, FinishEvent):
                finish = event
        if finish is None:
            raise MillmError("The engine ended a context without finishing it")
        tokens = list(finish.prompt_tokens)
        if len(tokens) != len(context):
            raise MillmError(f"The engine gave {len(tokens)} token texts for a context of {len(context)} tokens")
        return (tokens, *csr_of(finish.activations, len(context), sae_id=self.sae_id, layer=self.layer))

    async def _loop(self, contexts: list[list[int]], acc: Any, done: int, tokens_done: int) -> str:
        at_engine: dict[asyncio.Task, int] = {}
        ready: dict[int, tuple] = {}
        submitted = done
        since_checkpoint = 0
        beat = 0.0
        total = len(contexts)
        try:
            while True:
                if self.stop is not None and self.stop.is_set():
                    log.warning("dashboard_run_stopped", run_id=self.run_id, contexts_done=done)
                    raise _Stopped("stopped")
                now = time.monotonic()
                if now - beat >= HEARTBEAT_S:
                    beat = now
                    status = await self.db(services.dashboard_heartbeat, run_id=self.run_id, runner=self.runner)
                    if status is None:
                        raise _Stopped("lost")
                    if status == DashboardRun.Status.CANCELLING:
                        await _cancel(at_engine)
                        await self.db(services.dashboard_cancelled, run_id=self.run_id, runner=self.runner)
                        log.info("dashboard_cancelled", run_id=self.run_id, contexts_done=done)
                        return DashboardRun.Status.CANCELLED
                    await self.db(
                        services.dashboard_advance,
                        run_id=self.run_id,
                        runner=self.runner,
                        contexts_done=done,
                        tokens_done=tokens_done,
                    )
                # a context the engine holds long (a slow row) stops the sending once the
                # others are AHEAD times the rows past it: what waits for it stays bounded
                while (
                    len(at_engine) < self.rows + QUEUED_EXTRA
                    and submitted < total
                    and submitted - done < AHEAD * self.rows
                ):
                    at_engine[asyncio.ensure_future(self._context(submitted, contexts[submitted]))] = submitted
                    submitted += 1
                if done >= total:
                    break
                finished, _ = await asyncio.wait(at_engine, timeout=HEARTBEAT_S, return_when=asyncio.FIRST_COMPLETED)
                for task in finished:
                    ready[at_engine.pop(task)] = task.result()  # an engine error ends the run
                while done in ready:
                    tokens, row_ptr, indices, values = ready.pop(done)
                    await self.off(acc.add, done, contexts[done], tokens, row_ptr, indices, values)
                    tokens_done += len(contexts[done])
                    done += 1
                    since_checkpoint += 1
                if since_checkpoint >= CHECKPOINT_CONTEXTS and done < total:
                    since_checkpoint = 0
                    path = await self.off(self._checkpoint, acc, done, tokens_done)
                    await self.db(
                        services.dashboard_advance,
                        run_id=self.run_id,
                        runner=self.runner,
                        contexts_done=done,
                        tokens_done=tokens_done,
                        checkpoint_path=path,
                    )
        finally:
            await _cancel(at_engine)
        await self.db(
            services.dashboard_advance,
            run_id=self.run_id,
            runner=self.runner,
            contexts_done=done,
            tokens_done=tokens_done,
            force=True,
        )
        return "read"

    # ------------------------------------------------------------------ after the loop

    def _logits(self, d_sae: int) -> dict[str, list[Any]]:
        """Every feature's logit effect (W_dec[i] @ W_U.T): its top and bottom tokens, as
        one FeatureLogitsResult's fields (what ``FeatureAccumulator.finish`` reads). They
        depend on the model and the SAE only: the newest complete run of this SAE at this
        layer on the same backend and model holds them, and they are taken from there
        when the engine's own product for a few spot-check features (the first, the last
        and LOGIT_SPOT_CHECKS - 2 spread between) gives the same tokens and values, so
        a changed model or SAE is computed afresh."""
        reused = self._stored_logits(d_sae) if LOGIT_REUSE else None
        if reused is not None:
            checks = sorted({round(i * (d_sae - 1) / max(LOGIT_SPOT_CHECKS - 1, 1)) for i in range(LOGIT_SPOT_CHECKS)})
            fresh = self._engine_logits(checks, "spot")
            if _same_logits(fresh, reused, checks):
                log.info("dashboard_logits_reused", run_id=self.run_id, features=d_sae)
                return reused
        return self._engine_logits(list(range(d_sae)), "all")

    def _stored_logits(self, d_sae: int) -> dict[str, list[Any]] | None:
        """The logit effects of every feature as the newest complete run of this SAE,
        layer, backend and model stored them (None: no such run, or one without them)."""
        from features.models import FeatureDashboard

        close_old_connections()
        try:
            previous = (
                DashboardRun.objects.filter(sae_id=self.sae_id, layer=self.layer, complete=True)
                .exclude(id=self.run_id)
                .order_by("-finished_at")
                .only("id", "summary")
                .first()
            )
            if previous is None or not isinstance(previous.summary, dict):
                return None
            if previous.summary.get("backend") != self.backend or previous.summary.get("model") != self.model:
                return None
            stored = list(
                FeatureDashboard.objects.filter(run_id=previous.id)
                .order_by("index")
                .values_list("index", "logit_top", "logit_bottom")
            )
        finally:
            close_old_connections()
        if [row[0] for row in stored] != list(range(d_sae)):
            return None
        out: dict[str, list[Any]] = {k: [] for k in _LOGIT_KEYS}
        for index, top, bottom in stored:
            if not top or not bottom:
                return None
            out["features"].append(index)
            for side, entries in (("top", top), ("bottom", bottom)):
                out[f"{side}_ids"].append([e["token_id"] for e in entries])
                out[f"{side}_values"].append([e["value"] for e in entries])
                out[f"{side}_tokens"].append([e["token"] for e in entries])
        return out

    def _engine_logits(self, features: list[int], tag: str) -> dict[str, list[Any]]:
        """The engine's logit effects of ``features`` (``feature_logits``), LOGIT_FEATURES
        a command."""
        from gpu_engine.api.protocol import FeatureLogitsJob

        out: dict[str, list[Any]] = {k: [] for k in _LOGIT_KEYS}
        for start in range(0, len(features), LOGIT_FEATURES):
            job = FeatureLogitsJob(
                request_id=f"{self.run_id}-logits-{tag}-{start}",
                sae_id=self.sae_id,
                layer=self.layer,
                features=features[start : start + LOGIT_FEATURES],
                top_n=LOGIT_TOP_N,
            )
            result = engine_command(runtime().engine.feature_logits, job)
            for key in _LOGIT_KEYS:
                out[key].extend(getattr(result, key))
        return out


_LOGIT_KEYS = ("features", "top_ids", "top_values", "top_tokens", "bottom_ids", "bottom_values", "bottom_tokens")


def _same_logits(fresh: dict[str, list[Any]], stored: dict[str, list[Any]], features: list[int]) -> bool:
    """Whether the engine's fresh logit effects of ``features`` are the stored ones: the
    same token ids (and texts, as stored) and values within float32 rounding (the
    product over a few rows may round differently from the one over all of them)."""
    from features.accumulate import _clean

    at = {f: i for i, f in enumerate(fresh["features"])}
    for f in features:
        if f not in at:
            return False
        i = at[f]
        for side in ("top", "bottom"):
            if list(fresh[f"{side}_ids"][i]) != list(stored[f"{side}_ids"][f]):
                return False
            if [_clean(t) for t in fresh[f"{side}_tokens"][i]] != list(stored[f"{side}_tokens"][f]):
                return False
            a = np.asarray(fresh[f"{side}_values"][i], dtype=np.float64)
            b = np.asarray(stored[f"{side}_values"][f], dtype=np.float64)
            if a.shape != b.shape or not np.allclose(a, b, rtol=1e-5, atol=1e-6):
                return False
    return True


async def _cancel(tasks: dict[asyncio.Task, int]) -> None:
    """Cancel the contexts at the engine (each task's stream cancels its job) and wait
    until each has let go."""
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.gather(*tasks, return_exceptions=True)
    tasks.clear()


def csr_of(records: list[Any], rows: int, *, sae_id: str, layer: int) -> tuple[Any, Any, Any]:
    """One CSR (row_ptr, indices, values) over a context's ``rows`` prompt rows from the
    packed records of its FinishEvent (one per encoded chunk of consecutive rows); a row
    no record covers has no non-zero feature."""
    from gpu_engine.api.monitoring import unpack

    per_row: list[tuple[Any, Any] | None] = [None] * rows
    for record in records:
        if record.packed is None or record.sae_id != sae_id or record.layer != layer:
            continue
        row_ptr, indices, values = unpack(record.packed)
        for r in range(record.packed.rows):
            at = record.position + r
            if 0 <= at < rows:
                per_row[at] = (indices[row_ptr[r] : row_ptr[r + 1]], values[row_ptr[r] : row_ptr[r + 1]])
    counts = np.zeros(rows + 1, dtype=np.int64)
    for r, entry in enumerate(per_row):
        counts[r + 1] = 0 if entry is None else len(entry[0])
    row_ptr = np.cumsum(counts)
    kept = [e for e in per_row if e is not None and len(e[0])]
    indices = np.concatenate([e[0] for e in kept]).astype(np.int64) if kept else np.zeros(0, dtype=np.int64)
    values = np.concatenate([e[1] for e in kept]).astype(np.float32) if kept else np.zeros(0, dtype=np.float32)
    return row_ptr, indices, values


def _error_of(exc: Exception) -> tuple[str, str]:
    """The run's error {code, message} for what ended it."""
    from features.corpus import CorpusError

    if isinstance(exc, CorpusError):
        return services.corpus_error(exc).code, str(getattr(exc, "message", exc))
    return run_error(exc, internal="The dashboard run failed on the server; its log says why")


def dashboards_resume(*, force: bool) -> int:
    return services.dashboards_resume(force=force)
