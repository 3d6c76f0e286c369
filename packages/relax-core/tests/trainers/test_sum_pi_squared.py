"""The torch trainer's ``forward_logprobs_and_sum_pi_squared``: the per-token ``sum_v pi(v)^2`` the
optimal token baselines read equals a hand computation from the model's own logits of each row
alone (no padding), at the trainer's temperature, and its logprobs are ``forward_logprobs``'."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from relax.core.data import Sample, collate
from relax.core.protocols import SupportsSumPiSquared
from relax.core.quickstart_model import build_tiny_model
from relax.core.trainers.torch_trainer import TorchTrainer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("spi"), seed=5, initializer_range=0.3)


@pytest.fixture(scope="module")
def samples():
    gen = torch.Generator().manual_seed(2)
    return [
        Sample(
            prompt_ids=torch.randint(4, 24, (2 + i % 3,), generator=gen).tolist(),
            group_id=i // 2,
            response_ids=torch.randint(4, 24, (1 + (i * 2) % 5,), generator=gen).tolist(),
        )
        for i in range(7)
    ]


def _by_hand(model, sample: Sample, temperature: float) -> torch.Tensor:
    """sum softmax(z / T)^2 at the logits predicting each response token, from the row alone."""
    ids = torch.tensor([sample.prompt_ids + sample.response_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].double()
    p = len(sample.prompt_ids)
    probs = torch.softmax(logits[p - 1 : p - 1 + len(sample.response_ids)] / temperature, dim=-1)
    return (probs * probs).sum(dim=-1)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sum_pi_squared_equals_the_hand_computation(model_dir, samples, temperature):
    trainer = TorchTrainer(model_dir, trainable=False, temperature=temperature, micro_batch_size=3)
    assert isinstance(trainer, SupportsSumPiSquared)
    batch = collate(samples, pad_id=0)
    logprobs, spi = trainer.forward_logprobs_and_sum_pi_squared(batch)
    assert spi.dtype == logprobs.dtype == torch.float32 and spi.shape == batch["responses"].shape
    assert torch.equal(logprobs, trainer.forward_logprobs(batch))  # the same forward's logprobs
    mask = batch["response_mask"] > 0
    assert torch.all(spi[~mask] == 0)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    for row, sample in enumerate(samples):
        want = _by_hand(model, sample, temperature).float()
        torch.testing.assert_close(spi[row, : len(sample.response_ids)], want, atol=2e-6, rtol=1e-5)
    values = spi[mask]
    vocab = model.config.vocab_size
    assert values.min() > 1 / vocab and values.max() < 1  # never uniform, never one-hot: not vacuous
    assert values.max() - values.min() > 1e-3
