import asyncio
import random

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from relax.core.algorithms.aggregation import aggregate_loss, masked_mean
from relax.core.controller.capabilities import capabilities, declares
from relax.core.data import Sample, collate
from relax.core.policy_update import NonFiniteError
from relax.core.protocols import Trainer
from relax.core.quickstart_model import build_tiny_model
from relax.core.trainers.torch_trainer import TorchTrainer, token_logprobs, trainer_from_config


def ppo_objective(inputs):
    """Minimal PPO-clip; aggregation with the global counts the trainer passes."""
    ratio = (inputs.logprobs - inputs.old_logprobs).exp()
    adv = inputs.advantages
    losses = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
    loss = aggregate_loss(
        losses, inputs.response_mask, inputs.loss_agg_mode, inputs.global_token_count, inputs.global_seq_count
    )
    return loss, {"ratio_mean": float(masked_mean(ratio.detach(), inputs.response_mask))}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=1, initializer_range=0.3)


def make(model_dir, **kw):
    return TorchTrainer(model_dir, **{"objective": ppo_objective, "lr": 1e-2, "micro_batch_size": 8, **kw})


def params(trainer):
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def assert_params_close(a, b, atol):
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=atol, rtol=0, msg=lambda m, n=name: f"{n}: {m}")


def test_is_a_trainer(model_dir):
    assert isinstance(make(model_dir), Trainer)


def test_positive_advantage_raises_logprob_and_metrics_are_real(model_dir, batch):
    trainer = make(model_dir)
    mask = batch["response_mask"]
    with torch.no_grad():
        logits = trainer._response_logits(batch).float()
    logp = logits.log_softmax(-1)
    expected_entropy = float(masked_mean(-(logp.exp() * logp).sum(-1), mask))
    before = trainer.forward_logprobs(batch)
    torch.testing.assert_close(before, torch.where(mask > 0, token_logprobs(logits, batch["responses"]), 0.0))
    pos = (batch["advantages"] > 0) & (mask > 0)
    metrics = [trainer.train_step(batch) for _ in range(3)]
    after = trainer.forward_logprobs(batch)
    assert after[pos].mean() > before[pos].mean() + 0.1
    assert after[~pos & (mask > 0)].mean() < before[~pos & (mask > 0)].mean()
    first = metrics[0]
    assert set(first) == {
        "loss",
        "grad_norm",
        "lr",
        "entropy",
        "ratio_mean",
        "skipped_nonfinite",
        "rollout_logprob_abs_diff",
        "rollout_k3_kl",  # old logprobs computed here
        "perf/micro_batches",
        "perf/padding_frac",
        "perf/peak_rss_gb",
    }
    assert first["entropy"] == pytest.approx(expected_entropy, abs=1e-5)
    assert first["ratio_mean"] == pytest.approx(1.0, abs=1e-5)  # first step is on-policy
    assert first["lr"] == 1e-2 and first["grad_norm"] > 0 and first["skipped_nonfinite"] == 0.0
    # ratio is 1 at each step's start (old logprobs recomputed), so the loss is -token-mean(A)
    assert first["loss"] == pytest.approx(float(-(batch["advantages"] * mask).sum() / mask.sum()), abs=1e-6)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_micro_batches_accumulate_to_the_full_batch(model_dir, batch, mode):
    small, full = make(model_dir, micro_batch_size=2, loss_agg_mode=mode), make(model_dir, loss_agg_mode=mode)
    for step in range(2):
        m_small, m_full = small.train_step(batch), full.train_step(batch)
        assert m_small["loss"] == pytest.approx(m_full["loss"], abs=1e-6)
        assert m_small["grad_norm"] == pytest.approx(m_full["grad_norm"], rel=1e-5)
        assert m_small["entropy"] == pytest.approx(m_full["entropy"], abs=1e-6)
        if step == 0:  # the accumulated gradient itself (kept until the next zero_grad)
            grads = {n: p.grad for n, p in full.model.named_parameters()}
            for n, p in small.model.named_parameters():
                torch.testing.assert_close(p.grad, grads[n], atol=1e-7, rtol=1e-5)
    # Adam divides by sqrt(v): float noise on near-zero gradients moves a weight by a sliver of lr
    assert_params_close(params(small), params(full), atol=1e-2 * small.settings.lr)


def test_minibatches_are_sequential_optimizer_steps(model_dir, batch):
    two = make(model_dir, num_minibatches=2)
    manual = make(model_dir)
    old = manual.forward_logprobs(batch)
    two.train_step(batch)
    assert two.optimizer.state_dict()["state"][0]["step"] == 2 and two.step == 1
    for rows in (slice(0, 4), slice(4, 8)):  # same old logprobs: taken before the first update
        half = {k: v[rows] for k, v in batch.items()}
        manual.train_step({**half, "old_logprobs": old[rows]})
    assert_params_close(params(two), params(manual), atol=1e-6)


def test_lr_schedule_follows_train_steps(model_dir, batch):
    trainer = make(model_dir, lr=1e-3, warmup_steps=2, total_steps=4, lr_schedule="linear", min_lr_ratio=0.1)
    lrs = [trainer.train_step(batch)["lr"] for _ in range(5)]
    assert lrs == pytest.approx([5e-4, 1e-3, 1e-3, 5.5e-4, 1e-4])


def test_save_load_resumes_identically(model_dir, batch, tmp_path):
    kw = dict(
        lr=3e-3, warmup_steps=1, total_steps=6, lr_schedule="cosine", min_lr_ratio=0.1, micro_batch_size=4
    )
    straight = make(model_dir, **kw)
    for _ in range(4):
        straight.train_step(batch)
    first = make(model_dir, **kw)
    for _ in range(2):
        first.train_step(batch)
    first.save(str(tmp_path / "ckpt"))
    draws = (torch.rand(3), np.random.rand(3), random.random())
    resumed = make(model_dir, **{**kw, "seed": 123})  # a different seed: everything must come from the file
    resumed.load(str(tmp_path / "ckpt"))
    assert torch.equal(torch.rand(3), draws[0]) and np.array_equal(np.random.rand(3), draws[1])
    assert random.random() == draws[2]
    assert resumed.step == 2
    for _ in range(2):
        resumed.train_step(batch)
    assert_params_close(params(resumed), params(straight), atol=0)
    assert resumed.current_lr() == straight.current_lr()


def test_save_hf_loads_with_plain_transformers(model_dir, batch, tmp_path):
    trainer = make(model_dir)
    trainer.train_step(batch)
    trainer.save_hf(str(tmp_path / "hf"))
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert tok.decode(tok("3+4=7")["input_ids"]) == "3+4=7"
    ids = batch["input_ids"][:2]
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, trainer.model(ids).logits, atol=1e-6, rtol=0)


def test_exported_weights_sync_an_engine_exactly(model_dir, batch):
    from relax.core.engines.hf import HFRolloutEngine
    from relax.core.protocols import GenerationRequest, SamplingParams

    trainer = make(model_dir)
    trainer.train_step(batch)
    buckets = list(trainer.export_weights(bucket_bytes=100_000))
    assert len(buckets) > 1
    for bucket in buckets:
        sizes = [t.numel() * t.element_size() for _, t in bucket]
        assert sum(sizes) <= 100_000 or len(bucket) == 1
    names = [n for b in buckets for n, _ in b]
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names  # tied: exported once
    assert names == list(trainer.state_dict_for_sync())
    engine = HFRolloutEngine(model_dir)
    for bucket in buckets:
        engine.update_weights(bucket, version=1)
    prompts = [[1, 4, 23, 10, 17, 11, 20], [10, 17], [12, 18, 9, 20, 5, 23], [7, 8, 9]]
    reqs = [
        GenerationRequest(str(i), p, SamplingParams(max_new_tokens=5, seed=i)) for i, p in enumerate(prompts)
    ]
    results = asyncio.run(engine.generate(reqs))
    samples = [
        Sample(prompt_ids=p, group_id=0, response_ids=r.response_ids, rollout_logprobs=r.logprobs)
        for p, r in zip(prompts, results, strict=True)
    ]
    rolled = collate(samples, pad_id=0)
    mask = rolled["response_mask"].bool()
    torch.testing.assert_close(
        trainer.forward_logprobs(rolled)[mask], rolled["rollout_logprobs"][mask], atol=1e-4, rtol=0
    )
    assert all(v == 1 for r in results for v in r.versions)


def test_from_config_policy_and_reference(model_dir, batch):
    from relax.core.config import RelaxConfig

    cfg = RelaxConfig()
    policy = trainer_from_config(cfg, model_dir)
    metrics = policy.train_step(batch)
    assert {"loss", "grad_norm", "lr", "entropy", "pg_loss", "clip_frac"} <= set(metrics)
    assert metrics["lr"] == cfg.trainer.lr
    reference = trainer_from_config(cfg, model_dir, reference=True)
    assert reference.optimizer is None and not any(p.requires_grad for p in reference.model.parameters())
    torch.testing.assert_close(reference.forward_logprobs(batch), make(model_dir).forward_logprobs(batch))
    with pytest.raises(RuntimeError, match="trainable"):
        reference.train_step(batch)


def nan_on_call(n):
    """``ppo_objective`` whose ``n``-th call (1-based) returns a NaN loss."""
    calls = []

    def objective(inputs):
        calls.append(1)
        loss, metrics = ppo_objective(inputs)
        return (loss * float("nan") if len(calls) == n else loss), metrics

    return objective


def test_nonfinite_loss_stops_naming_the_step_and_leaves_weights_alone(model_dir, batch):
    trainer = make(model_dir, objective=nan_on_call(2))
    trainer.train_step(batch)
    before = params(trainer)
    with pytest.raises(
        NonFiniteError,
        match=r"train step 2: non-finite loss \(loss nan, grad_norm nan\); the update was not applied",
    ):
        trainer.train_step(batch)
    assert_params_close(params(trainer), before, atol=0)


def test_skip_nonfinite_skips_and_counts(model_dir, batch):
    trainer = make(model_dir, objective=nan_on_call(2), num_minibatches=2, skip_nonfinite=True)
    first = trainer.train_step(batch)  # calls 1 (mini-batch 1) and 2 (mini-batch 2: NaN, skipped)
    assert first["skipped_nonfinite"] == 1.0
    assert trainer.optimizer.state_dict()["state"][0]["step"] == 1  # one of two updates applied
    second = trainer.train_step(batch)
    assert second["skipped_nonfinite"] == 0.0
    assert all(torch.isfinite(v).all() for v in params(trainer).values())


def test_huge_lr_stops_the_run_or_is_skipped_and_counted(model_dir, batch):
    """lr=1e30: Adam moves every weight by ~lr, the next loss overflows: an error naming the step,
    or with skip_nonfinite every later update skipped and counted (weights stay finite)."""
    trainer = make(model_dir, lr=1e30)
    trainer.train_step(batch)
    with pytest.raises(NonFiniteError, match=r"train step 2: non-finite (loss|gradient)"):
        trainer.train_step(batch)
    trainer = make(model_dir, lr=1e30, skip_nonfinite=True)
    skipped = sum(trainer.train_step(batch)["skipped_nonfinite"] for _ in range(3))
    assert skipped == 2 and all(torch.isfinite(v).all() for v in params(trainer).values())


def test_infinite_lr_never_leaves_a_nan_model_even_in_skip_mode(model_dir, batch):
    """lr=inf (config validation rejects it; a plugin could still compute one): the applied update
    makes the weights non-finite, which no skip can undo, so the step fails either way."""
    for skip in (False, True):
        trainer = make(model_dir, lr=float("inf"), skip_nonfinite=skip)
        with pytest.raises(
            NonFiniteError, match=r"train step 1: the update \(lr inf\) made the weights non-finite"
        ):
            trainer.train_step(batch)


def test_from_config_passes_skip_nonfinite(model_dir):
    from relax.core.config import load_config

    cfg = load_config(None, ["trainer.skip_nonfinite=true"])
    assert trainer_from_config(cfg, model_dir).settings.skip_nonfinite is True


@pytest.mark.parametrize("minibatches", [1, 2])
def test_fused_old_logprobs_give_the_separate_forwards_loss_and_gradients(model_dir, batch, minibatches):
    """On-policy shortcut: a batch without old_logprobs takes the first mini-batch's from its own
    training forward (detached); loss, gradient norm, weights and ratio must equal the path where
    the old logprobs came from a separate forward (``forward_logprobs``) first."""
    kw = dict(micro_batch_size=4, num_minibatches=minibatches)
    separate, fused = make(model_dir, **kw), make(model_dir, **kw)
    with_old = dict(
        batch, old_logprobs=separate.forward_logprobs(batch), rollout_logprobs=batch["rollout_logprobs"]
    )
    seen = []
    fused.update.objective = lambda inputs: (
        seen.append(inputs.old_logprobs.requires_grad),
        ppo_objective(inputs),
    )[1]
    for _ in range(2):
        a, b = separate.train_step(dict(with_old)), fused.train_step(dict(batch))
        for key in ("loss", "grad_norm", "entropy", "ratio_mean"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), key
        assert_params_close(params(separate), params(fused), atol=1e-6)
        with_old["old_logprobs"] = separate.forward_logprobs(batch)
    assert b["grad_norm"] > 0 and (minibatches > 1 or b["ratio_mean"] == pytest.approx(1.0, abs=1e-6))
    assert seen and not any(seen)  # the old logprobs never carry the graph
    assert (
        b["rollout_logprob_abs_diff"] > 0 and "rollout_logprob_abs_diff" not in a
    )  # vs the fixture's rollout lp
    assert fused.fuses_old_logprobs()
    # declared, and read by the controller through the declared capabilities (never probed by calling)
    assert "fuses_old_logprobs" in capabilities(fused) and declares(fused, "fuses_old_logprobs")
    assert not declares(fused, "collective_export")


def test_exact_rollout_logprobs_are_the_later_minibatches_old_logprobs(model_dir, batch):
    """A batch marking every row ``rollout_logprobs_exact`` (an engine that sampled with this very
    module) runs no forward for mini-batches after the first: their old logprobs are the rollout's.
    With the rollout's equal to this model's, training equals the scored path; with other values the
    second update's ratio moves (they were used); the mismatch metric covers the first mini-batch,
    which the training forward still scores."""
    kw = dict(micro_batch_size=4, num_minibatches=2)
    scored, exact, wrong = make(model_dir, **kw), make(model_dir, **kw), make(model_dir, **kw)
    own = scored.forward_logprobs(batch)
    flags = torch.ones(batch["responses"].shape[0], dtype=torch.bool)
    a = scored.train_step(dict(batch, rollout_logprobs=own))
    b = exact.train_step(dict(batch, rollout_logprobs=own, rollout_logprobs_exact=flags))
    for key in ("loss", "grad_norm", "entropy", "ratio_mean"):
        assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), key
    assert_params_close(params(scored), params(exact), atol=1e-6)
    assert b["rollout_logprob_abs_diff"] < 1e-6
    c = wrong.train_step(
        dict(batch, rollout_logprobs=own - 0.5 * batch["response_mask"], rollout_logprobs_exact=flags)
    )
    assert c["ratio_mean"] > a["ratio_mean"] + 0.05  # exp(+0.5) on the second mini-batch's tokens
    assert c["rollout_logprob_abs_diff"] == pytest.approx(0.5, abs=1e-4)  # scored on the first: 0.5 off
    calls = []
    exact.score = lambda rows: calls.append(rows) or own  # a forward here would be recorded
    exact.train_step(dict(batch, rollout_logprobs=own, rollout_logprobs_exact=flags))
    assert not calls
    exact.train_step(dict(batch, rollout_logprobs=own, rollout_logprobs_exact=flags & False))
    assert len(calls) == 1


def test_bf16_trains_fp32_masters_so_a_small_lr_still_moves_the_weights(model_dir, batch):
    """10 steps at lr 1e-6: AdamW on bf16 weights changes ~2 % of them (the update rounds away);
    mixed precision (fp32 masters, bf16 autocast) changes as many as fp32 does. Exports are bf16."""
    changed = {}
    for dtype in ("float32", "bfloat16"):
        t = make(model_dir, dtype=dtype, lr=1e-6)
        before = params(t)
        assert all(p.dtype == torch.float32 for p in t.model.parameters())
        for _ in range(10):
            t.train_step(dict(batch))
        after = params(t)
        changed[dtype] = sum(int((after[n] != before[n]).sum()) for n in before) / sum(
            v.numel() for v in before.values()
        )
        assert {x.dtype for b in t.export_weights() for _, x in b} == {getattr(torch, dtype)}
    assert changed["float32"] > 0.9
    assert changed["bfloat16"] == pytest.approx(changed["float32"], abs=0.03), changed
    frozen = TorchTrainer(model_dir, dtype="bfloat16", trainable=False)  # a reference needs no masters
    assert {p.dtype for p in frozen.model.parameters()} == {torch.bfloat16}
