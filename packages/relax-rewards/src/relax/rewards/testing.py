"""Rewards that misbehave on purpose, for isolation tests of the hub (and of your own runs):
``RELAX_PLUGINS=relax.rewards.testing`` registers ``misbehave``. On responses containing ``trigger``
it raises, hangs forever or kills its process with ``os._exit``; otherwise it scores 1.0."""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any, Literal

from relax.core.hookspecs import hookimpl


@dataclass(frozen=True)
class MisbehaveParams:
    mode: Literal["ok", "raise", "hang", "exit"] = "ok"
    trigger: str = "BAD"


class MisbehavingReward:
    def __init__(self, params: MisbehaveParams, ctx: Any = None) -> None:
        self.params = params

    def score(self, sample: Any) -> dict[str, float]:
        if self.params.trigger in sample.response_text:
            if self.params.mode == "raise":
                raise RuntimeError(f"misbehave: raising on {sample.response_text[:40]!r}")
            if self.params.mode == "hang":
                threading.Event().wait()
            if self.params.mode == "exit":
                os._exit(3)
        return {"score": 1.0, "ok": 1.0}


def exit_at_start_up() -> None:
    """A ``warm`` hook whose worker exits while starting (pool tests; picklable by reference,
    unlike ``sys.exit``, which pytest's machinery may have replaced by the time it is pickled)."""
    raise SystemExit("exit_at_start_up")


def make_sample(
    response: str,
    label: Any = None,
    metadata: dict[str, Any] | None = None,
    group: int = 0,
    index: int = 0,
    prompt: str = "",
) -> Any:
    """A scored-to-be ``Sample`` with only what rewards read."""
    from relax.core.data import Sample

    return Sample(
        prompt_ids=[1, 2],
        group_id=group,
        index_in_group=index,
        prompt_text=prompt,
        response_text=response,
        label=label,
        metadata=dict(metadata or {}),
    )


@hookimpl
def relax_register_rewards(register):
    register("misbehave", MisbehavingReward, config=MisbehaveParams)
