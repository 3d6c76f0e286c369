"""The reference role of a LoRA run, served by the policy trainer itself.

With ``trainer.lora`` the reference policy is the frozen base the adapters sit on, which the trainer
already holds: its ``forward_reference_logprobs`` scores with the adapters disabled, so no reference
actor is started and no second copy of the weights exists. :class:`TrainerReference` gives the
trainer's handle the reference role's one call (``forward_logprobs.remote(batch)``), so the step and
the queue's reference pump use it unchanged.
"""

from __future__ import annotations

from typing import Any


class TrainerReference:
    """``roles.reference`` when it is the trainer's base (not an actor of its own: never closed or killed
    as one; the trainer's handle is)."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    @property
    def forward_logprobs(self) -> Any:
        return self.trainer.forward_reference_logprobs  # an actor method: ``.remote(batch)``

    @property
    def __ray_ready__(self) -> Any:
        return self.trainer.__ray_ready__

    def __repr__(self) -> str:
        return f"TrainerReference({self.trainer!r})"
