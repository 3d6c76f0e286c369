import asyncio
import time

import pytest

from relax.core.data import Sample
from relax.core.rewards import ExactMatchReward, NumericReward, RewardError, score_samples


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
    t0 = time.perf_counter()
    stats = asyncio.run(score_samples(reward, samples([str(i) for i in range(20)]), max_concurrency=5))
    assert reward.peak == 5
    assert stats.scored == 20
    assert 0.35 < time.perf_counter() - t0 < 2.0  # 4 waves of 0.1 s, not 20 sequential ones


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
        t0 = time.perf_counter()
        stats = await score_samples(Slow(hang={"hang"}, linger=0.6), ss, timeout_s=0.2, on_error="zero")
        elapsed = time.perf_counter() - t0
        await asyncio.sleep(0.7)  # let the abandoned scores finish before the loop closes
        return ss, stats, elapsed

    ss, stats, elapsed = asyncio.run(main())
    assert elapsed < 0.5  # returned at the timeout, not when the stubborn reward gave up
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
