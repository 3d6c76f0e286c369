"""Registry lookups through the plugin manager, compute_advantages and build_policy_objective."""

from __future__ import annotations

import dataclasses
import sys
import types

import pytest
import torch

from relax.core import plugins
from relax.core.algorithms import (
    ADVANTAGE_ESTIMATORS,
    POLICY_LOSSES,
    AdvantageInputs,
    AlgorithmConfig,
    CorrectionConfig,
    KLConfig,
    PolicyLossInputs,
    aggregate_loss,
    build_policy_objective,
    compute_advantages,
    entropy_from_logits,
    get_advantage_estimator,
    get_kl_estimator,
    get_policy_loss,
    list_kl_estimators,
    list_policy_losses,
    register_builtin_algorithms,
    truncated_is,
)
from relax.core.algorithms.kl import KL_ESTIMATORS
from relax.core.hookspecs import hookimpl

F64 = torch.float64


def _double_reinforce(inputs, scale: float = 2.0):
    return scale * POLICY_LOSSES["reinforce"](inputs)[0], {}


@hookimpl
def relax_register_algorithms(register):
    register_builtin_algorithms(register)
    register("double_reinforce", _double_reinforce, kind="policy_loss")


@pytest.fixture(autouse=True)
def registry(monkeypatch):
    """A real plugin manager holding the built-ins plus one third-party loss, as the process-wide one."""
    module = types.ModuleType("relax_test_algorithms")
    module.relax_register_algorithms = relax_register_algorithms
    manager = plugins.RelaxPluginManager(extra_plugins={"algos": module}, load_entry_points=False)
    monkeypatch.setattr(plugins, "_MANAGER", manager)
    return manager


def test_builtins_registered_by_kind(registry):
    assert set(registry.names("advantage")) == set(ADVANTAGE_ESTIMATORS)
    assert set(registry.names("policy_loss")) == set(POLICY_LOSSES) | {"double_reinforce"}
    assert set(list_kl_estimators()) == set(KL_ESTIMATORS) >= {"k1", "k2", "k3", "low_var_kl", "k3+", "abs"}
    assert get_advantage_estimator("grpo") is ADVANTAGE_ESTIMATORS["grpo"]
    assert get_kl_estimator("k3") is KL_ESTIMATORS["k3"]
    assert get_policy_loss("double_reinforce") is _double_reinforce
    assert "double_reinforce" in list_policy_losses()
    with pytest.raises(plugins.UnknownNameError, match="registered policy_loss names"):
        get_policy_loss("nope")


def test_builtin_fallback_without_plugin_manager(monkeypatch):
    monkeypatch.setitem(sys.modules, "relax.core.plugins", None)  # import now raises ImportError
    assert get_policy_loss("ppo") is POLICY_LOSSES["ppo"]
    assert list_kl_estimators() == sorted(KL_ESTIMATORS)
    with pytest.raises(KeyError, match="built-in policy_loss names"):
        get_policy_loss("double_reinforce")


# ---------------------------------------------------------------- compute_advantages

MASK = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0]], dtype=F64)
ADV_INPUTS = AdvantageInputs(
    rewards=torch.tensor([1.0, 0.0, 1.0, 0.5], dtype=F64),
    response_mask=MASK,
    index=torch.tensor([0, 0, 1, 1]),
)


def test_compute_advantages_uses_config_defaults_and_params():
    adv, _ = compute_advantages(AlgorithmConfig(norm_adv_by_std=False), ADV_INPUTS)
    torch.testing.assert_close(adv[:, 0], torch.tensor([0.5, -0.5, 0.25, -0.25], dtype=F64))
    adv, _ = compute_advantages(AlgorithmConfig(advantage_params={"epsilon": 1.0}), ADV_INPUTS)
    std = 0.5**0.5  # unbiased std of {1, 0}
    assert adv[0, 0].item() == pytest.approx(0.5 / (std + 1.0))
    values = torch.zeros(4, 3, dtype=F64)
    cfg = AlgorithmConfig(advantage_estimator="gae", gamma=0.5, lam=1.0)
    _, returns = compute_advantages(cfg, dataclasses.replace(ADV_INPUTS, values=values))
    torch.testing.assert_close(returns[1], torch.tensor([0.0, 0.0, 0.0], dtype=F64))
    torch.testing.assert_close(returns[0], torch.tensor([0.5, 1.0, 0.0], dtype=F64))
    with pytest.raises(TypeError, match="does not take"):
        compute_advantages(AlgorithmConfig(advantage_params={"gama": 1.0}), ADV_INPUTS)


def test_kl_in_reward_shapes_token_rewards():
    old = torch.full((4, 3), -1.0, dtype=F64)
    ref = torch.tensor([[-1.5, -0.5, 0.0]] * 4, dtype=F64)  # k1 = old - ref = 0.5, -0.5, -1.0
    inputs = dataclasses.replace(ADV_INPUTS, old_logprobs=old, ref_logprobs=ref)
    cfg = AlgorithmConfig(norm_adv_by_std=False, kl=KLConfig(coef=0.2, estimator="k1", use="reward"))
    adv, _ = compute_advantages(cfg, inputs)
    # score = r - 0.2 * (sum of k1 over valid tokens): 1 - 0, 0 + 0.2, 1 - 0.1, 0.5 - 0
    # Dr.GRPO-style advantages (groups {0, 1} and {2, 3}): score - group mean
    torch.testing.assert_close(adv[:, 0], torch.tensor([0.4, -0.4, 0.2, -0.2], dtype=F64))
    adv_off, _ = compute_advantages(cfg, inputs, kl_coef=0.0)
    torch.testing.assert_close(adv_off[:, 0], torch.tensor([0.5, -0.5, 0.25, -0.25], dtype=F64))
    with pytest.raises(ValueError, match="ref_logprobs"):
        compute_advantages(cfg, ADV_INPUTS)


# ---------------------------------------------------------------- build_policy_objective


def _batch(seed=0, b=6, t=5, vocab=7):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, t, vocab, generator=gen, dtype=F64, requires_grad=True)
    tokens = torch.randint(0, vocab, (b, t), generator=gen)
    mask = (torch.rand(b, t, generator=gen) > 0.3).to(F64)
    mask[3] = 0
    fields = {
        "old_logprobs": -torch.rand(b, t, generator=gen, dtype=F64) * 2 - 0.5,
        "advantages": torch.randn(b, t, generator=gen, dtype=F64),
        "response_mask": mask,
        "rollout_logprobs": -torch.rand(b, t, generator=gen, dtype=F64) * 2 - 0.5,
        "ref_logprobs": -torch.rand(b, t, generator=gen, dtype=F64) * 2 - 0.5,
        "teacher_logprobs": -torch.rand(b, t, generator=gen, dtype=F64) * 2 - 0.5,
    }
    return logits, tokens, fields


def _inputs(logits, tokens, fields, rows=slice(None), **extra):
    logp = torch.log_softmax(logits[rows], dim=-1).gather(-1, tokens[rows].unsqueeze(-1)).squeeze(-1)
    return PolicyLossInputs(
        logprobs=logp,
        entropy=entropy_from_logits(logits[rows]),
        **{k: v[rows] for k, v in fields.items()},
        **extra,
    )


FULL_CFG = AlgorithmConfig(
    policy_loss="ppo",
    clip_ratio_high=0.28,
    entropy_coef=0.01,
    kl=KLConfig(coef=0.05, estimator="k3"),
    correction=CorrectionConfig(is_mode="truncate", is_high=1.5, opsm_delta=0.2),
    opd_coef=0.3,
)


def test_objective_combines_terms():
    logits, tokens, fields = _batch()
    cfg = AlgorithmConfig(
        entropy_coef=0.01, kl=KLConfig(coef=0.05, estimator="k3"), loss_agg_mode="seq-mean-token-mean"
    )
    inputs = _inputs(logits, tokens, fields)
    loss, metrics = build_policy_objective(cfg)(inputs)
    mode_inputs = dataclasses.replace(inputs, loss_agg_mode="seq-mean-token-mean")
    pg, _ = POLICY_LOSSES["ppo"](mode_inputs)
    kl = aggregate_loss(
        KL_ESTIMATORS["k3"](inputs.logprobs, inputs.ref_logprobs), inputs.response_mask, "seq-mean-token-mean"
    )
    ent = aggregate_loss(inputs.entropy, inputs.response_mask, "seq-mean-token-mean")
    torch.testing.assert_close(loss, pg + 0.05 * kl - 0.01 * ent)
    assert metrics["pg_loss"] == pytest.approx(pg.item()) and metrics["kl_loss"] == pytest.approx(kl.item())
    assert metrics["entropy"] == pytest.approx(ent.item()) and metrics["loss"] == pytest.approx(loss.item())
    (g1,) = torch.autograd.grad(loss, logits, retain_graph=True)
    (g2,) = torch.autograd.grad(pg + 0.05 * kl - 0.01 * ent, logits)
    torch.testing.assert_close(g1, g2)


def test_objective_applies_corrections_and_distillation():
    logits, tokens, fields = _batch(seed=1)
    inputs = _inputs(logits, tokens, fields)
    loss, metrics = build_policy_objective(FULL_CFG)(inputs)
    w, _ = truncated_is(inputs.old_logprobs, inputs.rollout_logprobs, inputs.response_mask, high=1.5)
    adv = inputs.advantages - 0.3 * (inputs.logprobs.detach() - inputs.teacher_logprobs) * (
        inputs.response_mask > 0
    )
    seq_kl = ((inputs.rollout_logprobs - inputs.logprobs.detach()) * inputs.response_mask).sum(
        -1
    ) / inputs.response_mask.sum(-1).clamp(min=1)
    keep = ~((adv < 0) & (seq_kl > 0.2).unsqueeze(-1))
    manual = dataclasses.replace(inputs, advantages=adv, is_weights=w * keep)
    pg, _ = POLICY_LOSSES["ppo"](manual, clip_ratio_high=0.28)
    kl = aggregate_loss(
        KL_ESTIMATORS["k3"](inputs.logprobs, inputs.ref_logprobs), inputs.response_mask, "token-mean"
    )
    ent = aggregate_loss(inputs.entropy, inputs.response_mask, "token-mean")
    torch.testing.assert_close(loss, pg + 0.05 * kl - 0.01 * ent)
    for key in (
        "is_clip_frac",
        "mismatch_k3_kl",
        "opsm_mask_frac",
        "opsm_mismatch_k3_kl",
        "opd_reverse_kl",
        "clip_frac_high",
    ):
        assert key in metrics, key
    assert not torch.equal(inputs.advantages, adv)  # the caller's tensors are left alone


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("loss_name", ["ppo", "gspo", "cispo", "dppo_tv"])
def test_micro_batch_accumulation_equals_full_batch(mode, loss_name):
    logits, tokens, fields = _batch(seed=2)
    cfg = dataclasses.replace(FULL_CFG, policy_loss=loss_name, loss_agg_mode=mode)
    objective = build_policy_objective(cfg)
    full, _ = objective(_inputs(logits, tokens, fields))
    (g_full,) = torch.autograd.grad(full, logits)
    mask = fields["response_mask"]
    counts = {"global_token_count": mask.sum().item(), "global_seq_count": (mask.sum(-1) > 0).sum().item()}
    total = 0.0
    for rows in (slice(0, 2), slice(2, 5), slice(5, 6)):
        total = total + objective(_inputs(logits, tokens, fields, rows, **counts))[0]
    (g_acc,) = torch.autograd.grad(total, logits)
    assert total.item() == pytest.approx(full.item(), rel=1e-10)
    torch.testing.assert_close(g_acc, g_full)


def test_objective_uses_plugin_loss_and_its_params():
    logits, tokens, fields = _batch()
    inputs = _inputs(logits, tokens, fields)
    loss, _ = build_policy_objective(
        AlgorithmConfig(policy_loss="double_reinforce", loss_params={"scale": 3.0})
    )(inputs)
    assert loss.item() == pytest.approx(3.0 * POLICY_LOSSES["reinforce"](inputs)[0].item())


def test_objective_errors_name_the_missing_piece():
    logits, tokens, fields = _batch()
    with pytest.raises(TypeError, match="does not take"):
        build_policy_objective(AlgorithmConfig(loss_params={"clip_ratio": 0.2}))
    bare = _inputs(logits, tokens, {k: fields[k] for k in ("old_logprobs", "advantages", "response_mask")})
    bare = dataclasses.replace(bare, entropy=None)
    for cfg, needle in [
        (AlgorithmConfig(kl=KLConfig(coef=0.1)), "ref_logprobs"),
        (AlgorithmConfig(entropy_coef=0.1), "entropy"),
        (AlgorithmConfig(opd_coef=0.1), "teacher_logprobs"),
        (AlgorithmConfig(correction=CorrectionConfig(is_mode="mask")), "rollout_logprobs"),
    ]:
        with pytest.raises(ValueError, match=needle):
            build_policy_objective(cfg)(bare)
