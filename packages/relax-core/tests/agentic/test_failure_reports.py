"""Issue 42: every fault of an environment reaches the console, ``failures.jsonl`` and the end summary with
its reason; malformed observations are named as what they are; an overrunning episode call is stopped.

The environment is a real plugin (``lookup_env``: a ``lookup(key)`` tool task) driven by a real tiny HF
engine through core's router, as in ``test_turns``."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from pathlib import Path

import pytest

from relax.core.agentic import EpisodeLimits, NoToolCalls, Turns
from relax.core.controller.local import LocalHandle
from relax.core.controller.router import EngineRouter, stream_groups
from relax.core.data import Sample
from relax.core.engines.hf import HFRolloutEngine
from relax.core.engines.stop_tokens import stop_token_ids
from relax.core.failures import FailureLog, FailureRateError, add_failure, format_summary
from relax.core.protocols import SamplingParams
from relax.core.testing.models import tiny_model_dir

sys.path.insert(0, str(Path(__file__).parent))
import lookup_env  # noqa: E402  (the plugin module, as RELAX_PLUGINS would import it)

PROMPT = "<|im_start|>user\nwhat is relax?<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model_dir(
        tmp_path_factory.getbasetemp()
    )  # the session's (shared with the conformance suites)


@pytest.fixture(scope="module")
def engine(model_dir):
    return HFRolloutEngine(model_dir)


class _Blocking:
    def __init__(self, engine):
        self.engine = engine

    def generate(self, requests):
        return asyncio.run(self.engine.generate(requests))


def _episodes(
    engine, fault: str, turn_timeout_s: float = 5.0, on_tool_error: str = "observe"
) -> list[Sample]:
    tok = engine.tokenizer
    env = lookup_env.LookupEnvironment(lookup_env.LookupParams(fault=fault))
    limits = EpisodeLimits(
        max_turns=3, max_total_tokens=200, turn_timeout_s=turn_timeout_s, on_tool_error=on_tool_error
    )
    turns = Turns(env, NoToolCalls(), tok, limits, stop_token_ids(tok))
    prompt = tok(PROMPT, add_special_tokens=False)["input_ids"]
    groups = [[Sample(prompt_ids=list(prompt), group_id=0, index_in_group=i) for i in range(2)]]
    params = SamplingParams(max_new_tokens=4, stop_token_ids=tuple(stop_token_ids(tok)))
    list(
        stream_groups(
            EngineRouter([LocalHandle(_Blocking(engine))]),
            groups,
            params,
            seed=3,
            step=1,
            timeout_s=60,
            turns=turns,
        )
    )
    return groups[0]


# ---------------------------------------------------------------------------- the failure log


def _failed(i: int, kind: str, reason: str) -> Sample:
    sample = Sample(prompt_ids=[1], group_id=i, index_in_group=0)
    if kind:
        add_failure(sample, kind, reason)
    return sample


def test_first_failures_are_logged_with_reasons_the_rest_counted_and_all_written(tmp_path, caplog):
    log = FailureLog(tmp_path, warnings_per_kind=2, max_rate=1.0)
    try:
        raise ValueError("bad label")
    except ValueError as exc:
        error = exc
    samples = [_failed(i, "reward", f"reward 'x' raised ValueError: bad label {i % 2}") for i in range(5)]
    add_failure(samples[0], "tool", "tool 'lookup' timed out", error)
    with caplog.at_level(logging.WARNING, logger="relax"):
        log.record(1, [*samples, _failed(9, "", "")])
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert (
        "relax: step 1: reward failed (group 0 index 0): reward 'x' raised ValueError: bad label 0"
        in warnings
    )
    assert "relax: step 1: tool failed (group 0 index 0): tool 'lookup' timed out" in warnings
    assert any(
        w.startswith(
            "relax: step 1: 3 more reward failures (top reasons: 3x reward 'x' raised ValueError: "
            "bad label 0; 2x reward 'x' raised ValueError: bad label 1); all of them in "
        )
        for w in warnings
    )
    assert len(warnings) == 4  # 2 reward warnings, 1 more-line, 1 tool warning
    rows = [json.loads(line) for line in (tmp_path / "failures.jsonl").read_text().splitlines()]
    assert len(rows) == 6 and {r["kind"] for r in rows} == {"reward", "tool"}
    tool_row = next(r for r in rows if r["kind"] == "tool")
    assert (
        tool_row["step"] == 1
        and tool_row["id"] == "group 0 index 0"
        and "ValueError: bad label" in tool_row["traceback"]
    )
    summary = log.summary()
    assert (
        summary["counts"] == {"reward": 5, "tool": 1}
        and summary["failed_samples"] == 5
        and summary["samples"] == 6
    )
    lines = format_summary(summary)
    assert lines[0].startswith("relax: failures: 5 reward, 1 tool (5 of 6 samples lost their score)")
    assert lines[1] == "relax:   3x reward: reward 'x' raised ValueError: bad label 0"
    assert format_summary(FailureLog(None).summary()) == []


def test_a_run_where_most_samples_fail_is_stopped_naming_the_reason(tmp_path):
    log = FailureLog(tmp_path, max_rate=0.5, window_steps=2)
    log.record(1, [_failed(0, "episode", "turn 0: episode raised RuntimeError: gone"), _failed(1, "", "")])
    log.record(2, [_failed(0, "", ""), _failed(1, "", "")])  # window 1/4 failed: goes on
    with pytest.raises(
        FailureRateError,
        match=r"3 of 5 samples failed over the last 2 step\(s\).*"
        r"top reason: 4x episode: turn 0: episode raised RuntimeError: gone",
    ):
        log.record(3, [_failed(i, "episode", "turn 0: episode raised RuntimeError: gone") for i in range(3)])
    short = FailureLog(tmp_path / "short", max_rate=0.5, window_steps=5)
    short.record(1, [_failed(0, "reward", "reward 'x' timed out after 1s")])  # shorter than the window
    with pytest.raises(FailureRateError, match="1 of 1 samples failed in this run"):
        short.finish()
    FailureLog(None, max_rate=1.0, window_steps=1).record(1, [_failed(0, "reward", "x")])  # 1.0: never stops


def test_a_resumed_run_keeps_the_failures_of_the_steps_it_kept(tmp_path):
    log = FailureLog(tmp_path, max_rate=1.0)
    for step in (1, 2, 3):
        log.record(step, [_failed(0, "episode", f"step {step}")])
    FailureLog(tmp_path, resume_step=2)
    assert [json.loads(r)["step"] for r in (tmp_path / "failures.jsonl").read_text().splitlines()] == [1, 2]


# ---------------------------------------------------------------------------- a real environment's faults


@pytest.mark.parametrize(
    "fault, named",
    [
        ("none_content", "observations[0]['content']=None (NoneType); expected a string"),
        ("int_content", "observations[0]['content']=42 (int); expected a string"),
        ("none_observations", "observations=None (NoneType); expected a list of messages"),
        ("str_observations", "observations='an RL engine' (str); expected a list of messages"),
    ],
)
def test_malformed_observations_are_named_as_what_they_are(engine, fault, named):
    for sample in _episodes(engine, fault):
        error = sample.metadata["episode_error"]
        assert error == f"turn 0: Episode.step returned {named}" or error.startswith(
            f"turn 0: Episode.step returned {named}"
        )
        assert "multimodal" not in error and "TypeError" not in error
        assert sample.metadata["failures"] == [{"kind": "episode", "reason": error}]
        assert sample.metadata["episode"]["errors"] == 1 and sample.metadata["episode_reward"] is None


def test_an_episode_that_raises_is_reported_with_its_traceback(engine):
    for sample in _episodes(engine, "raise"):
        (failure,) = sample.metadata["failures"]
        assert failure["reason"] == "turn 0: episode raised RuntimeError: lookup table is gone"
        assert (
            "lookup_env.py" in failure["traceback"]
            and "RuntimeError: lookup table is gone" in failure["traceback"]
        )


def test_a_spinning_episode_call_is_stopped_not_abandoned(engine):
    lookup_env.SPIN_STOPPED.clear()
    samples = _episodes(engine, "spin", turn_timeout_s=0.5)
    for sample in samples:
        assert sample.metadata["episode"]["timeouts"] == 1
        assert "turn_timeout_s=0.5s" in sample.metadata["failures"][0]["reason"]
    # the busy loop's thread got EpisodeTimeout raised in it: it ended, instead of spinning for the whole run
    assert lookup_env.SPIN_STOPPED.wait(30), "the spinning episode's thread is still running"


def test_a_tool_failure_the_environment_reports_is_recorded_and_the_episode_goes_on(engine):
    for sample in _episodes(engine, "tool_failure"):
        assert sample.metadata["failures"] == [
            {"kind": "tool", "reason": "turn 0: tool 'lookup' raised KeyError: 'relax'"}
        ]
        assert sample.metadata["episode_reward"] == 1.0 and sample.metadata["episode"]["turns"] == 2
        turns = sample.metadata["episode_turns"]
        assert turns[0]["observations"] == ["an RL engine"] and turns[0]["observation_tokens"] > 0


def test_on_tool_error_end_also_ends_at_a_failure_the_environment_reports(engine):
    """Not only a counter named exactly ``tool_errors``: ``StepResult.failures`` ends the episode too."""
    for sample in _episodes(engine, "tool_failure", on_tool_error="end"):
        assert sample.metadata["episode"]["turns"] == 1 and sample.metadata["episode_reward"] is None
        assert [f["kind"] for f in sample.metadata["failures"]] == ["tool"]


def test_the_kits_turn_helpers_are_exported_for_an_environments_own_tests():
    from relax.core.testing import default_samples, make_turn, malformed_turn

    episode = lookup_env.LookupEnvironment(lookup_env.LookupParams()).start(default_samples()[0])
    assert episode.step(make_turn("lookup(relax)")).observations == [
        {"role": "user", "content": "an RL engine"}
    ]
    assert malformed_turn().tool_calls[0].error and make_turn("x").content == "x"


def test_a_failing_reward_is_recorded_on_its_sample_with_the_reason():
    from relax.core.rewards.runner import score_samples

    class Picky:
        def score(self, sample):
            if sample.index_in_group == 1:
                raise ValueError("no label")
            return 1.0

    samples = [Sample(prompt_ids=[1], group_id=0, index_in_group=i) for i in range(2)]
    asyncio.run(score_samples(Picky(), samples, timeout_s=10, on_error="zero", reward_name="picky"))
    assert "failures" not in samples[0].metadata
    (failure,) = samples[1].metadata["failures"]
    assert (
        failure["kind"] == "reward"
        and failure["reason"] == "reward 'picky' raised ValueError: no label (scored 0)"
    )
    assert "ValueError: no label" in failure["traceback"]
