"""``trainer.offload`` on the megatron trainer (own optimizer path, CPU, in-process gloo, TP=1): the bf16 model,
its fp32 masters (outside the model) and the AdamW state go to fresh host storage and back bit for bit, and the
next step is the one a twin that never offloaded takes. The distributed optimizer is refused, by name."""

from __future__ import annotations

import pytest
import torch

from relax.core.config import ConfigError, load_config
from relax.core.testing import TinyModelFixtures, make_batch, make_samples
from relax.core.testing.trainer import exported, learning_metrics
from relax.core.trainers.offload import PARTS


def megatron_trainer(model_dir: str):
    from relax.core.algorithms import build_policy_objective
    from relax.core.algorithms.config import AlgorithmConfig
    from relax.megatron.trainer import MegatronTrainer

    return MegatronTrainer(
        model_dir,
        objective=build_policy_objective(AlgorithmConfig()),
        lr=1e-4,
        micro_batch_size=4,
        dtype="bfloat16",
    )


def state(trainer) -> list[torch.Tensor]:
    """Views of the model's parameters and buffers, the fp32 masters and the AdamW state, in a fixed order (a
    view keeps its storage alive: a later copy cannot take its address)."""
    masters = trainer.masters.masters
    optim = [
        v for m in masters for v in trainer.optimizer.state[m].values() if torch.is_tensor(v) and v.dim()
    ]
    return [t.detach() for t in (*trainer.model.parameters(), *trainer.model.buffers(), *masters, *optim)]


class TestMegatronOffload(TinyModelFixtures):
    def test_round_trip_is_bit_identical_and_the_next_step_is_the_same(
        self, megatron_world, model_dir, tokenizer
    ):
        first, second = (
            make_batch(make_samples(tokenizer, rows=8, seed=s), tokenizer.pad_token_id) for s in (3, 4)
        )
        plain, moved = megatron_trainer(model_dir), megatron_trainer(model_dir)
        for trainer in (plain, moved):
            trainer.train_step(dict(first))
        live = state(moved)
        before = [t.detach().clone() for t in live]
        assert any(
            m is not p for m, p in zip(moved.masters.masters, moved.masters.params, strict=True)
        )  # fp32 copies
        assert moved.offload(PARTS)["moved_gb"] > 0
        assert all(m.grad is None for m in moved.masters.masters)
        on_host = state(moved)
        assert not {t.data_ptr() for t in live} & {t.data_ptr() for t in on_host}
        moved.onload()
        after = state(moved)
        assert not {t.data_ptr() for t in after} & {t.data_ptr() for t in on_host}
        assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))
        assert learning_metrics(moved.train_step(dict(second))) == learning_metrics(
            plain.train_step(dict(second))
        )
        want = exported(plain)
        assert all(torch.equal(t, want[n]) for n, t in exported(moved).items())


def test_the_distributed_optimizer_is_refused_with_the_reason():
    with pytest.raises(
        ConfigError, match=r"trainer.offload with trainer.backend_params.distributed_optimizer: .*views"
    ):
        load_config(
            None,
            [
                "trainer.offload=true",
                "rollout.host=separate",
                "trainer.backend=megatron",
                "trainer.backend_params={device: cuda, distributed_optimizer: true}",
            ],
        )
