"""The one line ``relax run`` prints when a role actor raises is that actor's own exception (type
and message) and the role, not Ray's ``ray::Role.op() (pid=..., ip=...)`` wrapper header."""

from __future__ import annotations

import sys

import pytest
import ray

from relax.core.controller import faults
from relax.core.controller.recovery import blame_trainer, reason

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


@ray.remote(num_cpus=0)
class Scorer:
    def score(self, sample: int) -> float:
        raise ValueError(f"sample {sample}: label missing in /data/train.jsonl line 12")

    def relay(self, other) -> float:  # one actor calling another: two Ray wrappers
        return ray.get(other.score.remote(7))


def test_reason_is_the_root_cause_of_a_role_actor_error(ray_local):
    scorer = Scorer.remote()
    with pytest.raises(ValueError) as err:
        faults.wait(scorer.score.remote(3), 60, "reward", "score")
    assert "ray::Scorer.score()" in str(err.value).splitlines()[0]  # what used to be printed: Ray's header
    assert (
        reason(err.value)
        == "ValueError: sample 3: label missing in /data/train.jsonl line 12 (raised by reward in score)"
    )

    relay = Scorer.remote()
    with pytest.raises(ValueError) as err:
        faults.wait(relay.relay.remote(scorer), 60, "trainer", "train_step")
    assert (
        reason(err.value)
        == "ValueError: sample 7: label missing in /data/train.jsonl line 12 (raised by trainer in train_step)"
    )
    assert faults.describe(err.value) == "ValueError: sample 7: label missing in /data/train.jsonl line 12"
    for actor in (scorer, relay):
        ray.kill(actor)


def test_a_lost_trainer_is_blamed_over_what_failed_first():
    engine_error = faults.NoEnginesLeft(
        "rollout engine[0] did not finish generate within 4s; no rollout engine left"
    )
    assert blame_trainer(engine_error) is engine_error  # the trainer was fine: the engine is the cause
    engine_error.relax_trainer_lost = True
    blamed = blame_trainer(engine_error)
    assert isinstance(blamed, faults.RoleDied) and blamed.role == "trainer" and blamed.relax_trainer_lost
    assert reason(blamed) == (
        "trainer died (the run also saw: rollout engine[0] did not finish generate within 4s; "
        "no rollout engine left)"
    )
    died = faults.RoleDied("trainer died during train_step (actor died)", "trainer", None, "train_step")
    died.relax_trainer_lost = True
    assert blame_trainer(died) is died
