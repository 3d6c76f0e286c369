"""The megatron trainer (TP=1, in-process gloo): core's conformance kit, agreement with core's torch
trainer on one policy-gradient step, and the typed ``trainer.backend_params``."""

from __future__ import annotations

import pytest
import torch

from relax.core.testing import TinyModelFixtures, TrainerConformance, make_batch, make_samples, torch_trainer
from relax.core.testing.trainer import exported

TRAINER_KW = {"lr": 1e-2, "micro_batch_size": 4}


def megatron_trainer(model_dir: str, **kw):
    from relax.core.algorithms import build_policy_objective
    from relax.core.algorithms.config import AlgorithmConfig
    from relax.megatron.trainer import MegatronTrainer

    return MegatronTrainer(
        model_dir, objective=build_policy_objective(AlgorithmConfig()), **{**TRAINER_KW, **kw}
    )


class TestMegatronTrainer(TrainerConformance):
    @pytest.fixture(autouse=True)
    def _world(self, megatron_world):
        """Every trainer of this class joins the package's gloo world (TP=1)."""

    def make_trainer(self, model_dir):
        return megatron_trainer(model_dir)


class TestAgreesWithTheTorchTrainer(TinyModelFixtures):
    def test_one_step_matches_the_torch_trainer(self, megatron_world, model_dir, tokenizer):
        """Same weights, batch and objective: the same loss and (exported, HF-named) updated weights."""
        batch = make_batch(make_samples(tokenizer, rows=8, seed=3), tokenizer.pad_token_id)
        # AdamW's first update is lr * g / (|g| + eps): with eps 1e-8 a gradient within float noise of 0 can
        # move a weight by up to lr either way; eps 1e-4 keeps the update a smooth function of the gradient
        ref, meg = torch_trainer(model_dir, **TRAINER_KW, eps=1e-4), megatron_trainer(model_dir, eps=1e-4)
        old = ref.forward_logprobs(batch)
        torch.testing.assert_close(meg.forward_logprobs(batch), old, atol=1e-5, rtol=0)
        m_ref = ref.train_step({**batch, "old_logprobs": old})
        m_meg = meg.train_step({**batch, "old_logprobs": old})
        for key in ("loss", "entropy", "grad_norm"):
            assert m_meg[key] == pytest.approx(m_ref[key], abs=1e-5), key
        want, got = exported(ref), exported(meg)
        moved = max(float((want[n] - t).abs().max()) for n, t in exported(torch_trainer(model_dir)).items())
        assert moved > 1e-3  # the step moved the weights: the comparison below is not vacuous
        for name, tensor in got.items():
            # AdamW's first step is ~lr * sign(grad): a gradient within float noise of 0 may flip a sign
            torch.testing.assert_close(
                tensor, want[name], atol=2e-4, rtol=0, msg=lambda m, n=name: f"{n}: {m}"
            )


def test_backend_params_reject_unsupported_layouts():
    from relax.megatron.plugin import MegatronParams

    assert MegatronParams().validate() == []
    assert MegatronParams(tensor_parallel=0).validate() == ["tensor_parallel: must be >= 1, got 0"]
    (cp,) = MegatronParams(context_parallel=2).validate()
    assert "Transformer Engine" in cp and "docs/gpu.md" in cp  # test_context_parallel.py: when it is accepted
    assert (
        MegatronParams(tensor_parallel=2, sequence_parallel=True).validate() == []
    )  # local spec: no TE needed
    (sp,) = MegatronParams(sequence_parallel=True).validate()
    assert sp == "sequence_parallel: needs tensor_parallel > 1 (it splits the sequence over the TP ranks)"
    assert MegatronParams(tensor_parallel=2, pipeline_parallel=2, sequence_parallel=True).validate() == []
    assert MegatronParams(tensor_parallel=2).validate() == []
    assert MegatronParams(tensor_parallel=2, pipeline_parallel=2, data_parallel=2).validate() == []
    assert MegatronParams(data_parallel=0).validate() == ["data_parallel: must be >= 1, got 0"]
    (ep,) = MegatronParams(expert_parallel=2, data_parallel=3).validate()
    assert "expert_parallel=2: must divide tensor_parallel x data_parallel=3" in ep
    assert MegatronParams(expert_parallel=2, data_parallel=4).validate() == []  # EP carved from DP
    assert (
        MegatronParams(expert_parallel=2, tensor_parallel=2).validate() == []
    )  # ... or from TP (experts whole)
    (dist_opt,) = MegatronParams(distributed_optimizer=True).validate()
    assert "distributed_optimizer: not supported" in dist_opt and "CUDA parameters" in dist_opt
    assert MegatronParams(distributed_optimizer=True, device="cuda", data_parallel=2).validate() == []
    (bf16,) = MegatronParams(dtype="bfloat16").validate()
    assert bf16 == "dtype: bfloat16 needs device: cuda; on CPU the megatron trainer runs float32 only"
    assert MegatronParams(device="cuda:1", dtype="bfloat16").validate() == []
    assert MegatronParams(device="tpu").validate() == [
        "device: expected 'cpu', 'cuda' or 'cuda:N', got 'tpu'"
    ]


def test_backend_params_check_layer_spec_and_timeout():
    from relax.megatron.plugin import MegatronParams

    (te,) = MegatronParams(layer_spec="te").validate()
    assert te == "layer_spec: te needs device: cuda (Transformer Engine has no CPU kernels)"
    assert MegatronParams(layer_spec="te", device="cuda").validate() == []
    assert MegatronParams(layer_spec="local", timeout_s=30.0).validate() == []
    assert MegatronParams(timeout_s=0.0).validate() == ["timeout_s: must be > 0, got 0.0"]


def test_registered_as_the_megatron_trainer():
    from relax.core.plugins import get_plugin_manager
    from relax.megatron.plugin import MegatronParams, megatron_trainer

    registration = get_plugin_manager().registry.registration("trainer", "megatron")
    assert registration.factory is megatron_trainer and registration.config is MegatronParams
    layout = MegatronParams(tensor_parallel=2, pipeline_parallel=3, data_parallel=2)
    assert registration.resources(layout).num_workers == 12  # one rank actor per rank: TP x PP x DP
    assert registration.resources(layout).num_gpus == 0.0
    assert (
        registration.resources(MegatronParams(tensor_parallel=2, device="cuda")).num_gpus == 1.0
    )  # per rank


class TestFactory(TinyModelFixtures):
    """The registered factory builds the trainer from core's settings, or refuses with a clear error."""

    @staticmethod
    def context(model_dir: str, critic: bool = False, dtype: str = "float32", timeout_s: float = 600.0):
        from dataclasses import replace

        from relax.core.algorithms.config import AlgorithmConfig, CriticConfig
        from relax.core.config import TrainerConfig
        from relax.core.context import PluginContext, TrainSpec

        algorithm = replace(AlgorithmConfig(), critic=CriticConfig(enable=critic))
        optim = TrainerConfig(lr=3e-3, micro_batch_size=2, num_minibatches=2, timeout_s=timeout_s)
        spec = TrainSpec(optim=optim, algorithm=algorithm, total_steps=5, temperature=0.7)
        return PluginContext(role="trainer", model_path=model_dir, dtype=dtype, seed=4, train=spec)

    def test_builds_from_core_settings(self, megatron_world, model_dir):
        from relax.megatron.plugin import MegatronParams, megatron_trainer

        trainer = megatron_trainer(MegatronParams(), self.context(model_dir))
        settings = trainer.settings
        assert (settings.lr, settings.micro_batch_size, settings.num_minibatches) == (3e-3, 2, 2)
        assert (settings.temperature, settings.total_steps, trainer.update.objective is not None) == (
            0.7,
            5,
            True,
        )

    def test_process_groups_follow_the_trainer_timeout(self, megatron_world, model_dir):
        """``trainer.timeout_s`` (not the weight-sync one in ``ctx.timeout_s``), or the backend's own
        ``timeout_s``; parallel.py's test checks the groups take it. CPU: the local layer spec, on CPU tensors."""
        from relax.megatron.plugin import MegatronParams, megatron_trainer

        trainer = megatron_trainer(MegatronParams(), self.context(model_dir, timeout_s=345.0))
        assert trainer.timeout_s == 345.0 and trainer.layer_spec == "local"
        assert megatron_trainer(MegatronParams(timeout_s=50.0), self.context(model_dir)).timeout_s == 50.0
        assert {t.device.type for bucket in trainer.export_weights() for _, t in bucket} == {"cpu"}

    def test_refuses_what_it_cannot_run(self, megatron_world, model_dir):
        from relax.megatron.plugin import MegatronParams, megatron_trainer

        with pytest.raises(ValueError, match="no critic"):
            megatron_trainer(MegatronParams(), self.context(model_dir, critic=True))
        with pytest.raises(ValueError, match="dtype='bfloat16': the megatron trainer runs float32 on CPU"):
            megatron_trainer(MegatronParams(), self.context(model_dir, dtype="bfloat16"))
        if not torch.cuda.is_available():
            with pytest.raises(RuntimeError, match="device='cuda': no CUDA GPU is visible"):
                megatron_trainer(MegatronParams(device="cuda"), self.context(model_dir))
        with pytest.raises(
            ValueError, match="trainer.backend_params: distributed_optimizer: not supported on CPU"
        ):
            megatron_trainer(MegatronParams(distributed_optimizer=True), self.context(model_dir))
        with pytest.raises(ValueError, match="trainer.backend_params: expert_parallel=2"):
            megatron_trainer(MegatronParams(expert_parallel=2), self.context(model_dir))
        with pytest.raises(
            ValueError, match="world_size=1 != tensor_parallel=2 x pipeline_parallel=1"
        ):  # a TP=2 rank needs its group
            megatron_trainer(MegatronParams(tensor_parallel=2), self.context(model_dir))


class TestNonFinite(TinyModelFixtures):
    def test_a_nan_update_raises_or_is_skipped(self, megatron_world, model_dir, tokenizer):
        from relax.core.policy_update import NonFiniteError

        batch = make_batch(make_samples(tokenizer, rows=8, seed=3), tokenizer.pad_token_id)
        batch["advantages"] = torch.full_like(batch["advantages"], float("nan"))
        with pytest.raises(NonFiniteError, match="train step 1: non-finite loss.*skip_nonfinite=true"):
            megatron_trainer(model_dir).train_step(batch)
        trainer = megatron_trainer(model_dir, skip_nonfinite=True)
        before = {n: t.clone() for n, t in exported(trainer).items()}
        assert trainer.train_step(batch)["skipped_nonfinite"] == 1.0
        for name, tensor in exported(trainer).items():
            assert torch.equal(tensor, before[name]), name  # the update was dropped


def test_a_moe_step_matches_the_torch_trainer(megatron_world, tiny_qwen3_moe, fuse_experts):
    """Qwen3-MoE (TP=1, EP=1): the same logprobs, loss, grad norm and updated weights as core's torch
    trainer on transformers' Qwen3-MoE (whose experts are fused tensors in memory; the export is per expert,
    as checkpoints and SGLang name them)."""
    from transformers import AutoTokenizer

    model_dir, config, _ = tiny_qwen3_moe
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    batch = make_batch(make_samples(tokenizer, rows=8, seed=3), tokenizer.pad_token_id)
    ref, meg = torch_trainer(model_dir, **TRAINER_KW, eps=1e-4), megatron_trainer(model_dir, eps=1e-4)
    old = ref.forward_logprobs(batch)
    torch.testing.assert_close(meg.forward_logprobs(batch), old, atol=1e-5, rtol=0)
    m_ref, m_meg = (
        ref.train_step({**batch, "old_logprobs": old}),
        meg.train_step({**batch, "old_logprobs": old}),
    )
    for key in ("loss", "entropy", "grad_norm"):
        assert m_meg[key] == pytest.approx(m_ref[key], abs=1e-5), key
    want, got = exported(ref), fuse_experts(exported(meg), config)
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, atol=2e-4, rtol=0, msg=lambda m, n=name: f"{n}: {m}")


def test_rank_rows_pads_every_replica_to_the_same_rows():
    """5 rows over 2 replicas (core's shard_bounds): rows 0-1 plus a fully masked copy of row 0, and rows
    2-4, so both run the same shapes (the MoE dispatcher gathers tokens across them); per-batch values
    pass through."""
    from relax.megatron.parallel import rank_rows

    batch = {"responses": torch.arange(10).view(5, 2), "response_mask": torch.ones(5, 2), "temperature": 0.7}
    first, second = rank_rows(batch, 2, 0), rank_rows(batch, 2, 1)
    assert first["responses"].tolist() == [[0, 1], [2, 3], [0, 1]] and first["temperature"] == 0.7
    assert first["response_mask"].tolist() == [[1, 1], [1, 1], [0, 0]]
    assert second["responses"].tolist() == [[4, 5], [6, 7], [8, 9]] and second["response_mask"].sum() == 6


def test_trainer_names_what_sequence_parallelism_cannot_run(tiny_qwen3):
    """Refused before any process group is joined: sequence parallelism without TP."""
    from relax.megatron.trainer import MegatronTrainer

    with pytest.raises(ValueError, match="sequence_parallel: needs tensor_parallel > 1"):
        MegatronTrainer(tiny_qwen3[0], sequence_parallel=True)


class TestRealLengths(TinyModelFixtures):
    @pytest.mark.parametrize(
        "variant",
        [
            {"recompute": "full"},
            {"recompute": "selective"},
            {"max_tokens_per_micro_batch": 16},
            {"logits_chunk_tokens": 7},
        ],
    )
    def test_a_step_equals_the_plain_fixed_row_step(self, megatron_world, model_dir, tokenizer, variant):
        """Activation recompute (megatron's full / selective), token-budget micro-batches and logprobs and
        entropy seven tokens at a time (chunked.py; the plain step takes whole logits) change memory, not
        the update."""
        from relax.core.testing.trainer import learning_metrics

        batch = make_batch(make_samples(tokenizer, rows=8, seed=3), tokenizer.pad_token_id)
        plain = megatron_trainer(model_dir, eps=1e-4, logits_chunk_tokens=0)
        other = megatron_trainer(model_dir, eps=1e-4, **variant)
        config = other.model.config
        assert config.recompute_granularity == variant.get("recompute")
        assert plain.head is None and other.head is not None  # whole logits vs chunks (chunked.py)

        torch.testing.assert_close(
            other.forward_logprobs(batch), plain.forward_logprobs(batch), atol=1e-5, rtol=0
        )
        batch["old_logprobs"] = plain.forward_logprobs(batch)  # given: the step runs training forwards only
        calls = {id(t): 0 for t in (plain, other)}
        for t in (plain, other):  # core attention runs again in backward when megatron recomputes
            for layer in t.model.decoder.layers:
                layer.self_attention.core_attention.register_forward_pre_hook(
                    lambda *_, key=id(t): calls.__setitem__(key, calls[key] + 1)  # noqa: B008
                )
        want, got = (
            learning_metrics(plain.train_step(dict(batch))),
            learning_metrics(other.train_step(dict(batch))),
        )
        if "recompute" in variant:
            assert calls[id(other)] == 2 * calls[id(plain)] > 0, calls
        for key in ("loss", "entropy", "grad_norm"):
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), key
        for name, tensor in exported(other).items():
            torch.testing.assert_close(tensor, exported(plain)[name], atol=2e-4, rtol=0)


def test_the_run_check_names_what_megatron_does_not_do_with_real_lengths():
    from relax.core.config import load_config
    from relax.megatron.plugin import MegatronParams

    cfg = load_config(None, ["trainer.pack_sequences=true", "trainer.max_tokens_per_micro_batch=4096"])
    (pack,) = MegatronParams().validate_run(cfg)
    assert pack.startswith("trainer.pack_sequences: the megatron trainer does not pack")
    errors = MegatronParams(pipeline_parallel=2).validate_run(cfg)
    assert any(
        e.startswith("trainer.max_tokens_per_micro_batch: megatron's pipeline schedule") for e in errors
    )


def test_the_run_check_refuses_a_critic_before_start_up():
    """The factory refuses a critic; relax validate names it first (with the backends that train one)."""
    from relax.core.config import ConfigError, load_config
    from relax.megatron.plugin import CRITIC_MISSING, MegatronParams

    cfg = load_config(None, ["algorithm.advantage_estimator=gae", "algorithm.critic.enable=true"])
    assert MegatronParams().validate_run(cfg) == [CRITIC_MISSING] and "torch or fsdp" in CRITIC_MISSING
    with pytest.raises(ConfigError, match="the megatron trainer has no critic"):
        load_config(
            None,
            ["trainer.backend=megatron", "algorithm.advantage_estimator=gae", "algorithm.critic.enable=true"],
        )
