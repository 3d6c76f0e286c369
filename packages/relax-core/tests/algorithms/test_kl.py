"""KL estimators, straight-through variants, entropy, KL controllers, KL reward penalty, value loss."""

from __future__ import annotations

import math

import pytest
import torch

from relax.core.algorithms import (
    KLController,
    apply_kl_penalty,
    clipped_value_loss,
    entropy_from_logits,
    logprobs_and_sum_pi_squared,
    logprobs_from_logits,
    update_kl_controller,
)
from relax.core.algorithms.kl import KL_ESTIMATORS

F64 = torch.float64
LP = torch.tensor([[-1.0, -0.5, -2.0], [-0.1, -30.0, -0.7]], dtype=F64)
REF = torch.tensor([[-1.2, -0.4, -1.5], [-0.1, -0.2, -25.0]], dtype=F64)

# computed from verl's kl_penalty_forward (kl / abs / mse / low_var_kl) on LP, REF
VERL_KL = {
    "k1": [[0.2, -0.1, -0.5], [0.0, -29.8, 24.3]],
    "abs": [[0.2, 0.1, 0.5], [0.0, 29.8, 24.3]],
    "k2": [[0.02, 0.005, 0.125], [0.0, 444.02, 295.245]],
    "k3": [[0.018730753077981888, 0.005170918075647624, 0.1487212707001282], [0.0, 10.0, 10.0]],
}


@pytest.mark.parametrize("name", sorted(VERL_KL))
def test_estimators_match_verl(name):
    torch.testing.assert_close(KL_ESTIMATORS[name](LP, REF), torch.tensor(VERL_KL[name], dtype=F64))


def test_aliases_and_hand_values():
    assert KL_ESTIMATORS["kl"] is KL_ESTIMATORS["k1"] and KL_ESTIMATORS["mse"] is KL_ESTIMATORS["k2"]
    assert KL_ESTIMATORS["low_var_kl"] is KL_ESTIMATORS["k3"]
    # k3 with log r = ref - lp = -0.5: e^-0.5 + 0.5 - 1
    assert KL_ESTIMATORS["k3"](torch.tensor([-1.0]), torch.tensor([-1.5])).item() == pytest.approx(
        math.exp(-0.5) - 0.5
    )


@pytest.mark.parametrize("name", ["k1", "kl", "abs", "k3", "low_var_kl"])
def test_straight_through_value_of_estimator_gradient_of_k2(name):
    plus = KL_ESTIMATORS[f"{name}+"]
    lp = LP[:1].clone().requires_grad_(True)
    value = plus(lp, REF[:1])
    torch.testing.assert_close(value, KL_ESTIMATORS[name](LP[:1], REF[:1]))
    value.sum().backward()
    torch.testing.assert_close(lp.grad, LP[:1] - REF[:1])  # d/dlp of (lp - ref)^2 / 2


def test_k3_gradient():
    lp = torch.tensor([-1.0], dtype=F64, requires_grad=True)
    KL_ESTIMATORS["k3"](lp, torch.tensor([-1.5], dtype=F64)).backward()
    # d/dlp (e^(ref-lp) - (ref-lp) - 1) = -e^(ref-lp) + 1
    assert lp.grad.item() == pytest.approx(1 - math.exp(-0.5))


def test_entropy_from_logits():
    logits = torch.tensor([[1.0, 2.0, 0.5], [0.0, 0.0, 0.0]], dtype=F64)
    torch.testing.assert_close(
        entropy_from_logits(logits), torch.tensor([0.9059592564792269, 1.0986122886681098], dtype=F64)
    )
    big = torch.randn(2, 5, 7, dtype=F64)
    torch.testing.assert_close(
        entropy_from_logits(big), torch.distributions.Categorical(logits=big).entropy()
    )


def test_sum_pi_squared_by_hand_and_against_verls_formula():
    logits = torch.tensor([[1.0, 2.0, 0.5], [0.0, 0.0, 0.0], [1000.0, 0.0, -1000.0]])
    tokens = torch.tensor([1, 0, 2])
    lp, spi = logprobs_and_sum_pi_squared(logits, tokens)
    assert lp.dtype == spi.dtype == torch.float32
    # sum softmax([1, 2, 0.5])^2; uniform over 3: 1/3; one-hot (no overflow): 1
    torch.testing.assert_close(spi, torch.tensor([0.46818509989650847, 1 / 3, 1.0]))
    assert torch.equal(lp, logprobs_from_logits(logits, tokens))  # the same logprobs, bit for bit
    assert lp[0].item() == pytest.approx(-0.46436878410794485, abs=1e-6) and lp[2].item() == -2000.0
    big = torch.randn(3, 5, 11, dtype=F64) * 4
    _, spi = logprobs_and_sum_pi_squared(big, torch.zeros(3, 5, dtype=torch.long))
    verl = torch.exp(torch.logsumexp(2.0 * big, dim=-1) - 2.0 * torch.logsumexp(big, dim=-1))
    torch.testing.assert_close(spi, verl.float())
    torch.testing.assert_close(spi, big.softmax(-1).pow(2).sum(-1).float())


def test_kl_controllers():
    fixed = KLController(value=0.1)
    assert update_kl_controller(fixed, current_kl=5.0, n_steps=64) is fixed
    adaptive = KLController(value=0.1, kind="adaptive", target_kl=0.05, horizon=1000)
    # verl AdaptiveKLController: error clipped to 0.2 -> 0.1 * (1 + 0.2 * 64 / 1000); below target: -0.1
    assert update_kl_controller(adaptive, 0.2, 64).value == pytest.approx(0.10128)
    assert update_kl_controller(adaptive, 0.045, 64).value == pytest.approx(0.09936)
    assert adaptive.value == 0.1  # pure update
    with pytest.raises(ValueError, match="horizon"):
        update_kl_controller(KLController(0.1, "adaptive", horizon=0), 0.1, 1)


def test_apply_kl_penalty():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=F64)
    shaped, metrics = apply_kl_penalty(rewards, LP, REF, mask, coef=0.1, estimator="k1")
    expected = rewards - 0.1 * torch.tensor([[0.2, -0.1, -0.5], [0.0, -29.8, 0.0]], dtype=F64)
    torch.testing.assert_close(shaped, expected)
    # per-sequence means: (0.2 - 0.1 - 0.5) / 3 and (0 - 29.8) / 2; then the mean over sequences
    assert metrics["reward_kl"] == pytest.approx(((-0.4 / 3) + (-14.9)) / 2)
    assert metrics["reward_kl_coef"] == 0.1
    empty_row = mask.clone()
    empty_row[1] = 0
    _, metrics = apply_kl_penalty(rewards, LP, REF, empty_row, 0.1)
    assert metrics["reward_kl"] == pytest.approx(-0.4 / 3)


def test_clipped_value_loss_matches_verl():
    values = torch.tensor([[0.5, 1.0, 2.0], [0.0, -1.0, 3.0]], dtype=F64, requires_grad=True)
    old = torch.tensor([[0.4, 1.5, 1.0], [0.0, -0.5, 2.9]], dtype=F64)
    returns = torch.tensor([[1.0, 0.0, 1.0], [0.3, -2.0, 9.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=F64)
    loss, metrics = clipped_value_loss(values, old, returns, mask, clip_range=0.2)
    loss.backward()
    # verl compute_value_loss: 0.472, clipfrac 0.4, same gradient
    assert loss.item() == pytest.approx(0.472)
    assert metrics["vf_clip_frac"] == pytest.approx(0.4)
    torch.testing.assert_close(values.grad, torch.tensor([[-0.1, 0.0, 0.2], [-0.06, 0.0, 0.0]], dtype=F64))


@pytest.mark.parametrize("name", ["k2+", "mse+"])
def test_straight_through_k2_names_are_k2(name):
    """verl accepts ``k2+`` / ``mse+``: k2's gradient already is the KL gradient, so they are k2."""
    lp = LP.clone().requires_grad_(True)
    KL_ESTIMATORS[name](lp, REF).sum().backward()
    expected = LP.clone().requires_grad_(True)
    KL_ESTIMATORS["k2"](expected, REF).sum().backward()
    torch.testing.assert_close(KL_ESTIMATORS[name](LP, REF), KL_ESTIMATORS["k2"](LP, REF))
    torch.testing.assert_close(lp.grad, expected.grad)
