"""``TrainerConformance`` and ``LogprobAgreementConformance``: what the controller needs from a trainer.

Forward logprobs in the batch convention ((B, R), masked, padding-independent), a train step that
moves the weights in the direction of the advantages, HF-named weight export in bounded buckets,
an exact save/load round trip and, when offered, ``save_hf``. And the backend side that core's
policy-update loop calls (``relax.core.policy_update.ModelStep``): micro-batch logprobs / entropy
into a loss callback, gradients that accumulate to the full batch's, an optimizer step, sums over
the data-parallel group -- so a new backend is that protocol plus the ``Trainer`` methods above.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from relax.core.data import Sample, collate
from relax.core.policy_update import ModelStep, split_rows
from relax.core.protocols import Trainer
from relax.core.testing.engine import EngineFixtures
from relax.core.testing.models import TinyModelFixtures, load_hf_weights


def exported(trainer: Any, bucket_bytes: int = 1 << 40) -> dict[str, torch.Tensor]:
    """All of ``trainer.export_weights`` as one name -> tensor dict (duplicates are an error)."""
    out: dict[str, torch.Tensor] = {}
    for bucket in trainer.export_weights(bucket_bytes):
        for name, tensor in bucket:
            assert name not in out, f"export_weights yielded {name!r} twice"
            out[name] = tensor.detach().cpu().clone()
    return out


def learning_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """A train step's metrics without the ``perf/*`` ones (memory peaks, micro-batch shapes): what two
    layouts of the same update (world sizes, a resume, prompt sharing) must agree on."""
    return {k: v for k, v in metrics.items() if not k.startswith("perf/")}


def make_samples(tokenizer: Any, rows: int = 8, seed: int = 0) -> list[Sample]:
    """Samples of random ordinary tokens: prompts 3-6 and responses 2-6 tokens long."""
    gen = torch.Generator().manual_seed(seed)
    special = set(tokenizer.all_special_ids)
    vocab = torch.tensor([t for t in range(len(tokenizer)) if t not in special])

    def draw(n: int) -> list[int]:
        return vocab[torch.randint(len(vocab), (n,), generator=gen)].tolist()

    return [
        Sample(prompt_ids=draw(3 + i % 4), group_id=i // 4, response_ids=draw(2 + (i * 3) % 5))
        for i in range(rows)
    ]


def make_batch(samples: list[Sample], pad_id: int) -> dict[str, torch.Tensor]:
    """The collated batch with advantages +1 on even rows and -0.5 on odd ones."""
    batch = collate(samples, pad_id=pad_id)
    sign = torch.where(torch.arange(len(samples))[:, None] % 2 == 0, 1.0, -0.5)
    batch["advantages"] = (sign * batch["response_mask"]).contiguous()
    return batch


def torch_trainer(model_dir: str, **kw: Any) -> Any:
    """Core's torch trainer with the default policy objective, tuned for the tiny model: the
    reference side of a third-party engine's ``LogprobAgreementConformance``."""
    from relax.core.algorithms import build_policy_objective
    from relax.core.algorithms.config import AlgorithmConfig
    from relax.core.trainers.torch_trainer import TorchTrainer

    kw = {"objective": build_policy_objective(AlgorithmConfig()), "lr": 1e-2, "micro_batch_size": 4, **kw}
    return TorchTrainer(model_dir, **kw)


def _assert_same_weights(
    got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], atol: float, what: str
) -> None:
    assert got.keys() == want.keys(), f"{what}: names differ: {sorted(got.keys() ^ want.keys())}"
    for name in want:
        torch.testing.assert_close(
            got[name], want[name], atol=atol, rtol=0, msg=lambda m, n=name: f"{what}, {n}: {m}"
        )


class TrainerFixtures(TinyModelFixtures):
    """The ``trainer`` fixture (a fresh trainer per test) and ``batch``."""

    def make_trainer(self, model_dir: str) -> Trainer:
        """A trainable trainer on ``model_dir`` with a policy-gradient objective (e.g. core's
        ``build_policy_objective(AlgorithmConfig())``), logits at temperature 1, and a learning rate
        large enough (~1e-2 for the tiny model) that one step visibly moves the weights."""
        raise NotImplementedError(f"{type(self).__name__} must implement make_trainer(self, model_dir)")

    def close_trainer(self, trainer: Any) -> None:
        """Release what ``make_trainer`` started. Default: nothing."""

    @pytest.fixture
    def trainer(self, model_dir: str) -> Iterator[Any]:
        trainer = self.make_trainer(model_dir)
        yield trainer
        self.close_trainer(trainer)

    @pytest.fixture(scope="class")
    @classmethod
    def samples(cls, tokenizer: Any) -> list[Sample]:
        return make_samples(tokenizer)

    @pytest.fixture(scope="class")
    @classmethod
    def batch(cls, samples: list[Sample], tokenizer: Any) -> dict[str, torch.Tensor]:
        return make_batch(samples, tokenizer.pad_token_id)

    def with_old_logprobs(self, trainer: Any, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A copy of ``batch`` with ``old_logprobs`` from ``trainer`` (as the controller passes it)."""
        return {**batch, "old_logprobs": trainer.forward_logprobs(batch)}


class TrainerConformance(TrainerFixtures):
    """Subclass as ``class TestMyTrainer(TrainerConformance)`` and implement ``make_trainer``.

    Optional ``save_hf`` and ``forward_logprobs_and_sum_pi_squared`` are skipped with a reason when
    absent. Tolerances are attributes so a bf16 or GPU trainer can widen them.
    """

    #: forward-logprob agreement between padded and unpadded rows
    forward_atol: float = 1e-4
    #: exported weights vs the checkpoint before training (0: bit-identical in fp32)
    export_atol: float = 0.0
    #: weights / metrics after load + train_step vs the uninterrupted trainer (0: bit-identical)
    resume_atol: float = 0.0

    def test_is_a_trainer(self, trainer):
        assert isinstance(trainer, Trainer), f"{type(trainer).__name__} lacks Trainer methods"

    def test_forward_logprobs_shape_mask_and_padding(self, trainer, batch, samples, tokenizer):
        lp = trainer.forward_logprobs(batch)
        mask = batch["response_mask"] > 0
        assert isinstance(lp, torch.Tensor) and lp.shape == batch["responses"].shape, (
            f"forward_logprobs shape {tuple(getattr(lp, 'shape', ()))} != responses {tuple(batch['responses'].shape)}"
        )
        lp = lp.cpu().float()
        assert torch.all(lp[~mask] == 0), "masked response positions must be 0"
        assert torch.isfinite(lp[mask]).all() and (lp[mask] <= 1e-6).all(), "logprobs must be finite and <= 0"
        assert lp[mask].min() < -0.5, "logprobs all ~0: the check would be vacuous"
        torch.testing.assert_close(trainer.forward_logprobs(batch).cpu().float(), lp, atol=0, rtol=0)
        for row in (1, 6):  # a row alone (other padding, no neighbours) must score the same
            single = trainer.forward_logprobs(collate([samples[row]], pad_id=tokenizer.pad_token_id))
            r = len(samples[row].response_ids)
            torch.testing.assert_close(
                single[0, :r].cpu().float(), lp[row, :r], atol=self.forward_atol, rtol=0
            )

    def test_train_step_returns_finite_metrics_and_follows_the_advantages(self, trainer, batch):
        before = exported(trainer)
        full = self.with_old_logprobs(trainer, batch)
        metrics = trainer.train_step(full)
        assert isinstance(metrics, dict) and metrics, f"train_step returned {metrics!r}, not a metrics dict"
        bad = {k: v for k, v in metrics.items() if not (isinstance(k, str) and math.isfinite(float(v)))}
        assert not bad, f"non-finite or non-numeric metrics: {bad}"
        after = exported(trainer)
        assert any(not torch.equal(after[n], before[n]) for n in before), "train_step changed no weight"
        gain = ((trainer.forward_logprobs(batch) - full["old_logprobs"]) * batch["advantages"]).sum()
        assert gain > 0, f"the step lowered sum(advantage * logprob) by {-float(gain):.3g}: wrong sign?"

    def test_export_weights_hf_names_shapes_and_buckets(self, trainer, model_dir):
        from transformers import AutoConfig, AutoModelForCausalLM

        with torch.device("meta"):
            reference = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
        shapes = {n: tuple(t.shape) for n, t in reference.state_dict().items()}
        checkpoint = load_hf_weights(model_dir)
        weights = exported(trainer)
        unknown = sorted(set(weights) - set(shapes))
        assert not unknown, f"exported names that are not HF parameter names: {unknown[:5]}"
        wrong = {n: tuple(t.shape) for n, t in weights.items() if tuple(t.shape) != shapes[n]}
        assert not wrong, f"exported shapes differ from the HF model's: {wrong}"
        missing = sorted(set(checkpoint) - set(weights))
        assert not missing, f"checkpoint tensors not exported: {missing[:5]}"
        for name, tensor in checkpoint.items():
            torch.testing.assert_close(weights[name].float(), tensor.float(), atol=self.export_atol, rtol=0)
        total = sum(t.numel() * t.element_size() for t in weights.values())
        limit = total // 4
        buckets = list(trainer.export_weights(limit))
        assert len(buckets) >= 2, (
            f"bucket_bytes={limit} (a quarter of the model) gave {len(buckets)} bucket(s)"
        )
        for i, bucket in enumerate(buckets):
            size = sum(t.numel() * t.element_size() for _, t in bucket)
            assert size <= limit or len(bucket) == 1, f"bucket {i} holds {size} bytes > bucket_bytes {limit}"
        assert sorted(n for b in buckets for n, _ in b) == sorted(weights), (
            "bucketing changed the exported names"
        )

    def test_save_load_round_trip_resumes_identically(self, trainer, batch, model_dir, tmp_path):
        trainer.train_step(self.with_old_logprobs(trainer, batch))
        trainer.save(str(tmp_path / "ckpt"))
        resumed = self.make_trainer(model_dir)
        try:
            resumed.load(str(tmp_path / "ckpt"))
            _assert_same_weights(exported(resumed), exported(trainer), 0.0, "weights after load")
            m_resumed = learning_metrics(resumed.train_step(self.with_old_logprobs(resumed, batch)))
            m_straight = learning_metrics(trainer.train_step(self.with_old_logprobs(trainer, batch)))
            _assert_same_weights(
                exported(resumed), exported(trainer), self.resume_atol, "weights one step after load"
            )
        finally:
            self.close_trainer(resumed)
        assert m_resumed.keys() == m_straight.keys()
        for k in m_straight:
            assert math.isclose(
                float(m_resumed[k]), float(m_straight[k]), rel_tol=0, abs_tol=self.resume_atol + 1e-12
            ), (
                f"metric {k!r} after load {m_resumed[k]} != uninterrupted {m_straight[k]} (optimizer state not restored?)"
            )

    def test_sum_pi_squared_comes_with_the_forward_logprobs(self, trainer, batch, samples, tokenizer):
        if not callable(getattr(trainer, "forward_logprobs_and_sum_pi_squared", None)):
            pytest.skip(f"{type(trainer).__name__} has no forward_logprobs_and_sum_pi_squared() (optional)")
        lp, spi = (t.cpu().float() for t in trainer.forward_logprobs_and_sum_pi_squared(batch))
        mask = batch["response_mask"] > 0
        assert lp.shape == spi.shape == mask.shape, f"shapes {tuple(lp.shape)}, {tuple(spi.shape)} != (B, R)"
        scored = trainer.forward_logprobs(batch).cpu().float()
        torch.testing.assert_close(lp, scored, atol=self.forward_atol, rtol=0)
        assert torch.all(spi[~mask] == 0), "masked response positions must be 0"
        # sum_v pi(v)^2 >= pi(sampled)^2 and <= 1 (a probability vector's squared norm)
        assert (spi[mask] >= lp[mask].exp().square() - 1e-6).all() and (spi[mask] <= 1 + 1e-6).all(), (
            "sum_pi_squared outside [pi(token)^2, 1]"
        )
        row = 1  # padding-independent, like the logprobs
        single = collate([samples[row]], pad_id=tokenizer.pad_token_id)
        _, alone = trainer.forward_logprobs_and_sum_pi_squared(single)
        r = len(samples[row].response_ids)
        torch.testing.assert_close(alone[0, :r].cpu().float(), spi[row, :r], atol=self.forward_atol, rtol=0)

    def test_save_hf_is_loadable_by_transformers(self, trainer, batch, tmp_path):
        if not callable(getattr(trainer, "save_hf", None)):
            pytest.skip(f"{type(trainer).__name__} has no save_hf() (optional capability)")
        from transformers import AutoModelForCausalLM, AutoTokenizer

        trainer.train_step(self.with_old_logprobs(trainer, batch))
        trainer.save_hf(str(tmp_path / "hf"))
        model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
        AutoTokenizer.from_pretrained(tmp_path / "hf")
        state = model.state_dict()
        for name, tensor in exported(trainer).items():
            torch.testing.assert_close(state[name].float(), tensor.float(), atol=self.export_atol, rtol=0)
        assert any(Path(tmp_path / "hf").glob("*.safetensors")), "save_hf should write safetensors"

    # ------------------------------------------------------------ the backend protocol (ModelStep)
    @staticmethod
    def _policy_gradient(trainer: Any, batch: dict[str, torch.Tensor], micro_rows: int) -> tuple[float, Any]:
        """Zero, forward-backward ``-sum(advantage * logprob) / tokens`` in micro-batches of ``micro_rows``
        and finish the gradients (no clip): (grad norm, what the loss callback saw)."""
        tokens = float(batch["response_mask"].sum())
        seen: list[tuple[int, torch.Tensor, torch.Tensor]] = []

        def loss_fn(micro, logprobs, entropy):
            mask = micro["response_mask"]
            seen.append(
                (
                    micro["responses"].shape[0],
                    torch.where(mask > 0, logprobs.detach(), 0.0).cpu(),
                    entropy.detach().cpu(),
                )
            )
            loss = -(logprobs * micro["advantages"] * mask).sum() / tokens
            return loss, {"index": float(len(seen) - 1)}

        trainer.zero_grad()
        records = trainer.forward_backward(list(split_rows(batch, micro_rows)), loss_fn)
        return trainer.finish_gradients(float("inf")), (records, seen)

    def test_is_a_backend_of_the_policy_update_loop(self, trainer):
        assert isinstance(trainer, ModelStep), (
            f"{type(trainer).__name__} lacks ModelStep methods or dp_rank/dp_size"
        )
        assert 0 <= trainer.dp_rank < trainer.dp_size
        assert trainer.all_reduce_sum([1.0, 2.5]) == [1.0 * trainer.dp_size, 2.5 * trainer.dp_size]

    def test_backend_micro_batches_accumulate_to_the_full_batch_gradient(self, trainer, batch):
        whole, _ = self._policy_gradient(trainer, batch, batch["responses"].shape[0])
        split, (records, seen) = self._policy_gradient(trainer, batch, 3)
        assert whole > 0 and math.isfinite(whole), f"grad norm {whole}: no gradient reached the weights"
        assert split == pytest.approx(whole, rel=1e-4), (
            f"grad norm {split} over micro-batches of 3 rows != {whole} in one: gradients do not accumulate, "
            "or zero_grad does not drop them"
        )
        assert [r["index"] for r in records] == [0.0, 1.0, 2.0], (
            f"records {records}: not one per micro-batch, in order"
        )
        assert [n for n, _, _ in seen] == [3, 3, 2], "loss_fn must see each micro-batch's rows"
        logprobs, entropy = torch.cat([lp for _, lp, _ in seen]), torch.cat([e for _, _, e in seen])
        torch.testing.assert_close(
            logprobs.float(), trainer.score(batch).cpu().float(), atol=self.forward_atol, rtol=0
        )
        mask = batch["response_mask"] > 0
        assert (
            torch.isfinite(entropy[mask]).all()
            and (entropy[mask] >= -1e-5).all()
            and entropy[mask].max() > 0.1
        ), "entropy must be finite, >= 0 and not all ~0"
        trainer.zero_grad()

    def test_backend_step_follows_the_finished_gradient(self, trainer, batch):
        before = exported(trainer)
        old = trainer.score(batch).cpu()
        self._policy_gradient(trainer, batch, 4)
        problem = trainer.apply_gradients(1e-2)
        assert problem is None, f"apply_gradients reported {problem!r} on a finite update"
        assert any(not torch.equal(t, before[n]) for n, t in exported(trainer).items()), (
            "apply_gradients moved no weight"
        )
        gain = ((trainer.score(batch).cpu() - old) * batch["advantages"]).sum()
        assert gain > 0, f"the step lowered sum(advantage * logprob) by {-float(gain):.3g}: wrong sign?"

    def test_loop_scores_missing_old_logprobs_as_forward_logprobs_does(self, trainer, batch, model_dir):
        """A batch without ``old_logprobs`` trains as one carrying ``forward_logprobs`` (the loop
        scores them, or fuses them into the first update where the backend declares it)."""
        separate = self.make_trainer(model_dir)
        try:
            m_scored = trainer.train_step(dict(batch))
            m_given = separate.train_step(self.with_old_logprobs(separate, batch))
            for key in ("loss", "grad_norm"):
                assert m_scored[key] == pytest.approx(m_given[key], rel=1e-4, abs=1e-6), key
            _assert_same_weights(
                exported(trainer), exported(separate), 1e-5, "weights, old logprobs scored vs given"
            )
        finally:
            self.close_trainer(separate)


class LogprobAgreementConformance(EngineFixtures, TrainerFixtures):
    """Engine and trainer agree: the trainer's ``forward_logprobs`` on the engine's sampled tokens
    equals the engine's per-token logprobs (temperature 1, no top-k/top-p). Needs ``make_engine``
    and ``make_trainer``."""

    #: |trainer - engine| per token (fp32 CPU: float noise; widen for bf16 / GPU kernels)
    agreement_atol: float = 1e-4

    def test_engine_logprobs_match_trainer_forward(self, engine, trainer, prompts, tokenizer):
        many = prompts * 2
        results = self.generate(engine, many, seeds=range(len(many)), temperature=1.0, max_new_tokens=10)
        samples = [
            Sample(prompt_ids=list(p), group_id=0, response_ids=r.response_ids, rollout_logprobs=r.logprobs)
            for p, r in zip(many, results, strict=True)
        ]
        batch = collate(samples, pad_id=tokenizer.pad_token_id)
        mask = batch["response_mask"] > 0
        trained = trainer.forward_logprobs(batch).cpu().float()
        torch.testing.assert_close(
            trained[mask], batch["rollout_logprobs"][mask], atol=self.agreement_atol, rtol=0
        )
        assert trained[mask].min() < -0.5, "logprobs all ~0: the check would be vacuous"
