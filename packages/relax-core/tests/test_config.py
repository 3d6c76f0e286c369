"""Config: YAML + overrides, and one clear error per kind of mistake."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from relax.core.config import ConfigError, RelaxConfig, config_from_dict, load_config, parse_overrides

REPO = Path(__file__).resolve().parents[3]


def test_quickstart_defaults_and_example_file_agree():
    bundled = load_config()
    example = load_config(REPO / "examples" / "quickstart.yaml")
    assert bundled == example
    assert isinstance(bundled, RelaxConfig) and bundled.mode == "colocate"


def test_overrides_are_typed_and_nested(tmp_path):
    cfg = load_config(
        None,
        [
            "trainer.lr=1e-5",
            "rollout.n_samples_per_prompt=4",
            "rollout.stop=[foo, bar]",
            "algorithm.kl.coef=0.01",
            "model.path=null",
        ],
    )
    assert cfg.trainer.lr == 1e-5 and cfg.rollout.n_samples_per_prompt == 4
    assert cfg.rollout.stop == ["foo", "bar"] and cfg.algorithm.kl.coef == 0.01
    assert parse_overrides(["a.b.c=3"]) == {"a": {"b": {"c": 3}}}


def test_config_is_frozen():
    cfg = load_config()
    with pytest.raises(AttributeError):
        cfg.trainer.lr = 1.0  # type: ignore[misc]


def test_every_example_validates():
    for path in sorted((REPO / "examples").glob("*.yaml")):
        load_config(path)


BAD = [
    (["trainer.lrr=1"], "trainer.lrr: unknown key; allowed keys: backend, lr,"),
    (["bogus=1"], "bogus: unknown key; allowed keys: name, run_dir,"),
    (["trainer.lr=fast"], "trainer.lr: expected float, got str 'fast'"),
    (["total_steps=2.5"], "total_steps: expected int, got float 2.5"),
    (["mode=turbo"], "mode: 'turbo' is not allowed; allowed values: 'colocate', 'async', 'hybrid'"),
    (["rollout.engine=vllm"], "rollout.engine: unknown rollout_engine 'vllm'; registered: hf"),
    (
        ["algorithm.advantage_estimator=magic"],
        "algorithm.advantage_estimator: unknown advantage 'magic'; registered: ",
    ),
    (["reward.name=nope"], "reward.name: unknown reward 'nope'; registered: "),
    (["rollout.top_p=1.5"], "rollout.top_p: must be in (0, 1], got 1.5"),
    (["trainer.lr=-1"], "trainer.lr: must be > 0, got -1.0"),
    (["max_staleness=2"], "max_staleness: mode 'colocate' is strictly on-policy and needs 0, got 2"),
    (
        ["rollout.n_samples_per_prompt=1"],
        "rollout.n_samples_per_prompt: advantage estimator 'grpo' compares responses within a group and needs >= 2, got 1",
    ),
    (["trainer.num_minibatches=3"], "trainer.num_minibatches: 3 does not divide the step batch"),
    (
        ["algorithm.loss_agg_mode=mean"],
        "algorithm.loss_agg_mode: 'mean' is not allowed; allowed values: 'token-mean'",
    ),
    (["trainer=5"], "trainer: expected a mapping of TrainerConfig fields, got int"),
    (["rollout.stop=abc"], "rollout.stop: expected a list, got str 'abc'"),
    (["data.path=data.csv"], "data.path: 'data.csv' must be a .jsonl, .json or .parquet file"),
    (
        ["checkpoint.resume=/no/such/dir"],
        "checkpoint.resume: '/no/such/dir' is neither 'auto', 'never' nor an existing directory",
    ),
    (["logging.wandb=yes please"], "logging.wandb: expected bool, got str 'yes please'"),
    (
        ["trainer.max_tokens_per_micro_batch=40", "data.max_prompt_length=32", "rollout.max_new_tokens=16"],
        "trainer.max_tokens_per_micro_batch: 40 is less than the longest row a step can hold (data.max_prompt_length "
        "32 + rollout.max_new_tokens 16 = 48); raise it to at least 48",
    ),
    (
        ["trainer.recompute=full", "algorithm.routing_replay=rollout"],
        "trainer.recompute: 'full' with algorithm.routing_replay 'rollout': the forward recomputed in backward",
    ),
    (
        ["trainer.recompute=some"],
        "trainer.recompute: 'some' is not allowed; allowed values: 'off', 'full', 'selective'",
    ),
]


@pytest.mark.parametrize(("overrides", "message"), BAD, ids=[b[0][0] for b in BAD])
def test_bad_config_names_the_field(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert message in str(err.value)


def test_all_problems_reported_at_once():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["trainer.lr=-1", "rollout.top_p=0"])
    assert "trainer.lr" in str(err.value) and "rollout.top_p" in str(err.value)


def test_yaml_file_errors(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(missing)
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    listy = tmp_path / "list.yaml"
    listy.write_text(yaml.safe_dump([1, 2]))
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(listy)
    with pytest.raises(ConfigError, match="expected key.path=value"):
        parse_overrides(["trainer.lr"])


def test_docs_config_reference_is_current():
    from relax.core.config_docs import config_reference_markdown

    assert (REPO / "docs" / "config.md").read_text() == config_reference_markdown(), (
        "docs/config.md is stale: run `python -m relax.core.config_docs > docs/config.md`"
    )


def test_builtin_plugin_sections_are_typed(tmp_path):
    from relax.core.builtin import HFEngineParams, NumericRewardParams, TorchTrainerParams

    cfg = load_config(None, ["rollout.engine_params.max_batch_size=8", "reward.params.abs_tol=1e-3"])
    assert cfg.rollout.engine_params == HFEngineParams(max_batch_size=8)
    assert cfg.reward.params == NumericRewardParams(
        abs_tol=1e-3
    )  # "1e-3" is a YAML string, parsed as a float
    assert cfg.trainer.backend_params == TorchTrainerParams()  # defaults filled in, visible in --print
    assert cfg.to_dict()["trainer"]["backend_params"]["world_size"] == 1
    with pytest.raises(ConfigError) as err:
        load_config(
            None,
            [
                "rollout.engine_params.max_batch_size=0",
                "rollout.engine_params.devise=cpu",
                "reward.params.mode=boxed",
                "trainer.backend_params.world_size=two",
            ],
        )
    text = str(err.value)
    for message in [
        "rollout.engine_params.devise: unknown key; allowed keys: device, max_batch_size, seed, num_cpus",
        "reward.params.mode: 'boxed' is not allowed; allowed values: 'first', 'last', 'answer'",
        "trainer.backend_params.world_size: expected int, got str 'two'",
    ]:
        assert message in text
    with pytest.raises(ConfigError, match=r"rollout.engine_params.max_batch_size: must be >= 1, got 0"):
        load_config(None, ["rollout.engine_params.max_batch_size=0"])


def test_capabilities_are_checked_against_what_the_config_needs():
    from relax.core.controller.capabilities import CapabilityError, capabilities, check

    class Bare:
        def train_step(self, batch): ...

    class WithValues(Bare):
        def forward_values(self, batch): ...
        def save_hf(self, directory): ...

    assert capabilities(Bare()) == [] and capabilities(WithValues()) == ["forward_values", "save_hf"]
    cfg = load_config(None, ["algorithm.advantage_estimator=gae", "algorithm.critic.enable=true"])
    check(cfg, {"trainer": ("mine", capabilities(WithValues())), "rollout": ("hf", ["abort"])})
    with pytest.raises(CapabilityError) as err:
        check(cfg, {"trainer": ("mine", capabilities(Bare())), "rollout": ("hf", [])})
    assert "trainer backend 'mine' does not implement forward_values()" in str(err.value)
    assert "needed by algorithm.critic.enable" in str(err.value) and "save_hf" in str(err.value)
    asyncc = load_config(None, ["mode=async", "max_staleness=1", "rollout.partial_rollout=abort"])
    with pytest.raises(
        CapabilityError,
        match=r"rollout backend 'hf' does not implement abort\(\).*rollout.partial_rollout=abort",
    ):
        check(asyncc, {"trainer": ("torch", ["forward_values", "save_hf"]), "rollout": ("hf", [])})


def test_to_dict_redacts_the_control_token():
    cfg = config_from_dict({"control": {"enabled": True, "token": "s3cret-token-0123456789"}})
    assert cfg.control.token == "s3cret-token-0123456789"  # the run still uses it ...
    assert cfg.to_dict()["control"]["token"] == "<redacted>"  # ... displays and trackers never see it
    assert "s3cret" not in str(cfg.to_dict())
