"""Every suite can fail: each seeded fault in a built-in makes the named conformance test fail.

The suites' test methods are called directly with a faulty object in place of the fixture value.
The queue suite's seeded faults live beside it, in ``test_queue_conformance.py``.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import random
import tempfile
import threading

import pytest
import torch
from transformers import AutoTokenizer

from relax.core.algorithms import build_policy_objective
from relax.core.algorithms.config import AlgorithmConfig
from relax.core.data import Sample
from relax.core.engines.hf import HFRolloutEngine
from relax.core.processors import TextProcessor
from relax.core.rewards import ExactMatchReward
from relax.core.testing.engine import PROMPT_TEXTS, RolloutEngineConformance
from relax.core.testing.models import OTHER_MODEL_SEED, tiny_model_dir
from relax.core.testing.processor import ProcessorConformance
from relax.core.testing.reward import RewardConformance
from relax.core.testing.trainer import (
    LogprobAgreementConformance,
    TrainerConformance,
    make_batch,
    make_samples,
)
from relax.core.testing.transport import WeightSyncConformance, scratch_tempdir
from relax.core.trainers.torch_trainer import TorchTrainer
from relax.core.weight_sync import WeightSyncError

FAILED = (AssertionError, pytest.fail.Exception)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    model_dir = tiny_model_dir(tmp_path_factory.getbasetemp())
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    samples = make_samples(tokenizer)
    return {
        "model_dir": model_dir,
        "other_model_dir": tiny_model_dir(tmp_path_factory.getbasetemp(), OTHER_MODEL_SEED),
        "tokenizer": tokenizer,
        "prompts": [tokenizer.encode(t, add_special_tokens=False) for t in PROMPT_TEXTS],
        "samples": samples,
        "batch": make_batch(samples, tokenizer.pad_token_id),
    }


def call(suite, test_name, env, **given):
    """Run ``suite.<test_name>`` with fixture values from ``env`` and ``given``."""
    import inspect

    method = getattr(suite, test_name)
    names = [p for p in inspect.signature(method).parameters]
    return method(**{n: given[n] if n in given else env[n] for n in names})


# ------------------------------------------------------------------ engines
class FaultyEngine(HFRolloutEngine):
    def __init__(self, model_dir, fault):
        super().__init__(model_dir)
        self.fault = fault

    async def generate(self, requests):
        f = self.fault
        reqs = []
        for r in requests:
            p = r.params
            if f == "ignores_seed":
                p = dataclasses.replace(p, seed=None)
            if f == "ignores_stop_ids":
                p = dataclasses.replace(p, stop_token_ids=())
            if f == "ignores_stop_strings":
                p = dataclasses.replace(p, stop=())
            if f == "ignores_ignore_eos":
                p = dataclasses.replace(p, ignore_eos=False)
            if f == "one_token_too_many":
                p = dataclasses.replace(p, max_new_tokens=p.max_new_tokens + 1)
            if f == "ignores_temperature":
                p = dataclasses.replace(p, temperature=1.0)
            if f == "ignores_top_k":
                p = dataclasses.replace(p, top_k=0)
            if f == "ignores_top_p":
                p = dataclasses.replace(p, top_p=1.0)
            prefix = (
                {}
                if f == "drops_prefix"
                else dict(
                    prefix_response_ids=r.prefix_response_ids,
                    prefix_logprobs=r.prefix_logprobs,
                    prefix_versions=r.prefix_versions,
                )
            )
            reqs.append(
                dataclasses.replace(
                    r,
                    params=p,
                    **(
                        {"prefix_response_ids": [], "prefix_logprobs": [], "prefix_versions": []}
                        if f == "drops_prefix"
                        else prefix
                    ),
                )
            )
        results = await super().generate(reqs)
        for res in results:
            if f == "wrong_versions":
                res.versions = [v + 1 for v in res.versions]
            if f == "misaligned_logprobs":
                res.logprobs = res.logprobs[:-1]
            if f == "positive_logprobs":
                res.logprobs = [-lp for lp in res.logprobs]
        return results

    def pause(self):
        if self.fault != "ignores_pause":
            super().pause()

    def abort(self):
        if self.fault != "noop_abort":
            super().abort()

    def update_weights(self, named_tensors, version):
        if self.fault == "stale_version":
            keep = self._version
            super().update_weights(named_tensors, version)
            self._version = keep
        elif self.fault == "drops_weights":
            self._version = version
        else:
            super().update_weights(named_tensors, version)


class HFSuite(RolloutEngineConformance):
    def make_engine(self, model_dir):
        return HFRolloutEngine(model_dir)


ENGINE_FAULTS = [
    ("test_generation_contract", "wrong_versions"),
    ("test_generation_contract", "misaligned_logprobs"),
    ("test_generation_contract", "positive_logprobs"),
    ("test_max_new_tokens_is_exact_with_ignore_eos", "one_token_too_many"),
    ("test_same_seed_same_output_different_seed_differs", "ignores_seed"),
    ("test_temperature_zero_is_greedy", "ignores_temperature"),
    ("test_top_k_one_is_greedy", "ignores_top_k"),
    ("test_tiny_top_p_is_greedy", "ignores_top_p"),
    ("test_stop_token_ids_end_the_response", "ignores_stop_ids"),
    ("test_stop_strings_end_the_response", "ignores_stop_strings"),
    ("test_eos_stops_unless_ignore_eos", "ignores_ignore_eos"),
    ("test_prefix_response_is_continued", "drops_prefix"),
    ("test_pause_holds_generation_until_resume", "ignores_pause"),
    ("test_abort_ends_in_flight_requests", "noop_abort"),
    ("test_update_weights_changes_outputs_and_version", "stale_version"),
    ("test_update_weights_changes_outputs_and_version", "drops_weights"),
]


@pytest.mark.parametrize(("test_name", "fault"), ENGINE_FAULTS)
def test_engine_suite_catches(env, test_name, fault):
    engine = FaultyEngine(env["model_dir"], fault)
    extra = {"budget": 3} if "max_new_tokens" in test_name else {}
    with pytest.raises(FAILED):
        call(HFSuite(), test_name, env, engine=engine, **extra)


def test_an_engine_ignoring_temperature_is_named_as_such_by_the_weight_update_check(env):
    engine = FaultyEngine(env["model_dir"], "ignores_temperature")
    with pytest.raises(FAILED, match="temperature=0 is not greedy"):
        call(HFSuite(), "test_update_weights_changes_outputs_and_version", env, engine=engine)


def test_engine_suite_passes_the_healthy_engine_it_was_given(env):
    """The harness itself: the same calls pass on an unmodified engine."""
    engine = FaultyEngine(env["model_dir"], "none")
    for test_name in dict(ENGINE_FAULTS):
        call(
            HFSuite(),
            test_name,
            env,
            engine=engine,
            **({"budget": 3} if "max_new_tokens" in test_name else {}),
        )


# ------------------------------------------------------------------ trainers
class FaultyTrainer(TorchTrainer):
    def __init__(self, model_dir, fault, **kw):
        objective = build_policy_objective(AlgorithmConfig())
        if fault == "flipped_sign":
            base = objective

            def objective(inputs):
                loss, metrics = base(inputs)
                return -loss, metrics

        super().__init__(model_dir, objective=objective, lr=1e-2, micro_batch_size=4, **kw)
        self.fault = fault

    def _stats(self, batch, **kw):
        if self.fault == "attends_to_padding":
            batch = {**batch, "attention_mask": torch.ones_like(batch["attention_mask"])}
        return super()._stats(batch, **kw)

    def forward_logprobs(self, batch):
        if self.fault == "unmasked":
            from relax.core.trainers.torch_trainer import token_logprobs

            with torch.no_grad():
                return token_logprobs(self._response_logits(batch), batch["responses"])
        return super().forward_logprobs(batch)

    def train_step(self, batch):
        if self.fault == "no_update":
            return {"loss": 0.5}
        metrics = super().train_step(batch)
        return {**metrics, "loss": math.nan} if self.fault == "nan_metric" else metrics

    def export_weights(self, bucket_bytes=64 << 20):
        if self.fault == "one_bucket":
            bucket_bytes = 1 << 40
        for bucket in super().export_weights(bucket_bytes):
            yield [("module." + n, t) for n, t in bucket] if self.fault == "renamed" else bucket

    def save(self, directory):
        if self.fault == "no_optimizer_state":
            optimizer, self.optimizer = self.optimizer, None
            try:
                super().save(directory)
            finally:
                self.optimizer = optimizer
        else:
            super().save(directory)


class TorchSuite(TrainerConformance, LogprobAgreementConformance):
    fault = "none"

    def make_trainer(self, model_dir):
        return FaultyTrainer(model_dir, self.fault)

    def make_engine(self, model_dir):
        return HFRolloutEngine(model_dir)


TRAINER_FAULTS = [
    ("test_forward_logprobs_shape_mask_and_padding", "unmasked"),
    ("test_forward_logprobs_shape_mask_and_padding", "attends_to_padding"),
    ("test_train_step_returns_finite_metrics_and_follows_the_advantages", "flipped_sign"),
    ("test_train_step_returns_finite_metrics_and_follows_the_advantages", "no_update"),
    ("test_train_step_returns_finite_metrics_and_follows_the_advantages", "nan_metric"),
    ("test_export_weights_hf_names_shapes_and_buckets", "one_bucket"),
    ("test_export_weights_hf_names_shapes_and_buckets", "renamed"),
    ("test_save_load_round_trip_resumes_identically", "no_optimizer_state"),
]


@pytest.mark.parametrize(("test_name", "fault"), TRAINER_FAULTS)
def test_trainer_suite_catches(env, test_name, fault, tmp_path):
    suite = TorchSuite()
    suite.fault = fault
    with pytest.raises(FAILED):
        call(suite, test_name, env, trainer=suite.make_trainer(env["model_dir"]), tmp_path=tmp_path)


def test_agreement_suite_catches_a_temperature_mismatch(env):
    trainer = TorchTrainer(env["model_dir"], temperature=0.9)
    with pytest.raises(FAILED):
        call(
            TorchSuite(),
            "test_engine_logprobs_match_trainer_forward",
            env,
            engine=HFRolloutEngine(env["model_dir"]),
            trainer=trainer,
        )


# ------------------------------------------------------------------ rewards
class FaultyReward(ExactMatchReward):
    def __init__(self, fault):
        super().__init__()
        self.fault = fault

    async def score(self, sample):
        value = await super().score(sample)
        if self.fault == "nan":
            return math.nan
        if self.fault == "no_score_key":
            return {"correct": value}
        if self.fault == "random":
            return random.random()
        if self.fault == "mutates":
            sample.reward = value
        return value


class RewardSuite(RewardConformance):
    fault = "none"

    def make_reward(self):
        return FaultyReward(self.fault)

    def expected_scores(self):
        return [1.0, 1.0, 0.0, 0.0]  # wrong on purpose for the "expected" case below

    def slow_sample(self):  # not slow at all: the timeout check must notice
        return Sample(prompt_ids=[1], group_id=0, response_text="7", label="7")


@pytest.mark.parametrize(
    ("test_name", "fault"),
    [
        ("test_returns_a_finite_float_or_a_dict_with_score", "nan"),
        ("test_returns_a_finite_float_or_a_dict_with_score", "no_score_key"),
        ("test_scores_are_deterministic_and_leave_the_sample_alone", "random"),
        ("test_scores_are_deterministic_and_leave_the_sample_alone", "mutates"),
        ("test_expected_scores", "none"),
        ("test_runner_times_out_a_slow_sample", "none"),
    ],
)
def test_reward_suite_catches(env, test_name, fault):
    suite = RewardSuite()
    suite.fault = fault
    with pytest.raises(FAILED):
        call(suite, test_name, env, reward=suite.make_reward())


# ------------------------------------------------------------------ processors
class FaultyProcessor(TextProcessor):
    fault = "none"

    def __call__(self, messages):
        if self.fault == "mutates":
            messages.append({"role": "assistant", "content": ""})
            return super().__call__(messages[:-1])
        out = super().__call__(messages)
        if self.fault == "extra_token":
            out["prompt_ids"] = [self.tokenizer.pad_token_id, *out["prompt_ids"]]
        return out


@pytest.mark.parametrize(
    ("test_name", "fault"),
    [
        ("test_prompt_matches_the_chat_template", "no_generation_prompt"),
        ("test_prompt_matches_the_chat_template", "extra_token"),
        ("test_deterministic_and_leaves_messages_alone", "mutates"),
    ],
)
def test_processor_suite_catches(env, test_name, fault):
    processor = FaultyProcessor(env["tokenizer"], add_generation_prompt=fault != "no_generation_prompt")
    processor.fault = fault
    with pytest.raises(FAILED):
        call(ProcessorConformance(), test_name, env, processor=copy.copy(processor))


# ------------------------------------------------------------------ weight-sync transports
class FaultyTransport:
    """Pushes buckets straight into local engines, with one seeded fault."""

    def __init__(self, fault):
        self.fault = fault

    def sync(self, trainer, engines, version):
        buckets = list(trainer.export_weights(1 << 18))
        if self.fault == "drops_bucket":
            buckets = buckets[:-1]
        if self.fault == "corrupts":
            name, tensor = buckets[0][0]
            buckets[0][0] = (name, tensor + 1e-6)
        if self.fault == "leaks_files":
            tempfile.mkstemp(prefix="relax-weights-")  # one file per sync, never removed
        for i, engine in enumerate(engines):
            errors = []

            def push(e=engine, errors=errors):
                try:
                    for b in buckets:
                        e.update_weights(b, version - (self.fault == "wrong_version"))
                except Exception as exc:  # noqa: BLE001  # handed to the caller below
                    errors.append(exc)

            worker = threading.Thread(target=push, daemon=True)
            worker.start()
            worker.join(timeout=1.0)
            if worker.is_alive():
                raise WeightSyncError("a weight update timed out")  # names no engine
            if errors and self.fault != "swallows_errors":
                raise WeightSyncError(f"engine[{i}] failed: {errors[0]}")
        return {"buckets": float(len(buckets))}


class TransportSuite(WeightSyncConformance):
    timeout_s = 1.0


@pytest.mark.parametrize(
    ("test_name", "fault"),
    [
        ("test_sync_delivers_bit_identical_weights_and_serves_the_version", "drops_bucket"),
        ("test_sync_delivers_bit_identical_weights_and_serves_the_version", "corrupts"),
        ("test_sync_delivers_bit_identical_weights_and_serves_the_version", "wrong_version"),
        ("test_dead_engine_is_named_within_the_timeout", "none"),
        ("test_repeated_syncs_leave_no_files_behind", "leaks_files"),
        ("test_engine_error_is_raised_naming_it", "swallows_errors"),
    ],
)
def test_transport_suite_catches(env, test_name, fault):
    suite = TransportSuite()
    release = threading.Event()
    with scratch_tempdir() as scratch:
        fleet = {
            "transport": FaultyTransport(fault),
            "trainer": suite.make_sender_trainer(env["other_model_dir"]),
            "engines": [suite.make_receiver_engine(env["model_dir"], i) for i in range(2)],
            "release": release,
            "scratch": scratch,
        }
        try:
            with pytest.raises(FAILED):
                call(suite, test_name, env, fleet=fleet)
        finally:
            release.set()


@pytest.mark.parametrize(
    "test_name", ["test_repeated_syncs_leave_no_files_behind", "test_engine_error_is_raised_naming_it"]
)
def test_transport_suite_passes_the_unfaulted_transport(env, test_name):
    suite = TransportSuite()
    with scratch_tempdir() as scratch:
        fleet = {
            "transport": FaultyTransport("none"),
            "trainer": suite.make_sender_trainer(env["other_model_dir"]),
            "engines": [suite.make_receiver_engine(env["model_dir"], i) for i in range(2)],
            "release": threading.Event(),
            "scratch": scratch,
        }
        call(suite, test_name, env, fleet=fleet)
