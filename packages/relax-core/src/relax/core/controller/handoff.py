"""The colocate memory handoff: who holds the accelerator when, around one training step.

Trainer and engines take turns on the same GPUs (mode ``colocate``). One step goes through:

1. ``rollout``: the engines generate; with ``trainer.offload`` the trainer holds nothing on the device
   (the first step, or after a trainer restart, offloads it first: ``trainer_offload``);
2. ``engines_release`` (``rollout.release_memory``): the engines free their weights and KV cache;
3. ``trainer_onload`` (``trainer.offload``): parameters and optimizer state back on the device;
4. ``train``: old / reference logprobs and the update;
5. ``trainer_release``: the trainer drops the step's activations and hands its allocator's cache back
   (``torch.cuda.empty_cache``); with ``trainer.offload`` its optimizer state goes to the host and its
   gradients are dropped;
6. ``engines_resume``: the engines take their memory back (the sync writes into it);
7. ``sync``: the new weights go to the engines, read from the trainer's parameters on the device;
8. ``trainer_offload`` (``trainer.offload``): the parameters go to the host.

The parameters leave after the sync, which reads them; the optimizer state, which nothing reads until the
next update, leaves before the engines resume: verl's order (offload optimizer and gradients after the update,
parameters after the sync). Each phase's memory is a step metric (``policy_update.memory.phase_metrics``):
``perf/mem_<phase>_gb`` and ``perf/mem_reserved_<phase>_gb`` where CUDA runs, ``perf/rss_<phase>_gb`` (host)
for ``before_train``, ``after_update``, ``after_release`` and ``after_offload`` (rank 0 of the trainer).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from relax.core.controller import faults, stages
from relax.core.policy_update.memory import phase_metrics

if TYPE_CHECKING:
    from relax.core.controller.step import StepContext

#: what ``trainer.offload`` moves after the update (nothing reads it before the next one), and after the sync
AFTER_UPDATE = ("grads", "optimizer")
AFTER_SYNC = ("grads", "optimizer", "params")


class Handoff:
    """One colocate step's handoff; ``phases`` lists what happened, in order (the names above)."""

    def __init__(self, state: StepContext, metrics: dict[str, float]) -> None:
        self.state, self.metrics = state, metrics
        self.offload = state.cfg.trainer.offload
        self.phases: list[str] = []

    def mark(self, phase: str) -> None:
        self.phases.append(phase)

    def _trainer(self, method: str, *args: Any) -> dict[str, Any]:
        ref = getattr(self.state.roles.trainer, method).remote(*args)
        return faults.wait(ref, self.state.cfg.trainer.timeout_s, "trainer", method)

    def before_rollout(self) -> None:
        """``trainer.offload``: the trainer's state on the host while the engines generate (a no-op when the
        last step left it there)."""
        if self.offload and self._trainer_offload(AFTER_SYNC, "before_rollout"):
            self.mark("trainer_offload")

    @contextmanager
    def training(self) -> Iterator[None]:
        """Phases 2-6 around the block that trains (6 also when it fails: the engines are whole for a retry)."""
        cfg, metrics = self.state.cfg, self.metrics
        with stages.engine_memory_released(self.state.fleet, cfg, metrics):
            if cfg.rollout.release_memory:
                self.mark("engines_release")
            if self.offload:
                with stages.timed(metrics, "onload"):
                    out = self._trainer("onload")
                metrics.update(phase_metrics("before_train", out["after"]))
                self.mark("trainer_onload")
            yield
            self.mark("train")
            with stages.timed(metrics, "trainer_release"):
                out = self._trainer("offload", AFTER_UPDATE if self.offload else ())
            metrics.update(
                {
                    **phase_metrics("after_update", out["before"]),
                    **phase_metrics("after_release", out["after"]),
                }
            )
            self.mark("trainer_release")
        if cfg.rollout.release_memory:
            self.mark("engines_resume")

    def after_sync(self) -> None:
        """``trainer.offload``: the parameters to the host, once the engines have the new weights."""
        if self.offload:
            self._trainer_offload(AFTER_SYNC, "after_offload")
            self.mark("trainer_offload")

    def _trainer_offload(self, parts: tuple[str, ...], phase: str) -> float:
        with stages.timed(self.metrics, "offload"):
            out = self._trainer("offload", parts)
        self.metrics.update(phase_metrics(phase, out["after"]))
        return out["moved_gb"]
