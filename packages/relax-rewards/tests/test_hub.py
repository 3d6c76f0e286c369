"""The hub: routing, weighted combinations, validation errors, isolation (raise, hang, ``os._exit``)
and the metrics its ``reward_info`` produces."""

from __future__ import annotations

import asyncio
import logging

import pytest

from relax.core.config import ConfigError, config_from_dict
from relax.core.rewards.runner import reward_metrics, score_samples
from relax.rewards.hub import Hub, HubParams, parse_routes
from relax.rewards.testing import make_sample


@pytest.fixture(scope="module")
def mixed_hub():
    hub = Hub(
        HubParams(
            routes={
                "math": "math",
                "gpqa": {"name": "gpqa"},
                "squad": [{"name": "f1", "weight": 0.5}, {"name": "exact_match_squad", "weight": 0.5}],
            },
            route_key="data_source",
            default="math",
            workers=2,
        )
    )
    yield hub
    hub.close()


def test_routing_on_a_mixed_dataset(mixed_hub):
    samples = [
        make_sample("\\boxed{\\frac12}", "0.5", {"data_source": "math"}, group=0, index=0),
        make_sample("\\boxed{3}", "4", {}, group=0, index=1),  # no field: default route
        make_sample("Answer: (B)", "B", {"data_source": "gpqa"}, group=1, index=0),
        make_sample("Answer: Paris", "Paris", {"data_source": "squad"}, group=1, index=1),
        make_sample("Paris, France", "Paris", {"data_source": "squad"}, group=2, index=0),
        make_sample("\\boxed{9}", "9", {"data_source": "unknown"}, group=2, index=1),  # unknown: default
    ]
    out = asyncio.run(mixed_hub.score_group(samples))
    assert [o["score"] for o in out] == pytest.approx([1.0, 0.0, 1.0, 1.0, 0.5 * 2 / 3 + 0.0, 1.0])
    assert out[0]["route/math"] == 1.0 and "route/math" in out[1] and out[2]["route/gpqa"] == 1.0
    assert out[3]["f1/score"] == 1.0 and out[3]["exact_match_squad/score"] == 1.0
    assert out[2]["acc"] == 1.0 and "acc" not in out[4]  # a single-component route copies its keys
    for s, o in zip(samples, out, strict=True):
        s.reward, s.reward_info = o["score"], o
    metrics = reward_metrics(samples)
    assert metrics["reward/route/math_mean"] == pytest.approx(2 / 3)  # per route
    assert metrics["reward/route/squad_mean"] == pytest.approx((1.0 + 1 / 3) / 2)
    assert metrics["reward/f1/f1_mean"] == pytest.approx((1.0 + 2 / 3) / 2)  # per component
    assert metrics["reward/failures"] == 0.0 and metrics["reward/timeouts"] == 0.0


def test_validation_names_every_problem():
    routes, errors = parse_routes(
        HubParams(
            routes={
                "a": "nope",
                "b": {"name": "math", "params": {"tail_chars": "x"}},
                "c": {"name": "hub"},
                "d": {"name": "f1", "weight": "heavy", "colour": 1},
            },
            default="z",
        )
    )
    text = "\n".join(errors)
    assert "routes.a.name: unknown reward 'nope'" in text
    assert "routes.b.params.tail_chars: expected int" in text
    assert "routes.c.name: a hub cannot contain a hub" in text
    assert "routes.d.weight: must be a finite number" in text and "routes.d: unknown keys ['colour']" in text
    assert "default: 'z' is not a route" in text
    cfg = {"reward": {"name": "hub", "params": {"routes": {"m": "math"}, "default": "gsm8k"}}}
    with pytest.raises(ConfigError, match=r"reward\.params\.default: 'gsm8k' is not a route"):
        config_from_dict(cfg)
    ok = config_from_dict({"reward": {"name": "hub", "params": {"routes": {"m": "math"}, "default": "m"}}})
    assert ok.reward.params.routes == {"m": "math"}
    with pytest.raises(ValueError, match="no route for data_source='x'"):
        Hub(HubParams(routes={"m": "f1"})).route_of(make_sample("a", metadata={"data_source": "x"}))


def test_core_group_bound_is_derived_from_call_timeout_unless_set():
    hub = {
        "name": "hub",
        "params": {
            "routes": {"m": "math", "two": ["f1", {"name": "gpqa", "timeout_s": 50}]},
            "default": "m",
            "workers": 2,
            "call_timeout_s": 30,
            "start_timeout_s": 100,
        },
    }
    derived = config_from_dict({"reward": hub, "rollout": {"n_samples_per_prompt": 4}})
    # 4 samples x 2 components of the longest route, 2 at a time, each up to 50 s; one worker start + margin
    assert derived.reward.timeout_s == 4 * 50 + 100 + 10 == derived.reward.params.group_timeout_s(4)
    explicit = config_from_dict({"reward": {**hub, "timeout_s": 120}, "rollout": {"n_samples_per_prompt": 4}})
    assert explicit.reward.timeout_s == 120, "an explicit reward.timeout_s is kept"
    plain = config_from_dict({"reward": {"name": "f1"}})
    assert plain.reward.timeout_s == 30.0, "a reward whose params derive nothing keeps core's default"


def test_no_default_route_is_a_counted_failure():
    hub = Hub(HubParams(routes={"squad": "f1"}))
    [out] = asyncio.run(hub.score_group([make_sample("a", "a", {"data_source": "other"})]))
    assert out == {"score": 0.0, "reward_failed": 1.0}
    hub.close()


def test_isolation_raise_hang_and_exit_yield_fallback_and_counts(with_misbehave, caplog):
    hub = Hub(
        HubParams(
            routes={
                "raise": {"name": "misbehave", "params": {"mode": "raise"}},
                "hang": {"name": "misbehave", "params": {"mode": "hang"}, "timeout_s": 1.5},
                "exit": {"name": "misbehave", "params": {"mode": "exit"}},
                "mix": [
                    {"name": "misbehave", "params": {"mode": "exit"}, "weight": 1.0},
                    {"name": "f1", "weight": 2.0},
                ],
            },
            route_key="kind",
            workers=2,
            fallback_score=-1.0,
            call_timeout_s=20,
        )
    )
    samples = [
        make_sample(f"{resp}", "ok", {"kind": kind}, group=g, index=0)
        for g, (kind, resp) in enumerate(
            [
                ("raise", "BAD"),
                ("raise", "fine"),
                ("hang", "BAD"),
                ("exit", "BAD"),
                ("exit", "fine"),
                ("mix", "ok BAD"),
                ("hang", "fine"),
            ]
        )
    ]
    # behaviour, not wall-clock time: the hung calls end at their route's 1.5 s (logged below), and a hub that
    # waited for them would make score_samples raise at its own 60 s instead of returning
    with caplog.at_level(logging.WARNING, logger="relax.rewards.hub"):
        stats = asyncio.run(score_samples(hub, samples, timeout_s=60, on_error="raise"))
    assert stats.failures == 0  # the hub absorbed every failure itself ...
    scores = [s.reward for s in samples]
    assert scores[:5] == [-1.0, 1.0, -1.0, -1.0, 1.0] and scores[6] == 1.0
    assert scores[5] == pytest.approx(
        -1.0 + 2.0 * 2 / 3
    )  # the failed component's fallback + f1 ("ok bad" vs "ok")
    metrics = reward_metrics(samples)
    assert (metrics["reward/failures"], metrics["reward/timeouts"]) == (
        4.0,
        1.0,
    )  # ... and counts them per sample
    assert (
        samples[2].reward_info["reward_timeout"] == 1.0 and samples[3].reward_info["misbehave/failed"] == 1.0
    )
    logged = caplog.text
    assert "on sample group 0 index 0: RemoteError: RuntimeError: misbehave: raising" in logged
    assert "on sample group 2 index 0: timed out after 1.5s" in logged
    assert "on sample group 3 index 0: WorkerDied" in logged
    # the driver's failure report (relax.core.failures) gets each one with its reason
    [hung] = samples[2].metadata["failures"]  # its worker killed and replaced, said with the pid
    assert hung["kind"] == "reward" and hung["reason"].startswith(
        "reward hub: 'misbehave' (route 'hang'): timed out after 1.5s (killed after 1.5s (worker pid "
    )
    assert hung["reason"].endswith(" replaced)) (scored -1)")
    assert "failures" not in samples[1].metadata and samples[5].metadata["failures"][0]["reason"].startswith(
        "reward hub: 'misbehave' (route 'mix'): WorkerDied"
    )
    assert hub.pool.restarts >= 3  # the hung worker and the two exited ones were replaced
    again = [make_sample("fine", "ok", {"kind": "exit"})]
    asyncio.run(score_samples(hub, again, timeout_s=60))
    assert again[0].reward == 1.0  # the pool still serves
    hub.close()


def test_standalone_math_runs_isolated_and_validates():
    from relax.core.plugins import get_plugin_manager
    from relax.rewards.mathverify import MathParams

    reward = get_plugin_manager().get("reward", "math")(MathParams(), None)
    assert isinstance(reward, Hub) and reward.pool is not None and reward.pooled == {"math.0.math"}
    samples = [make_sample("\\boxed{0.5}", "\\frac{1}{2}"), make_sample("\\boxed{2}", "3", index=1)]
    asyncio.run(score_samples(reward, samples, timeout_s=60))
    assert [s.reward for s in samples] == [1.0, 0.0] and samples[0].reward_info["acc"] == 1.0
    reward.close()
    with pytest.raises(ConfigError, match=r"reward\.params\.tail_chars: must be >= 1"):
        config_from_dict({"reward": {"name": "math", "params": {"tail_chars": 0}}})


def test_fallback_defaults_to_core_reward_fallback_score(with_misbehave):
    from relax.core.context import PluginContext

    raising = {"name": "misbehave", "params": {"mode": "raise"}, "isolate": False}
    ctx = PluginContext(role="reward", fallback_score=-2.0)
    inherited, own = (
        Hub(HubParams(routes={"r": raising}), ctx),
        Hub(HubParams(routes={"r": raising}, fallback_score=0.5), ctx),
    )
    for hub, expected in ((inherited, -2.0), (own, 0.5)):
        samples = [make_sample("BAD", "ok", {"data_source": "r"})]
        asyncio.run(score_samples(hub, samples, timeout_s=60))
        assert samples[0].reward == expected and samples[0].reward_info["reward_failed"] == 1.0
        hub.close()
