"""The process pool on its own: results, a worker whose start-up fails, a closed pool."""

from __future__ import annotations

import pytest

from relax.rewards.local import LocalReward
from relax.rewards.pool import ProcessPool
from relax.rewards.squad import SquadParams, f1_score
from relax.rewards.testing import exit_at_start_up, make_sample


def test_results_start_up_failures_and_close():
    pool = ProcessPool(
        {
            "f1": LocalReward(f1_score, SquadParams()),
            "broken": LocalReward(f1_score, SquadParams(), warm=exit_at_start_up),
        },
        size=1,
    )
    with pytest.raises(RuntimeError, match="worker start-up failed: SystemExit"):
        pool.call("f1", make_sample("Paris", "Paris"), timeout_s=30)
    assert pool.restarts == 1  # the failed worker was replaced (and fails the same way: every call says why)
    pool.close()
    with pytest.raises(RuntimeError, match="closed"):
        pool.call("f1", make_sample("Paris", "Paris"), timeout_s=30)
    good = ProcessPool({"f1": LocalReward(f1_score, SquadParams())}, size=1)
    assert good.call("f1", make_sample("Paris", "Paris"), timeout_s=30)["f1"] == 1.0
    with pytest.raises(TypeError, match="must be picklable"):
        ProcessPool({"x": lambda: None})
    good.close()


def test_a_fresh_workers_first_call_does_not_pay_the_torch_import():
    """A call's timeout covers the call: unpickling its Sample (whose module imports torch, 1.5 s
    here) happens at worker start-up, so a 0.5 s limit holds on a fresh worker's first call."""
    pool = ProcessPool({"f1": LocalReward(f1_score, SquadParams())}, size=1)
    try:
        assert pool.call("f1", make_sample("Paris", "Paris"), timeout_s=0.5)["f1"] == 1.0
        assert pool.restarts == 0
    finally:
        pool.close()
