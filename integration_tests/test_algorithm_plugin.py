"""An out-of-tree algorithm gets the wiring and checks of a built-in one: a plugin module, loaded
through ``RELAX_PLUGINS`` like any plugin, registers an advantage estimator through the
``relax_register_algorithms`` hook declaring ``needs={"reference", "groups", "old_logprobs"}``. With
``algorithm.kl.coef`` left at 0 (nothing else asks for a reference model), a real colocate run
through Ray starts the reference role because of that declaration and hands the estimator real
reference logprobs; config errors for the plugin's algorithms come from their declarations."""

from __future__ import annotations

import sys
import textwrap

import pytest

from relax.core.config import ConfigError, load_config
from relax.core.controller.run import run
from relax.core.plugins import get_plugin_manager

pytestmark = pytest.mark.slow

PLUGIN = """
import torch

from relax.core.algorithms import ADVANTAGE_ESTIMATORS

SEEN = []


def ref_regularised_grpo(inputs, beta: float = 0.1):
    '''GRPO minus a per-token penalty on the sampled log-ratio to the reference model.'''
    if inputs.ref_logprobs is None:
        raise ValueError("ref_regularised_grpo needs reference logprobs")
    SEEN.append((inputs.old_logprobs.clone(), inputs.ref_logprobs.clone(), inputs.response_mask.clone()))
    adv, _ = ADVANTAGE_ESTIMATORS["grpo"](inputs)
    shaped = adv - beta * (inputs.old_logprobs - inputs.ref_logprobs)
    shaped = torch.where(inputs.response_mask > 0, shaped, torch.zeros_like(shaped))
    return shaped, shaped


def needs_values(inputs):
    return inputs.values, inputs.values


def relax_register_algorithms(register):
    register("ref_grpo", ref_regularised_grpo, kind="advantage", needs={"reference", "groups", "old_logprobs"})
    register("valued", needs_values, kind="advantage", needs={"values"}, modes={"colocate"})
"""

SMALL = [
    "rollout.prompts_per_step=2",
    "rollout.n_samples_per_prompt=4",
    "rollout.max_new_tokens=3",
    "trainer.micro_batch_size=8",
    "data.task_size=50",
    "logging.progress=false",
    "logging.console=false",
    "logging.tensorboard=false",
    "logging.plot=false",
    "checkpoint.save_hf_final=false",
    "checkpoint.resume=never",
]


@pytest.fixture
def algorithm_plugin(tmp_path, monkeypatch):
    (tmp_path / "ref_grpo_plugin.py").write_text(textwrap.dedent(PLUGIN))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("RELAX_PLUGINS", "ref_grpo_plugin")  # advantages are computed in the driver
    get_plugin_manager(refresh=True)
    yield sys.modules["ref_grpo_plugin"]
    monkeypatch.delenv("RELAX_PLUGINS")
    get_plugin_manager(refresh=True)
    sys.modules.pop("ref_grpo_plugin", None)


def test_validation_errors_come_from_the_plugins_declarations(algorithm_plugin):
    with pytest.raises(ConfigError) as err:
        load_config(None, [*SMALL, "algorithm.advantage_estimator=valued", "mode=async", "max_staleness=1"])
    text = str(err.value)
    assert (
        "algorithm.critic.enable: advantage estimator 'valued' (plugin 'ref_grpo_plugin') needs critic values; "
        "set algorithm.critic.enable=true"
    ) in text
    assert "mode: advantage estimator 'valued' (plugin 'ref_grpo_plugin') supports mode colocate only" in text
    with pytest.raises(
        ConfigError,
        match=r"rollout.n_samples_per_prompt: advantage estimator 'ref_grpo' \(plugin "
        r"'ref_grpo_plugin'\) compares responses within a group and needs >= 2",
    ):
        load_config(
            None, [*SMALL, "algorithm.advantage_estimator=ref_grpo", "rollout.n_samples_per_prompt=1"]
        )


def test_runtime_starts_the_reference_role_a_plugin_algorithm_declares(
    ray_session, tmp_path, algorithm_plugin
):
    cfg = load_config(
        None,
        [*SMALL, "algorithm.advantage_estimator=ref_grpo", "total_steps=2", f"run_dir={tmp_path / 'run'}"],
    )
    assert cfg.algorithm.kl.coef == 0  # only the declaration asks for a reference model
    summary = run(cfg)
    assert summary["steps"] == 2
    seen = algorithm_plugin.SEEN
    assert len(seen) == 2  # the plugin's estimator computed both steps' advantages
    old, ref, mask = seen[0]
    assert old.shape == ref.shape == mask.shape and mask.sum() > 0
    valid = mask > 0
    # the reference role serves the initial policy: at step 1 (untouched policy) it agrees with the
    # trainer's recomputed logprobs; after one update they differ
    assert (old[valid] - ref[valid]).abs().max() < 1e-4
    old, ref, mask = seen[1]
    assert (old[mask > 0] - ref[mask > 0]).abs().max() > 1e-6
