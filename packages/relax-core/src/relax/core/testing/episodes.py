"""``repeat``: a tool-free multi-turn environment for tests of the loop (``RELAX_PLUGINS=relax.core.testing.episodes``).

Each episode asks the prompt again after every answer (``"again"``), ``turns`` policy turns in all;
the reward is 1.0 when the last answer equals the label (the quick-start's sums), else 0.0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from relax.core.hookspecs import hookimpl
from relax.core.protocols import StepResult, Turn


@dataclass(frozen=True)
class RepeatParams:
    turns: int = 2
    observation: str = "again"

    def validate(self) -> list[str]:
        return [] if self.turns >= 1 else [f"turns: must be >= 1, got {self.turns}"]


class RepeatEpisode:
    def __init__(self, params: RepeatParams, label: Any) -> None:
        self.params, self.label, self.closed = params, label, False

    def step(self, turn: Turn) -> StepResult:
        if turn.index + 1 < self.params.turns:
            return StepResult([{"role": "user", "content": self.params.observation}])
        return StepResult(done=True, reward=float(turn.content.strip() == str(self.label).strip()))

    def close(self) -> None:
        self.closed = True


class RepeatEnvironment:
    def __init__(self, params: RepeatParams) -> None:
        self.params = params

    def start(self, sample: Any) -> RepeatEpisode:
        return RepeatEpisode(self.params, sample.label)


@hookimpl
def relax_register_environments(register):
    register("repeat", lambda params, ctx: RepeatEnvironment(params), config=RepeatParams)
