"""The row router (gpu_engine.interp.rows) without a model: what a forward's rows receive.

The batched tests (tests/batching, tests/vllm, test_llamacpp*) check whole generations
against solo runs; these check the routing itself where those rarely reach: a router that
grows past its first size while requests hold deltas (vLLM's workers), unsteered rows
beside steered ones, padding rows, and a request leaving."""

from __future__ import annotations

import torch

from gpu_engine.interp.hooks import AttachmentPlan, RequestHooks
from gpu_engine.interp.rows import RowRouter

KEY = ("sae", 1)
D = 4


def steered(i: int) -> RequestHooks:
    plan = AttachmentPlan(KEY)
    plan.delta = torch.full((D,), float(i + 1))
    return RequestHooks(f"r{i}", {KEY: plan})


def added(router: RowRouter, parts) -> torch.Tensor:
    """What the hook adds to each row of a forward of ``parts`` (zeros where no table)."""
    ctx = router.context(parts)
    table = ctx.delta_tables.get(KEY)
    n = parts[-1][2]
    return torch.zeros((n, D)) if table is None else table.index_select(0, ctx.row_slots)


def test_a_growing_router_keeps_every_requests_delta_in_its_own_rows():
    router = RowRouter(device="cpu")
    rows = [router.add(steered(i)) for i in range(20)]  # past the first 16 slots
    plain = router.add(None)
    # request i runs 2 rows, the unsteered one 3
    parts = [(row, 2 * i, 2 * i + 2, 7) for i, row in enumerate(rows)] + [(plain, 40, 43, 0)]
    got = added(router, parts)
    want = torch.cat([torch.full((2, D), float(i + 1)) for i in range(20)] + [torch.zeros((3, D))])
    assert torch.equal(got, want)


def test_a_request_that_leaves_takes_its_delta_and_its_slot_goes_to_the_next():
    router = RowRouter(device="cpu", max_rows=2)
    a, b = router.add(steered(0)), router.add(steered(1))
    router.remove(a)
    c = router.add(None)  # takes a's slot: its rows must be plain
    assert torch.equal(added(router, [(b, 0, 1, 5), (c, 1, 2, 5)]), torch.tensor([[2.0] * D, [0.0] * D]))
    router.remove(b)
    # nobody steers any more: the hooks get no table to add
    assert router.context([(c, 0, 1, 5)]).delta_tables == {}


def test_padding_rows_take_the_slot_but_no_monitor_reads_them():
    hooks = steered(0)
    hooks.plans[KEY].post.append(object())  # stands for a monitor: the request's rows go to the hooks
    router = RowRouter(device="cpu", max_rows=1)
    row = router.add(hooks)
    # a left-padded prefill row of width 5 holding a 3-token prompt
    ctx = router.context([(row, 0, 5, -2)])
    assert [(s.row_start, s.row_end, s.start_position) for s in ctx.segments] == [(2, 5, 0)]
    assert ctx.row_slots.tolist() == [row.slot] * 5


def test_counts_go_to_the_requests_steered_at_an_applied_attachment():
    router = RowRouter(device="cpu", max_rows=2)
    a, b = router.add(steered(0)), router.add(None)
    router.count([a, b], {KEY})
    router.count([a, b], set())  # a forward whose hook never added anything
    assert [c.count for c in a.hooks.steering_counts()] == [1]
