"""Interior mask holes (issue 26): every policy loss x every ``loss_agg_mode``, the KL-in-loss
estimators, the entropy bonus, the mismatch corrections, distillation and the value loss.

Observation tokens have loss mask 0 and no logprobs. Whatever sits at masked positions (huge values,
NaN, inf: a sentinel an engine writes for "not sampled") must change neither the loss, nor its
gradient on unmasked tokens, nor any metric, and must get exactly zero gradient itself; and a batch
with holes trains exactly like the same tokens packed without holes. Parametrized over the registry,
so a newly registered loss is covered automatically.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from relax.core.algorithms import (
    AGG_MODES,
    AlgorithmConfig,
    CorrectionConfig,
    KLConfig,
    PolicyLossInputs,
    build_policy_objective,
    clipped_value_loss,
    get_policy_loss,
    list_kl_estimators,
    list_policy_losses,
)

F64 = torch.float64
MASK = torch.tensor(
    [
        [1, 1, 1, 0, 0, 1, 1, 0, 1, 1],
        [1, 1, 0, 0, 0, 1, 1, 1, 0, 0],
        [1, 1, 1, 1, 1, 1, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0, 0, 0, 0, 0],
        [0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 1, 1, 1, 1, 1, 0],
    ],
    dtype=F64,
)
LEAVES = ("logprobs", "entropy")  # what carries the model's gradient
COLUMNS = (
    "logprobs",
    "old_logprobs",
    "advantages",
    "rollout_logprobs",
    "ref_logprobs",
    "teacher_logprobs",
    "entropy",
    "is_weights",
)


def columns(seed: int = 0) -> dict[str, torch.Tensor]:
    """Per-token inputs, 0 at masked positions; ratios spread enough that clips and masks bind."""
    gen = torch.Generator().manual_seed(seed)

    def rand(lo: float, hi: float) -> torch.Tensor:
        return lo + (hi - lo) * torch.rand(MASK.shape, generator=gen, dtype=F64)

    logprobs = rand(-3, -0.05)
    old = logprobs + rand(-0.4, 0.4)
    seq_adv = torch.tensor([1.0, -0.7, 0.4, -1.2, 0.9, 0.3], dtype=F64)[:, None]
    out = {
        "logprobs": logprobs,
        "old_logprobs": old,
        "advantages": seq_adv + rand(-0.3, 0.3),
        "rollout_logprobs": old + rand(-0.3, 0.3),
        "ref_logprobs": logprobs + rand(-0.5, 0.5),
        "teacher_logprobs": logprobs + rand(-1.0, 0.2),
        "entropy": rand(0.1, 3.0),
        "is_weights": rand(0.5, 1.5),  # detached per-token weights a caller may pass
    }
    return {k: v * MASK for k, v in out.items()}


def garbage(kind: str, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 + seed)
    if kind == "huge":
        return 1e4 * (2 * torch.rand(MASK.shape, generator=gen, dtype=F64) - 1)
    pattern = torch.tensor([float("nan"), float("inf"), -float("inf"), -1e30], dtype=F64)
    return pattern[torch.randint(len(pattern), MASK.shape, generator=gen)]


def dirty(cols: dict[str, torch.Tensor], kind: str, mask: torch.Tensor = MASK) -> dict[str, torch.Tensor]:
    return {k: torch.where(mask > 0, v, garbage(kind, i)) for i, (k, v) in enumerate(cols.items())}


def compact(x: torch.Tensor, mask: torch.Tensor = MASK) -> torch.Tensor:
    out = torch.zeros_like(x)
    for row in range(x.shape[0]):
        valid = x[row][mask[row] > 0]
        out[row, : valid.numel()] = valid
    return out


PACKED_MASK = (torch.arange(MASK.shape[-1]) < (MASK > 0).sum(-1, keepdim=True)).to(F64)


def evaluate(fn, cols: dict[str, torch.Tensor], mode: str, mask: torch.Tensor = MASK):
    """(loss, {leaf: grad}, metrics) of ``fn(PolicyLossInputs)``, with the step-global counts the trainer passes."""
    leaves = {k: cols[k].clone().requires_grad_(True) for k in LEAVES}
    inputs = PolicyLossInputs(
        **{**cols, **leaves},
        response_mask=mask,
        loss_agg_mode=mode,
        global_token_count=float(mask.sum()),
        global_seq_count=float((mask.sum(-1) > 0).sum()),
    )
    loss, metrics = fn(inputs)
    loss.backward()
    grads = {k: v.grad if v.grad is not None else torch.zeros_like(v) for k, v in leaves.items()}
    return loss.detach(), grads, metrics


def assert_same_update(clean, got, what: str) -> None:
    """Bit-identical loss, metrics and gradients on unmasked tokens; zero, finite gradient at masked ones."""
    loss, grads, metrics = clean
    got_loss, got_grads, got_metrics = got
    assert torch.equal(got_loss, loss), f"{what}: loss {got_loss.item()} != {loss.item()}"
    assert got_metrics == metrics, f"{what}: metrics changed"
    for leaf in LEAVES:
        g = got_grads[leaf]
        assert torch.isfinite(g).all(), f"{what}: non-finite gradient w.r.t. {leaf}"
        assert torch.count_nonzero(g[MASK == 0]) == 0, f"{what}: gradient w.r.t. {leaf} at masked positions"
        assert torch.equal(g, grads[leaf]), f"{what}: gradient w.r.t. {leaf} on unmasked tokens changed"


def assert_packed_equal(holed, packed, what: str) -> None:
    loss, grads, metrics = holed
    p_loss, p_grads, p_metrics = packed
    torch.testing.assert_close(p_loss, loss, atol=1e-12, rtol=1e-10, msg=f"{what}: loss")
    assert p_metrics.keys() == metrics.keys()
    for k, v in metrics.items():
        assert p_metrics[k] == pytest.approx(v, rel=1e-6, abs=1e-9), f"{what}: metric {k}"  # some are fp32
    for leaf in LEAVES:
        torch.testing.assert_close(
            compact(grads[leaf]), p_grads[leaf], atol=1e-12, rtol=1e-10, msg=f"{what}: {leaf}"
        )


def objective(**cfg):
    base = {"kl": KLConfig(coef=0.1, estimator="k3", use="loss"), "entropy_coef": 0.01}
    return build_policy_objective(AlgorithmConfig(**{**base, **cfg}))


def packed_columns(cols):
    return {k: compact(v) for k, v in cols.items()}


# ------------------------------------------------------------------ every loss x every mode
@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("name", list_policy_losses())
def test_policy_loss_ignores_huge_values_at_masked_positions(name, mode):
    """The registered function itself, called directly."""
    fn = get_policy_loss(name)
    cols = columns()
    clean = evaluate(fn, cols, mode)
    assert torch.count_nonzero(clean[1]["logprobs"]) > 0, f"{name}: no gradient proves nothing"
    assert_same_update(clean, evaluate(fn, dirty(cols, "huge"), mode), f"{name}/{mode}")


@pytest.mark.parametrize("kind", ["huge", "nonfinite"])
@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("name", list_policy_losses())
def test_objective_ignores_anything_at_masked_positions(name, mode, kind):
    """What the trainer calls: the loss plus KL-in-loss and the entropy bonus."""
    fn = objective(policy_loss=name, loss_agg_mode=mode)
    cols = columns()
    assert_same_update(
        evaluate(fn, cols, mode), evaluate(fn, dirty(cols, kind), mode), f"{name}/{mode}/{kind}"
    )


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("name", list_policy_losses())
def test_objective_sees_through_holes(name, mode):
    fn = objective(policy_loss=name, loss_agg_mode=mode)
    cols = columns()
    holed = evaluate(fn, cols, mode)
    assert_packed_equal(holed, evaluate(fn, packed_columns(cols), mode, PACKED_MASK), f"{name}/{mode}")


# ---------------------------------------------------------- KL, corrections, distillation
VARIANTS = {
    **{f"kl_{e}": {"kl": KLConfig(coef=0.3, estimator=e, use="loss")} for e in list_kl_estimators()},
    **{
        f"is_{m}_{level}": {
            "correction": CorrectionConfig(is_mode=m, is_level=level, is_low=0.8, is_high=1.2)
        }
        for m in ("truncate", "mask")
        for level in ("token", "sequence", "geometric")
    },
    "opsm": {"correction": CorrectionConfig(opsm_delta=0.01)},
    "opd_coef": {"opd_coef": 0.5},
    "entropy_only": {"kl": KLConfig(), "entropy_coef": 0.05},
}


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_objective_terms_ignore_masked_positions_and_see_through_holes(variant, mode):
    fn = objective(loss_agg_mode=mode, **VARIANTS[variant])
    cols = columns(seed=1)
    clean = evaluate(fn, cols, mode)
    assert_same_update(clean, evaluate(fn, dirty(cols, "nonfinite"), mode), f"{variant}/{mode}")
    assert_packed_equal(clean, evaluate(fn, packed_columns(cols), mode, PACKED_MASK), f"{variant}/{mode}")


def test_the_variants_change_the_update():
    """Each variant's term is active on this batch (else the test above would prove nothing)."""
    cols = columns(seed=1)
    plain = evaluate(objective(kl=KLConfig(), entropy_coef=0.0), cols, "token-mean")
    for variant, cfg in VARIANTS.items():
        if variant == "opsm":  # OPSM drops negative-advantage tokens of sequences past delta
            loss, _, metrics = evaluate(objective(**cfg), cols, "token-mean")
            assert metrics["opsm_mask_frac"] > 0, variant
            continue
        loss, grads, _ = evaluate(
            objective(**{"kl": KLConfig(), "entropy_coef": 0.0, **cfg}), cols, "token-mean"
        )
        changed = not torch.equal(loss, plain[0]) or not torch.equal(grads["logprobs"], plain[1]["logprobs"])
        assert changed, f"{variant} did not change the update"


# ----------------------------------------------------------------------------- value loss
@pytest.mark.parametrize("mode", AGG_MODES)
def test_value_loss_ignores_masked_positions_and_sees_through_holes(mode):
    cols = columns(seed=2)
    new, old, returns = cols["logprobs"], cols["old_logprobs"], cols["advantages"]

    def run(new, old, returns, mask):
        leaf = new.clone().requires_grad_(True)
        loss, metrics = clipped_value_loss(leaf, old, returns, mask, clip_range=0.2, agg=mode)
        loss.backward()
        return loss.detach(), leaf.grad, metrics

    loss, grad, metrics = run(new, old, returns, MASK)
    d = dirty({"new": new, "old": old, "returns": returns}, "nonfinite")
    d_loss, d_grad, d_metrics = run(d["new"], d["old"], d["returns"], MASK)
    assert torch.equal(d_loss, loss) and d_metrics == metrics
    assert torch.isfinite(d_grad).all() and torch.count_nonzero(d_grad[MASK == 0]) == 0
    assert torch.equal(d_grad, grad) and torch.count_nonzero(grad) > 0
    p_loss, p_grad, p_metrics = run(compact(new), compact(old), compact(returns), PACKED_MASK)
    torch.testing.assert_close(p_loss, loss, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(p_grad, compact(grad), atol=1e-12, rtol=1e-10)
    assert p_metrics["vf_clip_frac"] == pytest.approx(metrics["vf_clip_frac"])


def test_a_masked_sentinel_would_poison_an_unguarded_loss():
    """Why the objective guards its inputs: REINFORCE's ``-A log pi`` called without the guard turns a NaN
    advantage at an observation token into a NaN gradient (``0 * NaN`` in backward), which would reach
    every weight; through the objective it is zero."""
    cols = dirty(columns(), "nonfinite")
    _, grads, _ = evaluate(get_policy_loss("reinforce"), cols, "token-mean")
    assert not torch.isfinite(grads["logprobs"]).all()
    _, grads, _ = evaluate(objective(policy_loss="reinforce"), cols, "token-mean")
    assert torch.isfinite(grads["logprobs"]).all()


def test_every_per_token_field_gets_garbage_and_is_guarded():
    """A new per-token field of PolicyLossInputs must get garbage above and be zeroed by the objective."""
    from relax.core.algorithms.policy_losses import TOKEN_FIELDS

    scalars = {
        "response_mask",
        "loss_agg_mode",
        "global_token_count",
        "global_seq_count",
        "loss_scale_factor",
    }
    per_token = {f.name for f in dataclasses.fields(PolicyLossInputs)} - scalars
    assert per_token == set(COLUMNS) == set(TOKEN_FIELDS)
