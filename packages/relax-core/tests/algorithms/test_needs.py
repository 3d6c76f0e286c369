"""Registration metadata: what an algorithm needs decides the roles a run starts and the config
errors it gets, for a plugin's algorithm exactly as for a built-in one."""

from __future__ import annotations

import types

import pytest

from relax.core import plugins
from relax.core.algorithms import AlgorithmConfig, KLConfig, algorithm_spec, config_needs
from relax.core.config import ConfigError, load_config
from relax.core.controller.runtime import teacher_path

BASE = ["rollout.n_samples_per_prompt=4", "rollout.max_new_tokens=3", "total_steps=10"]


def _estimator(inputs, scale: float = 1.0):
    return inputs.response_mask * scale, inputs.response_mask


def _loss(inputs):
    return inputs.logprobs.sum() * 0, {}


def _plugin(**declared):
    """A plugin module registering one estimator and one loss per entry of ``declared``:
    ``name=(kind, needs, modes)``."""

    def relax_register_algorithms(register):
        for name, (kind, needs, modes) in declared.items():
            fn = _estimator if kind == "advantage" else _loss
            register(
                name,
                fn,
                kind=kind,
                **({"needs": needs} if needs is not None else {}),
                **({"modes": modes} if modes is not None else {}),
            )

    module = types.ModuleType("third_party_algorithms")
    module.relax_register_algorithms = relax_register_algorithms
    return module


@pytest.fixture
def with_plugin(monkeypatch):
    """Install a plugin into the process-wide registry (core's built-ins load from their entry point)."""

    def install(**declared):
        manager = plugins.RelaxPluginManager(extra_plugins={"thirdparty": _plugin(**declared)})
        monkeypatch.setattr(plugins, "_MANAGER", manager)
        return manager

    return install


def test_builtin_declarations():
    assert algorithm_spec("advantage", "gae").needs == {"values"}
    assert algorithm_spec("advantage", "rloo").needs == {"groups"}
    assert algorithm_spec("advantage", "remax").modes == {"colocate"}
    assert algorithm_spec("policy_loss", "opd").needs == {"teacher", "old_logprobs"}
    assert algorithm_spec("advantage", "grpo").plugin == "core"
    assert config_needs(AlgorithmConfig()) == {"groups", "old_logprobs"}
    # config switches add roles: kl.coef > 0 reads the reference, opd_coef > 0 a teacher
    assert {"reference", "teacher"} <= config_needs(AlgorithmConfig(kl=KLConfig(coef=0.1), opd_coef=0.5))


def test_declarations_are_checked_at_registration(with_plugin):
    with pytest.raises(
        plugins.PluginError,
        match=r"plugin 'thirdparty': advantage 'bad': unknown needs \['critic'\]; "
        r"allowed: values, reference, teacher",
    ):
        with_plugin(bad=("advantage", {"critic"}, None))
    with pytest.raises(plugins.PluginError, match=r"needs= must be a set of names, got the string 'values'"):
        with_plugin(bad=("advantage", "values", None))
    with pytest.raises(
        plugins.PluginError, match=r"unknown modes \['sync'\]; allowed: colocate, async, hybrid"
    ):
        with_plugin(bad=("policy_loss", None, {"sync"}))
    manager = with_plugin(plain=("advantage", None, None))
    assert manager.registration("advantage", "plain").options == {
        "needs": frozenset(),
        "modes": frozenset({"colocate", "async", "hybrid"}),
    }


def _errors(overrides) -> str:
    with pytest.raises(ConfigError) as err:
        load_config(None, [*BASE, *overrides])
    return str(err.value)


def test_validation_errors_derive_from_a_plugins_declarations(with_plugin, tmp_path):
    with_plugin(
        valued=("advantage", {"values"}, None),
        grouped=("advantage", {"groups"}, None),
        async_only=("advantage", None, {"async"}),
        greedy=("advantage", {"greedy_baseline"}, None),
        distill=("policy_loss", {"teacher"}, None),
    )
    text = _errors(["algorithm.advantage_estimator=valued"])
    assert (
        "algorithm.critic.enable: advantage estimator 'valued' (plugin 'thirdparty') needs critic values; "
        "set algorithm.critic.enable=true"
    ) in text
    load_config(None, [*BASE, "algorithm.advantage_estimator=valued", "algorithm.critic.enable=true"])
    # a critic nobody reads is refused for a plugin's estimator as for a built-in one
    text = _errors(["algorithm.advantage_estimator=grouped", "algorithm.critic.enable=true"])
    assert (
        "algorithm.critic.enable: advantage estimator 'grouped' does not use critic values (estimators that do: "
        "'gae', 'valued')" in text
    )
    text = _errors(["algorithm.advantage_estimator=grouped", "rollout.n_samples_per_prompt=1"])
    assert (
        "rollout.n_samples_per_prompt: advantage estimator 'grouped' (plugin 'thirdparty') compares responses"
        in text
    )
    text = _errors(["algorithm.advantage_estimator=async_only"])
    assert (
        "mode: advantage estimator 'async_only' (plugin 'thirdparty') supports mode async only, got 'colocate'"
        in text
    )
    text = _errors(["algorithm.advantage_estimator=greedy", "rollout.n_samples_per_prompt=1"])
    assert (
        "algorithm.greedy_baseline: advantage estimator 'greedy' (plugin 'thirdparty') uses the reward of a greedy"
        in text
    )
    text = _errors(["algorithm.policy_loss=distill"])
    assert (
        "algorithm.teacher_model_path: policy loss 'distill' (plugin 'thirdparty') needs a distillation teacher"
        in text
    )
    text = _errors(
        ["algorithm.policy_loss=distill", "algorithm.teacher_model_path=policy_init", "algorithm.opd_coef=1"]
    )
    assert (
        "algorithm.opd_coef: policy loss 'distill' (plugin 'thirdparty') already reads teacher logprobs"
        in text
    )
    text = _errors(
        [
            "algorithm.advantage_estimator=valued",
            "algorithm.critic.enable=true",
            "algorithm.advantage_params={scael: 2}",
        ]
    )
    assert (
        "algorithm.advantage_params.scael: advantage estimator 'valued' (plugin 'thirdparty') takes no "
        "parameter 'scael'; it takes: scale"
    ) in text


def test_runtime_roles_follow_declarations(with_plugin):
    with_plugin(needs_ref=("advantage", {"reference"}, None), distill=("policy_loss", {"teacher"}, None))
    cfg = load_config(None, [*BASE, "algorithm.advantage_estimator=needs_ref"])
    assert cfg.algorithm.kl.coef == 0 and "reference" in config_needs(cfg.algorithm)
    assert teacher_path(cfg, "/policy") is None
    cfg = load_config(
        None, [*BASE, "algorithm.policy_loss=distill", "algorithm.teacher_model_path=policy_init"]
    )
    assert teacher_path(cfg, "/policy") == "/policy" and "reference" not in config_needs(cfg.algorithm)


def test_needs_nothing_provides_are_refused_before_a_run(monkeypatch):
    from relax.core.algorithms import validate

    load_config(None, [*BASE, "algorithm.advantage_estimator=optimal_token_baseline"])  # trainer-provided
    monkeypatch.setattr(validate, "UNPROVIDED", frozenset({"sum_pi_squared"}))
    text = _errors(["algorithm.advantage_estimator=optimal_token_baseline"])
    assert (
        "algorithm.advantage_estimator: advantage estimator 'optimal_token_baseline' needs per-token sum over "
        "the vocabulary of squared policy probabilities"
    ) in text
    assert (
        "remax"
        in _errors(
            [
                "algorithm.advantage_estimator=remax",
                "algorithm.greedy_baseline=true",
                "mode=async",
                "max_staleness=1",
            ]
        ).split("mode: advantage estimator ")[1]
    )


def test_docs_tables_list_every_builtin_with_its_needs():
    import re
    from pathlib import Path

    from relax.core.algorithms import ADVANTAGE_ESTIMATORS, POLICY_LOSSES

    docs = (Path(__file__).resolve().parents[4] / "docs" / "algorithms.md").read_text()
    for kind, table, heading in [
        ("advantage", ADVANTAGE_ESTIMATORS, "## Advantage estimators"),
        ("policy_loss", POLICY_LOSSES, "## Policy losses"),
    ]:
        section = docs.split(heading, 1)[1].split("\n## ", 1)[0]
        rows = dict(re.findall(r"^\| `(\w+)`(?: \[`\w+`\])? \|.*\| ([\w, —]+) \| [^|]+ \|$", section, re.M))
        for name in table:
            documented = set() if rows[name] == "—" else set(rows[name].split(", "))
            assert documented == algorithm_spec(kind, name).needs, name
