"""Where the prompts come from: the dataset cursor plus the next group id, drawn one step at a time.

Rollout may run ahead of training (async/hybrid), so the source remembers its position after each
drawn step: a checkpoint records the position after the last *trained* step, and rows generated
ahead of it are regenerated after a resume (nothing lost, nothing trained twice).
"""

from __future__ import annotations

import threading
from typing import Any

from relax.core.controller.samples import build_groups
from relax.core.data import Sample

Position = tuple[dict[str, Any], int]  # (dataset state, next group id)


class PromptSource:
    def __init__(self, dataset: Any, cfg: Any, step: int = 0) -> None:
        self.dataset, self.cfg = dataset, cfg
        self.next_group_id = 0
        self._lock = threading.Lock()  # the async producer draws while the trainer checkpoints
        self._after: dict[int, Position] = {step: self._position()}

    def _position(self) -> Position:
        return self.dataset.state_dict(), self.next_group_id

    def draw(self, step: int) -> list[list[Sample]]:
        """The next prompt batch as groups of empty samples for ``step`` (may be called again for
        the same step: DAPO dynamic sampling draws extra batches)."""
        with self._lock:
            items, shared = self.dataset.next_batch(), None
            if getattr(self.dataset, "multimodal", False):  # media are processed once per drawn prompt
                from relax.core.data_multimodal import draw_multimodal

                items, shared = draw_multimodal(self.dataset, items)
            groups = build_groups(items, step, self.cfg, self.next_group_id)
            for group, ref in zip(groups, shared or (), strict=False):
                for sample in group:
                    sample.mm_inputs = ref  # one reference for the whole group
            self.next_group_id += len(groups)
            self._after[step] = self._position()
        return groups

    def position_after(self, step: int) -> Position:
        """The position once everything for ``step`` was drawn (what a checkpoint at ``step`` records)."""
        with self._lock:
            return self._after[step]

    def forget_before(self, step: int) -> None:
        """Drop positions older than ``step`` (only the last trained step is ever checkpointed)."""
        with self._lock:
            for old in [s for s in self._after if s < step]:
                del self._after[old]

    def restore(self, step: int, position: Position) -> None:
        """Continue after ``step`` from a checkpointed position."""
        dataset_state, next_group_id = position
        with self._lock:
            self.dataset.load_state_dict(dataset_state)
            self.next_group_id = next_group_id
            self._after = {step: self._position()}
