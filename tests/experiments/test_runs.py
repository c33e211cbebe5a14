"""An experiment as a job (docs/experiments.md, "Runs"): a cancel keeps the points already
done and marks the run partial; a crashed runner's run is resumed from the points it
stored, computing only the rest, with the same figures; the sweeper queues a runner for a
run whose runner died and ends a cancel nobody saw; downloads (JSONL, CSV, Parquet read
by pyarrow) hold exactly the stored points; a backend without teacher-forced
distributions leaves KL null and says why; progress goes over the event bus."""

from __future__ import annotations

import csv
import io
import json
from datetime import timedelta

import pytest

from tests.background import runner_by_hand
from tests.experiments.conftest import api, ok, refused, wait_run, wait_until
from tests.v1.helpers import request
from tests.fixtures.served import GatedEngine

pytestmark = pytest.mark.django_db(transaction=True)

FEATURE = 3
PROMPTS = ["the cat sat on the mat and then it", "one two three four five", "a quick brown fox"]


def body(sae, **extra):
    return {
        "prompts": PROMPTS,
        "variants": [{"sae_id": sae.id, "index": FEATURE}],
        "strengths": [0.0, 4.0],
        "max_tokens": 4,
        **extra,
    }


def sweep(sae, **extra):
    from core.auth import ANONYMOUS
    from experiments.services import experiment_sweep_start

    return experiment_sweep_start(principal=ANONYMOUS, data=body(sae, **extra))


FIGURES = ("text", "token_ids", "kl_per_position", "target_before_per_position", "target_after_per_position", "loglik")


def figures(run_id: str) -> dict[int, tuple]:
    from experiments.models import ExperimentPoint

    return {p.ordinal: tuple(getattr(p, f) for f in FIGURES) for p in ExperimentPoint.objects.filter(run_id=run_id)}


def test_a_cancelled_sweep_keeps_its_points_and_is_partial(sae, llama, settings):
    from core.runtime import runtime
    from experiments.models import ExperimentPoint, ExperimentRun
    from experiments.services import experiment_cancel
    from core.auth import ANONYMOUS

    settings.EXPERIMENT_ENGINE_ROWS = 1
    inner = runtime().engine
    gate = GatedEngine(inner, hold=8)
    try:
        with runtime().replaced(engine=gate):
            run = sweep(sae)
            assert gate.reached.wait(120), "the eighth job never reached the engine"
            stored = wait_until(lambda: ExperimentPoint.objects.filter(run_id=run.id).count(), "a point stored")
            assert experiment_cancel(run_id=run.id, principal=ANONYMOUS).status == "cancelling"
            ended = wait_until(
                lambda: (r := ExperimentRun.objects.get(id=run.id)).status == "cancelled" and r, "cancel"
            )
            calls = gate.calls
            gate.release.set()
            done = wait_run(run.id)
    finally:
        gate.release.set()
    assert done.status == "cancelled" and done.partial and ended.partial
    kept = ExperimentPoint.objects.filter(run_id=run.id).count()
    assert stored <= kept < done.total
    assert done.done == kept
    assert gate.calls == calls  # nothing more went to the engine after the cancel
    wait_until(lambda: inner.status().in_flight == 0, "the engine to let the jobs go", 60)
    # a cancelled run's points still download
    # (read raw: a single JSONL line is a JSON document too)
    resp = request(llama.url, "GET", f"/api/experiments/{run.id}/download?format=jsonl", None, headers={})
    assert resp.status == 200 and len(resp.body.decode().splitlines()) == kept
    # cancelling it again changes nothing; a completed run cannot be cancelled
    assert ok(api(llama, "POST", f"/api/experiments/{run.id}/cancel"))["status"] == "cancelled"
    finished = wait_run(sweep(sae, prompts=PROMPTS[:1], strengths=[1.0]).id)
    assert finished.status == "completed"
    refused(api(llama, "POST", f"/api/experiments/{finished.id}/cancel"), 409, "EXPERIMENT_NOT_CANCELLABLE")


def test_a_crashed_sweep_resumes_from_its_points_with_the_same_figures(sae, llama, settings):
    from core.runtime import runtime
    from experiments import runner
    from experiments.models import ExperimentPoint, ExperimentRun
    from experiments.services import experiments_resume

    settings.EXPERIMENT_ENGINE_ROWS = 2
    reference = wait_run(sweep(sae).id)
    assert reference.status == "completed", reference.error

    # the same sweep, its runner called by hand (no queued task beside it)
    run = ExperimentRun.objects.create(kind="sweep", spec=dict(reference.spec), total=reference.total)
    inner = runtime().engine
    gate = GatedEngine(inner, hold=10)
    with runner_by_hand(gate, lambda stop: runner.experiment_run(run_id=run.id, stop=stop)) as (stop, outcome, _):
        assert gate.reached.wait(120), "the tenth job never reached the engine"
        wait_until(lambda: ExperimentPoint.objects.filter(run_id=run.id).count() >= 2, "two points in")
        stop.set()
        # the runner sees the stop at its next heartbeat with the tenth job still held, and
        # cancels it (released before, the rest of a tiny sweep could finish inside one
        # heartbeat and leave nothing to resume); the runner's thread then ends once the
        # gate lets the held job's waiting thread go, as it leaves this block
        assert gate.cancelled.wait(120), "the stopped runner did not cancel its held job"
    assert outcome == ["stopped"]
    crashed = ExperimentRun.objects.get(id=run.id)
    assert crashed.status == "running" and crashed.runner
    before = figures(run.id)
    assert 2 <= len(before) < reference.total

    # a restarted server's start-up (millm_site/asgi.py) takes it over (force) and resumes
    counter = GatedEngine(inner, hold=0)
    tags: list[str] = []
    real = counter.agenerate
    counter.agenerate = lambda job: (tags.append(job.request_id.split("-", 1)[1].rsplit("-", 1)[0]), real(job))[1]
    with runtime().replaced(engine=counter):
        assert experiments_resume(force=True) == 1
        done = wait_run(run.id)
    assert done.status == "completed" and not done.partial and done.resumes == 1
    after = figures(run.id)
    assert after.keys() == figures(reference.id).keys()
    for ordinal, values in before.items():  # the points stored before the crash were kept, not redone
        assert after[ordinal] == values
    for ordinal, values in figures(reference.id).items():
        assert after[ordinal][:2] == values[:2], ordinal  # the same texts and tokens
        assert after[ordinal][2] == pytest.approx(values[2], abs=1e-6) if values[2] else after[ordinal][2] == values[2]
    # only what was missing ran again: per missing steered point a generation, a KL pass
    # and a log-likelihood pass, plus one reference pass per prompt with any missing
    per = 1 + 1 * 2  # each prompt's default and its variant at 2 strengths
    missing = [o for o in after if o not in before]
    steered = [o for o in missing if o % per]
    prompts = {o // per for o in missing}
    defaults = [o for o in missing if not o % per]
    assert counter.calls == 3 * len(steered) + len(prompts) + len(defaults), (sorted(tags), sorted(before))


def test_the_sweeper_resumes_a_dead_runners_run_and_ends_an_unseen_cancel(sae):
    from django.utils import timezone

    from experiments.models import ExperimentRun
    from experiments.sweeper import sweep_once

    long_ago = timezone.now() - timedelta(hours=1)
    alive = ExperimentRun.objects.create(
        kind="sweep", spec={}, status="running", runner="gone:1", runner_seen_at=long_ago
    )
    cancelled = ExperimentRun.objects.create(
        kind="sweep", spec={}, status="cancelling", runner="gone:2", runner_seen_at=long_ago
    )
    from core.jobs import LongRuns

    queued: list[str] = []
    real = LongRuns.enqueue
    LongRuns.enqueue = lambda self, run_id, force=False: queued.append(run_id)  # type: ignore[method-assign]
    try:
        assert sweep_once() == {"cancelled": 1, "resumed": 1}
    finally:
        LongRuns.enqueue = real  # type: ignore[method-assign]
    assert queued == [alive.id]
    assert ExperimentRun.objects.get(id=cancelled.id).status == "cancelled"
    assert ExperimentRun.objects.get(id=alive.id).runner is None
    assert sweep_once() == {"cancelled": 0, "resumed": 0}  # its heartbeat was set to now
    ExperimentRun.objects.filter(id=alive.id).update(status="cancelled")


def test_downloads_parse_and_hold_the_points(sae, llama):
    import pyarrow.parquet as pq

    from experiments.models import ExperimentPoint

    run = ok(api(llama, "POST", "/api/experiments/sweep", body(sae)), 202)["run"]
    assert wait_run(run["id"]).status == "completed"
    points = ok(api(llama, "GET", f"/api/experiments/{run['id']}/points?limit=1000"))["points"]
    assert len(points) == 9 == ExperimentPoint.objects.filter(run_id=run["id"]).count()

    status, raw = api(llama, "GET", f"/api/experiments/{run['id']}/download?format=jsonl")
    assert status == 200
    rows = [json.loads(line) for line in raw.decode().splitlines()]
    assert len(rows) == len(points)
    for row, point in zip(rows, points, strict=True):
        assert row["run_id"] == run["id"] and row["kind"] == "sweep"
        for key, value in point.items():
            assert row[key] == value, key

    status, raw = api(llama, "GET", f"/api/experiments/{run['id']}/download?format=csv")
    assert status == 200
    table = list(csv.DictReader(io.StringIO(raw.decode())))
    assert len(table) == len(points)
    for row, point in zip(table, points, strict=True):
        assert row["text"] == point["text"]
        assert json.loads(row["token_ids"]) == point["token_ids"]
        assert row["is_default"] == ("true" if point["is_default"] else "false")
        if point["kl_mean"] is None:
            assert row["kl_mean"] == ""
        else:
            assert float(row["kl_mean"]) == point["kl_mean"]
            assert json.loads(row["kl_per_position"]) == point["kl_per_position"]

    status, raw = api(llama, "GET", f"/api/experiments/{run['id']}/download?format=parquet")
    assert status == 200 and raw[:4] == b"PAR1"
    table = pq.read_table(io.BytesIO(raw)).to_pylist()
    assert len(table) == len(points)
    for row, point in zip(table, points, strict=True):
        assert row["ordinal"] == point["ordinal"] and row["text"] == point["text"]
        assert row["token_ids"] == point["token_ids"]
        assert row["kl_per_position"] == point["kl_per_position"]
        assert row["loglik"] == point["loglik"]
        assert (json.loads(row["target_after_per_position"]) if row["target_after_per_position"] else None) == point[
            "target_after_per_position"
        ]
    # a format it does not write is refused naming the field
    refused(api(llama, "GET", f"/api/experiments/{run['id']}/download?format=xlsx"), 422, "VALIDATION_ERROR")


def test_without_distributions_a_sweeps_kl_is_null_with_the_reason(sae, llama, monkeypatch, published):
    import msgspec

    from core.runtime import runtime
    from experiments.models import ExperimentPoint

    engine = runtime().engine
    real = engine.status

    def status():
        got = real()
        caps = msgspec.structs.replace(
            got.capabilities, prompt_distributions=False, prompt_distributions_reason="vLLM cannot give them exactly"
        )
        return msgspec.structs.replace(
            got, batching={**(got.batching or {}), "capabilities": msgspec.to_builtins(caps)}
        )

    monkeypatch.setattr(engine, "status", status)
    seen: list[dict] = []
    real_generate = engine.agenerate

    def agenerate(job):
        seen.append({"distributions_from": job.distributions_from})
        return real_generate(job)

    monkeypatch.setattr(engine, "agenerate", agenerate)
    run = ok(api(llama, "POST", "/api/experiments/sweep", body(sae, prompts=PROMPTS[:1])), 202)["run"]
    done = wait_run(run["id"])
    assert done.status == "completed", done.error
    assert done.result["kl_unavailable"] == "vLLM cannot give them exactly"
    assert all(p.kl_mean is None and p.kl_per_position is None for p in ExperimentPoint.objects.filter(run=done))
    assert all(s["distributions_from"] is None for s in seen) and seen  # none was asked of the engine
    # the log-likelihood does not need them
    assert all(p.loglik is not None for p in ExperimentPoint.objects.filter(run=done))
    # progress and the end went over the event bus, to the owner only, with no prompt text
    events = [(name, data) for name, data in published if name.startswith("experiment:")]
    assert ("experiment:complete", {"run_id": done.id, "kind": "sweep", "_owner": "anonymous"}) in events
    progress = [d for n, d in events if n == "experiment:progress" and d["run_id"] == done.id]
    assert progress[-1]["status"] == "completed" and progress[-1]["done"] == progress[-1]["total"] == 3
    assert not any("cat sat" in json.dumps(d) for _, d in events)
