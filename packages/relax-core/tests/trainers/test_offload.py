"""``trainer.offload`` on the torch and fsdp trainers (one process): offload -> onload moves every tensor to fresh
host storage and back bit for bit, the optimizer keeps its parameters, and training goes on exactly as it
would have without the round trip. On CPU the "device" is the host too, so each move is a real copy into new
storage (the data pointers change), which is what a GPU run does across the bus."""

from __future__ import annotations

import pytest
import torch

from relax.core.policy_update.memory import onloaded, phase_metrics
from relax.core.quickstart_model import build_tiny_model
from relax.core.testing import make_batch, make_samples, torch_trainer
from relax.core.testing.trainer import exported, learning_metrics
from relax.core.trainers.critic import Critic
from relax.core.trainers.offload import PARTS, Offloader

KW = {"lr": 1e-2, "micro_batch_size": 4, "num_minibatches": 2}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("offload"), seed=2, initializer_range=0.2)


@pytest.fixture(scope="module")
def batches(model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    first = make_batch(make_samples(tok, rows=8, seed=11), tok.pad_token_id)
    return first, {**first, "advantages": -first["advantages"]}


def local(t: torch.Tensor) -> torch.Tensor:
    return getattr(t, "_local_tensor", t)  # an FSDP2 parameter: this rank's shard


def snapshot(trainer) -> dict[str, torch.Tensor]:
    """Copies of every parameter, buffer and optimizer-state tensor (the critic's too), by a stable key."""
    out = {}
    for owner, module, optimizer in (
        (".", trainer.model, trainer.optimizer),
        ("critic.", *_critic_parts(trainer)),
    ):
        if module is None:
            continue
        for name, t in (*module.named_parameters(), *module.named_buffers()):
            out[owner + name] = local(t).detach().clone()
        names = {id(p): n for n, p in module.named_parameters()}
        for p, state in optimizer.state.items():
            for key, value in state.items():
                out[f"{owner}{names[id(p)]}/{key}"] = local(value).clone()
    return out


def _critic_parts(trainer):
    critic = getattr(trainer, "critic", None)
    return (critic.model, critic.optimizer) if critic is not None else (None, None)


def held(trainer) -> list[torch.Tensor]:
    """Views of every parameter's and optimizer-state tensor's storage (the critic's too): kept alive, so a new
    copy cannot reuse its address."""
    parts = [(trainer.model, trainer.optimizer), _critic_parts(trainer)]
    params = [local(p).detach() for m, _ in parts if m is not None for p in m.parameters()]
    state = [
        local(v) for _, o in parts if o is not None for st in o.state.values() for v in st.values() if v.dim()
    ]
    return params + state


def pointers(tensors: list[torch.Tensor]) -> set[int]:
    return {t.data_ptr() for t in tensors}


def assert_identical(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for key, tensor in want.items():
        assert got[key].device == tensor.device and got[key].dtype == tensor.dtype, key
        assert torch.equal(got[key], tensor), key


def with_critic(batch):
    """``batch`` with critic values and returns (so the critic trains and has optimizer state too)."""
    return {**batch, "values": torch.zeros_like(batch["advantages"]), "returns": batch["advantages"]}


def round_trip_keeps_everything(make, batches) -> None:
    """Two twins take a step; one goes to the host and back; both take another step: equal bit for bit."""
    first, second = batches
    plain, moved = make(), make()
    try:
        for trainer in (plain, moved):
            trainer.train_step(dict(first))
        before, old = snapshot(moved), held(moved)
        assert any(k.endswith("/exp_avg") for k in before)  # the optimizer has state to move
        if _critic_parts(moved)[0] is not None:
            assert any(k.startswith("critic.") and k.endswith("/exp_avg") for k in before)
        out = moved.offload(PARTS)
        assert moved.offloader.on_host == {"optimizer", "params"} and out["moved_gb"] > 0
        assert all(p.grad is None for p in moved.model.parameters())  # dropped, not moved
        assert pointers(held(moved)).isdisjoint(pointers(old))  # fresh host storage
        assert set(out["after"]) >= {"rss_gb"}  # host memory (CUDA adds mem_gb / mem_reserved_gb)
        assert moved.offload(PARTS)["moved_gb"] == 0  # idempotent
        on_host = held(moved)
        moved.onload()
        assert moved.offloader.on_host == set()
        assert pointers(held(moved)).isdisjoint(pointers(on_host))  # every tensor came back into new storage
        assert_identical(snapshot(moved), before)
        opt_params = [p for g in moved.optimizer.param_groups for p in g["params"]]
        assert all(any(p is q for q in moved.model.parameters()) for p in opt_params)  # the same objects
        want, got = plain.train_step(dict(second)), moved.train_step(dict(second))
        assert learning_metrics(got) == learning_metrics(want)
        assert_identical(snapshot(moved), snapshot(plain))
        assert all(torch.equal(t, exported(plain)[n]) for n, t in exported(moved).items())
    finally:
        for trainer in (plain, moved):
            if hasattr(trainer, "close"):
                trainer.close()


def test_torch_trainer_round_trip_is_bit_identical_and_training_continues_the_same(model_dir, batches):
    round_trip_keeps_everything(lambda: torch_trainer(model_dir, **KW), batches)


def test_the_critic_goes_to_the_host_and_back_with_the_policy(model_dir, batches):
    def make():
        return torch_trainer(model_dir, critic=Critic(model_dir, lr=1e-3, micro_batch_size=4), **KW)

    round_trip_keeps_everything(make, tuple(with_critic(b) for b in batches))


def test_fsdp_trainer_moves_its_dtensor_shards_and_comes_back_bit_identical(model_dir, batches):
    from relax.core.algorithms import build_policy_objective
    from relax.core.algorithms.config import AlgorithmConfig
    from relax.core.trainers.fsdp.trainer import FSDPTrainer

    def make():
        return FSDPTrainer(model_dir, objective=build_policy_objective(AlgorithmConfig()), **KW)

    round_trip_keeps_everything(make, batches)


def test_after_the_update_only_the_optimizer_leaves_and_a_checkpoint_sees_the_device(
    model_dir, batches, tmp_path
):
    """The order colocate uses: optimizer state (and gradients) out after the update, the parameters stay for
    the sync; a checkpoint written while offloaded (``onloaded``) resumes to the same next step."""
    first, second = batches
    trainer = torch_trainer(model_dir, **KW)
    trainer.train_step(dict(first))
    params = pointers(held(trainer)[: len(list(trainer.model.parameters()))])
    trainer.offload(("grads", "optimizer"))
    assert trainer.offloader.on_host == {"optimizer"} and pointers(held(trainer)).issuperset(params)
    trainer.offload(PARTS)
    with onloaded(trainer):
        assert trainer.offloader.on_host == set()
        trainer.save(str(tmp_path / "ckpt"))
    assert trainer.offloader.on_host == {"optimizer", "params"}  # back where it was
    trainer.onload()
    want = trainer.train_step(dict(second))
    resumed = torch_trainer(model_dir, **KW)
    resumed.load(str(tmp_path / "ckpt"))
    assert learning_metrics(resumed.train_step(dict(second))) == learning_metrics(want)


def test_offloader_refuses_unknown_parts_and_names_phase_metrics():
    module = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"unknown part\(s\) \['weights'\]; known: grads, optimizer, params"):
        Offloader("cpu", [module], []).offload(["weights"])
    snap = {"mem_gb": 1.5, "mem_reserved_gb": 2.0, "rss_gb": 3.0}
    assert phase_metrics("after_offload", snap) == {
        "perf/mem_after_offload_gb": 1.5,
        "perf/mem_reserved_after_offload_gb": 2.0,
        "perf/rss_after_offload_gb": 3.0,
    }
