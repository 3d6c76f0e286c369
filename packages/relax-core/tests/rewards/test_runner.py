import asyncio
import threading
import time

import pytest

from relax.core.data import Sample
from relax.core.rewards import (
    ExactMatchReward,
    NumericReward,
    RewardError,
    ScoringLoop,
    reward_metrics,
    score_samples,
)


def samples(responses, label="7"):
    return [
        Sample(prompt_ids=[1], group_id=i // 2, index_in_group=i % 2, response_text=r, label=label)
        for i, r in enumerate(responses)
    ]


class Slow:
    """Scores 1.0 after ``delay`` s; responses in ``hang`` never finish, or, with ``linger``, swallow
    the cancellation and finish ``linger`` s later. Tracks peak concurrency."""

    def __init__(self, delay=0.05, hang=(), linger=None):
        self.delay, self.hang, self.linger = delay, set(hang), linger
        self.active = self.peak = 0

    async def score(self, sample):
        self.active += 1
        self.peak = max(self.peak, self.active)
        try:
            if sample.response_text in self.hang:
                try:
                    await asyncio.sleep(3600)
                except asyncio.CancelledError:
                    if self.linger is None:
                        raise
                    await asyncio.sleep(self.linger)  # a reward that ignores cancellation
            await asyncio.sleep(self.delay)
            return 1.0
        finally:
            self.active -= 1


class Broken:
    async def score(self, sample):
        if sample.response_text == "boom":
            raise KeyError("no such field")
        return {"score": 0.5, "extra": 2}


def test_sets_reward_and_info():
    ss = samples(["7", "8", "the answer is 7"])
    stats = asyncio.run(score_samples(NumericReward(mode="answer"), ss))
    assert [s.reward for s in ss] == [1.0, 0.0, 1.0]
    assert ss[1].reward_info == {"score": 0.0, "parsed_ok": 1.0}
    assert (stats.scored, stats.failures, stats.first_error) == (3, 0, None)
    ss = samples(["7", " 7 "])
    asyncio.run(score_samples(ExactMatchReward(), ss))
    assert [s.reward_info for s in ss] == [{"score": 1.0}, {"score": 1.0}]


def test_runs_concurrently_up_to_the_limit():
    reward = Slow(delay=0.1)
    stats = asyncio.run(score_samples(reward, samples([str(i) for i in range(20)]), max_concurrency=5))
    assert (
        reward.peak == 5
    )  # five at a time, never more (behaviour, not a wall-clock bound a loaded machine breaks)
    assert stats.scored == 20


def test_timeout_raises_naming_reward_and_sample():
    ss = samples(["a", "b", "c", "hang"])
    t0 = time.perf_counter()
    with pytest.raises(RewardError, match=r"reward 'slowrm' on sample group 1 index 1: timed out after 0.2s"):
        asyncio.run(score_samples(Slow(hang={"hang"}), ss, timeout_s=0.2, reward_name="slowrm"))
    assert time.perf_counter() - t0 < 3


def test_error_raises_with_cause():
    with pytest.raises(
        RewardError, match=r"reward 'Broken' on sample group 0 index 1: KeyError: 'no such field'"
    ) as e:
        asyncio.run(score_samples(Broken(), samples(["ok", "boom"])))
    assert isinstance(e.value.__cause__, KeyError)


def test_zero_mode_counts_failures():
    ss = samples(["ok", "boom", "ok", "ok"])
    stats = asyncio.run(score_samples(Broken(), ss, on_error="zero"))
    assert [s.reward for s in ss] == [0.5, 0.0, 0.5, 0.5]
    assert ss[0].reward_info == {"score": 0.5, "extra": 2.0}
    assert ss[1].reward_info == {"score": 0.0, "reward_failed": 1.0}
    assert (stats.scored, stats.errors, stats.timeouts) == (3, 1, 0)
    assert "group 0 index 1: KeyError" in stats.first_error


def test_a_reward_that_ignores_cancellation_cannot_stall_the_step():
    async def main():
        ss = samples(["x", "hang", "y", "hang"])
        reward = Slow(hang={"hang"}, linger=2.0)
        stats = await score_samples(reward, ss, timeout_s=0.2, on_error="zero")
        lingering = reward.active
        await asyncio.sleep(2.1)  # let the abandoned scores finish before the loop closes
        return ss, stats, lingering

    ss, stats, lingering = asyncio.run(main())
    assert lingering == 2  # returned at the timeout, while both stubborn scores still ran
    assert [s.reward for s in ss] == [1.0, 0.0, 1.0, 0.0]
    assert (stats.scored, stats.errors, stats.timeouts, stats.failures) == (2, 0, 2, 2)


def test_invalid_return_values_are_errors():
    class Bad:
        def __init__(self, value):
            self.value = value

        async def score(self, sample):
            return self.value

    for value, needle in [
        ("1.0", "returned str"),
        ({"acc": 1.0}, "without 'score'"),
        (float("nan"), "non-finite"),
        ({"score": 1.0, "note": "hi"}, "ValueError"),
    ]:
        with pytest.raises(RewardError, match=needle):
            asyncio.run(score_samples(Bad(value), samples(["7"])))


def test_sync_score_function_runs_in_a_thread_with_timeout():
    class Blocking:
        def score(self, sample):
            time.sleep(0.5 if sample.response_text == "slow" else 0.0)
            return 1.0

    ss = samples(["fast", "slow"])
    stats = asyncio.run(score_samples(Blocking(), ss, timeout_s=0.1, on_error="zero"))
    assert [s.reward for s in ss] == [1.0, 0.0] and stats.timeouts == 1


def test_bad_arguments():
    with pytest.raises(ValueError, match="on_error"):
        asyncio.run(score_samples(Broken(), [], on_error="skip"))


# ---------------------------------------------------------------- hangs, groups, fallback, components

FOREVER = threading.Event()  # never set


class HangsSync:
    """A plain ``def score`` that never returns for responses starting with "hang"."""

    def score(self, sample):
        if sample.response_text.startswith("hang"):
            FOREVER.wait()
        return 1.0


class HangsAsync:
    """``async def score`` that sleeps forever for "hang*"; ``stubborn`` also swallows every cancellation."""

    def __init__(self, stubborn=False):
        self.stubborn = stubborn

    async def score(self, sample):
        while sample.response_text.startswith("hang"):
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                if not self.stubborn:
                    raise
        return 1.0


@pytest.mark.parametrize("reward", [HangsSync(), HangsAsync()], ids=["sync", "async"])
def test_a_hanging_reward_is_abandoned_at_the_timeout(reward):
    """asyncio.run returns at the timeout: nothing joins the hung thread or awaits the hung task."""
    ss = samples(["a", "hang1", "b", "hang2"])
    t0 = time.perf_counter()
    stats = asyncio.run(score_samples(reward, ss, timeout_s=1.0, on_error="zero"))
    elapsed = time.perf_counter() - t0
    assert elapsed < 1.0 + 2.0, elapsed
    assert [s.reward for s in ss] == [1.0, 0.0, 1.0, 0.0]
    assert (stats.scored, stats.errors, stats.timeouts) == (2, 0, 2)
    assert ss[1].reward_info == {"score": 0.0, "reward_failed": 1.0, "reward_timeout": 1.0}
    if isinstance(reward, HangsSync):  # left behind as daemon threads: they cannot hold the process open
        hung = [t for t in threading.enumerate() if t.name == "relax-reward-score" and t.is_alive()]
        assert len(hung) >= 2 and all(t.daemon for t in hung)


class RecordsThread:
    """A plain ``def score`` noting which thread ran each call."""

    def __init__(self):
        self.threads = set()

    def score(self, sample):
        self.threads.add(threading.current_thread())  # the object: an ident can be recycled
        return 1.0


def test_plain_def_scorers_reuse_daemon_threads_and_never_a_hung_one():
    """Thousands of cheap plain-``def`` calls do not start a thread each (a plugin reward's cost in the
    driver), while a hung call's thread is never handed another call."""
    reward, loop = RecordsThread(), ScoringLoop()
    for _ in range(3):
        stats = loop.score(reward, samples(["7"] * 64), timeout_s=5.0, max_concurrency=4)
        assert stats.scored == 64
    assert len(reward.threads) <= 8  # at most the concurrency's worth, reused across rounds
    hung = HangsSync()
    stats = loop.score(hung, samples(["hang"]), timeout_s=0.5, on_error="zero")
    assert stats.timeouts == 1
    stats = loop.score(reward, samples(["7"] * 16), timeout_s=5.0, max_concurrency=4)
    assert stats.scored == 16  # the hung thread is busy forever: the calls went elsewhere


@pytest.mark.parametrize(
    "reward", [HangsSync(), HangsAsync(stubborn=True)], ids=["sync", "async-ignores-cancel"]
)
def test_scoring_loop_moves_on_and_stays_usable(reward):
    loop = ScoringLoop()
    for _ in range(2):  # the abandoned calls of the first round do not block the second
        ss = samples(["hang", "x"])
        t0 = time.perf_counter()
        stats = loop.score(reward, ss, timeout_s=1.0, on_error="zero", fallback_score=-1.0)
        assert time.perf_counter() - t0 < 1.0 + 2.0
        assert [s.reward for s in ss] == [-1.0, 1.0] and stats.timeouts == 1
    with pytest.raises(
        RewardError, match=r"reward 'HangsSync|HangsAsync'.*group 0 index 0: timed out after 1s"
    ):
        loop.score(reward, samples(["hang"]), timeout_s=1.0, on_error="raise")


def test_an_async_reward_that_blocks_its_loop_is_reported():
    class Blocking:
        async def score(self, sample):
            time.sleep(8.0)  # blocks the event loop: no timeout can fire meanwhile
            return 1.0

    loop = ScoringLoop(margin_s=0.3)
    t0 = time.perf_counter()
    with pytest.raises(RewardError, match="blocks its event loop"):
        loop.score(Blocking(), samples(["x"]), timeout_s=0.2)
    assert time.perf_counter() - t0 < 6  # reported while the reward still blocks, not when it returns
    ss = samples(["7"])
    loop.score(NumericReward(), ss, timeout_s=5.0)  # a fresh loop serves the next call
    assert ss[0].reward == 1.0


class GroupJudge:
    """Scores a whole group at once: 1.0 for the longest response, 0.0 for the others. ``score_group``
    is a plain method; ``hang_group`` never returns, ``wrong_size_group`` returns one result."""

    def __init__(self, hang_group=None, wrong_size_group=None):
        self.calls, self.hang_group, self.wrong_size_group = [], hang_group, wrong_size_group

    def score(self, sample):  # pragma: no cover - score_group takes precedence
        raise AssertionError("score() called although score_group exists")

    def judge(self, group):
        self.calls.append([s.index_in_group for s in group])
        if group[0].group_id == self.wrong_size_group:
            return [1.0]
        best = max(len(s.response_text) for s in group)
        return [
            {"score": float(len(s.response_text) == best), "length": float(len(s.response_text))}
            for s in group
        ]

    def score_group(self, group):
        if group[0].group_id == self.hang_group:
            FOREVER.wait()
        return self.judge(group)


class AsyncGroupJudge(GroupJudge):
    async def score_group(self, group):
        if group[0].group_id == self.hang_group:
            await asyncio.sleep(3600)
        return self.judge(group)


def grouped(responses_per_group):
    return [
        Sample(prompt_ids=[1], group_id=g, index_in_group=i, response_text=r)
        for g, responses in enumerate(responses_per_group)
        for i, r in enumerate(responses)
    ]


@pytest.mark.parametrize("cls", [AsyncGroupJudge, GroupJudge], ids=["async", "sync"])
def test_score_group_scores_each_group_in_one_call(cls):
    judge = cls()
    ss = grouped([["a", "abc", "ab"], ["xy", "x"]])
    stats = asyncio.run(score_samples(judge, ss))
    assert sorted(judge.calls) == [[0, 1], [0, 1, 2]]
    assert [s.reward for s in ss] == [0.0, 1.0, 0.0, 1.0, 0.0]
    assert ss[1].reward_info == {"score": 1.0, "length": 3.0}
    assert (stats.scored, stats.failures) == (5, 0)


@pytest.mark.parametrize("cls", [AsyncGroupJudge, GroupJudge], ids=["async", "sync"])
def test_score_group_timeout_and_errors_count_every_sample_of_the_group(cls):
    judge = cls(hang_group=0, wrong_size_group=2)
    ss = grouped([["a", "b"], ["cc", "c"], ["d", "dd", "ddd"]])
    t0 = time.perf_counter()
    stats = asyncio.run(score_samples(judge, ss, timeout_s=1.0, on_error="zero", fallback_score=0.25))
    assert time.perf_counter() - t0 < 1.0 + 2.0
    assert [s.reward for s in ss] == [0.25, 0.25, 1.0, 0.0, 0.25, 0.25, 0.25]
    assert (stats.scored, stats.errors, stats.timeouts) == (2, 3, 2)
    assert (
        "score_group returned 1 results for 3 samples" in stats.first_error
        or "timed out" in stats.first_error
    )
    with pytest.raises(
        RewardError, match=rf"reward '{cls.__name__}' on sample group 2: ValueError: score_group returned 1"
    ):
        asyncio.run(score_samples(judge, grouped([["a"], ["b"], ["c", "cc"]])))


def test_fallback_score_replaces_zero_and_is_validated():
    ss = samples(["ok", "boom"])
    stats = asyncio.run(score_samples(Broken(), ss, on_error="zero", fallback_score=-0.5))
    assert [s.reward for s in ss] == [0.5, -0.5] and stats.errors == 1
    assert ss[1].reward_info == {"score": -0.5, "reward_failed": 1.0}
    with pytest.raises(ValueError, match="finite fallback_score"):
        asyncio.run(score_samples(Broken(), ss, on_error="zero", fallback_score=float("nan")))


def test_defaults_are_the_run_configs():
    import inspect as _inspect

    from relax.core.config import RewardConfig

    params = _inspect.signature(score_samples).parameters
    cfg = RewardConfig()
    for name in ("timeout_s", "max_concurrency", "on_error", "fallback_score"):
        assert params[name].default == getattr(cfg, name), name


def test_reward_metrics_log_extra_components_and_failure_counts():
    ss = samples(["ok", "boom", "ok", "hang"])
    asyncio.run(score_samples(Broken(), ss[:3], on_error="zero"))
    asyncio.run(score_samples(HangsAsync(), ss[3:], timeout_s=0.2, on_error="zero"))
    metrics = reward_metrics(ss)
    assert metrics["reward/extra_mean"] == 2.0  # only the two samples that carry it
    assert metrics["reward/score_mean"] == pytest.approx((0.5 + 0.0 + 0.5 + 0.0) / 4)
    assert (metrics["reward/failures"], metrics["reward/timeouts"]) == (2.0, 1.0)
    assert "reward/reward_failed_mean" not in metrics and "reward/reward_timeout_mean" not in metrics


def test_sample_metrics_include_reward_components():
    from relax.core.controller.stages import sample_metrics

    ss = samples(["ok", "ok"])
    asyncio.run(score_samples(Broken(), ss))
    metrics = sample_metrics(ss)
    assert metrics["reward/extra_mean"] == 2.0 and metrics["reward/failures"] == 0.0


def test_a_plain_method_returning_a_coroutine_is_awaited():
    class Wrapped:
        def score(self, sample):
            async def inner():
                return {"score": 1.0, "judge_tokens": 3}

            return inner()

    ss = samples(["x"])
    asyncio.run(score_samples(Wrapped(), ss))
    assert ss[0].reward_info == {"score": 1.0, "judge_tokens": 3.0}


def test_the_bounded_call_is_public_for_rewards_that_call_rewards():
    from relax.core.rewards.bounded import ScorerTimeout, as_result, bounded, call_scorer, score_bounded

    release = threading.Event()

    def hung(sample):  # a plain def that never returns in time: left behind in its daemon thread
        release.wait(30)
        return 1.0

    async def fast(sample):
        return {"score": 1, "acc": True}

    async def main():
        started = time.monotonic()
        with pytest.raises(ScorerTimeout, match="within 0.2s"):
            await bounded(call_scorer(hung, None), timeout_s=0.2)
        assert time.monotonic() - started < 20  # left behind, not waited for (it would take 30 s)
        return await score_bounded(fast, None, timeout_s=5), await bounded(
            call_scorer(lambda s: 0.5, None), 5
        )

    (score, info), plain = asyncio.run(main())
    release.set()
    assert (score, info, plain) == (1.0, {"score": 1.0, "acc": 1.0}, 0.5)
    assert issubclass(ScorerTimeout, TimeoutError)
    for bad, error in ((float("nan"), ValueError), ({"acc": 1}, ValueError), ("1", TypeError)):
        with pytest.raises(error):
            as_result(bad)


class Sleeps:
    """A plain ``def score`` taking ``seconds`` (``FOREVER`` for "hang*"), noting the calls it began."""

    def __init__(self, seconds):
        self.seconds, self.began = seconds, []

    def score(self, sample):
        self.began.append(sample.response_text)
        if sample.response_text.startswith("hang"):
            FOREVER.wait()
        if sample.response_text.startswith("bad"):
            raise ValueError("bad sample")
        time.sleep(self.seconds)
        return 1.0


def test_plain_def_calls_are_limited_from_their_own_start_not_their_queueing():
    """One lane, four 0.3 s calls, a 0.5 s limit: 1.2 s in all, yet no call ran past its limit."""
    ss = samples(["a", "b", "c", "d"])
    stats = asyncio.run(score_samples(Sleeps(0.3), ss, timeout_s=0.5, max_concurrency=1, on_error="zero"))
    assert (stats.scored, stats.timeouts) == (4, 0) and [s.reward for s in ss] == [1.0] * 4


def test_a_hung_plain_def_call_blames_only_its_sample_and_the_rest_are_scored():
    ss = samples(["a", "hang", "b", "c", "d", "e"])
    stats = asyncio.run(score_samples(Sleeps(0.01), ss, timeout_s=0.5, max_concurrency=2, on_error="zero"))
    assert [s.reward for s in ss] == [1.0, 0.0, 1.0, 1.0, 1.0, 1.0]
    assert (stats.scored, stats.timeouts, stats.errors) == (5, 1, 0)
    assert ss[1].reward_info == {"score": 0.0, "reward_failed": 1.0, "reward_timeout": 1.0}


def test_on_error_raise_starts_no_plain_def_call_after_the_failure():
    reward = Sleeps(0.0)
    with pytest.raises(RewardError, match=r"group 0 index 1: ValueError: bad sample"):
        asyncio.run(
            score_samples(reward, samples(["a", "bad", *"cdefgh"]), max_concurrency=1, on_error="raise")
        )
    assert reward.began == ["a", "bad"]
