"""``collate``: the padded layout the trainer and the advantage math read (left-padded prompts,
right-padded responses), and a clear error for per-token fields of the wrong length."""

from __future__ import annotations

import pytest
import torch

from relax.core.data import Sample, collate


def test_prompts_are_left_padded_and_responses_right_padded():
    samples = [
        Sample(
            prompt_ids=[5, 6, 7],
            group_id=0,
            response_ids=[8, 9],
            loss_mask=[1.0, 0.0],
            rollout_logprobs=[-0.5, -1.5],
            versions=[2, 3],
            reward=1.0,
        ),
        Sample(prompt_ids=[4], group_id=1, index_in_group=1, response_ids=[3, 2, 1], versions=[1, 1, 1]),
        Sample(prompt_ids=[4, 4], group_id=1, response_ids=[], reward=0.5),  # no response at all
    ]
    b = collate(samples, pad_id=0)
    assert b["input_ids"].tolist() == [[5, 6, 7, 8, 9, 0], [0, 0, 4, 3, 2, 1], [0, 4, 4, 0, 0, 0]]
    assert b["attention_mask"].tolist() == [[1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1], [0, 1, 1, 0, 0, 0]]
    assert b["position_ids"].tolist() == [[0, 1, 2, 3, 4, 4], [0, 0, 0, 1, 2, 3], [0, 0, 1, 1, 1, 1]]
    assert b["responses"].tolist() == [[8, 9, 0], [3, 2, 1], [0, 0, 0]]
    assert b["response_mask"].tolist() == [[1.0, 0.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]
    assert b["rollout_logprobs"].tolist() == [[-0.5, -1.5, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    assert b["rewards"].tolist() == [1.0, 0.0, 0.5] and b["group_index"].tolist() == [0, 1, 1]
    assert b["min_version"].tolist()[:2] == [2, 1]
    assert b["input_ids"].dtype == torch.long and b["response_mask"].dtype == torch.float32


@pytest.mark.parametrize("field", ["loss_mask", "rollout_logprobs"])
def test_a_per_token_field_of_the_wrong_length_is_named(field):
    sample = Sample(prompt_ids=[1], group_id=0, response_ids=[2, 3], **{field: [1.0]})
    with pytest.raises(ValueError, match=f"{field} has 1 entries for 2 response tokens"):
        collate([sample], pad_id=0)
