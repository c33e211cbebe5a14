"""A dashboard run takes the logit effects of the newest complete run of the same SAE,
layer, backend and model when the engine's own product for a few spot-check features
agrees with the stored ones (docs/features.md, "How a dashboard run works"), and
computes every feature afresh when it does not: the engine's ``feature_logits`` calls
are counted, and the rows compared with the first run's (which tests/features/
test_runner.py checks against ``W_dec @ W_U.T``)."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from tests.features.test_runner import engine_client, sae, start, wait_run  # noqa: F401 - fixtures

pytestmark = pytest.mark.django_db(transaction=True)


class CountingEngine:
    """The engine client, recording the features of every ``feature_logits`` call."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.lock = threading.Lock()
        self.calls: list[list[int]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def feature_logits(self, job: Any, **kwargs: Any) -> Any:
        with self.lock:
            self.calls.append(list(job.features))
        return self.inner.feature_logits(job, **kwargs)

    def take(self) -> list[int]:
        with self.lock:
            out = sorted(f for call in self.calls for f in call)
            self.calls.clear()
        return out


def logits_of(run: Any) -> dict[int, tuple[list, list]]:
    from features.models import FeatureDashboard

    return {
        i: (top, bottom)
        for i, top, bottom in FeatureDashboard.objects.filter(run=run).values_list("index", "logit_top", "logit_bottom")
    }


def test_a_second_run_reuses_the_logit_effects_only_while_the_engine_agrees(sae, engine_client):  # noqa: F811
    from core.runtime import runtime
    from features.models import FeatureDashboard
    from features.runner import LOGIT_SPOT_CHECKS

    d_sae = sae.d_sae
    counting = CountingEngine(engine_client)
    with runtime().replaced(engine=counting):
        first = wait_run(start(sae).id)
        assert first.status == "completed" and first.complete, first.error
        assert counting.take() == list(range(d_sae))  # nothing to reuse: every feature computed
        expected = logits_of(first)
        assert len(expected) == d_sae and all(top and bottom for top, bottom in expected.values())

        second = wait_run(start(sae).id)
        assert second.status == "completed" and second.complete, second.error
        spot = counting.take()
        assert 0 in spot and d_sae - 1 in spot and len(spot) <= LOGIT_SPOT_CHECKS < d_sae  # only the spot check
        assert logits_of(second) == expected

        # the newest run's stored effect of a spot-check feature no longer matches the
        # engine (as after a changed SAE file): every feature is computed again
        top, _ = expected[0]
        changed = [{**top[0], "value": top[0]["value"] + 1.0}, *top[1:]]
        assert FeatureDashboard.objects.filter(run=second, index=0).update(logit_top=changed) == 1
        third = wait_run(start(sae).id)
        assert third.status == "completed" and third.complete, third.error
        calls = counting.take()
        assert calls == sorted(spot + list(range(d_sae)))
        assert logits_of(third) == expected
