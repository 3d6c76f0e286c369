"""The trainer tests' shared policy batch: 8 random rows of varied prompt/response lengths, two groups,
advantages +1 / -0.5 alternating."""

import pytest
import torch

from relax.core.data import Sample, collate


@pytest.fixture(scope="module")
def batch():
    gen = torch.Generator().manual_seed(0)
    samples = []
    for i in range(8):
        prompt = torch.randint(4, 24, (3 + i % 4,), generator=gen).tolist()
        response = torch.randint(4, 24, (2 + (i * 3) % 5,), generator=gen).tolist()
        samples.append(Sample(prompt_ids=prompt, group_id=i // 4, response_ids=response))
    out = collate(samples, pad_id=0)
    out["advantages"] = (
        torch.where(torch.arange(8)[:, None] % 2 == 0, 1.0, -0.5).expand_as(out["response_mask"]).clone()
    )
    return out
