"""Shared-prompt forwards (``relax.core.trainers.shared_prefix``): the logits, gradients and whole
train steps of the plain forward, with each distinct prompt of a micro-batch run once."""

import pytest
import torch

from relax.core.data import Sample, collate
from relax.core.quickstart_model import build_tiny_model
from relax.core.testing.trainer import learning_metrics
from relax.core.trainers.shared_prefix import distinct_prompts, shared_prefix_logits
from relax.core.trainers.torch_trainer import TorchTrainer

from .test_torch_trainer import assert_params_close, params, ppo_objective


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=1, initializer_range=0.3)


def grouped_batch(groups: int = 4, group_size: int = 4, seed: int = 0) -> dict[str, torch.Tensor]:
    """GRPO-shaped rows: prompts of different lengths (left padding), G responses of different
    lengths each (right padding), advantages of both signs."""
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for g in range(groups):
        prompt = torch.randint(4, 24, (3 + 2 * g,), generator=gen).tolist()
        for k in range(group_size):
            response = torch.randint(4, 24, (1 + (g + k) % 4,), generator=gen).tolist()
            samples.append(Sample(prompt_ids=prompt, group_id=g, response_ids=response))
    out = collate(samples, pad_id=0)
    signs = torch.where(torch.arange(len(samples))[:, None] % 3 == 0, 1.0, -0.7)
    out["advantages"] = signs.expand_as(out["response_mask"]).clone()
    return out


def plain_and_shared(
    trainer: TorchTrainer, batch: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    trainer.share_prompts = False
    plain = trainer._response_logits(batch)
    trainer.share_prompts = True
    return plain, trainer._response_logits(batch)


def test_distinct_prompts_index_rows_in_order_of_first_appearance():
    batch = grouped_batch(groups=3, group_size=2)
    first, inverse = distinct_prompts(batch, batch["input_ids"].shape[1] - batch["responses"].shape[1])
    assert first.tolist() == [0, 2, 4]
    assert inverse.tolist() == [0, 0, 1, 1, 2, 2]


def test_shared_logits_equal_the_plain_forward(model_dir):
    trainer = TorchTrainer(model_dir, objective=ppo_objective)
    batch = grouped_batch()
    with torch.no_grad():
        plain, shared = plain_and_shared(trainer, batch)
    assert shared.shape == plain.shape
    torch.testing.assert_close(shared, plain, atol=1e-5, rtol=1e-5)


def test_one_token_responses_need_only_the_prompt_pass(model_dir):
    trainer = TorchTrainer(model_dir, objective=ppo_objective)
    samples = [Sample(prompt_ids=[5, 6, 7], group_id=0, response_ids=[9]) for _ in range(3)]
    with torch.no_grad():
        plain, shared = plain_and_shared(trainer, collate(samples, pad_id=0))
    assert shared.shape == (3, 1, plain.shape[-1])
    torch.testing.assert_close(shared, plain, atol=1e-5, rtol=1e-5)


def test_nothing_to_share_is_left_to_the_plain_forward(model_dir):
    trainer = TorchTrainer(model_dir, objective=ppo_objective)
    distinct = grouped_batch(groups=4, group_size=1)
    assert shared_prefix_logits(trainer.model, distinct, distinct["responses"].shape[1]) is None


def test_gradients_equal_the_plain_forward(model_dir):
    trainer = TorchTrainer(model_dir, objective=ppo_objective)
    batch = grouped_batch()

    def grads(share: bool) -> dict[str, torch.Tensor]:
        trainer.share_prompts = share
        trainer.model.zero_grad(set_to_none=True)
        logits = trainer._response_logits(batch).log_softmax(-1)
        picked = logits.gather(-1, batch["responses"][..., None]).squeeze(-1)
        (picked * batch["response_mask"] * batch["advantages"]).sum().backward()
        return {n: p.grad.clone() for n, p in trainer.model.named_parameters()}

    plain, shared = grads(False), grads(True)
    assert plain.keys() == shared.keys()
    for name in plain:
        scale = float(plain[name].abs().max())
        assert float((shared[name] - plain[name]).abs().max()) <= 1e-5 * max(scale, 1.0), name


def test_train_steps_match_the_plain_forward(model_dir):
    """A whole ``train_step`` (two updates: fused old logprobs, then a scored second mini-batch)."""
    batch = grouped_batch()
    results = []
    for share in (False, True):
        trainer = TorchTrainer(
            model_dir,
            objective=ppo_objective,
            lr=1e-3,
            micro_batch_size=8,
            num_minibatches=2,
            share_prompts=share,
        )
        results.append((learning_metrics(trainer.train_step(dict(batch))), params(trainer)))
    (plain_metrics, plain_params), (shared_metrics, shared_params) = results
    assert plain_metrics.keys() == shared_metrics.keys()
    for key in plain_metrics:
        assert shared_metrics[key] == pytest.approx(plain_metrics[key], rel=1e-5, abs=1e-6), key
    # Adam divides by sqrt(v): a weight whose gradient is ~0 turns float noise into a step of up to lr
    # (1e-3), so a tenth of lr bounds the noise while any real difference (a whole lr step) fails
    assert_params_close(shared_params, plain_params, atol=1e-4)


def test_a_sliding_window_cache_falls_back_to_the_plain_forward(tmp_path):
    """Rows of a sliding-window cache cannot be repeated: the trainer says so once and goes plain."""
    model_dir = build_tiny_model(
        tmp_path, seed=1, use_sliding_window=True, sliding_window=4, max_window_layers=0
    )
    trainer = TorchTrainer(model_dir, objective=ppo_objective)
    batch = grouped_batch(groups=2, group_size=3)
    with torch.no_grad():
        trainer.share_prompts = True
        fallback = trainer._response_logits(batch)
        assert trainer.share_prompts is False
        plain = trainer._response_logits(batch)
    torch.testing.assert_close(fallback, plain)
