"""``StepRows``: a step's queue rows as the async trainer uses them -- samples in group order with
rewards merged, and the queue roles' per-token columns following their samples through the sort
and through group filtering (by position, never by object identity)."""

from __future__ import annotations

import torch

from relax.core.controller.pipeline import StepRows
from relax.core.data import Sample
from relax.core.queue import Batch


def _batch() -> Batch:
    """Two groups of two, arriving interleaved; each row's columns carry its (group, index) tag."""
    order = [(7, 1), (3, 0), (7, 0), (3, 1)]
    samples = [
        Sample(prompt_ids=[1], group_id=g, index_in_group=i, response_ids=[5] * (i + 1)) for g, i in order
    ]
    return Batch(
        keys=[(1, k) for k in range(4)],
        data={
            "sample": samples,
            "reward": [(float(g + i), {"score": float(g)}) for g, i in order],
            "advantages": [[g + i / 10] * (i + 1) for g, i in order],
            "ref_logprobs": [[-(g + i / 10)] * (i + 1) for g, i in order],
        },
        group_ids=[g for g, _ in order],
    )


def test_rows_come_in_group_order_with_rewards_and_columns_aligned():
    rows = StepRows.of(_batch())
    assert [(s.group_id, s.index_in_group) for s in rows.samples] == [(3, 0), (3, 1), (7, 0), (7, 1)]
    assert [s.reward for s in rows.samples] == [3.0, 4.0, 7.0, 8.0]
    assert rows.columns["advantages"] == [[3.0], [3.1, 3.1], [7.0], [7.1, 7.1]]
    assert [[(s.group_id, s.index_in_group) for s in g] for g in rows.groups()] == [
        [(3, 0), (3, 1)],
        [(7, 0), (7, 1)],
    ]
    assert rows.keys == [(1, k) for k in range(4)]  # every key of the step, acknowledged when it is done


def test_keeping_groups_keeps_their_columns_and_pads_them_per_token():
    rows = StepRows.of(_batch())
    kept = rows.keep([rows.groups()[1]])  # e.g. a relax_filter_group hook dropped group 3
    assert [(s.group_id, s.index_in_group) for s in kept.samples] == [(7, 0), (7, 1)]
    assert torch.equal(kept.column("ref_logprobs", 3), torch.tensor([[-7.0, 0, 0], [-7.1, -7.1, 0]]))
    assert kept.keys == rows.keys
    assert rows.keep([]).samples == [] and rows.keep([]).columns == {"advantages": [], "ref_logprobs": []}
