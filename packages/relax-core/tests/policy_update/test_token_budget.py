"""Token-budget micro-batches without a model: bin packing, data-parallel balance, column trimming and
putting per-row results back in the batch's order."""

import torch

from relax.core.data import Sample, collate
from relax.core.policy_update.token_budget import (
    ROWS,
    balanced_order,
    pack_by_padded_tokens,
    pack_by_tokens,
    row_tokens,
    scatter_rows,
    token_micro_batches,
    trim_columns,
)


def long_tailed_batch():
    """Six rows: prompts 2-4 tokens, responses 1-3 tokens except one of 12 (the long tail)."""
    rows = [(2, 1), (3, 2), (4, 12), (2, 3), (3, 1), (4, 2)]
    samples = [
        Sample(prompt_ids=list(range(5, 5 + p)), group_id=i, response_ids=list(range(20, 20 + r)))
        for i, (p, r) in enumerate(rows)
    ]
    batch = collate(samples, pad_id=0)
    batch["advantages"] = torch.arange(6.0)[:, None] * batch["response_mask"]
    return batch


def test_first_fit_decreasing_respects_the_budget_and_isolates_a_longer_row():
    groups = pack_by_tokens([3, 9, 4, 2, 20, 5], max_tokens=10)
    assert sorted(i for g in groups for i in g) == list(range(6))  # every row exactly once
    assert [4] in groups  # longer than the budget: alone
    loads = [sum([3, 9, 4, 2, 20, 5][i] for i in g) for g in groups if g != [4]]
    assert all(load <= 10 for load in loads)
    assert len(groups) == 4  # 20 | 9 | 5 4 | 3 2 (first fit decreasing)


def test_balanced_order_gives_replicas_similar_tokens():
    lengths = [10, 9, 8, 7, 1, 1, 1, 1]  # contiguous halves: 34 vs 4 tokens
    order = balanced_order(lengths, world_size=2)
    assert sorted(order) == list(range(8))
    shares = [sum(lengths[i] for i in order[:4]), sum(lengths[i] for i in order[4:])]
    assert shares == [19, 19]


def test_trim_keeps_every_real_token_and_drops_padding_columns():
    batch = long_tailed_batch()
    short = {k: v[[0, 4]] for k, v in batch.items()}  # prompts 2 and 3, responses 1 and 1
    trimmed = trim_columns(short)
    assert trimmed["input_ids"].shape == (2, 3 + 1)
    assert trimmed["responses"].shape == (2, 1) and trimmed["advantages"].shape == (2, 1)
    assert torch.equal(trimmed["attention_mask"].sum(-1), short["attention_mask"].sum(-1))
    assert torch.equal(trimmed["responses"], short["responses"][:, :1])


def test_micro_batches_cover_each_row_once_within_budget_and_scatter_back():
    batch = long_tailed_batch()
    micros = token_micro_batches(batch, max_tokens=8)
    seen = torch.cat([m[ROWS] for m in micros]).sort().values
    assert torch.equal(seen, torch.arange(6))
    for m in micros:
        assert int(row_tokens(m).sum()) <= 8 or len(m[ROWS]) == 1
        torch.testing.assert_close(m["advantages"], batch["advantages"][m[ROWS], : m["advantages"].shape[1]])
    back = scatter_rows([(m, m["advantages"]) for m in micros], *batch["responses"].shape)
    assert torch.equal(back, batch["advantages"])


def test_padded_groups_keep_long_rows_from_padding_short_ones():
    """(prompt, response) widths: a padded micro-batch costs rows x (longest prompt + longest response)."""
    widths = [(4, 60), (4, 2), (3, 3), (4, 60), (2, 1), (4, 4)]
    groups = pack_by_padded_tokens(widths, max_tokens=70)
    assert sorted(i for g in groups for i in g) == list(range(6))
    for g in groups:
        rect = len(g) * (max(widths[i][0] for i in g) + max(widths[i][1] for i in g))
        assert rect <= 70 or len(g) == 1
    assert [0] in groups and [3] in groups  # each long row alone: with any short one it would be 2 x 64
    assert pack_by_tokens([sum(w) for w in widths], 70)[0] == [0, 1]  # real tokens alone would mix them
