"""When the colocate step leaves old logprobs to the trainer's first update (verl's on-policy shortcut)."""

from __future__ import annotations

import json
import types
from dataclasses import replace
from types import SimpleNamespace

import pytest

from relax.core.config import load_config
from relax.core.controller.stages import fuse_old_logprobs

ROLES = SimpleNamespace(reference=None, teacher=None)


@pytest.mark.parametrize(
    ("overrides", "roles", "trainer_fuses", "expected"),
    [
        ([], ROLES, True, True),  # the quick-start: GRPO, no reference
        ([], ROLES, False, False),  # a trainer that needs old logprobs in the batch
        (
            ["trainer.recompute_old_logprobs=false"],
            ROLES,
            True,
            False,
        ),  # the engine's logprobs: no forward anyway
        (
            [],
            SimpleNamespace(reference=object(), teacher=None),
            True,
            False,
        ),  # kl/policy_ref reads them first
        ([], SimpleNamespace(reference=None, teacher=object()), True, False),
        (["algorithm.advantage_estimator=optimal_token_baseline"], ROLES, True, False),  # reads old logprobs
        (["+spi_only"], ROLES, True, False),  # sum_pi_squared comes from the forward before the update
        (["+old_only"], ROLES, True, False),
        (["+plain"], ROLES, True, True),
    ],
)
def test_fuse_only_when_nothing_before_the_update_reads_old_logprobs(
    overrides, roles, trainer_fuses, expected
):
    estimator = [o[1:] for o in overrides if o.startswith("+")]
    cfg = load_config(None, [o for o in overrides if not o.startswith("+")])
    if estimator:
        cfg = replace(cfg, algorithm=replace(cfg.algorithm, advantage_estimator=estimator[0]))
    assert fuse_old_logprobs(cfg, roles, trainer_fuses) is expected


@pytest.fixture(autouse=True)
def _declaring_estimators(monkeypatch):
    """Estimators that declare one need each, from a plugin in the process-wide registry."""
    from relax.core import plugins

    def relax_register_algorithms(register):
        for name, needs in [("spi_only", {"sum_pi_squared"}), ("old_only", {"old_logprobs"}), ("plain", ())]:
            register(
                name,
                lambda inputs: (inputs.response_mask, inputs.response_mask),
                kind="advantage",
                needs=needs,
            )

    module = types.ModuleType("fuse_test_algorithms")
    module.relax_register_algorithms = relax_register_algorithms
    monkeypatch.setattr(plugins, "_MANAGER", plugins.RelaxPluginManager(extra_plugins={"fuse_test": module}))


def _samples(*versions: list[int]):
    from relax.core.data import Sample

    return [Sample(prompt_ids=[1], group_id=0, response_ids=[2] * len(v), versions=list(v)) for v in versions]


@pytest.mark.parametrize(
    ("overrides", "versions", "expected"),
    [
        ([], [[3, 3], [3]], True),  # the quick-start: hosted in the driver, temperature 1, untruncated
        (["rollout.host=trainer"], [[3, 3]], True),  # hosted in the trainer's actor: the same module
        (
            ["rollout.temperature=0.7"],
            [[3, 3]],
            True,
        ),  # the trainer divides its logits by the same temperature
        (["rollout.host=separate"], [[3, 3]], False),  # its own copy of the weights, synced: scored again
        (["rollout.top_k=5"], [[3, 3]], False),  # truncated distribution: not the trainer's logprobs
        (["rollout.top_p=0.9"], [[3, 3]], False),
        ([], [[3, 3], [2, 3]], False),  # a token from the previous version (a resumed partial rollout)
        ([], [[2, 2]], False),  # sampled before the trainer's current weights
        (["+media"], [[3, 3]], False),  # the engine's and trainer's media paths differ
    ],
)
def test_the_hosted_engines_logprobs_are_old_only_when_they_are_the_trainers(overrides, versions, expected):
    from relax.core.controller.stages import engine_scored_old_logprobs

    cfg = load_config(None, [o for o in overrides if o != "+media"])
    samples = _samples(*versions)
    if "+media" in overrides:
        samples[0].mm_inputs = {"pixel_values": [[0.0]]}
    assert engine_scored_old_logprobs(cfg, samples, version=3) is expected


def test_a_run_on_the_engines_logprobs_trains_as_one_that_scores_them_again(tmp_path):
    """Same seeds, same first batch (top_k=1000 keeps all 24 tokens: it samples the same tokens, but
    the trainer then scores every mini-batch's old logprobs itself): the first update's loss and
    gradient norm agree to float noise, and both report a rollout/train mismatch near 0."""
    from relax.core.controller.run import run

    small = [
        "total_steps=2",
        "rollout.prompts_per_step=4",
        "rollout.n_samples_per_prompt=4",
        "data.task_size=100",
        "logging.progress=false",
        "logging.console=false",
        "logging.tensorboard=false",
        "logging.plot=false",
        "checkpoint.save_hf_final=false",
        "checkpoint.save_every=0",
        "trainer.num_minibatches=2",
    ]
    rows = {}
    for name, extra in (("engine", []), ("scored", ["rollout.top_k=1000"])):
        run(load_config(None, [*small, *extra, f"run_dir={tmp_path / name}"]))
        rows[name] = [
            json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        ]
    first, again = rows["engine"][0], rows["scored"][0]
    assert (
        first["reward/mean"] == again["reward/mean"]
        and first["response/length_mean"] == again["response/length_mean"]
    )
    assert first["train/loss"] == pytest.approx(again["train/loss"], abs=1e-5)
    assert first["train/grad_norm"] == pytest.approx(again["train/grad_norm"], rel=1e-4)
    assert all(0 <= r["rollout/train_logprob_abs_diff"] < 1e-5 for r in (first, again))
