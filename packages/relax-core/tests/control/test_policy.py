"""Pure parts of the control plane: operation rules, autoscaler decisions, Prometheus text,
config validation, token resolution, CLI tables."""

from __future__ import annotations

import pytest

from relax.core.config import ConfigError, load_config
from relax.core.control.autoscaler import Autoscaler, Observation, queue_fill
from relax.core.control.cli import format_status, table
from relax.core.control.prometheus import exposition, metric_name
from relax.core.control.server import resolve_token
from relax.core.control.settings import AutoscalerConfig
from relax.core.control.state import ControlError, ControlState

ENGINES = [
    {"engine_id": 0, "protected": True, "load": 3},
    {"engine_id": 1, "protected": False, "load": 5},
    {"engine_id": 2, "protected": False, "load": 1},
]


def running(engines=ENGINES) -> ControlState:
    state = ControlState()
    state.exchange({"state": "running", "engines": engines})
    return state


def test_one_scale_operation_at_a_time_and_phases_to_one_terminal_state():
    state = running()
    op = state.submit("scale_out", {"num_engines": 1})
    with pytest.raises(
        ControlError, match="op-1 \\(scale_out\\) is still pending; one scale operation at a time"
    ) as err:
        state.submit("scale_in", {"num_engines": 1})
    assert err.value.status == 409
    assert state.submit("pause", {})["state"] == "pending"  # not a scale operation
    assert [c["op"] for c in state.exchange({"state": "running", "engines": ENGINES})] == ["op-1", "op-2"]
    for phase in ("creating", "health-checking", "weight-syncing", "active"):
        state.update(op["id"], phase)
    state.update(op["id"], "failed")  # a terminal state is final
    assert state.operation("op-1")["history"] == [
        "pending",
        "taken",
        "creating",
        "health-checking",
        "weight-syncing",
        "active",
    ]
    assert state.submit("scale_out", {"num_engines": 1})["id"] == "op-3"


def test_scale_in_targets_never_protected_nor_the_last_engine():
    state = running()
    assert state.submit("scale_in", {"num_engines": 1})["engine_ids"] == [2]  # least loaded unprotected
    state = running()
    with pytest.raises(ControlError, match=r"engine_ids: \[0\] are protected"):
        state.submit("scale_in", {"engine_ids": [0]})
    with pytest.raises(ControlError, match=r"engine_ids: \[7\] not serving; serving: \[0, 1, 2\]") as err:
        state.submit("scale_in", {"engine_ids": [7]})
    assert err.value.status == 404
    with pytest.raises(ControlError, match="num_engines: 3 requested but only 2 engine"):
        state.submit("scale_in", {"num_engines": 3})
    lone = running([{"engine_id": 4, "protected": False, "load": 0}])
    with pytest.raises(ControlError, match="would leave no serving engine"):
        lone.submit("scale_in", {"engine_ids": [4]})


def test_cancel_only_before_the_driver_takes_it_and_finish_cancels_the_rest():
    state = running()
    state.submit("checkpoint", {})
    assert state.cancel("op-1")["state"] == "cancelled" and state.exchange({"state": "running"}) == []
    state.submit("checkpoint", {})
    state.exchange({"state": "running"})
    with pytest.raises(ControlError, match="only an operation not started yet can be cancelled"):
        state.cancel("op-2")
    state.finish("completed", {"step": 3})
    assert state.operation("op-2")["state"] == "cancelled" and state.status()["status"] == "completed"
    with pytest.raises(ControlError, match="the run is finished"):
        state.submit("pause", {})


def test_autoscaler_scales_out_after_k_starved_steps_then_cools_down_and_respects_bounds():
    cfg = AutoscalerConfig(
        enabled=True, min_engines=1, max_engines=2, idle_frac=0.3, starved_fill=0.5, steps=2, cooldown_s=10
    )
    policy = Autoscaler(cfg)
    starved = dict(trainer_idle_frac=0.6, queue_fill=0.1)
    assert policy.observe(Observation(1, 1, now=0, **starved)).action is None
    decision = policy.observe(Observation(2, 1, now=1, **starved))
    assert decision.action == "scale_out" and "over 2/2 steps trainer idle 60%" in decision.reason
    assert "in flight" in policy.observe(Observation(3, 1, now=2, busy=True, **starved)).reason
    policy.operation_ended(now=3)
    assert "cooling down" in policy.observe(Observation(4, 2, now=5, **starved)).reason
    policy.observe(Observation(5, 2, now=14, **starved))
    assert "max_engines=2 is reached" in policy.observe(Observation(6, 2, now=15, **starved)).reason
    full = dict(trainer_idle_frac=0.0, queue_fill=0.95)
    policy = Autoscaler(cfg)
    policy.observe(Observation(1, 2, now=0, **full))
    assert policy.observe(Observation(2, 2, now=1, **full)).action == "scale_in"
    policy.observe(Observation(3, 1, now=2, **full))
    assert "min_engines=1 is reached" in policy.observe(Observation(4, 1, now=3, **full)).reason
    assert queue_fill(32, max_staleness=1, step_rows=32) == 0.5 and queue_fill(99, 0, 32) == 1.0
    # steps alternating between waiting and finding the batch ready (staleness 1) still add up to starved
    policy = Autoscaler(cfg)
    policy.observe(Observation(1, 1, trainer_idle_frac=0.95, queue_fill=0.0, now=0))
    assert (
        policy.observe(Observation(2, 1, trainer_idle_frac=0.05, queue_fill=0.5, now=1)).action == "scale_out"
    )


def test_prometheus_exposition_is_valid_text_format():
    text = exposition(
        {"queue/depth/sample": 3, "perf/tokens_per_s": 12.5, "bad": float("nan"), "name": "x"}, 'r"1'
    )
    assert metric_name("fault/engines_live") == "relax_fault_engines_live"
    assert text.splitlines() == [
        "# HELP relax_bad Relax metric bad",
        "# TYPE relax_bad gauge",
        'relax_bad{run="r\\"1"} NaN',
        "# HELP relax_perf_tokens_per_s Relax metric perf/tokens_per_s",
        "# TYPE relax_perf_tokens_per_s gauge",
        'relax_perf_tokens_per_s{run="r\\"1"} 12.5',
        "# HELP relax_queue_depth_sample Relax metric queue/depth/sample",
        "# TYPE relax_queue_depth_sample gauge",
        'relax_queue_depth_sample{run="r\\"1"} 3.0',
    ]


def test_control_config_is_validated_naming_each_field():
    with pytest.raises(ConfigError) as err:
        load_config(
            None,
            [
                "control.port=0",
                "control.token=short",
                "control.autoscaler.enabled=true",
                "control.autoscaler.max_engines=0",
                "logging.notify_urls=[nonsense]",
            ],
        )
    msg = str(err.value)
    for part in [
        "control.port: must be in [1, 65535], got 0",
        "control.token: must be at least 16 characters",
        "control.autoscaler.max_engines: 0 is below min_engines (1)",
        "control.autoscaler.enabled: needs control.enabled: true",
        "control.autoscaler.enabled: needs mode 'async' or 'hybrid'",
        "logging.notify_urls[0]: 'nonsense' is not an Apprise URL",
    ]:
        assert part in msg, msg


def test_token_is_required_off_loopback(monkeypatch):
    monkeypatch.delenv("RELAX_CONTROL_TOKEN", raising=False)
    assert resolve_token("127.0.0.1", None) == (None, False)
    token, generated = resolve_token("0.0.0.0", None)
    assert generated and len(token) >= 32
    assert resolve_token("10.0.0.5", "t" * 20) == ("t" * 20, False)
    monkeypatch.setenv("RELAX_CONTROL_TOKEN", "e" * 20)
    assert resolve_token("0.0.0.0", None) == ("e" * 20, False)


def test_status_renders_as_a_table():
    text = format_status(
        {
            "name": "q",
            "state": "running",
            "mode": "async",
            "step": 3,
            "total_steps": 9,
            "weight_version": 3,
            "queue": {"rows": 8.0, "capacity": 48.0},
            "trainer_idle_frac": 0.25,
            "engines": [
                {
                    "engine_id": 0,
                    "healthy": True,
                    "weight_version": 3,
                    "load": 2,
                    "draining": False,
                    "protected": True,
                }
            ],
        }
    )
    assert text.splitlines()[0] == "run q: running (async), step 3/9, weight version 3"
    assert "trainer idle 25%" in text
    assert table([{"a": 1, "bb": None}], ["a", "bb"]).splitlines() == ["a  bb", "1  -"]
