import math

import torch

from relax.core.engines.sampling import sample_tokens, sampling_logprobs

LOGITS = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))


def _lp(temperature=1.0, top_k=0, top_p=1.0, logits=LOGITS):
    return sampling_logprobs(
        logits, torch.tensor([temperature]), torch.tensor([top_k]), torch.tensor([top_p])
    )


def test_plain_distribution_is_log_softmax():
    torch.testing.assert_close(_lp().exp(), torch.tensor([[0.5, 0.3, 0.2]]))


def test_top_p_keeps_smallest_prefix_reaching_mass():
    # 0.5 < 0.6, so the second token is needed; 0.8 >= 0.6, so the third is dropped
    torch.testing.assert_close(_lp(top_p=0.6).exp(), torch.tensor([[0.625, 0.375, 0.0]]))
    torch.testing.assert_close(_lp(top_p=0.5).exp(), torch.tensor([[1.0, 0.0, 0.0]]))
    torch.testing.assert_close(_lp(top_p=0.0).exp(), torch.tensor([[1.0, 0.0, 0.0]]))


def test_top_k_and_temperature():
    torch.testing.assert_close(_lp(top_k=2).exp(), torch.tensor([[0.625, 0.375, 0.0]]))
    # temperature 2: p ~ sqrt(p)
    s = torch.tensor([0.5, 0.3, 0.2]).sqrt()
    torch.testing.assert_close(_lp(temperature=2.0).exp(), (s / s.sum())[None])
    # order is temperature -> top-k -> top-p: after top-k the first token holds 0.56 < 0.6, both stay
    kept = s[:2] / s[:2].sum()
    torch.testing.assert_close(
        _lp(temperature=2.0, top_k=2, top_p=0.6).exp(), torch.cat([kept, torch.zeros(1)])[None]
    )


def test_greedy_rows_report_plain_logprobs_and_rows_are_independent():
    logits = torch.cat([LOGITS, LOGITS.flip(-1)])
    lp = sampling_logprobs(logits, torch.tensor([0.0, 1.0]), torch.tensor([0, 1]), torch.tensor([1.0, 1.0]))
    torch.testing.assert_close(lp[0].exp(), torch.tensor([0.5, 0.3, 0.2]))
    assert lp[1, 2].item() == 0.0 and math.isinf(lp[1, 0].item())


def test_inverse_cdf_sampling():
    lp = _lp(top_p=0.6).expand(4, 3)
    tokens = sample_tokens(lp, torch.tensor([0.0, 0.6, 0.7, 0.999999]), torch.zeros(4, dtype=torch.bool), lp)
    assert tokens.tolist() == [0, 0, 1, 1]  # never the masked third token, even at u -> 1
    greedy = sample_tokens(
        lp, torch.tensor([0.99] * 4), torch.ones(4, dtype=torch.bool), LOGITS.flip(-1).expand(4, 3)
    )
    assert greedy.tolist() == [2, 2, 2, 2]


def test_sampling_frequencies_match_distribution():
    gen = torch.Generator().manual_seed(0)
    u = torch.rand(20000, generator=gen, dtype=torch.float64)
    lp = _lp().expand(20000, 3)
    counts = torch.bincount(sample_tokens(lp, u, torch.zeros(20000, dtype=torch.bool), lp), minlength=3)
    torch.testing.assert_close(counts / 20000.0, torch.tensor([0.5, 0.3, 0.2]), atol=0.015, rtol=0)


def test_untruncated_rows_are_the_same_with_or_without_a_truncated_neighbour():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 50, generator=gen) * 4
    temperature = torch.tensor([1.0, 0.7, 0.0])
    plain = sampling_logprobs(logits, temperature, torch.zeros(3, dtype=torch.long), torch.ones(3))
    torch.testing.assert_close(plain[0], logits[0].log_softmax(-1))
    torch.testing.assert_close(plain[1], (logits[1] / 0.7).log_softmax(-1))
    torch.testing.assert_close(plain[2], logits[2].log_softmax(-1))
    mixed = sampling_logprobs(
        torch.cat([logits, logits[:1]]),
        torch.cat([temperature, torch.ones(1)]),
        torch.tensor([0, 50, 0, 5]),
        torch.tensor([1.0, 1.0, 1.0, 0.9]),
    )
    torch.testing.assert_close(mixed[:3], plain, atol=0, rtol=0)
    assert torch.isinf(mixed[3]).sum() >= 45  # the fourth row is truncated to at most 5 tokens
