"""``LocalReward``: a pure scoring function plus its typed params, picklable so that the hub can run
it in worker processes (or anyone can call it in-process)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

#: ``fn(response_text, label, metadata, params) -> {"score": ..., other numeric components}``
Scorer = Callable[[str, Any, dict[str, Any], Any], dict[str, float]]


class LocalReward:
    """Scores in the calling process: a plain ``def score`` (core's runner gives it a thread, the hub
    a worker process). ``fn`` and ``warm`` must be module-level functions (pickled by reference)."""

    isolation = "process"  # the hub's default for this reward: run it in its process pool

    def __init__(self, fn: Scorer, params: Any, warm: Callable[[], None] | None = None) -> None:
        self.fn, self.params, self.warm = fn, params, warm

    def score(self, sample: Any) -> dict[str, float]:
        # the prompt is there for checkers that need it (IFEval's repeat-the-prompt); a raw prompt
        # among the row's metadata (data.metadata_keys: [prompt]) wins over the templated one
        metadata = {"prompt": sample.prompt_text, **(sample.metadata or {})}
        return self.fn(sample.response_text, sample.label, metadata, self.params)

    def warm_up(self) -> None:
        """Import heavy libraries before the first timed call (worker start-up runs this)."""
        if self.warm is not None:
            self.warm()

    def __repr__(self) -> str:
        return f"LocalReward({self.fn.__module__}.{self.fn.__name__}, {self.params!r})"
